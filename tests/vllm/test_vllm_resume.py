"""An evicted request resumes from its exact tokens on a real vLLM server (the CPU build, a tiny
random Llama: tests/vllm/conftest.py): the agents' runtime runs a chat or a completion, evicts
it mid-answer and sends it again as a completion of exactly the prompt vLLM made of it (a chat
with its template applied) and the tokens it had written — which vLLM counts as such — and the
answer comes whole, to its full length. A parked request goes on from the KV blocks vLLM kept;
KV offloading, which would keep them in CPU memory, the CPU build refuses. Waits poll
conditions; nothing is timed."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from resume_helpers import Ended, EvictOnceAt, Watched, serve_one

from qlm.domain import SLO, InstanceSpec, Request, Tier
from qlm.engines.base import EngineRequest, TokenChunk
from qlm.engines.vllm import VllmEngine
from qlm.service.jobs import Job

from .conftest import MODEL, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

DEADLINE_S = 120.0
TOKENS = 1800  # the answer's length (ignore_eos: exactly this many)
EVICT_AT = 40  # tokens streamed before the eviction
LONG = 1800  # a parked request's length: ~2 s alone on the tiny model


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_an_evicted_request_resumes_from_the_exact_tokens_vllm_made_and_wrote(
    vllm_url: str, chat: bool
) -> None:
    """A chat (its prompt: vLLM's rendering of the messages with the model's template) and a
    completion (its prompt text, tokenized by vLLM). (On a loaded host the eviction may reach
    vLLM after the request ended: it is tried again under a new id, three times at most.)"""
    kind = "chat" if chat else "completion"
    for attempt in range(3):
        if asyncio.run(evicted(vllm_url, f"{kind}-{attempt}", chat=chat)):
            return
    pytest.fail(f"the {kind} ended before its eviction reached vLLM, three times")


async def evicted(vllm_url: str, rid: str, *, chat: bool) -> bool:
    """One try: False when the request ended before it was evicted."""
    engine = Watched(VllmEngine("cpu-0", vllm_url, MODEL, timeout_s=DEADLINE_S))
    policy = EvictOnceAt(rid, "cpu-0", lambda: engine.written() >= EVICT_AT)
    done = Ended()
    question = "Which queue serves me first, and why?"
    messages = [{"role": "user", "content": question}] if chat else None
    await serve_one(
        engine, policy, InstanceSpec("cpu-0", "cpu", (MODEL,)),
        lambda now: Request(
            id=rid, model=MODEL, arrival_s=now, input_tokens=20, max_tokens=TOKENS,
            slo=SLO(e2e_s=3600.0), tier=Tier.STANDARD, replay_output_tokens=TOKENS,
        ),
        Job(prompt=question, messages=messages, sampling={"temperature": 0.0, "logprobs": True}),
        done, deadline_s=DEADLINE_S, poll_s=0.05,
    )  # fmt: skip
    assert not done.errors, done.errors
    if len(engine.sent) == 1:
        return False
    first, resumed = engine.sent  # evicted once, sent again once
    assert (first.messages is not None) == chat and isinstance(resumed.prompt, tuple)
    before, after = engine.chunks
    template = before[0].prompt_token_ids
    assert template is not None and len(template) > (10 if chat else 2)  # vLLM's prompt ids
    if not chat:
        async with httpx.AsyncClient(base_url=vllm_url, timeout=DEADLINE_S) as http:
            body = {"model": MODEL, "prompt": first.prompt}
            tokenized = (await http.post("/tokenize", json=body)).json()["tokens"]
        assert tuple(tokenized) == template
    written = [t for c in before for t in (c.token_ids or ())]
    kept = len(resumed.prompt) - len(template)
    assert kept >= EVICT_AT and resumed.prompt == template + tuple(written[:kept])
    assert resumed.messages is None and dict(resumed.sampling) == {"temperature": 0.0}
    assert after[0].prompt_tokens == len(resumed.prompt)  # vLLM counts exactly those
    record, text = done.done[rid]
    assert record.output_tokens == TOKENS == kept + after[-1].tokens
    assert record.evictions == 1
    # the answer: the text of the tokens kept, then the rest, nothing dropped or repeated
    shown = [c for c in before if c.tokens <= kept]
    assert shown[-1].tokens == kept
    assert text == "".join(c.text for c in shown) + "".join(c.text for c in after)
    return True


async def prefix_hits(engine: VllmEngine) -> float:
    """vLLM's count of prompt tokens it found in its prefix cache (not computed again)."""
    families = await engine._metrics()
    return sum(v for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits")
               for _, v in families.get(name, []))  # fmt: skip


def test_a_parked_request_goes_on_from_the_kv_cache_vllm_kept(vllm_url: str) -> None:
    """``swap_out`` parks a running request (its stream ends, ``submit`` waits); ``swap_in``
    sends it again from its exact token ids and vLLM finds them in its prefix cache instead of
    computing them again. (The CPU build cannot offload KV to CPU memory, so it is not offered
    KV swap as a planner's choice; the mechanism is the same.)"""

    async def scenario() -> None:
        engine = VllmEngine("cpu-0", vllm_url, MODEL, timeout_s=DEADLINE_S)
        try:
            caps = await engine.capabilities()
            assert not caps.supports_swap  # no KV offloading on the CPU build
            chunks: list[TokenChunk] = []
            ready = asyncio.Event()

            def seen(chunk: TokenChunk) -> None:
                chunks.append(chunk)
                if chunk.tokens >= EVICT_AT * 4:
                    ready.set()

            request = EngineRequest(
                "park-1", MODEL, 8, max_tokens=LONG, output_tokens=LONG,
                prompt="QLM parks this request and brings it back.",
            )  # fmt: skip
            task = asyncio.create_task(engine.submit(request, seen))
            await asyncio.wait_for(ready.wait(), DEADLINE_S)
            await engine.swap_out("park-1")
            assert not task.done(), "it ended before it was parked"  # (160 of 1,800 tokens)
            parked_at = chunks[-1].tokens
            hits = await prefix_hits(engine)
            await engine.swap_in("park-1")
            out = await asyncio.wait_for(task, DEADLINE_S)
            assert (out.tokens, out.finish_reason) == (LONG, "length")
            assert out.text == "".join(c.text for c in chunks)
            assert [c.tokens for c in chunks] == sorted({c.tokens for c in chunks})
            # at least the whole 128-token blocks of what it had were found, not computed
            reused = await prefix_hits(engine) - hits
            assert reused >= 128 * ((parked_at + 8) // 128) > 0, (reused, parked_at)
        finally:
            await engine.close()

    asyncio.run(scenario())


OFFLOAD_REFUSED = "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"


def test_the_cpu_build_refuses_kv_offloading_at_start_up(offload_refused: VllmServer) -> None:
    """Why KV swap is not offered on the CPU build: started as ``qlm instance launch
    --kv-offload-gb`` starts vLLM (``--kv-offloading-size G --kv-offloading-backend native``,
    vLLM's ``OffloadingConnector``), its engine fails at start-up — the CPU offloading worker
    exists for CUDA-alike and XPU GPUs only (``vllm/v1/kv_offload/cpu/spec.py``). Should a
    later CPU build serve it, this fails: then test swap with offloading on."""
    server = offload_refused
    assert "--kv-offloading-size" in server.command()
    assert not server.started_s, "vLLM's CPU build served with KV offloading on"
    assert server.proc is not None
    code = server.proc.returncode
    assert code is not None and code != 0, code
    assert OFFLOAD_REFUSED in server.tail(10**7), server.tail()
