"""The global queue's message schema: a round trip, and one clear error per defect."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from qlm.domain import SLO, Tier
from qlm.global_queue import SCHEMA_VERSION, MessageError, QueuedRequest


def make_message(**overrides: Any) -> QueuedRequest:
    fields: dict[str, Any] = {
        "id": "req-1",
        "tenant": "acme",
        "model": "llama-3-8b",
        "prompt": "Tell me a story",
        "prompt_tokens": 5,
        "max_tokens": 200,
        "sampling": {"temperature": 0.7, "top_p": 0.9, "stop": ["\n\n"], "seed": 3},
        "slo_e2e_s": 30.0,
        "slo_ttft_s": 2.0,
        "tier": Tier.INTERACTIVE,
        "labels": {"team": "search"},
        "submitted_at": 1_700_000_000.5,
    }
    fields.update(overrides)
    return QueuedRequest(**fields)


def body(**changes: Any) -> bytes:
    """A valid encoded message with fields changed (``...`` deletes one)."""
    data = json.loads(make_message().encode())
    for name, value in changes.items():
        if value is ...:
            del data[name]
        else:
            data[name] = value
    return json.dumps(data).encode()


def test_message_survives_an_encode_decode_round_trip() -> None:
    message = make_message(
        attempt=2,
        partial_text="Once upon",
        partial_tokens=2,
        replay_output_tokens=120,
        messages=[{"role": "user", "content": "Tell me a story"}],
        prompt="ünïcode ✓",
    )
    assert QueuedRequest.decode(message.encode()) == message


def test_encoding_is_compact_json_with_the_schema_version() -> None:
    raw = make_message().encode()
    assert b" " not in raw.replace(b"Tell me a story", b"")
    data = json.loads(raw)
    assert data["schema"] == SCHEMA_VERSION == 1
    assert data["tier"] == 0


def test_optional_fields_may_be_absent_and_unknown_fields_are_ignored() -> None:
    minimal = {
        "schema": 1,
        "id": "r",
        "model": "m",
        "prompt_tokens": 1,
        "max_tokens": 1,
        "slo_e2e_s": 10,
        "submitted_at": 0,
        "added_by_a_newer_producer": True,
    }
    message = QueuedRequest.decode(json.dumps(minimal).encode())
    assert message.tenant == "default"
    assert message.tier == Tier.STANDARD
    assert message.prompt is None and message.messages is None
    assert message.slo_e2e_s == 10.0 and isinstance(message.slo_e2e_s, float)


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        (b"\xff\xfe", "UTF-8"),
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (body(schema=...), "'schema'"),
        (body(schema=2), "'schema'"),
        (body(schema="1"), "'schema'"),
        (body(id=...), "'id'"),
        (body(model=...), "'model'"),
        (body(prompt_tokens=...), "'prompt_tokens'"),
        (body(max_tokens=...), "'max_tokens'"),
        (body(slo_e2e_s=...), "'slo_e2e_s'"),
        (body(submitted_at=...), "'submitted_at'"),
        (body(id=7), "'id'"),
        (body(id=""), "'id'"),
        (body(tenant=None), "'tenant'"),
        (body(model=["m"]), "'model'"),
        (body(prompt=3), "'prompt'"),
        (body(prompt_tokens=0), "'prompt_tokens'"),
        (body(prompt_tokens=2.5), "'prompt_tokens'"),
        (body(prompt_tokens=True), "'prompt_tokens'"),
        (body(max_tokens="100"), "'max_tokens'"),
        (body(sampling=[]), "'sampling'"),
        (body(sampling={"temperature": {"x": 1}}), "'sampling.temperature'"),
        (body(slo_e2e_s=0), "'slo_e2e_s'"),
        (body(slo_e2e_s="30"), "'slo_e2e_s'"),
        (body(slo_ttft_s=-1.0), "'slo_ttft_s'"),
        (body(slo_ttft_s=60.0), "'slo_ttft_s'"),
        (body(tier=3), "'tier'"),
        (body(tier="interactive"), "'tier'"),
        (body(labels={"team": 1}), "'labels.team'"),
        (body(labels="team"), "'labels'"),
        (body(submitted_at=-5), "'submitted_at'"),
        (
            b'{"schema":1,"id":"r","model":"m","prompt_tokens":1,"max_tokens":1,'
            b'"slo_e2e_s":NaN,"submitted_at":0}',
            "'slo_e2e_s'",
        ),
        (body(attempt=-1), "'attempt'"),
        (body(partial_text=None), "'partial_text'"),
        (body(partial_tokens=-1), "'partial_tokens'"),
        (body(replay_output_tokens=0), "'replay_output_tokens'"),
        (body(messages={"role": "user"}), "'messages'"),
        (body(messages=["hi"]), "'messages[0]'"),
    ],
)
def test_every_defect_is_a_message_error_naming_the_field(raw: bytes, named: str) -> None:
    with pytest.raises(MessageError, match=re.escape(named)):
        QueuedRequest.decode(raw)


def test_an_invalid_message_cannot_even_be_built() -> None:
    with pytest.raises(MessageError, match="'max_tokens'"):
        make_message(max_tokens=0)


def test_to_request_gives_the_domain_request_at_the_callers_arrival_time() -> None:
    message = make_message(labels={"z": "1", "a": "2"}, replay_output_tokens=40)
    request = message.to_request(arrival_s=12.5)
    assert request.id == "req-1"
    assert request.model == "llama-3-8b"
    assert request.input_tokens == 5
    assert request.max_tokens == 200
    assert request.arrival_s == 12.5
    assert request.slo == SLO(e2e_s=30.0, ttft_s=2.0)
    assert request.tier is Tier.INTERACTIVE
    assert request.tenant == "acme"
    assert request.replay_output_tokens == 40
    assert request.labels == (("a", "2"), ("z", "1"))


def test_an_error_quotes_a_huge_bad_value_only_in_part() -> None:
    with pytest.raises(MessageError, match="'prompt'") as caught:
        QueuedRequest.decode(body(prompt=["x" * 100_000]))
    assert len(str(caught.value)) < 200
