"""The vLLM-compatible server of the simulated engine: routes, formats, errors, dev mode."""

from __future__ import annotations

import asyncio
import itertools
import json
import warnings
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from builders import make_catalog, simulated_vllm
from prometheus_client.parser import text_string_to_metric_families

from qlm.engines.base import EngineRequest, TokenChunk
from qlm.engines.server import OffloadTier, SchedulingPolicy, _stream, create_app
from qlm.engines.vllm import VllmEngine
from qlm.engines.vllm_wire import context_room
from qlm.engines.wallclock import VOCAB_SIZE, WallClockEngine, filler_text
from qlm.errors import ConfigError, RequestRejected

with warnings.catch_warnings():  # Starlette nudges towards httpx2; httpx is what QLM uses
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient


def make_client(
    dev_mode: bool = False,
    eos_lengths: tuple[int, ...] = (),
    scheduling_policy: SchedulingPolicy = "priority",  # as QLM's servers run
) -> TestClient:
    engine = WallClockEngine.from_catalog("s0", "m", "G", 1, time_scale=50, catalog=make_catalog())
    app = create_app(
        engine, dev_mode=dev_mode, eos_lengths=eos_lengths, scheduling_policy=scheduling_policy
    )
    return TestClient(app)


@pytest.fixture
def client() -> Iterator[TestClient]:
    with make_client(dev_mode=True, eos_lengths=(3,)) as c:
        yield c


def complete(client: TestClient, **body: Any) -> dict[str, Any]:
    resp = client.post("/v1/completions", json={"model": "m", "prompt": "hi there"} | body)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def sse(client: TestClient, **body: Any) -> list[Any]:
    payload = {"model": "m", "prompt": [1, 2, 3], "stream": True} | body
    with client.stream("POST", "/v1/completions", json=payload) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


def test_a_completion_with_ignore_eos_has_exactly_max_tokens_and_vllm_fields(
    client: TestClient,
) -> None:
    resp = client.post(
        "/v1/completions",
        json={"model": "m", "prompt": "one two three", "max_tokens": 12, "ignore_eos": True},
        headers={"X-Request-Id": "req-7"},
    )
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "req-7"
    body = resp.json()
    assert body["id"] == "cmpl-req-7" and body["object"] == "text_completion"
    assert body["model"] == "m"
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (filler_text(12), "length")
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}


def test_without_ignore_eos_the_output_length_comes_from_the_sample_capped_at_max_tokens(
    client: TestClient,
) -> None:
    stopped = complete(client, max_tokens=50)
    assert stopped["usage"]["completion_tokens"] == 3
    assert stopped["choices"][0]["finish_reason"] == "stop"
    capped = complete(client, max_tokens=2)
    assert capped["usage"]["completion_tokens"] == 2
    assert capped["choices"][0]["finish_reason"] == "length"


def test_max_tokens_defaults_to_16_as_in_vllm() -> None:
    with make_client() as c:
        assert complete(c)["usage"]["completion_tokens"] == 16


def test_a_streamed_completion_sends_sse_chunks_usage_and_done(client: TestClient) -> None:
    events = sse(client, max_tokens=9, ignore_eos=True, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    usage_event, chunks = events[-2], events[:-2]
    assert usage_event["choices"] == []
    assert usage_event["usage"] == {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    assert "".join(c["choices"][0]["text"] for c in chunks) == filler_text(9)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all("usage" not in c for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1


def test_continuous_usage_stats_put_the_running_token_count_in_every_chunk(
    client: TestClient,
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = sse(client, max_tokens=9, ignore_eos=True, stream_options=options)
    counts = [e["usage"]["completion_tokens"] for e in events[:-2]]
    assert counts == sorted(counts) and counts[-1] == 9


def test_bad_requests_get_vllm_style_errors(client: TestClient) -> None:
    resp = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert resp.status_code == 404
    assert resp.json()["error"]["message"] == "The model `nope` does not exist. Valid aliases: m."
    assert client.post("/v1/completions", json={"model": "m"}).status_code == 400
    assert client.post("/v1/completions", json={"prompt": []}).status_code == 400


def refusal(resp: Any) -> tuple[int, str, str | None]:
    """Status, message and parameter of a vLLM-style error answer."""
    error = resp.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == resp.status_code
    return resp.status_code, error["message"], error["param"]


def test_a_prompt_past_the_context_is_refused_and_max_tokens_past_it_clamped_as_032(
    client: TestClient,
) -> None:
    """vLLM 0.32 checks before generating: ``max_tokens`` above the context (8,192 here) and a
    prompt longer than it are refused (a text is tokenized one token past the context, hence "at
    least"); prompt + ``max_tokens`` past it is not: ``max_tokens`` is lowered to the room left,
    which must be at least one token. ``VllmEngine.context_room`` reads the room from the
    refusal. A null ``max_tokens`` is 16, vLLM's default."""
    too_many = {"prompt": "x y z", "max_tokens": 8193}
    assert refusal(client.post("/v1/completions", json=too_many)) == (
        400,
        "max_tokens=8193 cannot be greater than max_model_len=8192. Please request fewer output "
        "tokens. (parameter=max_tokens, value=8193)",
        "max_tokens",
    )
    past = (
        "This model's maximum context length is 8192 tokens. However, your prompt contains {} "
        "input tokens, which exceeds this limit even without any output tokens. Please reduce "
        "the length of the input prompt. (parameter=input_tokens, value={})"
    )
    for prompt, count in (([7] * 8200, "8200"), ([7] * 8193, "at least 8193"), ("w " * 9000, "at least 8193")):  # fmt: skip
        status, message, param = refusal(
            client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        )
        assert (status, param) == (400, "input_tokens")
        assert message == past.format(count, count.split()[-1])
        assert context_room(message) == 8192 - int(count.split()[-1])
    full = {"prompt": [7] * 8192, "max_tokens": 4}  # no room left for one token
    assert refusal(client.post("/v1/completions", json=full)) == (
        400,
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        "max_tokens",
    )
    none = {"prompt": "x", "max_tokens": 0}
    assert refusal(client.post("/v1/completions", json=none))[1].startswith(
        "max_tokens must be at least 1, got 0."
    )
    clamped = complete(client, prompt=[7] * 8100, max_tokens=1000, ignore_eos=True)
    assert clamped["usage"] == {
        "prompt_tokens": 8100,
        "completion_tokens": 92,
        "total_tokens": 8192,
    }
    assert clamped["choices"][0]["finish_reason"] == "length"
    default = complete(client, prompt=[7] * 8100, max_tokens=None, ignore_eos=True)
    assert default["usage"]["completion_tokens"] == 16


def test_models_health_and_metrics_use_vllm_names_and_labels(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    cards = client.get("/v1/models").json()
    assert cards["object"] == "list"
    assert [(c["id"], c["max_model_len"]) for c in cards["data"]] == [("m", 8192)]
    complete(client, max_tokens=5, ignore_eos=True)
    resp = client.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    samples = {s.name: s for f in text_string_to_metric_families(resp.text) for s in f.samples}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
    ):
        assert samples[name].labels == {"model_name": "m", "engine": "0"}
        assert samples[name].value == 0.0
    info = samples["vllm:cache_config_info"].labels
    assert int(info["num_gpu_blocks"]) * int(info["block_size"]) > 10_000


def test_dev_mode_endpoints_exist_only_in_dev_mode() -> None:
    with make_client(dev_mode=False) as c:
        assert c.post("/sleep?level=1").status_code == 404
        assert c.get("/is_sleeping").status_code == 404
        assert c.post("/wake_up").status_code == 404


def test_sleep_and_wake_up_as_in_vllm_dev_mode(client: TestClient) -> None:
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    slept = client.post("/sleep", params={"level": 1})
    assert slept.json() == {"status": "sleeping", "level": 1}  # vLLM 0.32's answer
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 503
    assert client.post("/wake_up").json() == {"status": "awake", "tags": None}
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert complete(client, max_tokens=2)["usage"]["completion_tokens"] == 2
    assert client.post("/sleep", params={"level": 3}).status_code == 422  # as vLLM (0..2)
    assert client.post("/sleep", params={"mode": "later"}).status_code == 422
    assert client.post("/sleep", params={"level": 0}).status_code == 400  # not simulated


def test_level_2_sleep_needs_the_weights_reloaded_as_vllm_does(client: TestClient) -> None:
    """Level 2 discards the weights: vLLM's recipe wakes the weights, reloads them in place and
    wakes the KV cache. A bare wake_up leaves them empty (vLLM then answers nonsense; this server
    refuses, so the mistake shows) until reload_weights."""
    assert client.post("/sleep", params={"level": 2}).status_code == 200
    assert client.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}  # the KV cache is not back
    assert client.post("/collective_rpc", json={"method": "reload_weights"}).status_code == 200
    assert client.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert complete(client, max_tokens=2)["usage"]["completion_tokens"] == 2

    assert client.post("/sleep", params={"level": 2}).status_code == 200
    assert client.post("/wake_up").status_code == 200  # the weights stay empty
    refused = client.post("/v1/completions", json={"prompt": "x"})
    assert refused.status_code == 500 and "reload_weights" in refused.text
    assert client.post("/collective_rpc", json={"method": "reload_weights"}).status_code == 200
    assert complete(client, max_tokens=2)["usage"]["completion_tokens"] == 2
    assert client.post("/collective_rpc", json={"method": "other"}).status_code == 400


class _Client:
    """The one thing ``_stream`` asks of a Starlette request."""

    def __init__(self) -> None:
        self.gone = False

    async def is_disconnected(self) -> bool:
        return self.gone


def test_a_client_that_leaves_mid_stream_aborts_its_engine_request() -> None:
    async def scenario() -> None:
        engine = WallClockEngine.from_catalog(
            "s", "m", "G", 1, time_scale=50, catalog=make_catalog()
        )
        req = EngineRequest("r", "m", prompt_tokens=4, max_tokens=5000, output_tokens=5000)
        chunks: asyncio.Queue[TokenChunk] = asyncio.Queue()
        engine.start_request(req, chunks.put_nowait)
        events = _stream(engine, _Client(), req, chunks, {"id": "cmpl-r"}, None)  # type: ignore[arg-type]
        first = await anext(events)
        assert first.startswith("data: ")
        assert engine.sim.has_request("r")
        await events.aclose()  # what Starlette does when the connection drops
        assert not engine.sim.has_request("r")
        await engine.close()

    asyncio.run(scenario())


CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "say hi"}]},
]


def chat_sse(client: TestClient, **body: Any) -> list[Any]:
    payload = {"model": "m", "messages": CHAT, "stream": True} | body
    with client.stream("POST", "/v1/chat/completions", json=payload) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line]
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


def test_a_streamed_chat_opens_with_the_role_then_deltas_usage_and_done(
    client: TestClient,
) -> None:
    """vLLM's chat stream: chat.completion.chunk objects, the role in the first delta, the
    text in delta.content, the finish reason on the last, a usage chunk, [DONE]. The prompt is
    counted as the words of the messages' text (no tokenizer or template here)."""
    options = {"include_usage": True}
    events = chat_sse(client, max_tokens=7, ignore_eos=True, stream_options=options)
    assert events[-1] == "[DONE]"
    first, chunks, usage_event = events[0], events[1:-2], events[-2]
    assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}
    assert len({e["id"] for e in events[:-1]}) == 1 and events[0]["id"].startswith("chatcmpl-")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == filler_text(7)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert usage_event["choices"] == []
    assert usage_event["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


def test_a_chat_answer_is_one_assistant_message_and_max_completion_tokens_wins(
    client: TestClient,
) -> None:
    body = {"messages": CHAT, "max_tokens": 9, "max_completion_tokens": 4, "ignore_eos": True}
    resp = client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "c-1"})
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert (answer["id"], answer["object"]) == ("chatcmpl-c-1", "chat.completion")
    choice = answer["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": filler_text(4)}
    assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 4
    # Without a cap the rest of the context is the limit, as in vLLM: the sampled end comes first.
    free = client.post("/v1/chat/completions", json={"messages": CHAT}).json()
    assert free["usage"]["completion_tokens"] == 3 and free["choices"][0]["finish_reason"] == "stop"


def test_a_chat_continues_its_final_message_only_without_a_generation_prompt(
    client: TestClient,
) -> None:
    """vLLM refuses continue_final_message with add_generation_prompt (on by default) with 400;
    without it, the answer continues the last message (its role opens the stream), and the
    partial answer counts in the prompt as the tokens it was."""
    resumed = [*CHAT, {"role": "assistant", "content": filler_text(3).strip()}]
    refused = client.post(
        "/v1/chat/completions", json={"messages": resumed, "continue_final_message": True}
    )
    assert refused.status_code == 400
    assert "Cannot set both `continue_final_message` and `add_generation_prompt`" in refused.text
    events = chat_sse(
        client,
        messages=resumed,
        continue_final_message=True,
        add_generation_prompt=False,
        max_tokens=2,
        ignore_eos=True,
        stream_options={"include_usage": True},
    )
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["usage"]["prompt_tokens"] == 5 + 3


def test_bad_chats_get_vllm_style_errors(client: TestClient) -> None:
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    assert client.post("/v1/chat/completions", json={"model": "m"}).status_code == 400
    unknown = client.post("/v1/chat/completions", json={"model": "x", "messages": CHAT})
    assert unknown.status_code == 404


def test_a_chat_past_the_context_is_refused_and_its_cap_clamped_as_032(client: TestClient) -> None:
    """The same checks on the chat endpoint, on ``max_completion_tokens`` (named so in the
    refusal) or else ``max_tokens``; with neither, the answer gets the rest of the context. The
    chat's prompt is counted as this server renders it (its messages' words)."""
    for cap in ("max_tokens", "max_completion_tokens"):
        body = {"messages": CHAT, cap: 9000}
        assert refusal(client.post("/v1/chat/completions", json=body)) == (
            400,
            f"{cap}=9000 cannot be greater than max_model_len=8192. Please request fewer output "
            f"tokens. (parameter={cap}, value=9000)",
            cap,
        )
    long = [{"role": "user", "content": "w " * 9000}]
    status, message, param = refusal(client.post("/v1/chat/completions", json={"messages": long}))
    assert (status, param) == (400, "input_tokens")
    assert "your prompt contains at least 8193 input tokens" in message
    full = [{"role": "user", "content": "w " * 8192}]
    assert refusal(client.post("/v1/chat/completions", json={"messages": full}))[1].startswith(
        "max_tokens must be at least 1, got 0."
    )
    # 5 prompt tokens + 8190 past the context: lowered to 8187, and the sampled end comes first
    fits = {"messages": CHAT, "max_completion_tokens": 8190, "max_tokens": 9000}
    resp = client.post("/v1/chat/completions", json=fits)  # max_completion_tokens wins
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    near = [{"role": "user", "content": "w " * 8180}]
    body = {"messages": near, "max_tokens": 100, "ignore_eos": True}
    answer = client.post("/v1/chat/completions", json=body).json()
    assert answer["usage"]["completion_tokens"] == 12
    assert answer["choices"][0]["finish_reason"] == "length"


def test_priority_is_refused_without_priority_scheduling_as_vllm_documents() -> None:
    """vLLM's default --scheduling-policy is fcfs, under which its API documents that a priority
    other than 0 is an error (vLLM's V0 engine raised it; 0.14's V1 engine ignores the priority,
    vllm-project/vllm#22997). Unstreamed: 400. Streamed: vLLM has answered 200 by the time its
    engine refuses, so the stream carries one error event, then [DONE]."""
    message = "Got priority 2 but Priority scheduling is not enabled."
    with make_client(scheduling_policy="fcfs") as fcfs:
        for path, body in (
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": CHAT}),
        ):
            resp = fcfs.post(path, json=body | {"priority": 2})
            assert refusal(resp) == (400, message, None)
            with fcfs.stream("POST", path, json=body | {"priority": 2, "stream": True}) as resp:
                assert resp.status_code == 200
                lines = [line for line in resp.iter_lines() if line]
            assert [json.loads(lines[0][6:]), lines[1]] == [
                {
                    "error": {
                        "message": message,
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    }
                },
                "data: [DONE]",
            ]
            assert fcfs.post(path, json=body | {"priority": 0}).status_code == 200
    with make_client(scheduling_policy="priority") as by_priority:
        assert complete(by_priority, priority=-3)["usage"]["completion_tokens"] == 16
    engine = WallClockEngine.from_catalog("s", "m", "G", 1, catalog=make_catalog())
    with pytest.raises(ConfigError, match="scheduling_policy must be fcfs or priority, got 'lifo'"):
        create_app(engine, scheduling_policy="lifo")  # type: ignore[arg-type]


# --- the vLLM client against this server --------------------------------------------------------


class Recording(httpx.ASGITransport):
    """The transport to the server, keeping the priority of every generation sent."""

    def __init__(self, app: Any) -> None:
        super().__init__(app)
        self.priorities: list[int] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.priorities.append(json.loads(request.content)["priority"])
        return await super().handle_async_request(request)


def test_the_client_sends_again_without_priority_to_a_server_that_schedules_fcfs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``VllmEngine`` against the simulated server started with fcfs: a request with a priority
    is refused (an error event in its stream), sent again without and completes; the next one
    goes without at once; one warning names the instance. Unstreamed (``complete``, another
    client), the refusal is a 400, handled the same way."""
    engine = WallClockEngine.from_catalog("s", "m", "G", 1, time_scale=50, catalog=make_catalog())
    app = create_app(engine, scheduling_policy="fcfs")
    wire_1, wire_2 = Recording(app), Recording(app)

    async def scenario() -> None:
        one = VllmEngine("fcfs-1", "http://sim", "m", transport=wire_1)
        two = VllmEngine("fcfs-2", "http://sim", "m", transport=wire_2)
        try:
            first = EngineRequest("a", "m", 3, max_tokens=4, priority=2, output_tokens=4)
            second = EngineRequest("b", "m", 3, max_tokens=4, priority=1, output_tokens=4)
            assert (await one.submit(first)).tokens == 4
            assert (await one.submit(second)).tokens == 4
            third = EngineRequest("c", "m", 3, max_tokens=4, priority=5, output_tokens=4)
            assert (await two.complete(third)).tokens == 4
        finally:
            await one.close()
            await two.close()
            await engine.close()

    with caplog.at_level("WARNING", logger="qlm.engines.vllm"):
        asyncio.run(scenario())
    assert wire_1.priorities == [2, 0, 0]
    assert wire_2.priorities == [5, 0]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [w.split(" ")[0] for w in warnings] == ["fcfs-1", "fcfs-2"]
    assert all("--scheduling-policy priority" in w for w in warnings)


def test_the_client_rejects_a_prompt_past_the_context_and_gets_what_fits_otherwise() -> None:
    """A prompt longer than the context: the server's 400 becomes ``RequestRejected`` (the
    request is at fault, not the server) carrying vLLM 0.32's message, from either endpoint.
    Prompt + ``max_tokens`` past it: the answer is what fits, cut at the context (``length``)."""
    past = (
        r"s0 \(http://s0\): POST {path} answered 400: This model's maximum context length is "
        r"8192 tokens\. However, your prompt contains {count} input tokens"
    )

    async def scenario() -> None:
        client, engine = simulated_vllm()
        try:
            long = EngineRequest("long", "m", 9000, max_tokens=10, output_tokens=10)
            with pytest.raises(
                RequestRejected, match=past.format(path="/v1/completions", count=9000)
            ):
                await client.submit(long)
            words = ({"role": "user", "content": "a " * 8200},)
            chat = EngineRequest("chat", "m", 8200, 10, output_tokens=10, messages=words)
            answer = past.format(path="/v1/chat/completions", count="at least 8193")
            with pytest.raises(RequestRejected, match=answer):
                await client.submit(chat)
            near = EngineRequest("near", "m", 8100, max_tokens=8000, output_tokens=8000)
            out = await client.submit(near)
            assert (out.tokens, out.finish_reason) == (92, "length")
        finally:
            await client.close()
            await engine.close()

    asyncio.run(scenario())


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "people": {"type": "integer", "minimum": 1}},
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "town", "schema": SCHEMA}}


def test_a_response_format_makes_the_answer_a_json_document_of_its_schema(
    client: TestClient,
) -> None:
    """As vLLM's structured outputs: the answer is a document of the schema, streamed token by
    token, and ends (``stop``) when complete; a cap below its size cuts it (``length``)."""
    body = {"messages": CHAT, "max_tokens": 50, "response_format": JSON_SCHEMA}
    answer = client.post("/v1/chat/completions", json=body).json()
    choice = answer["choices"][0]
    assert json.loads(choice["message"]["content"]) == {"city": "tok", "people": 1}
    assert choice["finish_reason"] == "stop"  # the sample (3 tokens) is shorter than the document
    events = chat_sse(client, **body)
    text = "".join(e["choices"][0]["delta"]["content"] for e in events[1:-1] if e["choices"])
    assert text == choice["message"]["content"]
    assert sum(1 for e in events[1:-1] if e["choices"][0]["delta"]["content"]) > 2  # streamed
    cut = complete(client, max_tokens=3, response_format={"type": "json_object"})
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["text"] == '{"answer": "'
    long = complete(client, max_tokens=400, ignore_eos=True, response_format=JSON_SCHEMA)
    assert long["usage"]["completion_tokens"] == 399  # grown to the cap, and complete
    assert json.loads(long["choices"][0]["text"])["people"] == 1


def test_a_response_format_the_server_cannot_honour_is_a_400(client: TestClient) -> None:
    missing = client.post(
        "/v1/chat/completions", json={"messages": CHAT, "response_format": {"type": "json_schema"}}
    )
    assert missing.status_code == 400 and "json_schema" in missing.json()["error"]["message"]
    remote = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "s.json"}}}
    r = client.post("/v1/completions", json={"prompt": "x", "response_format": remote})
    assert r.status_code == 400 and "$ref 's.json'" in r.json()["error"]["message"]


def test_a_stream_interval_sends_the_first_token_at_once_then_every_n() -> None:
    """vLLM's ``--stream-interval``: fewer events, the same text and counts."""
    engine = WallClockEngine.from_catalog("s0", "m", "G", 1, time_scale=50, catalog=make_catalog())
    app = create_app(engine, eos_lengths=(3,), scheduling_policy="priority", stream_interval=4)
    with TestClient(app) as client:
        options = {"include_usage": True, "continuous_usage_stats": True}
        events = sse(
            client, max_tokens=11, ignore_eos=True, stream_options=options, return_token_ids=True
        )
        chunks = [e for e in events[:-1] if e["choices"]]
        counts = [e["usage"]["completion_tokens"] for e in chunks]
        assert counts[0] == 1 and counts[-1] == 11  # the first at once, the end whatever is left
        assert all(b - a >= 4 for a, b in itertools.pairwise(counts[:-1]))
        assert len(chunks) <= 1 + 10 // 4 + 1
        assert "".join(c["choices"][0]["text"] for c in chunks) == filler_text(11)
        ids = [len(c["choices"][0]["token_ids"]) for c in chunks]  # each event: its tokens' ids
        assert ids == [b - a for a, b in itertools.pairwise([0, *counts])]
        tools = [{"type": "function", "function": {"name": "f"}}]
        body = {"messages": CHAT, "tools": tools, "max_tokens": 30, "ignore_eos": True}
        calls = [
            d["tool_calls"][0]
            for e in chat_sse(client, **body)[1:-1]
            if e["choices"] and "tool_calls" in (d := e["choices"][0]["delta"])
        ]
        assert [c["function"].get("name") for c in calls] == ["f"] + [None] * (len(calls) - 1)
        assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {}
    with pytest.raises(ConfigError, match="stream_interval"):
        create_app(engine, stream_interval=0)


def test_the_server_times_each_finished_request_as_vllm_exports_it() -> None:
    """``vllm:e2e_request_latency_seconds``: arrival to last token on the engine's clock, read
    back by the vLLM client; an aborted request is not counted."""

    async def scenario() -> None:
        client, engine = simulated_vllm()
        try:
            assert await client.latency_totals() == (0.0, 0)
            for rid, tokens in (("a", 5), ("b", 40)):
                await client.submit(
                    EngineRequest(rid, "m", 100, max_tokens=tokens, output_tokens=tokens)
                )
            total, count = await client.latency_totals() or (0.0, 0)
            assert count == 2 and total == pytest.approx(engine.latencies.total)
            assert engine.latencies.counts[-1] == 2  # +Inf counts every one
            # each took at least its prefill and decode steps on the engine's clock
            assert total > 0.0
        finally:
            await client.close()
            await engine.close()

    asyncio.run(scenario())


# --- what vLLM 0.32 says besides generating: token ids, /tokenize, dev mode's /server_info and
# /abort_requests ---------------------------------------------------------------------------------


def test_tokenize_counts_a_prompt_and_a_chat_as_the_generations_count_them(
    client: TestClient,
) -> None:
    """``/tokenize`` answers vLLM's fields with this server's tokens: a text's words (a chat's
    messages rendered as the chat endpoint renders them), so its count is the prompt's
    ``usage.prompt_tokens``, and the text of generated tokens tokenizes to the ids generated."""
    text = "Which queue serves me first?"
    said = client.post("/tokenize", json={"model": "m", "prompt": text}).json()
    assert set(said) == {"count", "max_model_len", "tokens", "token_strs"}
    assert (said["count"], said["max_model_len"], said["token_strs"]) == (5, 8192, None)
    assert len(said["tokens"]) == 5 and len(set(said["tokens"])) == 5
    assert said["count"] == complete(client, prompt=text)["usage"]["prompt_tokens"]
    chat = client.post("/tokenize", json={"messages": CHAT, "return_token_strs": True}).json()
    answer = client.post("/v1/chat/completions", json={"messages": CHAT}).json()
    assert chat["count"] == answer["usage"]["prompt_tokens"] == 5
    assert chat["token_strs"] == ["You", "are", "terse.", "say", "hi"]
    written = complete(client, prompt=text, return_token_ids=True)["choices"][0]
    again = client.post("/tokenize", json={"prompt": text + written["text"]}).json()
    assert again["tokens"] == said["tokens"] + written["token_ids"]
    assert client.post("/tokenize", json={"prompt": ""}).json()["count"] == 1
    unknown = client.post("/tokenize", json={"model": "x", "prompt": "a"})
    assert unknown.status_code == 404 and "Valid aliases: m." in unknown.text
    assert client.post("/tokenize", json={"model": "m"}).status_code == 400


def test_the_client_builds_synthetic_prompts_of_ids_the_server_takes() -> None:
    """``VllmEngine.load_token_ids`` reads the ids of its sample text from ``/tokenize``; a
    replay's synthetic prompt made of them is inside the vocabulary and counted exactly. An id
    outside the vocabulary is refused as vLLM refuses it (streamed: an error event)."""

    async def scenario() -> None:
        client, engine = simulated_vllm()
        try:
            ids = await client.load_token_ids()
            assert len(ids) > 50 and all(0 <= t < VOCAB_SIZE for t in ids)
            chunks: list[TokenChunk] = []
            out = await client.submit(
                EngineRequest("replay", "m", 300, max_tokens=4, output_tokens=4), chunks.append
            )
            assert out.tokens == 4 and chunks[0].prompt_tokens == 300
            bad = EngineRequest("bad", "m", 2, max_tokens=4, prompt=(5, VOCAB_SIZE))
            with pytest.raises(
                RequestRejected, match=f"Token id {VOCAB_SIZE} is out of vocabulary"
            ):
                await client.submit(bad)
        finally:
            await client.close()
            await engine.close()

    asyncio.run(scenario())


def test_return_token_ids_streams_the_ids_where_vllm_032_puts_them(client: TestClient) -> None:
    """Completions: ``prompt_token_ids`` in the first chunk's choice (null after), ``token_ids``
    (the chunk's new tokens) in every choice. Chat: ``prompt_token_ids`` at the top level of the
    role's chunk, ``token_ids`` in every content choice. Unstreamed: the same fields on the one
    choice (a chat's prompt ids at the top level). Not asked for: the same keys, null."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    prompt_ids = client.post("/tokenize", json={"prompt": "hi there"}).json()["tokens"]
    events = sse(
        client,
        prompt="hi there",
        max_tokens=5,
        ignore_eos=True,
        return_token_ids=True,
        stream_options=options,
    )
    chunks = [e["choices"][0] for e in events[:-2]]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    written = [t for c in chunks for t in c["token_ids"]]
    assert len(written) == 5 == events[-2]["usage"]["completion_tokens"]
    plain = sse(client, prompt="hi there", max_tokens=2, ignore_eos=True)
    assert all(
        e["choices"][0]["token_ids"] is None and e["choices"][0]["prompt_token_ids"] is None
        for e in plain[:-1]
    )

    chat_ids = client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    events = chat_sse(
        client, max_tokens=5, ignore_eos=True, return_token_ids=True, stream_options=options
    )
    role, deltas = events[0], [e["choices"][0] for e in events[1:-2]]
    assert role["prompt_token_ids"] == chat_ids and "token_ids" not in role["choices"][0]
    assert all("prompt_token_ids" not in e for e in events[1:-1])
    assert sum(len(d["token_ids"]) for d in deltas) == 5
    assert chat_sse(client, max_tokens=2)[0]["prompt_token_ids"] is None

    answer = complete(client, prompt="hi there", max_tokens=3, return_token_ids=True)
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 3
    body = {"messages": CHAT, "max_tokens": 3, "return_token_ids": True}
    chat = client.post("/v1/chat/completions", json=body).json()
    assert chat["prompt_token_ids"] == chat_ids and len(chat["choices"][0]["token_ids"]) == 3


def test_a_prompt_of_the_ids_said_goes_on_from_exactly_those_tokens(client: TestClient) -> None:
    """What QLM sends to resume an evicted request: the first run's prompt ids + the ids it
    wrote, as a completion's prompt. The server counts exactly those tokens as the prompt, and a
    replay (``ignore_eos``) writes exactly ``max_tokens`` more."""
    body = {"messages": CHAT, "max_tokens": 7, "ignore_eos": True, "return_token_ids": True}
    first = client.post("/v1/chat/completions", json=body).json()
    ids = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    resumed = complete(client, prompt=ids, max_tokens=20, ignore_eos=True, return_token_ids=True)
    assert resumed["usage"] == {"prompt_tokens": 12, "completion_tokens": 20, "total_tokens": 32}
    choice = resumed["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 20
    assert first["choices"][0]["message"]["content"] + choice["text"] == filler_text(27)


def test_server_info_says_the_simulated_engines_configuration_and_the_client_reads_it() -> None:
    """Dev mode's ``/server_info`` (JSON, or vLLM's one-line text by default): the simulated
    engine's own values, which ``VllmEngine.capabilities`` reads (``max_num_seqs``) beside the
    KV capacity of ``/metrics``; sleep mode on, which the probe confirms by sleeping it."""
    engine = WallClockEngine.from_catalog(
        "s0", "m", "G", 1, time_scale=50, catalog=make_catalog(), max_num_seqs=48
    )
    app = create_app(engine, dev_mode=True, scheduling_policy="priority")

    async def scenario() -> None:
        client = VllmEngine("s0", "http://s0", "m", transport=httpx.ASGITransport(app))
        try:
            info = await client.server_info()
            assert info is not None
            cache, scheduler = info["cache_config"], info["scheduler_config"]
            assert scheduler["max_num_seqs"] == 48 and scheduler["policy"] == "priority"
            capacity = engine.sim.token_capacity()
            assert cache["num_gpu_blocks"] * cache["block_size"] == capacity
            assert cache["block_size"] == engine.sim.config.block_size
            assert info["model_config"]["max_model_len"] == 8192
            assert info["model_config"]["enable_sleep_mode"] is True
            caps = await client.capabilities()
            assert (caps.max_num_seqs, caps.kv_capacity_tokens) == (48, capacity)
            assert caps.supports_sleep and caps.supports_abort_endpoint
            assert "cuda: slept (level 1) and woke" in client.sleep_probe
        finally:
            await client.close()
            await engine.close()

    asyncio.run(scenario())
    with TestClient(app) as http:
        text = http.get("/server_info").json()
        assert isinstance(text["vllm_config"], str) and "max_num_seqs=48" in text["vllm_config"]
        assert set(text) == {"vllm_config", "vllm_env", "system_env"}
    with make_client(dev_mode=False) as plain:
        assert plain.get("/server_info").status_code == 404
        assert plain.post("/abort_requests", json={}).status_code == 404


def test_abort_requests_takes_vllms_own_ids_as_vllm_032_does() -> None:
    """Dev mode's ``/abort_requests``: vLLM's id of a completion (``cmpl-<X-Request-Id>-0``) or a
    chat (``chatcmpl-<X-Request-Id>``) aborts it, whose answer ends with ``finish_reason:
    abort``; the bare id aborts nothing; no ids abort everything. It answers how many ids it was
    given (without ids: how many it aborted)."""
    engine = WallClockEngine.from_catalog("s0", "m", "G", 1, time_scale=50, catalog=make_catalog())
    app = create_app(engine, dev_mode=True, scheduling_policy="priority")

    async def scenario() -> None:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://s"
        ) as http:

            async def running(rid: str, path: str, body: dict[str, Any]) -> asyncio.Task[Any]:
                body |= {"max_tokens": 5000, "ignore_eos": True, "return_token_ids": True}
                task = asyncio.create_task(
                    http.post(path, json=body, headers={"X-Request-Id": rid})
                )
                while rid not in engine.in_flight():
                    await asyncio.sleep(0.001)
                return task

            async def abort(*ids: str) -> Any:
                body = {"request_ids": list(ids)} if ids else {}
                return (await http.post("/abort_requests", json=body)).json()

            one = await running("one", "/v1/completions", {"prompt": "a b"})
            two = await running("two", "/v1/chat/completions", {"messages": CHAT})
            assert await abort("one", "two", "cmpl-one", "chatcmpl-two-0") == {
                "status": "aborted",
                "aborted": 4,
            }
            assert sorted(engine.in_flight()) == ["one", "two"]
            assert await abort("cmpl-one-0") == {"status": "aborted", "aborted": 1}
            cut = (await one).json()["choices"][0]
            assert cut["finish_reason"] == "abort" and len(cut["token_ids"]) < 5000
            assert await abort("chatcmpl-two") == {"status": "aborted", "aborted": 1}
            assert (await two).json()["choices"][0]["finish_reason"] == "abort"
            three = await running("three", "/v1/completions", {"prompt": "c", "stream": True})
            assert await abort() == {"status": "aborted", "aborted": 1}
            events = [line for line in (await three).text.splitlines() if line]
            assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
            assert events[-1] == "data: [DONE]"
            assert not engine.in_flight()
            bad = await http.post("/abort_requests", content=b"{")
            assert (
                bad.status_code == 400 and bad.json()["error"]["message"] == "Invalid JSON format"
            )
        await engine.close()

    asyncio.run(scenario())


def test_the_offloading_tier_finds_whole_kept_blocks_and_drops_the_oldest() -> None:
    """``--kv-offloading-size``: an ended request's blocks are kept in CPU memory; a prompt
    that begins with them is computed only past its whole kept blocks (and at least its last
    token); the least recently used go first when the memory is full."""
    tier = OffloadTier(gb=48 * 100 / 2**30, kv_bytes_per_token=100, block_size=16)  # 48 tokens
    assert tier.capacity_tokens == 48
    a = tuple(range(40))
    tier.store(a)  # 32 tokens kept: whole blocks only
    assert tier.held == 32
    assert tier.lookup((*a, 7, 8)) == 32
    assert tier.lookup(a[:32]) == 16  # its last token is computed: one block short
    assert tier.lookup((99, *a)) == 0  # the first block differs: nothing
    assert (tier.queries, tier.hits) == (42 + 32 + 41, 48)
    tier.store(tuple(range(100, 132)))  # 64 > 48: the oldest goes
    assert tier.held == 32 and tier.lookup((*a, 7)) == 0
    assert tier.lookup((*range(100, 132), 1)) == 32
