"""Tool-using conversations: earlier turns keep their tool calls and tool answers on the way to
vLLM's chat template (they were dropped without a word before)."""

from __future__ import annotations

from typing import Any

import pytest

from qlm.api.prompts import render_chat
from tests.unit.test_api import Harness, error, published
from tests.unit.test_api import run as run_api

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
