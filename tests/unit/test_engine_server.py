"""The vLLM-compatible server of the simulated engine: routes, formats, errors, dev mode."""

from __future__ import annotations

import asyncio
import json
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from builders import make_catalog
from prometheus_client.parser import text_string_to_metric_families

from qlm.engines.base import EngineRequest, TokenChunk
from qlm.engines.server import _stream, create_app
from qlm.engines.wallclock import WallClockEngine, filler_text

with warnings.catch_warnings():  # Starlette nudges towards httpx2; httpx is what QLM uses
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient


def make_client(dev_mode: bool = False, eos_lengths: tuple[int, ...] = ()) -> TestClient:
    engine = WallClockEngine.from_catalog("s0", "m", "G", 1, time_scale=50, catalog=make_catalog())
    return TestClient(create_app(engine, dev_mode=dev_mode, eos_lengths=eos_lengths))


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
    assert resp.json()["error"]["message"] == "The model `nope` does not exist."
    assert client.post("/v1/completions", json={"model": "m"}).status_code == 400
    assert client.post("/v1/completions", json={"prompt": []}).status_code == 400
    too_long = {"prompt": "x", "max_tokens": 9000, "ignore_eos": True}
    resp = client.post("/v1/completions", json=too_long)
    assert resp.status_code == 400 and "max context" in resp.json()["error"]["message"]


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
    assert client.post("/sleep", params={"level": 1}).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 503
    assert client.post("/wake_up").status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert complete(client, max_tokens=2)["usage"]["completion_tokens"] == 2
    assert client.post("/sleep", params={"level": 3}).status_code == 400


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
    too_long = {"messages": CHAT, "max_tokens": 9000, "ignore_eos": True}
    resp = client.post("/v1/chat/completions", json=too_long)
    assert resp.status_code == 400 and "max context" in resp.json()["error"]["message"]
