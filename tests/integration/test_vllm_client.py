"""End to end: ``VllmEngine`` against a real ``qlm sim-engine serve`` process over HTTP.

The server is the simulated engine behind vLLM's API, so this needs no GPU and no external
service and runs in the normal suite. No assertion depends on wall-clock timing: every wait polls
with a generous deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from resume_helpers import Ended, EvictOnceAt, Watched, serve_one

from qlm.domain import SLO, Decision, InstanceSpec, ModelTier, Pull, Request, SwapIn, SwapOut
from qlm.engines.base import Engine, EngineRequest, TokenChunk
from qlm.engines.vllm import VllmEngine
from qlm.engines.wallclock import filler_text
from qlm.errors import EngineError, RequestRejected, UnknownRequest
from qlm.planner.policy import DispatchContext, PolicyBase
from qlm.service.jobs import Job

MODEL = "llama-3-8b"
DEADLINE_S = 60.0
# ~12 ms per decode step in simulated time; x10 keeps a 4000-token request running for seconds,
# so an abort always lands mid-stream, while short requests finish in a few milliseconds.
TIME_SCALE = "10"

pytestmark = pytest.mark.timeout(180)

LOADED_HOST_S = 60.0  # the client's timeout per call: a scrape on a busy host can take seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def qlm_executable() -> str:
    exe = Path(sys.executable).with_name("qlm")
    return str(exe) if exe.exists() else "qlm"


@contextmanager
def sim_engine(
    log: Path, time_scale: str = TIME_SCALE, model: str = MODEL, extra: tuple[str, ...] = ()
) -> Iterator[str]:
    """A ``qlm sim-engine serve`` process of ``model`` (output to ``log``; ``extra``: more
    flags), healthy; its URL."""
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [qlm_executable(), "sim-engine", "serve", "--model", model, "--gpu", "A100",
             "--port", str(port), "--time-scale", time_scale, "--dev-mode",
             "--scheduling-policy", "priority", *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            if proc.poll() is not None:
                text = log.read_text(errors="replace")[-4000:]
                pytest.fail(f"qlm sim-engine serve exited with {proc.returncode}:\n{text}")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"qlm sim-engine serve did not become healthy at {url}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with sim_engine(tmp_path_factory.mktemp("sim-engine") / "server.log") as url:
        yield url


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        await asyncio.sleep(0.02)


def request(rid: str, tokens: int, **kw: object) -> EngineRequest:
    args: dict[str, object] = {
        "request_id": rid,
        "model": MODEL,
        "prompt_tokens": 32,
        "max_tokens": tokens,
        "output_tokens": tokens,
    }
    return EngineRequest(**(args | kw))  # type: ignore[arg-type]


def test_vllm_client_streams_aborts_reads_metrics_and_sleeps(server_url: str) -> None:
    async def scenario() -> None:
        engine = VllmEngine("sim-0", server_url, MODEL, timeout_s=LOADED_HOST_S)
        assert isinstance(engine, Engine)
        try:
            assert await engine.health()
            caps = await engine.capabilities()
            assert caps.models == (MODEL,)
            assert caps.kv_capacity_tokens and caps.kv_capacity_tokens > 10_000
            assert caps.supports_sleep and not caps.supports_swap

            # A replayed request streams exactly its recorded length (ignore_eos + max_tokens).
            chunks: list[TokenChunk] = []
            out = await engine.submit(request("r-1", 20, priority=1), chunks.append)
            assert (out.tokens, out.finish_reason) == (20, "length")
            assert out.text == filler_text(20)
            assert "".join(c.text for c in chunks) == out.text
            assert [c.tokens for c in chunks] == sorted(c.tokens for c in chunks)
            assert chunks[-1].finish_reason == "length"

            # Abort mid-stream: the partial output comes back and the server forgets the request.
            seen: list[TokenChunk] = []
            long_run = asyncio.create_task(engine.submit(request("r-long", 4000), seen.append))

            async def streaming() -> bool:
                return bool(seen) and seen[-1].tokens >= 5

            await eventually(streaming, "the long request streams tokens")
            stats = await engine.stats()
            assert stats.running == 1
            assert stats.kv_usage > 0
            partial = await engine.abort("r-long")
            assert partial.aborted
            assert 5 <= partial.tokens < 4000
            assert partial.text == filler_text(partial.tokens)
            assert await long_run == partial

            async def drained() -> bool:
                s = await engine.stats()
                return s.running == 0 and s.waiting == 0

            await eventually(drained, "the server drops the aborted request")
            stats = await engine.stats()
            assert stats.preemptions_total == 0
            assert stats.kv_usage == 0
            with pytest.raises(UnknownRequest):
                await engine.abort("r-long")

            # Sleep (level 1), refuse work while asleep, wake up, serve again.
            await engine.set_model_tier(MODEL, ModelTier.WARM)
            assert await engine.is_sleeping()
            assert (await engine.stats()).sleeping
            with pytest.raises(EngineError, match="503"):
                await engine.submit(request("r-asleep", 4))
            await engine.set_model_tier(MODEL, ModelTier.ACTIVE)
            assert not await engine.is_sleeping()
            assert (await engine.submit(request("r-2", 3))).tokens == 3

            # Level 2 (cold): the client wakes it the way vLLM needs, weights reloaded.
            await engine.set_model_tier(MODEL, ModelTier.COLD)
            assert await engine.is_sleeping()
            await engine.set_model_tier(MODEL, ModelTier.ACTIVE)
            assert (await engine.submit(request("r-3", 3))).tokens == 3
        finally:
            await engine.close()

    asyncio.run(scenario())


def test_vllm_client_errors_name_the_instance_and_url(server_url: str) -> None:
    async def scenario() -> None:
        engine = VllmEngine("sim-0", server_url, MODEL, timeout_s=LOADED_HOST_S)
        try:
            with pytest.raises(RequestRejected, match=r"sim-0 \(http://127\.0\.0\.1:\d+\).*404"):
                await engine.submit(request("r-x", 4, model="no-such-model"))
            with pytest.raises(RequestRejected, match=r"400.*maximum context length is 8192"):
                # the request is at fault, not the server
                await engine.submit(request("r-y", 10, prompt_tokens=9000))
        finally:
            await engine.close()
        dead = VllmEngine("dead-1", "http://127.0.0.1:9", MODEL, timeout_s=2.0)
        try:
            assert not await dead.health()
            with pytest.raises(EngineError, match=r"dead-1 \(http://127\.0\.0\.1:9\)"):
                await dead.stats()
        finally:
            await dead.close()

    asyncio.run(scenario())


def test_the_client_runs_as_many_requests_at_once_as_the_agent_sends(tmp_path: Path) -> None:
    """An agent keeps up to max_num_seqs requests streaming on one server (256 on an A100, 1,024
    on an H100); every one holds its connection until it ends. A connection pool capped below
    that (httpx's default is 100) would hold the rest back and time them out. The requests are
    long (8,000 tokens of the 8,192-token context) on a server in real time (minutes each), so
    none ends before the last one starts, however slowly a loaded machine opens the streams;
    once all run they are aborted."""
    n, tokens = 150, 8000

    async def scenario(server_url: str) -> None:
        engine = VllmEngine("sim-0", server_url, MODEL, timeout_s=LOADED_HOST_S)
        peak = 0
        try:
            runs = [asyncio.create_task(engine.submit(request(f"c-{i}", tokens))) for i in range(n)]

            async def all_running() -> bool:
                nonlocal peak
                peak = max(peak, (await engine.stats()).running)
                return peak >= n or any(r.done() for r in runs)

            await eventually(all_running, f"{n} requests run at once (or one ended)")
            ended = {i: r for i, r in enumerate(runs) if r.done()}
            assert not ended, f"{len(ended)} ended before all ran: " + ", ".join(
                f"c-{i}: {r.exception() or r.result().finish_reason}"
                for i, r in list(ended.items())[:3]
            )
            outs = [await engine.abort(f"c-{i}") for i in range(n)]
            await asyncio.gather(*runs, return_exceptions=True)

            async def server_idle() -> bool:
                return (await engine.stats()).running == 0

            await eventually(server_idle, "the server dropped every aborted request")
        finally:
            await engine.close()
        assert peak == n, f"at most {peak} of {n} ran at once"
        assert all(o.tokens < tokens for o in outs)

    with sim_engine(tmp_path / "server.log", time_scale="1") as url:
        asyncio.run(scenario(url))


class Recording(httpx.AsyncHTTPTransport):
    """The client's transport, keeping the path and body of every POST."""

    def __init__(self) -> None:
        super().__init__()
        self.posts: list[tuple[str, dict[str, object]]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.posts.append((request.url.path, json.loads(request.content)))
        return await super().handle_async_request(request)


def test_a_chat_reaches_the_chat_endpoint_and_a_resumed_one_continues_its_answer(
    server_url: str,
) -> None:
    """A chat is sent as its messages to /v1/chat/completions (vLLM applies the model's chat
    template), streams its answer and ends; evicted and sent again, it carries its partial answer
    as the assistant's message to continue, which the server accepts and continues."""
    messages = [{"role": "user", "content": "Tell me about queues."}]
    wire = Recording()

    async def scenario() -> None:
        engine = VllmEngine("sim-0", server_url, MODEL, transport=wire, timeout_s=LOADED_HOST_S)
        try:
            chunks: list[TokenChunk] = []
            chat = Job(prompt="<|im_start|>user ...", messages=messages).fill(
                EngineRequest("chat-1", MODEL, prompt_tokens=8, max_tokens=40)
            )
            out = await engine.submit(chat, chunks.append)
            assert out.finish_reason in ("stop", "length") and 1 <= out.tokens <= 40
            assert out.text == filler_text(out.tokens) == "".join(c.text for c in chunks)

            job = Job(messages=messages)
            seen: list[TokenChunk] = []
            first = EngineRequest("chat-2", MODEL, 8, max_tokens=4000, output_tokens=4000)
            running = asyncio.create_task(engine.submit(job.fill(first), seen.append))

            async def streaming() -> bool:
                return bool(seen) and seen[-1].tokens >= 5

            await eventually(streaming, "the long chat streams tokens")
            partial = await engine.abort("chat-2")
            assert partial.aborted and await running == partial
            job.partial_text = partial.text
            done = partial.tokens  # the rest is cut to 20 tokens (a replay's), to end soon
            rest = EngineRequest("chat-2", MODEL, 8 + done, 4000 - done, output_tokens=20)
            out = await engine.submit(job.fill(rest))
            assert (out.tokens, out.finish_reason) == (20, "length")
            assert partial.text + out.text == filler_text(done + 20)
        finally:
            await engine.close()

    asyncio.run(scenario())
    (path, body), (_, long_run), (_, resumed) = wire.posts
    assert path == "/v1/chat/completions" and body["messages"] == messages
    assert "prompt" not in body and "continue_final_message" not in body
    assert long_run["messages"] == messages
    assert resumed["messages"][:-1] == messages
    assert resumed["messages"][-1]["role"] == "assistant"  # type: ignore[index]
    assert resumed["continue_final_message"] is True
    assert resumed["add_generation_prompt"] is False


def test_a_response_format_reaches_the_server_which_answers_a_document_of_its_schema(
    server_url: str,
) -> None:
    """Structured output through the client: the format goes to vLLM's chat endpoint with the
    other sampling parameters, and the streamed answer is the JSON document."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "town", "schema": schema}}
    wire = Recording()

    async def scenario() -> str:
        engine = VllmEngine("sim-0", server_url, MODEL, transport=wire, timeout_s=LOADED_HOST_S)
        try:
            messages = [{"role": "user", "content": "Where?"}]
            job = Job(messages=messages, sampling={"seed": 3, "response_format": fmt})
            chunks: list[TokenChunk] = []
            out = await engine.submit(
                job.fill(EngineRequest("fmt-1", MODEL, 8, max_tokens=30)), chunks.append
            )
            assert out.finish_reason == "stop" and out.text == "".join(c.text for c in chunks)
            return out.text
        finally:
            await engine.close()

    text = asyncio.run(scenario())
    assert set(json.loads(text)) == {"city"}
    ((_, body),) = wire.posts
    assert body["response_format"] == fmt and body["seed"] == 3


def test_a_chat_with_tools_comes_back_as_the_calls_the_server_made(server_url: str) -> None:
    """Tool calling over HTTP: the tools go to vLLM's chat endpoint, the streamed call deltas
    come back assembled into whole calls, with the finish reason ``tool_calls``."""
    weather = {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }

    async def scenario() -> Any:
        engine = VllmEngine("sim-0", server_url, MODEL, timeout_s=LOADED_HOST_S)
        try:
            job = Job(
                messages=[{"role": "user", "content": "Oslo?"}], sampling={"tools": [weather]}
            )
            chunks: list[TokenChunk] = []
            out = await engine.submit(
                job.fill(EngineRequest("tools-1", MODEL, 8, max_tokens=30)), chunks.append
            )
            assert any(c.calls for c in chunks) and not any(c.text for c in chunks)
            return out
        finally:
            await engine.close()

    out = asyncio.run(scenario())
    assert out.finish_reason == "tool_calls" and out.text == ""
    (call,) = out.tool_calls
    assert call["id"] == "call_tools-1" and call["function"]["name"] == "weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}


def test_an_evicted_chat_resumes_from_the_token_ids_the_server_said(server_url: str) -> None:
    """The agents' runtime over ``qlm sim-engine serve`` as over vLLM 0.32: a chat is sent with
    ``return_token_ids``, the server says its prompt's ids (as ``/tokenize`` makes them) and each
    chunk's; evicted mid-answer, it goes again as a completion whose prompt is exactly those ids
    + the ids written, which the server counts as the prompt, and the answer comes whole."""
    tokens, evict_at = 1000, 40  # (~1 ms a token here: the eviction lands mid-answer)
    messages = [{"role": "user", "content": "Which queue serves me first, and why?"}]

    async def scenario() -> Ended:
        engine = Watched(VllmEngine("sim-0", server_url, MODEL, timeout_s=LOADED_HOST_S))
        policy = EvictOnceAt("chat-1", "sim-0", lambda: engine.written() >= evict_at)
        ended = Ended()
        await serve_one(
            engine, policy, InstanceSpec("sim-0", "A100", (MODEL,)),
            lambda now: Request(
                id="chat-1", model=MODEL, arrival_s=now, input_tokens=7, max_tokens=tokens,
                slo=SLO(e2e_s=3600.0), replay_output_tokens=tokens,
            ),
            Job(prompt="Which queue", messages=messages), ended, deadline_s=DEADLINE_S,
        )  # fmt: skip
        first, resumed = engine.sent  # evicted once, sent again once
        assert first.messages is not None and isinstance(resumed.prompt, tuple)
        assert resumed.messages is None and not resumed.continue_final_message
        before, after = engine.chunks
        prompt = before[0].prompt_token_ids
        said = httpx.post(f"{server_url}/tokenize", json={"messages": messages}).json()
        assert prompt is not None and list(prompt) == said["tokens"] and len(prompt) == 7
        ids = [t for c in before for t in (c.token_ids or ())]
        kept = len(resumed.prompt) - len(prompt)
        assert kept >= evict_at and resumed.prompt == prompt + tuple(ids[:kept])
        assert after[0].prompt_tokens == len(resumed.prompt)  # counted as exactly those
        assert kept + after[-1].tokens == tokens
        return ended

    ended = asyncio.run(scenario())
    assert not ended.errors, ended.errors
    record, text = ended.done["chat-1"]
    assert (record.output_tokens, record.evictions) == (tokens, 1)
    assert text == filler_text(tokens)


class SwapOnceAt(PolicyBase):
    """Pulls everything onto ``instance``; swaps ``rid`` out once, when ``ready()`` — only where
    the instance offers swap space, as the planner does — and in again once it is parked."""

    name = "swap-once-at"

    def __init__(self, rid: str, instance: str, ready: Callable[[], bool], parked: asyncio.Event):
        self.rid, self.instance, self.ready, self.parked = rid, instance, ready, parked
        self.out = self.back = False
        self.swap_space_gb = 0.0

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        out: list[Decision] = [Pull(r.id, self.instance) for r in ctx.arrived]
        (load,) = ctx.instances
        if not self.out and self.ready() and load.swap_free_gb > 0:
            self.out, self.swap_space_gb = True, load.swap_free_gb
            out.append(SwapOut(self.rid, self.instance))
        elif self.out and not self.back and self.parked.is_set():
            self.back = True
            out.append(SwapIn(self.rid, self.instance))
        return out


class Parking(Watched):
    """The watched engine, saying when a request has been parked."""

    def __init__(self, inner: VllmEngine) -> None:
        super().__init__(inner)
        self.parked = asyncio.Event()
        self.parked_at = 0  # tokens streamed when it was parked

    async def swap_out(self, request_id: str) -> None:
        await self.inner.swap_out(request_id)
        self.parked_at = self.written()
        self.parked.set()


def external_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=LOADED_HOST_S).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "vllm:external_prefix_cache_hits"
        for s in f.samples
        if s.name.endswith("_total")
    )


def test_with_kv_offloading_a_swapped_request_goes_on_from_the_blocks_the_server_kept(
    tmp_path: Path,
) -> None:
    """KV swap through the agents' runtime over HTTP, where the server offloads KV to CPU
    memory (``--kv-offloading-size``, as vLLM's flag): the client offers swap with that memory
    as swap space, the policy swaps a running request out (parked: its stream ends) and in
    (sent again from its exact token ids), and the server's own counter shows its prompt found
    in the CPU tier — at least the whole blocks of what it had — instead of computed again.
    The answer comes whole, to its full length, under one submission."""
    tokens, swap_at = 1000, 200

    async def scenario(url: str) -> tuple[Parking, SwapOnceAt, Ended]:
        engine = Parking(VllmEngine("sim-0", url, MODEL, timeout_s=LOADED_HOST_S))
        caps = await engine.inner.capabilities()
        assert caps.supports_swap and (await engine.inner.stats()).swap_free_gb == 4.0
        policy = SwapOnceAt("swap-1", "sim-0", lambda: engine.written() >= swap_at, engine.parked)
        ended = Ended()
        await serve_one(
            engine, policy, InstanceSpec("sim-0", "A100", (MODEL,)),
            lambda now: Request(
                id="swap-1", model=MODEL, arrival_s=now, input_tokens=300, max_tokens=tokens,
                slo=SLO(e2e_s=3600.0), replay_output_tokens=tokens,
            ),
            Job(prompt=filler_text(300)), ended, deadline_s=DEADLINE_S,
        )  # fmt: skip
        return engine, policy, ended

    with sim_engine(tmp_path / "server.log", extra=("--kv-offloading-size", "4")) as url:
        hits = external_hits(url)
        engine, policy, ended = asyncio.run(scenario(url))
        reused = external_hits(url) - hits
    assert not ended.errors, ended.errors
    assert policy.back and policy.swap_space_gb == 4.0
    assert len(engine.sent) == 1  # parked and sent again inside the one submission
    (chunks,) = engine.chunks
    prompt = chunks[0].prompt_token_ids
    assert prompt is not None and engine.parked_at >= swap_at
    counts = [c.tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == tokens
    # sent again as prompt + what it had written: whole blocks of it (the server's are 16
    # tokens) were found in CPU memory, not computed again
    assert reused >= (len(prompt) + engine.parked_at - 1) // 16 * 16 > 0, reused
    record, text = ended.done["swap-1"]
    assert record.output_tokens == tokens and text == filler_text(tokens)


def test_sleep_aborts_the_requests_in_flight_unless_told_to_wait_as_vllm_032(
    server_url: str,
) -> None:
    """``POST /sleep`` as vLLM 0.32: by default (``mode=abort``) the requests in flight are
    aborted (their answers end ``abort``); with ``mode=wait`` they finish first, whole."""

    async def scenario() -> None:
        engine = VllmEngine("sim-0", server_url, MODEL, timeout_s=LOADED_HOST_S)
        http = httpx.AsyncClient(base_url=server_url, timeout=LOADED_HOST_S)
        try:
            for mode, tokens in (("abort", 4000), ("wait", 300)):
                started = asyncio.Event()

                def seen(chunk: TokenChunk, started: asyncio.Event = started) -> None:
                    started.set()

                task = asyncio.create_task(engine.submit(request(f"sleep-{mode}", tokens), seen))
                await asyncio.wait_for(started.wait(), DEADLINE_S)
                params = {"level": 1} | ({"mode": mode} if mode == "wait" else {})
                slept = await http.post("/sleep", params=params)
                assert slept.json() == {"status": "sleeping", "level": 1}
                out = await asyncio.wait_for(task, DEADLINE_S)
                if mode == "abort":
                    assert out.aborted and out.tokens < tokens
                else:
                    assert (out.tokens, out.finish_reason) == (tokens, "length")
                assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
                assert (await http.post("/wake_up")).json()["status"] == "awake"
        finally:
            await http.aclose()
            await engine.close()

    asyncio.run(scenario())
