"""QLM's vLLM client (``qlm/engines/vllm.py``) against a real vLLM server: vLLM's CPU build
0.32.0 serving a tiny random Llama (tests/vllm/conftest.py). What the server says of itself,
streaming, ``X-Request-Id``, priority, ``/metrics``, cancel, abort, evict + resume, prompts made
of the server's own vocabulary, vLLM 0.32's context limits, and the sleep probe refusing on the
CPU build. Waits poll with deadlines; no assertion is about how long anything took."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from qlm.domain import ModelTier
from qlm.engines.base import EngineOutput, EngineRequest, TokenChunk
from qlm.engines.vllm import VllmEngine
from qlm.engines.vllm_wire import context_room
from qlm.errors import RequestRejected, UnknownRequest

from .conftest import KV_CACHE_BYTES, MODEL, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

DEADLINE_S = 120.0
LOADED_S = 600.0  # a deadline for what a CPU-starved vLLM server does slowly
LONG = 1800  # output tokens of a request meant to be interrupted: ~2 s alone on the tiny model
CONTEXT = 2048  # the tiny model's max_model_len
VOCAB = 4096  # its vocabulary (scripts/vllm_tiny_model.py)
KV_TOKENS = KV_CACHE_BYTES // 512  # bytes per token: 2 layers x (K, V) x 2 KV heads x 32 x bf16


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(scenario())


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, within_s: float = DEADLINE_S
) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        await asyncio.sleep(0.05)


def engine(url: str) -> VllmEngine:
    return VllmEngine("cpu-0", url, MODEL, timeout_s=60.0)


def text_request(rid: str, max_tokens: int, **kw: Any) -> EngineRequest:
    fields: dict[str, Any] = {
        "prompt": "QLM orders the queue by deadline.",
        "output_tokens": max_tokens,
    }
    return EngineRequest(rid, MODEL, 8, max_tokens=max_tokens, **(fields | kw))


def test_the_server_says_what_it_serves_and_the_cpu_builds_defaults(vllm_url: str) -> None:
    async def scenario() -> None:
        e = engine(vllm_url)
        try:
            assert await e.health()
            caps = await e.capabilities()
            assert caps.models == (MODEL,)
            # vLLM's CPU build: KV blocks of 128 tokens, max_num_seqs 128 (from /server_info)
            assert caps.kv_capacity_tokens == KV_TOKENS
            assert caps.max_num_seqs == 128
            info = await e.server_info()
            assert info is not None
            assert info["cache_config"]["block_size"] == 128
            assert info["scheduler_config"]["policy"] == "priority"
            assert caps.supports_abort_endpoint and not caps.supports_swap
            # the synthetic prompts' ids are the server's own: inside any vocabulary
            assert e.token_ids and max(e.token_ids) < VOCAB
        finally:
            await e.close()

    run(scenario)


def test_the_sleep_probe_refuses_the_cpu_build_without_putting_it_to_sleep(vllm_url: str) -> None:
    """vLLM's dev mode serves /sleep, /wake_up and /is_sleeping without sleep mode; the CPU
    build then only pauses its scheduler ("sleep mode is not supported on CPU, ignore it")."""

    async def scenario() -> None:
        e = engine(vllm_url)
        try:
            caps = await e.capabilities()
            assert not caps.supports_sleep
            assert "--enable-sleep-mode" in e.sleep_probe and "cpu" in e.sleep_probe
            assert not await e.is_sleeping()  # the probe did not put it to sleep
            out = await e.submit(text_request("after-probe", 4))
            assert out.tokens == 4
        finally:
            await e.close()

    run(scenario)


def test_a_request_streams_with_its_id_and_the_servers_token_counts(vllm_url: str) -> None:
    async def scenario() -> None:
        e = engine(vllm_url)
        try:
            chunks: list[TokenChunk] = []
            out = await e.submit(text_request("stream-1", 40, priority=3), chunks.append)
            assert (out.tokens, out.finish_reason) == (40, "length")
            assert "".join(c.text for c in chunks) == out.text and out.text
            counts = [c.tokens for c in chunks]
            assert counts == sorted(counts) and counts[-1] == 40
            assert chunks[-1].finish_reason == "length"
            assert chunks[0].prompt_tokens and chunks[0].prompt_tokens > 1

            chat = EngineRequest(
                "chat-1", MODEL, 8, max_tokens=12, output_tokens=12,
                messages=({"role": "user", "content": "Which queue is mine?"},),
            )  # fmt: skip
            answer = await e.submit(chat)
            assert (answer.tokens, answer.finish_reason) == (12, "length")
        finally:
            await e.close()

        # X-Request-Id is vLLM's request id (and echoed: --enable-request-id-headers)
        async with httpx.AsyncClient(base_url=vllm_url, timeout=60) as http:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
            resp = await http.post(
                "/v1/completions", json=body, headers={"X-Request-Id": "qlm-rid-7"}
            )
        assert resp.status_code == 200
        assert resp.headers["x-request-id"] == "qlm-rid-7"
        assert resp.json()["id"] == "cmpl-qlm-rid-7"

    run(scenario)


def test_a_synthetic_prompt_fits_a_small_vocabulary(vllm_url: str) -> None:
    """A replayed request has no text: its prompt is token ids, which must be the server's
    (ids up to 30,000 were refused: "Token id N is out of vocabulary")."""

    async def scenario() -> None:
        e = engine(vllm_url)
        try:
            chunks: list[TokenChunk] = []
            req = EngineRequest("replay-1", MODEL, 300, max_tokens=5, output_tokens=5)
            out = await e.submit(req, chunks.append)
            assert out.tokens == 5
            assert chunks[0].prompt_tokens == 300
            done = await e.complete(
                EngineRequest("replay-2", MODEL, 200, max_tokens=3, output_tokens=3)
            )
            assert done.tokens == 3
        finally:
            await e.close()

    run(scenario)


def test_priority_lets_an_urgent_request_pass_those_waiting(one_at_a_time: VllmServer) -> None:
    """Four requests wait, then an urgent one (lower ``priority``) comes, all with the same
    prompt: vLLM, running one at a time, starts the urgent one first (FCFS: after all four).

    Seen in vLLM's engine, not by when answers arrive (on a 2-core host vLLM's API server can
    hold a tiny model's output for seconds and hand it over in one burst, in which no order can
    be seen): the first one it starts computes the prompt, and every later one finds it in the
    prefix cache. The scheduler is held (dev mode's ``/pause?mode=keep``) while they are
    handed to the engine one after the other (its log says when), then let go. Each is sent
    with the body QLM's client sends (``VllmEngine.request_body``), its whole answer at once."""
    server, waiting = one_at_a_time, 4
    prompt = " ".join(["QLM orders the queue by deadline."] * 80)  # a few hundred tokens

    async def scenario() -> None:
        e = VllmEngine("cpu-0", server.url, MODEL, timeout_s=LOADED_S)
        http = httpx.AsyncClient(base_url=server.url, timeout=LOADED_S)
        added_before = server.tail(10**9).count("Added request")

        def added(n: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:  # handed to vLLM's engine, in the order sent
                return server.tail(10**9).count("Added request") - added_before >= n

            return check

        async def send(request: EngineRequest) -> dict[str, Any]:
            body = e.request_body(request, stream=False)
            resp = await http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            return dict(resp.json())

        async def scheduler(path: str) -> None:
            assert (await http.post(path)).status_code == 200, path

        requests = [
            EngineRequest(f"low-{i}", MODEL, 0, max_tokens=64, prompt=prompt, priority=10)
            for i in range(waiting)
        ]
        requests.append(EngineRequest("urgent", MODEL, 0, max_tokens=1, prompt=prompt, priority=0))
        tasks: list[asyncio.Task[dict[str, Any]]] = []
        try:
            await scheduler("/pause?mode=keep")
            for r in requests:
                tasks.append(asyncio.create_task(send(r)))
                await eventually(added(len(tasks)), f"{r.request_id} in the engine", LOADED_S)
            await scheduler("/resume")
            answers = await asyncio.gather(*tasks)
            cached = {
                r.request_id: a["usage"]["prompt_tokens_details"]["cached_tokens"]
                for r, a in zip(requests, answers, strict=True)
            }
            first = [rid for rid, n in cached.items() if n == 0]
            assert first == ["urgent"], cached  # FCFS: ["low-0"]
        finally:
            with contextlib.suppress(httpx.HTTPError):
                await http.post("/resume")
            for t in tasks:
                t.cancel()
            await http.aclose()
            await e.close()

    run(scenario)


async def interrupted(
    e: VllmEngine, make: Callable[[str], EngineRequest], at_tokens: int, *, cancel: bool = False
) -> tuple[EngineRequest, EngineOutput, list[TokenChunk]]:
    """Run a request and stop it from its own stream once it has ``at_tokens`` tokens: by
    ``abort`` (its partial output), or by cancelling the ``submit`` task. The tiny model is
    fast (~2 s for 1,800 tokens) and a loaded host can fall behind its stream: a request that
    ended first is tried again under a new id (three times at most)."""
    for attempt in range(3):
        request = make(f"-{attempt}" if attempt else "")
        stopped = await _stop_once(e, request, at_tokens, cancel)
        if stopped is not None:
            return request, *stopped
    pytest.fail("the request ended before it could be stopped, three times")


async def _stop_once(
    e: VllmEngine, request: EngineRequest, at_tokens: int, cancel: bool
) -> tuple[EngineOutput, list[TokenChunk]] | None:
    """One try of ``interrupted``; None when the request ended before it was stopped."""
    seen: list[TokenChunk] = []
    stopping: list[asyncio.Task[Any]] = []

    def on_chunk(chunk: TokenChunk) -> None:
        seen.append(chunk)
        if chunk.tokens >= at_tokens and not stopping:
            if cancel:
                task.cancel()
                stopping.append(task)
            else:
                stopping.append(asyncio.create_task(e.abort(request.request_id)))

    task = asyncio.create_task(e.submit(request, on_chunk))
    try:
        out = await task
    except asyncio.CancelledError:
        if cancel:
            return EngineOutput(request.request_id, "", 0, "abort"), seen
        raise
    if not stopping or cancel:
        return None
    try:
        partial = await stopping[0]
    except UnknownRequest:
        return None  # it had ended
    if not partial.aborted:
        return None
    assert out == partial
    return partial, seen


async def idle(e: VllmEngine) -> bool:
    s = await e.stats()
    return s.running == 0 and s.waiting == 0


def test_metrics_cancel_and_abort(vllm_url: str) -> None:
    async def scenario() -> None:
        e = engine(vllm_url)
        try:
            await e.capabilities()  # /abort_requests is served: abort also sends vLLM's id
            request, partial, seen = await interrupted(
                e, lambda n: text_request(f"abort-1{n}", LONG), 20
            )
            assert partial.aborted and 20 <= partial.tokens < LONG
            assert partial.text == "".join(c.text for c in seen)[: len(partial.text)]
            with pytest.raises(UnknownRequest):
                await e.abort(request.request_id)
            await eventually(lambda: idle(e), "vLLM drops the aborted request")

            # cancelling the submit task closes the stream: vLLM aborts the request
            await interrupted(e, lambda n: text_request(f"cancel-1{n}", LONG), 20, cancel=True)
            await eventually(lambda: idle(e), "vLLM drops the cancelled request")
            stats = await e.stats()
            assert stats.kv_capacity_tokens == KV_TOKENS and stats.preemptions_total >= 0
        finally:
            await e.close()

    run(scenario)


def test_an_evicted_request_resumes_with_its_partial_output_to_its_full_length(
    vllm_url: str,
) -> None:
    async def scenario() -> None:
        e = engine(vllm_url)
        try:
            await e.capabilities()
            original, partial, _ = await interrupted(
                e, lambda n: text_request(f"evict-1{n}", LONG), 50
            )
            assert partial.aborted and 50 <= partial.tokens < LONG
            # sent again at once, under the same id: it goes as "<id>.2" (vLLM may still hold
            # the aborted one), prompt + partial output, for the tokens still to come
            rest = LONG - partial.tokens
            resumed = text_request(
                original.request_id, rest, prompt=f"{original.prompt}{partial.text}",
                resumed_tokens=partial.tokens,
            )  # fmt: skip
            out = await e.submit(resumed)
            assert (out.tokens, out.finish_reason) == (rest, "length")
            assert partial.tokens + out.tokens == LONG
        finally:
            await e.close()

    run(scenario)


def test_vllm_032_refuses_a_prompt_past_the_context_and_clamps_max_tokens(vllm_url: str) -> None:
    async def scenario() -> None:
        e = engine(vllm_url)
        try:
            too_long = EngineRequest("ctx-1", MODEL, 2100, max_tokens=4, prompt=tuple([5] * 2100))
            with pytest.raises(RequestRejected, match="maximum context length is 2048") as err:
                await e.submit(too_long)
            assert context_room(str(err.value)) == CONTEXT - 2100
            # prompt + max_tokens past the context: 0.32 answers with what fits
            near = EngineRequest(
                "ctx-2", MODEL, 2000, max_tokens=100, output_tokens=100, prompt=tuple([5] * 2000)
            )
            out = await e.submit(near)
            assert (out.tokens, out.finish_reason) == (CONTEXT - 2000, "length")
        finally:
            await e.close()

    run(scenario)


def test_a_server_asleep_at_attach_is_taken_as_asleep_at_the_level_vllm_says(
    vllm_url: str,
) -> None:
    """QLM reads a server's sleep state when it attaches (colocated servers are started and put
    to sleep before QLM attaches): ``/is_sleeping``, and vLLM 0.32's ``vllm:engine_sleep_state``
    for the level. The CPU build only pauses, but says both as a sleeping GPU build does."""

    async def scenario() -> None:
        e = engine(vllm_url)
        http = httpx.AsyncClient(base_url=vllm_url, timeout=DEADLINE_S)
        try:
            for level, tier in ((1, ModelTier.WARM), (2, ModelTier.COLD)):
                resp = await http.post("/sleep", params={"level": level, "mode": "wait"})
                assert resp.status_code == 200, resp.text
                try:
                    await e.capabilities()
                    assert dict((await e.stats()).model_tiers) == {MODEL: tier}, level
                finally:
                    assert (await http.post("/wake_up")).status_code == 200
                await eventually(lambda: _awake(http), "the server says it is awake")
            await e.capabilities()
            assert dict((await e.stats()).model_tiers) == {MODEL: ModelTier.ACTIVE}
            assert (await e.submit(text_request("after-sleep", 4))).tokens == 4
        finally:
            await http.aclose()
            await e.close()

    run(scenario)


async def _awake(http: httpx.AsyncClient) -> bool:
    return (await http.get("/is_sleeping")).json() == {"is_sleeping": False}
