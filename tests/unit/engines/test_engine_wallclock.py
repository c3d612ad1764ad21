"""The simulated engine on the wall clock behind the async ``Engine`` protocol.

Runs at 50x real time on the small test hardware (10 ms decode steps), so every request here
takes a few milliseconds; waits poll with a generous deadline, nothing asserts on elapsed time.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable

import pytest
from builders import make_catalog

from qlm.domain import ModelTier
from qlm.engines.base import Engine, EngineRequest, TokenChunk
from qlm.engines.wallclock import (
    FILLER_TOKEN_ID,
    VOCAB_SIZE,
    WallClockEngine,
    count_tokens,
    filler_text,
    tokenize,
)
from qlm.errors import EngineError, UnknownRequest


def make_engine(scale: float = 50.0) -> WallClockEngine:
    return WallClockEngine.from_catalog("w0", "m", "G", 1, time_scale=scale, catalog=make_catalog())


def req(rid: str, tokens: int, **kw: object) -> EngineRequest:
    args: dict[str, object] = {
        "request_id": rid,
        "model": "m",
        "prompt_tokens": 16,
        "max_tokens": tokens,
        "output_tokens": tokens,
    }
    return EngineRequest(**(args | kw))  # type: ignore[arg-type]


async def eventually(check: Callable[[], bool | Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + 30.0
    while True:
        ok = check()
        if not isinstance(ok, bool):
            ok = await ok
        if ok:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        await asyncio.sleep(0.005)


def run(scenario: Callable[[WallClockEngine], Awaitable[None]]) -> None:
    async def main() -> None:
        engine = make_engine()
        try:
            await scenario(engine)
        finally:
            await engine.close()

    asyncio.run(main())


def test_it_implements_the_engine_protocol_and_reports_its_capabilities() -> None:
    async def scenario(engine: WallClockEngine) -> None:
        assert isinstance(engine, Engine)
        caps = await engine.capabilities()
        assert caps.models == ("m",)
        assert caps.max_num_seqs == engine.sim.config.max_num_seqs
        assert caps.kv_capacity_tokens == engine.sim.token_capacity()
        assert caps.supports_sleep and caps.supports_swap
        assert await engine.health()

    run(scenario)


def test_a_request_streams_its_tokens_steadily_and_ends_with_the_whole_text() -> None:
    async def scenario(engine: WallClockEngine) -> None:
        chunks: list[TokenChunk] = []
        out = await engine.submit(req("a", 30), chunks.append)
        assert (out.tokens, out.finish_reason, out.text) == (30, "length", filler_text(30))
        assert "".join(c.text for c in chunks) == out.text
        assert len(chunks) >= 30 // engine.sim.config.max_macro_steps  # type: ignore[operator]
        assert all(c.finish_reason is None for c in chunks[:-1])
        assert chunks[-1].finish_reason == "length"
        assert count_tokens(out.text) == 30

    run(scenario)


def test_a_request_that_ends_before_max_tokens_finishes_with_stop() -> None:
    async def scenario(engine: WallClockEngine) -> None:
        out = await engine.submit(req("a", 5, max_tokens=50))
        assert (out.tokens, out.finish_reason) == (5, "stop")

    run(scenario)


def test_concurrent_requests_are_batched_and_all_finish() -> None:
    async def scenario(engine: WallClockEngine) -> None:
        outs = await asyncio.gather(*(engine.submit(req(f"r{i}", 10 + i)) for i in range(8)))
        assert [o.tokens for o in outs] == [10 + i for i in range(8)]
        stats = await engine.stats()
        assert (stats.running, stats.waiting) == (0, 0)

    run(scenario)


def test_abort_returns_the_partial_output_and_the_engine_forgets_the_request() -> None:
    async def scenario(engine: WallClockEngine) -> None:
        seen: list[TokenChunk] = []
        task = asyncio.create_task(engine.submit(req("long", 5000), seen.append))
        await eventually(lambda: bool(seen) and seen[-1].tokens >= 3, "tokens stream")
        partial = await engine.abort("long")
        assert partial.aborted and 3 <= partial.tokens < 5000
        assert partial.text == filler_text(partial.tokens)
        assert await task == partial
        assert not engine.sim.has_request("long")
        with pytest.raises(UnknownRequest):
            await engine.abort("long")

    run(scenario)


def test_cancelling_the_submit_task_aborts_the_request_in_the_engine() -> None:
    async def scenario(engine: WallClockEngine) -> None:
        task = asyncio.create_task(engine.submit(req("long", 5000)))
        await eventually(lambda: engine.sim.has_request("long"), "the request is queued")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not engine.sim.has_request("long")

    run(scenario)


def test_the_engine_refuses_what_vllm_would_refuse_with_a_clear_error() -> None:
    async def scenario(engine: WallClockEngine) -> None:
        with pytest.raises(EngineError, match="model 'x' is not served"):
            await engine.submit(req("a", 4, model="x"))
        with pytest.raises(EngineError, match="max context"):
            await engine.submit(req("b", 9000))

    run(scenario)


def test_sleep_needs_a_drained_instance_refuses_work_and_wake_up_restores_it() -> None:
    async def scenario(engine: WallClockEngine) -> None:
        task = asyncio.create_task(engine.submit(req("long", 5000)))
        await eventually(lambda: engine.sim.has_request("long"), "the request is queued")
        with pytest.raises(EngineError, match="in flight"):
            await engine.set_model_tier("m", ModelTier.WARM)
        await engine.abort("long")
        await task
        assert await engine.set_model_tier("m", ModelTier.WARM) is ModelTier.WARM
        assert engine.is_sleeping
        stats = await engine.stats()
        assert stats.sleeping and stats.active_model is None
        assert dict(stats.model_tiers)["m"] is ModelTier.WARM
        with pytest.raises(EngineError, match="sleeping"):
            await engine.submit(req("a", 4))
        assert await engine.set_model_tier("m", ModelTier.ACTIVE) is ModelTier.ACTIVE
        assert not engine.is_sleeping
        assert (await engine.submit(req("a", 4))).tokens == 4
        # Level 2 dropped the weights: asked warm, asleep, it stays cold, as vLLM does.
        assert await engine.set_model_tier("m", ModelTier.COLD) is ModelTier.COLD
        assert await engine.set_model_tier("m", ModelTier.WARM) is ModelTier.COLD
        assert engine.sleep_level == 2
        assert dict((await engine.stats()).model_tiers)["m"] is ModelTier.COLD

    run(scenario)


def test_swap_out_pauses_a_running_request_and_swap_in_resumes_it() -> None:
    async def scenario(engine: WallClockEngine) -> None:
        seen: list[TokenChunk] = []
        task = asyncio.create_task(engine.submit(req("a", 400), seen.append))
        await eventually(lambda: bool(seen), "the request runs")
        await engine.swap_out("a")
        await eventually(lambda: engine.sim.stats().swapped == 1, "the KV cache is swapped out")
        await engine.swap_in("a")
        out = await task
        assert out.tokens == 400 and out.finish_reason == "length"

    run(scenario)


def test_prompt_tokens_are_whitespace_words_of_a_text_or_the_number_of_ids() -> None:
    assert count_tokens("hello  big\nworld") == 3
    assert count_tokens("") == 1
    assert count_tokens([5, 6, 7, 8]) == 4
    assert count_tokens("prompt" + filler_text(7)) == 8


def test_every_chunk_says_the_ids_of_its_tokens_which_tokenize_gives_back() -> None:
    """The simulated vocabulary: a text's ids are its words' (``tokenize``, as ``count_tokens``
    counts them), and a chunk's ``token_ids`` are its new tokens', so the text of a prompt and
    its output tokenizes to the prompt's ids + the ids generated. A structured answer's pieces
    have ids of their own."""
    assert tokenize("a b a") == [tokenize("a")[0], tokenize("b")[0], tokenize("a")[0]]
    assert len(tokenize("")) == count_tokens("") == 1
    assert all(0 <= t < VOCAB_SIZE for t in tokenize("the quick brown fox"))

    async def scenario(engine: WallClockEngine) -> None:
        chunks: list[TokenChunk] = []
        out = await engine.submit(req("r", 9), chunks.append)
        ids = [t for c in chunks for t in c.token_ids or ()]
        assert ids == [FILLER_TOKEN_ID] * 9 == tokenize(out.text)
        counts = [0, *(c.tokens for c in chunks)]
        assert [len(c.token_ids or ()) for c in chunks] == [
            b - a for a, b in itertools.pairwise(counts)
        ]
        fmt = {"type": "json_object"}
        doc: list[TokenChunk] = []
        await engine.submit(req("j", 12, sampling=(("response_format", fmt),)), doc.append)
        assert sum(len(c.token_ids or ()) for c in doc) == doc[-1].tokens
        assert {t for c in doc for t in c.token_ids or ()} != {FILLER_TOKEN_ID}

    run(scenario)
