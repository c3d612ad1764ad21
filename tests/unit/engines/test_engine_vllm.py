"""The vLLM HTTP client without a server: metrics parsing, tiers, errors, the launch command."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from qlm.cli import app
from qlm.domain import ModelTier
from qlm.engines.base import Engine, EngineRequest, TokenChunk, UnsupportedOperation
from qlm.engines.vllm import OPENING, VllmEngine, filler_prompt
from qlm.engines.vllm_launch import vllm_serve_command
from qlm.engines.vllm_wire import context_room, engine_request_id, event_parts, one_token
from qlm.errors import EngineError, EngineTimeout, RequestRejected, UnknownRequest

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
vllm:num_requests_running{engine="1",model_name="llama"} 2.0
vllm:num_requests_running{engine="0",model_name="other"} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.25
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="llama"} 7.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
"""


def engine_with(handler: Callable[[httpx.Request], httpx.Response]) -> VllmEngine:
    return VllmEngine(
        "gpu-3", "http://vllm-3:8000/", "llama", transport=httpx.MockTransport(handler)
    )


def test_stats_are_read_from_vllm_metrics_for_this_model() -> None:
    async def scenario() -> None:
        engine = engine_with(lambda r: httpx.Response(200, text=METRICS))
        assert isinstance(engine, Engine)
        stats = await engine.stats()
        await engine.close()
        assert (stats.running, stats.waiting, stats.preemptions_total) == (5, 4, 7)
        assert stats.kv_usage == 0.25
        assert (stats.kv_capacity_tokens, stats.kv_used_tokens) == (16_000, 4_000)
        assert stats.active_model == "llama" and not stats.sleeping

    asyncio.run(scenario())


def test_kv_swap_is_offered_where_vllm_offloads_kv_to_cpu_memory() -> None:
    """A parked request's KV cache lasts only where vLLM offloads KV blocks to CPU memory
    (``--kv-offloading-size``, with prefix caching): there its size is the swap space; without
    it (the default, and vLLM's CPU build, which cannot offload) the planner gets no KV swap."""
    off = METRICS.replace(
        'num_gpu_blocks="1000"',
        'num_gpu_blocks="1000",enable_prefix_caching="True",kv_offloading_size="None"',
    )
    on = off.replace('kv_offloading_size="None"', 'kv_offloading_size="2.5"')
    no_prefix = on.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"')

    async def swap_space(metrics: str) -> float | None:
        engine = engine_with(lambda r: httpx.Response(200, text=metrics))
        stats = await engine.stats()
        await engine.close()
        return stats.swap_free_gb

    async def scenario() -> None:
        assert await swap_space(on) == 2.5
        assert await swap_space(off) is None
        assert await swap_space(no_prefix) is None
        assert await swap_space(METRICS) is None

    asyncio.run(scenario())


def test_model_tiers_map_to_vllm_sleep_levels_and_wake_up() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path}?{request.url.query.decode()}")
        return httpx.Response(200)

    asked = [ModelTier.WARM, ModelTier.ACTIVE, ModelTier.COLD, ModelTier.WARM, ModelTier.ACTIVE]

    async def scenario() -> list[ModelTier]:
        engine = engine_with(handler)
        said = [await engine.set_model_tier("llama", tier) for tier in asked]
        await engine.close()
        return said

    said = asyncio.run(scenario())
    # Asleep at level 2, asked warm, the model stays cold (vLLM cannot bring the weights back
    # to CPU memory asleep): nothing is sent, and the client says so.
    assert said == [ModelTier.WARM, ModelTier.ACTIVE, ModelTier.COLD, ModelTier.COLD,
                    ModelTier.ACTIVE]  # fmt: skip
    # Level 1 keeps the weights in CPU memory: a wake_up brings them back. Level 2 discarded
    # them: reallocate, reload in place, then the KV cache (vLLM's sleep-mode recipe).
    assert calls == [
        "POST /sleep?level=1&mode=wait",
        "POST /wake_up?",
        "POST /sleep?level=2&mode=wait",
        "POST /wake_up?tags=weights",
        "POST /collective_rpc?",
        "POST /wake_up?tags=kv_cache",
    ]


def test_sleep_without_dev_mode_says_how_to_start_vllm() -> None:
    async def scenario() -> None:
        engine = engine_with(lambda r: httpx.Response(404, json={"detail": "Not Found"}))
        with pytest.raises(EngineError, match=r"gpu-3 \(http://vllm-3:8000\).*VLLM_SERVER_DEV"):
            await engine.set_model_tier("llama", ModelTier.WARM)
        with pytest.raises(EngineError, match="unknown model"):
            await engine.set_model_tier("mistral", ModelTier.WARM)
        await engine.close()

    asyncio.run(scenario())


def test_only_a_request_whose_token_ids_the_server_said_can_be_parked() -> None:
    """Parking (the swap vLLM's cache makes possible) needs the prompt's and the output's token
    ids: a server that does not say them (before 0.10.2) gets the request evicted instead."""

    async def scenario() -> None:
        started = asyncio.Event()

        async def body() -> Any:
            yield b'data: {"choices": [{"index": 0, "text": "a"}], "usage": {"completion_tokens": 1}}\n\n'
            started.set()
            await asyncio.Event().wait()  # (until cancelled)

        engine = engine_with(lambda r: httpx.Response(200, content=body()))
        with pytest.raises(UnknownRequest):
            await engine.swap_out("nobody")
        task = asyncio.create_task(
            engine.submit(EngineRequest("r1", "llama", 3, max_tokens=9, prompt="x"))
        )
        await started.wait()
        with pytest.raises(UnsupportedOperation, match="did not say all its token ids"):
            await engine.swap_out("r1")
        with pytest.raises(UnknownRequest):
            await engine.swap_in("r1")  # (not parked)
        assert (await engine.abort("r1")).aborted
        await task
        await engine.close()

    asyncio.run(scenario())


def test_a_parked_request_is_sent_again_from_its_exact_token_ids_and_its_submit_goes_on() -> None:
    """``swap_out`` ends the request's stream (vLLM frees its place; its KV stays in vLLM's
    cache) while ``submit`` waits; ``swap_in`` sends it again as a completion of the prompt's
    and the output's ids, under a new wire id, for the tokens left, and the one ``submit``
    returns the whole output with every chunk counted from the start."""
    bodies: list[tuple[dict[str, Any], str]] = []
    streaming = asyncio.Event()

    def event(
        text: str, ids: list[int], n: int, *, first: bool = False, end: bool = False
    ) -> bytes:
        choice = {
            "index": 0,
            "text": text,
            "token_ids": ids,
            "finish_reason": "length" if end else None,
        }
        if first:
            choice["prompt_token_ids"] = [1, 2, 3]
        usage = {"prompt_tokens": 3, "completion_tokens": n}
        return f"data: {json.dumps({'choices': [choice], 'usage': usage})}\n\n".encode()

    async def first() -> Any:
        yield event("A", [10], 1, first=True)
        yield event(" b", [11], 2)
        streaming.set()
        await asyncio.Event().wait()  # (until the park cancels it)

    async def rest() -> Any:
        yield event("c", [12], 1)
        yield event("d", [13], 2, end=True)
        yield b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append((body, request.headers.get("X-Request-Id", "")))
        if request.url.path == "/abort_requests":
            return httpx.Response(200)
        return httpx.Response(200, content=first() if len(bodies) == 1 else rest())

    async def scenario() -> None:
        engine = engine_with(handler)
        engine._abort_endpoint = True  # (as ``capabilities`` finds on a dev-mode server)
        chunks: list[TokenChunk] = []
        request = EngineRequest(
            "r1", "llama", 3, max_tokens=4, messages=HI,
            sampling=(("temperature", 0.0), ("logprobs", True)),
        )  # fmt: skip
        task = asyncio.create_task(engine.submit(request, chunks.append))
        await streaming.wait()
        await engine.swap_out("r1")
        assert not task.done()
        await engine.swap_in("r1")
        out = await task
        assert (out.text, out.tokens, out.finish_reason) == ("A bcd", 4, "length")
        assert [(c.text, c.tokens, c.token_ids) for c in chunks] == [
            ("A", 1, (10,)), (" b", 2, (11,)), ("c", 3, (12,)), ("d", 4, (13,)),
        ]  # fmt: skip
        assert chunks[0].prompt_token_ids == (1, 2, 3)
        assert all(c.prompt_token_ids is None for c in chunks[1:])
        await engine.close()

    asyncio.run(scenario())
    (chat, wire1), (abort, _), (again, wire2) = bodies
    assert "messages" in chat and wire1 == "r1"
    assert abort == {"request_ids": ["chatcmpl-r1"]}
    assert again["prompt"] == [1, 2, 3, 10, 11] and "messages" not in again
    assert again["max_tokens"] == 2 and again["temperature"] == 0.0 and "logprobs" not in again
    assert wire2 == "r1.2"


def test_server_errors_carry_vllm_s_message() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "prompt too long", "code": 400}})

    async def scenario() -> None:
        engine = engine_with(handler)
        with pytest.raises(EngineError, match="GET /metrics answered 400: prompt too long"):
            await engine.stats()
        await engine.close()

    asyncio.run(scenario())


def test_a_timeout_is_an_engine_timeout_and_says_whether_the_request_reached_the_server() -> None:
    """Slow is not dead: a timeout is ``EngineTimeout`` (a connect that timed out never reached
    the server), a refused connection stays a plain ``EngineError``, and a health check that
    times out raises rather than answering False."""
    failure: dict[str, Exception] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [5, 6, 7]})
        raise failure["now"]

    async def scenario() -> None:
        engine = engine_with(handler)
        failure["now"] = httpx.ConnectTimeout("connect timed out")
        with pytest.raises(EngineTimeout, match="ConnectTimeout") as connect:
            await engine.submit(EngineRequest("a", "llama", 3, max_tokens=1))
        assert not connect.value.reached
        with pytest.raises(EngineTimeout):
            await engine.health()
        failure["now"] = httpx.WriteTimeout("write timed out")
        with pytest.raises(EngineTimeout) as write:
            await engine.stats()
        assert write.value.reached
        failure["now"] = httpx.ConnectError("connection refused")
        with pytest.raises(EngineError) as refused:
            await engine.submit(EngineRequest("b", "llama", 3, max_tokens=1))
        assert not isinstance(refused.value, EngineTimeout)
        assert not await engine.health()
        await engine.close()

    asyncio.run(scenario())


def test_the_launch_command_has_the_flags_qlm_needs() -> None:
    cmd = vllm_serve_command(
        "meta-llama/Llama-3.1-8B",
        port=8003,
        sleep_mode=True,
        kv_offload_gb=32,
        tool_call_parser="llama3_json",
        stream_interval=8,
    )
    argv = " ".join(cmd.argv)
    assert argv.startswith("vllm serve meta-llama/Llama-3.1-8B --port 8003")
    for flag in (
        "--scheduling-policy priority",
        "--enable-request-id-headers",
        "--enable-sleep-mode",
        "--kv-offloading-size 32 --kv-offloading-backend native",
        "--enable-auto-tool-choice --tool-call-parser llama3_json",
        "--stream-interval 8",
    ):
        assert flag in argv
    keep = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "60"}  # above the client's 2 s (KEEPALIVE_S)
    assert dict(cmd.env) == {"VLLM_SERVER_DEV_MODE": "1", **keep}
    plain = vllm_serve_command("m")
    assert "--enable-sleep-mode" not in plain.argv and "--enable-auto-tool-choice" not in plain.argv
    assert dict(plain.env) == {"VLLM_SERVER_DEV_MODE": "1", **keep}  # /abort_requests, ...
    assert dict(vllm_serve_command("m", dev_mode=False).env) == keep
    with pytest.raises(EngineError, match="--sleep-mode needs the dev-mode endpoints"):
        vllm_serve_command("m", sleep_mode=True, dev_mode=False)
    with pytest.raises(EngineError, match="--stream-interval must be >= 1"):
        vllm_serve_command("m", stream_interval=0)
    with pytest.raises(EngineError, match="--tool-call-parser"):
        vllm_serve_command("m", tool_call_parser="x; rm -rf /")


def test_without_a_working_vllm_command_the_server_module_is_started_with_vllms_python() -> None:
    """vLLM's CPU build installs a ``vllm`` command that fails (PackageNotFoundError)."""
    cmd = vllm_serve_command("/models/tiny", port=8001, python="/venv/bin/python", extra=("-x",))
    assert cmd.argv[:6] == (
        "/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/tiny",
        "--port",
    )  # fmt: skip
    assert "--scheduling-policy" in cmd.argv and cmd.argv[-1] == "-x"
    result = CliRunner().invoke(
        app, ["instance", "launch", "--model", "m", "--python", "/v/bin/python", "--print-only"]
    )
    assert result.exit_code == 0
    assert result.stdout.startswith(
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE=60 VLLM_SERVER_DEV_MODE=1 /v/bin/python -m "
        "vllm.entrypoints.openai.api_server --model m"
    )


def test_abort_requests_is_sent_vllms_own_id_of_the_request() -> None:
    completion = EngineRequest("r1", "m", 3, max_tokens=4)
    chat = EngineRequest("r1", "m", 3, max_tokens=4, messages=({"role": "user", "content": "x"},))
    assert engine_request_id(completion, "r1.2") == "cmpl-r1.2-0"
    assert engine_request_id(chat, "r1") == "chatcmpl-r1"


def test_instance_launch_prints_the_command_or_says_vllm_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app, ["instance", "launch", "--model", "m", "--print-only", "--sleep-mode"]
    )
    assert result.exit_code == 0
    assert result.stdout.startswith(
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE=60 VLLM_SERVER_DEV_MODE=1 vllm serve m "
    )
    monkeypatch.setattr("qlm.engines.vllm_launch.vllm_launcher", lambda python=None: None)
    result = runner.invoke(app, ["instance", "launch", "--model", "m"])
    assert result.exit_code == 1
    assert "vLLM is not installed" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_complete_asks_for_one_answer_with_random_prompts_kept_and_reads_its_token_count() -> None:
    seen: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        answer = {"choices": [{"text": "ab", "finish_reason": "length"}]}
        return httpx.Response(200, json=answer | {"usage": {"completion_tokens": 5}})

    async def scenario() -> None:
        engine = engine_with(handler)
        req = EngineRequest("p1", "llama", 3, max_tokens=5, output_tokens=5, prompt=(7, 8, 9))
        out = await engine.complete(req)
        await engine.close()
        assert (out.tokens, out.finish_reason, out.text) == (5, "length", "ab")
        (body,) = seen
        assert body["stream"] is False and "stream_options" not in body
        assert body["prompt"] == [7, 8, 9] and body["ignore_eos"] is True

    asyncio.run(scenario())


def test_a_completion_answer_without_usage_is_an_engine_error_naming_the_instance() -> None:
    async def scenario() -> None:
        engine = engine_with(lambda r: httpx.Response(200, json={"choices": [{"text": ""}]}))
        with pytest.raises(EngineError, match=r"gpu-3.*bad answer"):
            await engine.complete(EngineRequest("p1", "llama", 3, max_tokens=5))
        await engine.close()

    asyncio.run(scenario())


def test_synthetic_prompts_of_different_requests_share_no_prefix_and_keep_their_length() -> None:
    """vLLM's prefix cache would serve identical filler prompts from the first one's blocks."""
    a, b = filler_prompt("r0001", 2000), filler_prompt("r0002", 2000)
    assert len(a) == len(b) == 2000
    assert a[:16] != b[:16]  # the first KV block differs, so every block's hash does
    assert filler_prompt("r0001", 2000) == a  # the same request, the same prompt
    assert len(filler_prompt("r0003", 5)) == 5
    # with the server's own ids (its /tokenize), every id is one of them: any vocabulary size
    ids = (3, 17, 42, 99)
    c, d = filler_prompt("r0001", 300, ids), filler_prompt("r0002", 300, ids)
    assert len(c) == 300 and set(c) | set(d) <= set(ids) and c[:16] != d[:16]


def test_a_server_without_priority_scheduling_gets_the_request_again_without_priority(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM refuses priority != 0 unless started with --scheduling-policy priority. Requests are
    sent again without it (QLM pulls in plan order anyway), and once the server said so, every
    later one goes without: one warning naming the instance and the flag, nothing fails."""
    sent: list[int] = []
    refusal = {"error": {"message": "Got priority 2 but Priority scheduling is not enabled.",
                         "type": "BadRequestError", "param": None, "code": 400}}  # fmt: skip

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body["priority"])
        if body["priority"]:
            return httpx.Response(400, json=refusal)
        if not body["stream"]:
            answer = {"choices": [{"text": "x", "finish_reason": "length"}]}
            return httpx.Response(200, json=answer | {"usage": {"completion_tokens": 1}})
        chunk = {"choices": [{"text": "x", "finish_reason": "length"}],
                 "usage": {"completion_tokens": 1}}  # fmt: skip
        text = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    async def scenario() -> None:
        engine = engine_with(handler)
        first = await engine.submit(EngineRequest("a", "llama", 3, max_tokens=1, priority=2))
        second = await engine.submit(EngineRequest("b", "llama", 3, max_tokens=1, priority=1))
        third = await engine.complete(EngineRequest("c", "llama", 3, max_tokens=1, priority=2))
        await engine.close()
        assert [o.tokens for o in (first, second, third)] == [1, 1, 1]

    with caplog.at_level("WARNING", logger="qlm.engines.vllm"):
        asyncio.run(scenario())
    assert sent == [2, 0, 0, 0]
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "gpu-3" in warning and "--scheduling-policy priority" in warning


def test_other_rejections_are_not_retried() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path == "/v1/completions")
        return httpx.Response(400, json={"error": {"message": "too long", "type": "x"}})

    async def scenario() -> None:
        engine = engine_with(handler)
        with pytest.raises(RequestRejected, match="too long"):
            await engine.submit(EngineRequest("a", "llama", 3, max_tokens=1, priority=2))
        await engine.close()

    asyncio.run(scenario())
    assert sum(calls) == 1  # (the other call: /tokenize, for the synthetic prompt's ids)


def test_a_request_sent_again_after_an_abort_gets_its_own_id_on_the_wire() -> None:
    """vLLM frees an aborted request only once it notices the closed stream, and refuses an id
    that is still running: the same request sent again goes as ``id.2``; once one finishes, the
    next sending uses the plain id again."""
    wire: list[str] = []
    hold = asyncio.Event()
    done = {
        "choices": [{"text": "x", "finish_reason": "length"}],
        "usage": {"completion_tokens": 1},
    }

    async def held() -> AsyncIterator[bytes]:
        yield f"data: {json.dumps({'choices': [{'text': 'x'}], 'usage': {'completion_tokens': 1}})}\n\n".encode()
        await hold.wait()

    def handler(request: httpx.Request) -> httpx.Response:
        wire.append(request.headers["X-Request-Id"])
        if len(wire) == 1:
            return httpx.Response(
                200, content=held(), headers={"content-type": "text/event-stream"}
            )
        text = f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    async def scenario() -> None:
        engine = engine_with(handler)
        seen: list[TokenChunk] = []
        first = asyncio.create_task(engine.submit(EngineRequest("r1", "llama", 3, 5), seen.append))
        while not seen:
            await asyncio.sleep(0.001)
        partial = await engine.abort("r1")
        assert partial.aborted and partial.tokens == 1 and (await first).aborted
        again = await engine.submit(EngineRequest("r1", "llama", 3, 5))
        third = await engine.submit(EngineRequest("r1", "llama", 3, 5))
        await engine.close()
        assert not again.aborted and not third.aborted

    asyncio.run(scenario())
    assert wire == ["r1", "r1.2", "r1"]


def test_a_burst_of_streams_opens_a_few_at_a_time_and_all_stay_open_together() -> None:
    """A controller taking over a backlog pulls hundreds of requests per server in one step:
    at most ``OPENING`` of them are being opened (connect, request, headers) at once, and the
    bound is on opening only — every stream, once open, streams alongside the others."""
    burst = 3 * OPENING
    opening = 0
    most = 0
    open_streams = 0
    answer = asyncio.Event()
    finish = asyncio.Event()
    done = {
        "choices": [{"text": "x", "finish_reason": "length"}],
        "usage": {"completion_tokens": 1},
    }

    async def body() -> AsyncIterator[bytes]:
        nonlocal open_streams
        open_streams += 1
        await finish.wait()
        yield f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode()

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal opening, most
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [5, 6, 7]})
        opening += 1
        most = max(most, opening)
        await answer.wait()  # a server slow to answer
        opening -= 1
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    async def scenario() -> None:
        engine = VllmEngine(
            "gpu-3", "http://vllm-3:8000/", "llama", transport=httpx.MockTransport(handler)
        )
        runs = [
            asyncio.create_task(engine.submit(EngineRequest(f"r{i}", "llama", 3, 1)))
            for i in range(burst)
        ]
        while opening < OPENING:
            await asyncio.sleep(0.001)
        for _ in range(20):  # the others had every chance to start opening too
            await asyncio.sleep(0)
        assert most == OPENING
        answer.set()
        while open_streams < burst:
            await asyncio.sleep(0.001)
        finish.set()
        outs = await asyncio.gather(*runs)
        await engine.close()
        assert all(out.tokens == 1 for out in outs)

    asyncio.run(scenario())
    assert most == OPENING


def sse(*events: object) -> httpx.Response:
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


def test_a_generation_that_fails_inside_the_stream_fails_that_request_alone() -> None:
    """vLLM reports a failed generation inside the 200 stream (an error event, or finish_reason
    ``error``): that request is rejected with vLLM's words — the server is not down, and the
    output is not taken for a finished answer (streamed or not)."""
    first = {"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}}
    oom = {"error": {"message": "CUDA error: out of memory", "type": "Internal", "code": 500}}
    failed = {
        "choices": [{"text": "a", "finish_reason": "error"}],
        "usage": {"completion_tokens": 1},
    }

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if not body["stream"]:
            return httpx.Response(200, json=failed)
        return sse(first, oom) if body["prompt"] == [1] else sse(failed)

    async def scenario() -> None:
        engine = engine_with(handler)
        with pytest.raises(RequestRejected, match="CUDA error: out of memory"):
            await engine.submit(EngineRequest("a", "llama", 1, max_tokens=5, prompt=(1,)))
        with pytest.raises(RequestRejected, match="finish_reason 'error'"):
            await engine.submit(EngineRequest("b", "llama", 1, max_tokens=5, prompt=(2,)))
        with pytest.raises(RequestRejected, match="finish_reason 'error'"):
            await engine.complete(EngineRequest("c", "llama", 1, max_tokens=5, prompt=(2,)))
        await engine.close()

    asyncio.run(scenario())


def test_kv_capacity_under_data_parallelism_is_one_engines_sample() -> None:
    """vLLM sums the KV blocks of its data-parallel engines at startup and every engine's
    cache_config_info carries that sum."""
    two = METRICS.replace(
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n',
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0\n',
    )
    assert two != METRICS

    async def scenario() -> None:
        engine = engine_with(lambda r: httpx.Response(200, text=two))
        stats = await engine.stats()
        await engine.close()
        assert stats.kv_capacity_tokens == 16_000

    asyncio.run(scenario())


def test_metrics_labelled_with_another_served_name_are_still_the_servers() -> None:
    """vLLM labels its metrics with the first --served-model-name only; an instance known to QLM
    by another of its names must not read zeros."""
    lines = [line for line in METRICS.splitlines() if 'model_name="other"' not in line]
    other = "\n".join(lines).replace('model_name="llama"', 'model_name="meta-llama/Llama-3.1-8B"')
    assert 'model_name="llama"' not in other

    async def scenario() -> None:
        engine = engine_with(lambda r: httpx.Response(200, text=other))
        stats = await engine.stats()
        await engine.close()
        assert (stats.running, stats.waiting, stats.preemptions_total) == (5, 4, 7)

    asyncio.run(scenario())


def chat_sse(*texts: str, finish: str = "length") -> httpx.Response:
    """A chat stream as vLLM sends it: the role first, content deltas (the last one with the
    finish reason), the usage chunk. Every chunk carries the running usage."""

    def usage(n: int) -> dict[str, int]:
        return {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n}

    def chunk(delta: dict[str, str], n: int, reason: str | None = None) -> dict[str, object]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {"object": "chat.completion.chunk", "choices": [choice], "usage": usage(n)}

    events = [chunk({"role": "assistant", "content": ""}, 0)]
    for i, text in enumerate(texts, 1):
        events.append(chunk({"content": text}, i, finish if i == len(texts) else None))
    return sse(
        *events, {"object": "chat.completion.chunk", "choices": [], "usage": usage(len(texts))}
    )


HI = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})


def test_a_chat_goes_to_the_chat_endpoint_with_its_messages_and_streams_its_deltas() -> None:
    """vLLM applies the model's own chat template only to ``messages`` on the chat endpoint; a
    prompt (or a replay's filler) still goes to completions."""
    seen: list[tuple[str, dict[str, Any]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if request.url.path == "/v1/completions":
            return sse({"choices": [{"text": "x", "finish_reason": "length"}]})
        if not body["stream"]:
            message = {"role": "assistant", "content": "Hello there"}
            answer = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
            return httpx.Response(200, json=answer | {"usage": {"completion_tokens": 2}})
        return chat_sse("Hel", "lo", " there", finish="stop")

    async def scenario() -> None:
        engine = engine_with(handler)
        chunks: list[TokenChunk] = []
        chat = EngineRequest(
            "c1", "llama", 9, max_tokens=40, priority=1, prompt="<|im_start|>...",
            messages=HI, sampling=(("temperature", 0.5), ("max_completion_tokens", 999)),
        )  # fmt: skip
        out = await engine.submit(chat, chunks.append)
        assert (out.text, out.tokens, out.finish_reason) == ("Hello there", 3, "stop")
        assert [c.text for c in chunks] == ["Hel", "lo", " there"]
        assert [c.tokens for c in chunks] == [1, 2, 3] and chunks[-1].finish_reason == "stop"
        whole = await engine.complete(chat)
        assert (whole.text, whole.tokens, whole.finish_reason) == ("Hello there", 2, "stop")
        await engine.submit(EngineRequest("p1", "llama", 3, max_tokens=1, prompt="Once"))
        await engine.close()

    asyncio.run(scenario())
    (path, body), (whole_path, whole), (prompt_path, prompt_body) = seen
    assert path == whole_path == "/v1/chat/completions"
    assert body["messages"] == list(HI) and "prompt" not in body
    assert body["max_tokens"] == 40 and "max_completion_tokens" not in body
    assert (body["model"], body["priority"], body["temperature"]) == ("llama", 1, 0.5)
    assert body["stream"] is True and body["stream_options"]["include_usage"] is True
    assert "continue_final_message" not in body and "add_generation_prompt" not in body
    assert whole["stream"] is False and whole["messages"] == list(HI)
    assert prompt_path == "/v1/completions" and prompt_body["prompt"] == "Once"
    assert "messages" not in prompt_body


def test_token_ids_are_asked_for_and_passed_on_with_every_chunk() -> None:
    """vLLM 0.32 (``return_token_ids``) puts the prompt's ids on the first chunk (completions:
    in the choice; chat: beside the choices) and each chunk's new ids in its choice: they reach
    the caller with each chunk, a token that decodes to nothing (no text) included."""
    seen: list[dict[str, Any]] = []

    def usage(n: int) -> dict[str, int]:
        return {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if request.url.path == "/v1/completions":

            def choice(text: str, ids: list[int], first: bool, end: bool) -> dict[str, Any]:
                return {
                    "index": 0, "text": text, "finish_reason": "length" if end else None,
                    "prompt_token_ids": [5, 6, 7] if first else None, "token_ids": ids,
                }  # fmt: skip

            return sse(
                {"choices": [choice(" a", [11], True, False)], "usage": usage(1)},
                {"choices": [choice("", [12], False, False)], "usage": usage(2)},
                {"choices": [choice("b", [13], False, True)], "usage": usage(3)},
                {"choices": [], "usage": usage(3)},
            )
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        delta = {"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop", "token_ids": [9]}
        return sse(
            {"choices": [role], "prompt_token_ids": [1, 2, 3, 4]},
            {"choices": [delta], "usage": usage(1)},
        )

    async def scenario() -> None:
        engine = engine_with(handler)
        chunks: list[TokenChunk] = []
        out = await engine.submit(
            EngineRequest("p1", "llama", 3, max_tokens=3, prompt="Once"), chunks.append
        )
        assert out.text == " ab" and out.tokens == 3
        assert [(c.text, c.token_ids) for c in chunks] == [(" a", (11,)), ("", (12,)), ("b", (13,))]
        assert chunks[0].prompt_token_ids == (5, 6, 7) and chunks[1].prompt_token_ids is None
        chat: list[TokenChunk] = []
        await engine.submit(EngineRequest("c1", "llama", 4, max_tokens=1, messages=HI), chat.append)
        assert [(c.text, c.token_ids) for c in chat] == [("Hi", (9,))]
        assert chat[0].prompt_token_ids == (1, 2, 3, 4)
        await engine.close()

    asyncio.run(scenario())
    assert all(body["return_token_ids"] is True for body in seen)


def test_a_resumed_chat_asks_vllm_to_continue_the_partial_answer() -> None:
    """Sent again after an eviction, a chat ends with its partial answer as the assistant's
    message; ``continue_final_message`` (with ``add_generation_prompt`` off: vLLM refuses both)
    makes the model continue that message instead of starting another."""
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return chat_sse(" world")

    async def scenario() -> None:
        engine = engine_with(handler)
        messages = (*HI, {"role": "assistant", "content": "Hello"})
        resumed = EngineRequest(
            "c1", "llama", 11, max_tokens=1, messages=messages, continue_final_message=True
        )
        out = await engine.submit(resumed)
        await engine.close()
        assert (out.text, out.tokens) == (" world", 1)

    asyncio.run(scenario())
    [body] = seen
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 1


# --- a resumed request past the context ----------------------------------------------------------


def test_the_room_left_in_the_context_is_read_from_vllms_refusal() -> None:
    new = (
        "'max_tokens' or 'max_completion_tokens' is too large: 8100. This model's maximum context "
        "length is 8192 tokens and your request has 103 input tokens (8100 > 8192 - 103). "
        "(parameter=max_tokens, value=8100)"
    )
    old = (
        "This model's maximum context length is 8192 tokens. However, you requested 8203 tokens "
        "(103 in the messages, 8100 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    too_long = (
        "This model's maximum context length is 8192 tokens. However, your request has 9000 "
        "input tokens. Please reduce the length of the input messages."
    )
    no_room_032 = (
        "This model's maximum context length is 2048 tokens. However, your prompt contains at "
        "least 2049 input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt. (parameter=input_tokens, value=2049)"
    )
    assert context_room(new) == context_room(old) == 8089
    assert context_room(too_long) == -808
    assert context_room(no_room_032) == -1
    assert context_room("Got priority 1 but Priority scheduling is not enabled.") is None


def test_a_resumed_request_past_the_context_is_sent_again_with_the_room_left() -> None:
    """Sent again after an eviction, a request's partial output can re-tokenize a few tokens
    longer, pushing prompt + max_tokens past the context: vLLM 0.14 refuses it (400; 0.32
    clamps max_tokens instead). QLM interrupted it, so it is not failed: it goes again with
    max_tokens lowered to the room left. A request sent as is (not resumed) that does not fit
    is the client's to fix: refused."""
    sent: list[int] = []

    def vllm_014(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompt, cap = len(body["prompt"].split()), body["max_tokens"]
        sent.append(cap)
        if prompt + cap > 8192:
            message = (
                f"'max_tokens' or 'max_completion_tokens' is too large: {cap}. This model's "
                f"maximum context length is 8192 tokens and your request has {prompt} input "
                f"tokens ({cap} > 8192 - {prompt}). (parameter=max_tokens, value={cap})"
            )
            return httpx.Response(400, json={"error": {"message": message, "code": 400}})
        done = {"choices": [{"text": " x", "finish_reason": "stop"}]}
        return sse(done | {"usage": {"prompt_tokens": prompt, "completion_tokens": 1}})

    async def scenario() -> None:
        engine = engine_with(vllm_014)
        prompt = " ".join(["word"] * 100)
        try:
            fresh = EngineRequest("r-fresh", "llama", 100, max_tokens=8100, prompt=prompt)
            with pytest.raises(RequestRejected, match="maximum context length is 8192"):
                await engine.submit(fresh)
            resumed = EngineRequest(
                "r-resumed", "llama", 97, max_tokens=8100, prompt=prompt, resumed_tokens=20
            )
            out = await engine.submit(resumed)
            assert (out.tokens, out.finish_reason) == (1, "stop")
        finally:
            await engine.close()

    asyncio.run(scenario())
    assert sent == [8100, 8100, 8092]


# --- what the server says of itself: /server_info, the sleep probe, /abort_requests, /tokenize ---


def _server(
    info: dict[str, Any] | None, calls: list[str]
) -> Callable[[httpx.Request], httpx.Response]:
    """A vLLM in dev mode whose /server_info says ``info`` (None: not served)."""
    asleep = [False]

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        calls.append(f"{request.method} {path}?{request.url.query.decode()}")
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "llama"}]})
        if path == "/metrics":
            return httpx.Response(
                200, text=METRICS.replace("3.0", "0.0").replace("2.0", "0.0").replace("4.0", "0.0")
            )
        if path == "/server_info":
            return (
                httpx.Response(404)
                if info is None
                else httpx.Response(200, json={"vllm_config": info})
            )
        if path == "/is_sleeping":
            return httpx.Response(200, json={"is_sleeping": asleep[0]})
        if path == "/sleep":
            asleep[0] = True
            return httpx.Response(200, json={"status": "sleeping"})
        if path == "/wake_up":
            asleep[0] = False
            return httpx.Response(200, json={"status": "awake"})
        if path == "/abort_requests":
            return httpx.Response(200, json={"status": "aborted", "aborted": 1})
        if path == "/tokenize":
            return httpx.Response(200, json={"count": 3, "tokens": [9, 3, 9, 7]})
        return httpx.Response(404)

    return handler


def test_a_server_without_sleep_mode_is_not_slept_and_says_its_limits() -> None:
    """vLLM's CPU build answers /sleep in dev mode without sleeping: /server_info tells."""
    calls: list[str] = []
    info = {
        "model_config": {"enable_sleep_mode": False},
        "device_config": {"device": "cpu"},
        "scheduler_config": {"max_num_seqs": 128},
    }

    async def scenario() -> None:
        engine = engine_with(_server(info, calls))
        caps = await engine.capabilities()
        await engine.close()
        assert not caps.supports_sleep and caps.supports_abort_endpoint
        assert caps.max_num_seqs == 128
        assert "--enable-sleep-mode on cpu" in engine.sleep_probe
        assert engine.token_ids == (3, 7, 9)

    asyncio.run(scenario())
    assert not any(c.startswith("POST /sleep") for c in calls)


def test_sleep_is_probed_by_sleeping_an_idle_server_and_waking_it() -> None:
    calls: list[str] = []

    async def scenario() -> None:
        engine = engine_with(_server(None, calls))  # no /server_info: the round trip decides
        caps = await engine.capabilities()
        await engine.close()
        assert caps.supports_sleep and caps.max_num_seqs is None
        assert "slept (level 1) and woke" in engine.sleep_probe

    asyncio.run(scenario())
    assert "POST /sleep?level=1&mode=wait" in calls and "POST /wake_up?" in calls


def test_without_dev_mode_there_is_no_sleep() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "llama"}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        return httpx.Response(404)

    async def scenario() -> None:
        engine = engine_with(handler)
        caps = await engine.capabilities()
        await engine.close()
        assert not caps.supports_sleep and not caps.supports_abort_endpoint
        assert "VLLM_SERVER_DEV_MODE=1" in engine.sleep_probe
        assert engine.token_ids == ()  # no /tokenize: filler ids from FILLER_IDS

    asyncio.run(scenario())


def test_a_stream_cut_anywhere_into_pieces_gives_the_same_output() -> None:
    """The events reach the client in pieces of any size — one byte at a time splits the
    lines and the UTF-8 characters of the text — with CRLF line ends, comments, and a last
    line without its newline: the answer is the same."""
    events = [
        {"choices": [{"text": "héllo "}], "usage": {"completion_tokens": 1}},
        {"choices": [{"text": "wörld ✓"}], "usage": {"completion_tokens": 2}},
        {"choices": [{"text": "", "finish_reason": "stop"}], "usage": {"completion_tokens": 2}},
    ]
    body = (
        ": a comment\r\n\r\n"
        + "".join(f"data: {json.dumps(e, ensure_ascii=False)}\r\n\r\n" for e in events)
        + "data: [DONE]"
    ).encode()

    def pieces(size: int) -> Callable[[httpx.Request], httpx.Response]:
        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(body), size):
                yield body[start : start + size]

        return lambda request: httpx.Response(200, content=chunks())

    async def answer(size: int) -> tuple[str, int]:
        engine = engine_with(pieces(size))
        out = await engine.submit(EngineRequest("a", "llama", 1, max_tokens=5, prompt=(1,)))
        await engine.close()
        return out.text, out.tokens

    for size in (1, 2, 3, 7, len(body)):
        assert asyncio.run(answer(size)) == ("héllo wörld ✓", 2), size


@pytest.mark.parametrize(
    "event",
    [
        {"choices": [{"index": 0, "text": " the", "finish_reason": None, "token_ids": [279]}]},
        {"choices": [{"text": "", "finish_reason": "length", "token_ids": []}], "usage": {}},
        {"choices": [{"text": None, "finish_reason": "", "token_ids": None}]},
        {"choices": [{"text": "a", "token_ids": ["7", 8]}]},
        {"choices": [{"text": "a", "token_ids": [1], "prompt_token_ids": [5, 6]}]},
        {"choices": [{"text": "a", "token_ids": [1], "prompt_token_ids": None}]},
        {"choices": [{"text": "a"}], "prompt_token_ids": [5, 6]},
        {"choices": [{"delta": {"content": "hi", "tool_calls": [{"index": 0}]}}]},
        {"choices": [{"text": "a", "token_ids": (1,)}]},
        {"choices": [{"text": "a"}, {"text": "b", "finish_reason": "stop"}]},
        {"choices": []},
        {"choices": ["text"]},
    ],
)
def test_an_events_common_shape_is_read_as_the_general_reading_reads_it(
    event: dict[str, Any],
) -> None:
    """``one_token`` reads the events most of a stream is made of (or declines: None), and
    what it reads is what ``event_parts`` reads of them."""
    choices = event.get("choices") or []
    quick = one_token(event, choices)
    assert quick is None or quick == event_parts(event, choices)
    one_plain_completion = (
        len(choices) == 1
        and isinstance(choices[0], dict)
        and "text" in choices[0]
        and not isinstance(choices[0].get("token_ids"), tuple)
        and choices[0].get("prompt_token_ids") is None
        and "prompt_token_ids" not in event
    )
    assert (quick is not None) == one_plain_completion


def test_instance_launch_of_several_models_prints_a_server_each_and_the_servers_line() -> None:
    """One GPU's servers for warm starts: one per model, consecutive ports, sleep mode, the
    GPU share each takes when awake; the instances file's ``servers`` line."""
    args = ["instance", "launch", "--model", "org/A", "--model", "org/B", "--served-model-name",
            "a", "--served-model-name", "b", "--port", "8001", "--gpu-share", "0.4",
            "--print-only"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    a, b, _, entry = result.stdout.splitlines()
    for line, model, port in ((a, "org/A a", 8001), (b, "org/B b", 8002)):
        m, name = model.split()
        assert f"vllm serve {m} --port {port} --served-model-name {name}" in line
        assert "--enable-sleep-mode" in line and line.endswith("--gpu-memory-utilization 0.4")
    assert entry == '# servers = { "a" = "http://127.0.0.1:8001", "b" = "http://127.0.0.1:8002" }'
    for bad, message in (
        (["--served-model-name", "a"], "give one per --model (2), got 1"),
        (["--gpu-share", "1.5"], "--gpu-share must be in (0, 1]"),
        (["--no-dev-mode"], "drop --no-dev-mode"),
    ):
        base = ["instance", "launch", "--model", "A", "--model", "B", "--print-only"]
        result = CliRunner().invoke(app, [*base, *bad])
        assert result.exit_code == 1 and message in result.stderr, result.output
