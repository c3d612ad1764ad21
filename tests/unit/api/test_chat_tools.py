"""Tool-using conversations: earlier turns keep their tool calls and tool answers on the way to
vLLM's chat template (they were dropped without a word before)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from qlm.api.prompts import render_chat
from qlm.domain import RequestStatus
from qlm.engines.base import EngineOutput, EngineRequest
from qlm.engines.vllm import VllmEngine
from qlm.structured import planned_call, resumable
from tests.unit.api.test_api import Harness, error, published
from tests.unit.api.test_api import run as run_api
from tests.unit.engines.test_engine_server import chat_sse, make_client

CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": -3}'},
]


def test_tool_calls_and_tool_answers_of_earlier_turns_reach_the_queue() -> None:
    async def scenario(h: Harness) -> None:
        r = await h.client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": HISTORY, "max_tokens": 8, "slo_seconds": 60},
            headers=h.auth(),
        )
        assert r.status_code != 422, r.text
        (msg,) = published(h.queue)
        assert msg.messages is not None
        assert msg.messages[1] == {"role": "assistant", "tool_calls": [CALL]}
        assert msg.messages[2] == HISTORY[2]
        assert msg.prompt is not None and "weather({})" in msg.prompt  # counted in the estimate

    run_api(scenario, wait_timeout_s=0.2)


@pytest.mark.parametrize(
    ("message", "fragment"),
    [
        ({"role": "user", "content": "x", "tool_calls": [CALL]}, "tool_calls belong to assistant"),
        ({"role": "tool", "content": "x"}, "tool_call_id is required on tool messages"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "and only there"),
        ({"role": "assistant", "content": None}, "content is required"),
    ],
)
def test_misplaced_tool_fields_are_refused_naming_the_message(
    message: dict[str, Any], fragment: str
) -> None:
    async def scenario(h: Harness) -> None:
        r = await h.submit(prompt=None, messages=[message])
        assert r.status_code == 422, r.text
        err = error(r)
        assert err["param"] == "messages[0]" and fragment in err["message"], err
        assert published(h.queue) == []

    run_api(scenario)


def test_the_estimate_counts_what_a_tool_call_turn_writes() -> None:
    plain = render_chat([{"role": "assistant", "content": ""}])
    calls = render_chat([{"role": "assistant", "tool_calls": [CALL]}])
    assert calls == plain.replace("<|im_end|>", "\nweather({})<|im_end|>", 1)


# --- tools offered to the model ---------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Today's weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "clock"}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def test_which_function_the_simulated_model_calls() -> None:
    tools = {"tools": [WEATHER, CLOCK]}
    assert planned_call(tools, ASK) == WEATHER["function"]
    assert planned_call(tools | {"tool_choice": "none"}, ASK) is None
    named = {"type": "function", "function": {"name": "clock"}}
    assert planned_call(tools | {"tool_choice": named}, ASK) == CLOCK["function"]
    assert planned_call(tools, HISTORY) is None  # a tool answered: it answers in text
    assert planned_call(tools | {"tool_choice": "required"}, HISTORY) == WEATHER["function"]
    assert planned_call({}, ASK) is None
    assert not resumable(tools) and resumable(tools | {"tool_choice": "none"})


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"tools": [WEATHER, WEATHER]}, "two functions have the same name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "names 'x', which is not in tools"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "pattern"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]},
         "/type: 'x'"),
        ({"tools": [{"type": "retrieval"}]}, "function"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_what_is_wrong(extra: dict[str, Any], fragment: str) -> None:
    async def scenario(h: Harness) -> None:
        r = await h.client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": ASK} | extra,
            headers=h.auth(),
        )
        assert r.status_code == 422, r.text
        assert fragment in error(r)["message"], error(r)
        assert published(h.queue) == []

    run_api(scenario)


def test_tools_reach_the_queue_with_the_choice() -> None:
    async def scenario(h: Harness) -> None:
        body = {"model": "m", "messages": ASK, "tools": [WEATHER], "tool_choice": "required"}
        body |= {"parallel_tool_calls": False, "temperature": 0.2}
        r = await h.client.post("/v1/chat/completions", json=body, headers=h.auth())
        assert r.status_code != 422, r.text
        (msg,) = published(h.queue)
        assert msg.sampling == {
            "temperature": 0.2,
            "tools": [WEATHER],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
        assert not msg.to_request(0.0).resumable

    run_api(scenario, wait_timeout_s=0.2)


# --- the simulated server and the vLLM client -------------------------------------------------


def test_the_simulated_server_calls_a_tool_with_arguments_of_its_schema() -> None:
    with make_client(eos_lengths=(30,)) as client:
        body = {"model": "m", "messages": ASK, "tools": [WEATHER, CLOCK], "max_tokens": 50}
        answer = client.post("/v1/chat/completions", json=body).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] is None
        (call,) = message["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "weather"
        args = json.loads(call["function"]["arguments"])
        assert set(args) == {"city", "days"} and args["days"] == 1
        assert answer["usage"]["completion_tokens"] == 30  # the arguments grew to its length

        events = chat_sse(client, messages=ASK, tools=[WEATHER], max_tokens=50)
        deltas = [e["choices"][0]["delta"] for e in events[1:-1] if e["choices"]]
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert len(calls) > 2 and calls[0]["function"]["name"] == "weather"
        assert all("name" not in c["function"] and "id" not in c for c in calls[1:])
        streamed = "".join(c["function"]["arguments"] for c in calls)
        assert streamed == call["function"]["arguments"]
        assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"

        named = {"type": "function", "function": {"name": "clock"}}
        chosen = client.post("/v1/chat/completions", json=body | {"tool_choice": named}).json()[
            "choices"
        ][0]
        assert chosen["finish_reason"] == "stop"  # as vLLM answers a named choice
        assert chosen["message"]["tool_calls"][0]["function"]["name"] == "clock"

        after = client.post(
            "/v1/chat/completions", json={"messages": HISTORY, "tools": [WEATHER]}
        ).json()
        assert after["choices"][0]["finish_reason"] == "stop"
        assert after["choices"][0]["message"]["content"].strip().startswith("tok")


def test_the_vllm_client_assembles_parallel_tool_calls_from_their_deltas() -> None:
    """Two calls streamed interleaved, as vLLM's tool parsers send them: id and name once,
    arguments in fragments, each under its index."""
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "t0", "type": "function",
             "function": {"name": "weather", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": '{"city": '}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 1, "id": "t1", "type": "function",
             "function": {"name": "clock", "arguments": "{}"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": '"Oslo"}'}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
         "usage": {"prompt_tokens": 9, "completion_tokens": 12}},
    ]  # fmt: skip
    stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["tools"] == [WEATHER, CLOCK]
        return httpx.Response(200, text=stream, headers={"content-type": "text/event-stream"})

    async def scenario() -> EngineOutput:
        engine = VllmEngine(
            "gpu-0", "http://vllm:8000", "m", transport=httpx.MockTransport(handler)
        )
        request = EngineRequest(
            "r1", "m", 9, 50, messages=tuple(ASK), sampling=(("tools", [WEATHER, CLOCK]),)
        )
        try:
            return await engine.submit(request)
        finally:
            await engine.close()

    out = asyncio.run(scenario())
    assert (out.finish_reason, out.text, out.tokens) == ("tool_calls", "", 12)
    assert [c["function"] for c in out.tool_calls] == [
        {"name": "weather", "arguments": '{"city": "Oslo"}'},
        {"name": "clock", "arguments": "{}"},
    ]
    assert [c["id"] for c in out.tool_calls] == ["t0", "t1"]


def test_the_native_api_takes_tools_with_messages_and_refuses_them_with_a_prompt() -> None:
    async def scenario(h: Harness) -> None:
        r = await h.submit(prompt=None, messages=ASK, tools=[WEATHER], tool_choice="auto")
        assert r.status_code == 202, r.text
        (msg,) = published(h.queue)
        assert msg.sampling == {"tools": [WEATHER], "tool_choice": "auto"}
        bad = await h.submit(tools=[WEATHER])  # the harness's default: a prompt
        assert bad.status_code == 422 and error(bad)["param"] == "tools"
        assert error(bad)["code"] == "tools_need_chat"
        dup = await h.submit(prompt=None, messages=ASK, tools=[WEATHER, WEATHER])
        assert dup.status_code == 422 and "same name" in error(dup)["message"]
        assert len(published(h.queue)) == 1

    run_api(scenario)


def test_a_call_cut_at_max_tokens_finishes_length_and_a_named_choice_stop() -> None:
    """``tool_calls`` means "make these calls": not for a call cut off at ``max_tokens``, and
    vLLM and OpenAI answer ``stop`` when the caller named the function."""
    call = {"id": "c", "type": "function", "function": {"name": "weather", "arguments": '{"ci'}}

    async def scenario(h: Harness) -> None:
        answers = []
        for max_tokens, choice in ((3, None), (30, None), (30, "named")):
            body: dict[str, Any] = {"model": "m", "messages": ASK, "tools": [WEATHER]}
            body |= {"max_tokens": max_tokens, "slo_seconds": 60}
            if choice:
                body["tool_choice"] = {"type": "function", "function": {"name": "weather"}}
            post = asyncio.create_task(
                h.client.post("/v1/chat/completions", json=body, headers=h.auth())
            )
            while len(h.store.list_requests()[0]) < len(answers) + 1:
                await asyncio.sleep(0.01)
            rid = h.store.list_requests()[0][0].id
            h.store.record_outcome(
                rid, status=RequestStatus.FINISHED, at=1.0, output_text="", output_tokens=3,
                tool_calls=[call],
            )  # fmt: skip
            answers.append((await post).json()["choices"][0])
        assert [a["finish_reason"] for a in answers] == ["length", "tool_calls", "stop"]
        assert all(a["message"]["tool_calls"] == [call] for a in answers)

    run_api(scenario, poll_interval_s=0.02)


def test_a_tool_choice_without_tools_is_refused_unless_none_which_is_not_sent() -> None:
    async def scenario(h: Harness) -> None:
        body = {"model": "m", "messages": ASK, "tool_choice": "auto"}
        r = await h.client.post("/v1/chat/completions", json=body, headers=h.auth())
        assert r.status_code == 422 and "tool_choice needs tools" in error(r)["message"]
        assert error(r)["param"] == "tool_choice"
        none = await h.submit(prompt=None, messages=ASK, tool_choice="none", tools=[])
        assert none.status_code == 202, none.text
        (msg,) = published(h.queue)
        assert msg.sampling == {}  # vLLM refuses a tool_choice without tools, even none

    run_api(scenario)


def test_the_tools_count_in_the_prompt_estimate() -> None:
    async def scenario(h: Harness) -> None:
        for tools in ([], [WEATHER]):
            r = await h.submit(prompt=None, messages=ASK, tools=tools)
            assert r.status_code == 202, r.text
        plain, with_tools = sorted(published(h.queue), key=lambda m: m.prompt_tokens)
        added = len(json.dumps([WEATHER], separators=(",", ":")))
        assert with_tools.prompt_tokens - plain.prompt_tokens in range(
            added // 4 - 1, added // 4 + 2
        )

    run_api(scenario)


def test_a_chat_recorded_from_its_message_is_the_row_the_api_records() -> None:
    """A controller records a request from its message when the API's row is missing (the
    API's commit failed or lost the race after the broker confirmed): the same row, a chat's
    messages without a prompt, as the API writes it."""
    from qlm.service.upkeep import new_request

    async def scenario(h: Harness) -> None:
        r = await h.submit(
            prompt=None, messages=HISTORY, labels={"team": "a"}, temperature=0.5, tier="batch"
        )
        assert r.status_code == 202, r.text
        (msg,) = published(h.queue)
        assert msg.prompt is not None  # the message carries the rendered chat, for estimates
        row = h.store.get(msg.id)
        assert row is not None and row.prompt is None
        recorded = new_request(msg).queued_row(row.updated_at)
        assert recorded == row

    run_api(scenario)
