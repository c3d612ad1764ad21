"""The global queue's message schema: a round trip, and one clear error per defect."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlm.domain import SLO, Tier
from qlm.global_queue import SCHEMA_VERSION, MessageError, QueuedRequest
from qlm.global_queue import message as message_module


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


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
)
ODD = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=2),
    st.dictionaries(st.text(max_size=2), SCALARS, max_size=2),
)
"""Values of every JSON kind, edge cases included (NaN, infinities, booleans as integers)."""


def odd_values(name: str) -> st.SearchStrategy[Any]:
    """Values for field ``name``, most of them breaking one of its rules, some not."""
    extra = {
        "tier": st.sampled_from([*Tier, 3, -1]),
        "sampling": st.dictionaries(
            st.sampled_from(["temperature", "stop", "tools", "response_format", "tool_choice"]),
            ODD,
            max_size=3,
        ),
        "labels": st.dictionaries(st.one_of(st.text(max_size=2), st.integers()), ODD, max_size=2),
        "messages": st.one_of(st.none(), st.lists(ODD, max_size=2)),
    }
    return st.one_of(ODD, extra.get(name, ODD))


VALID = {name: getattr(make_message(), name) for name in QueuedRequest.__dataclass_fields__}


@settings(max_examples=1000, deadline=None)
@given(st.data())
def test_the_quick_check_passes_only_messages_every_rule_passes(data: st.DataObject) -> None:
    """``QueuedRequest`` skips its rules one by one for a message its quick check passes: that
    must never let through a message one of the rules refuses. A valid message with one or
    two fields changed to values of every JSON kind."""
    changed = data.draw(st.lists(st.sampled_from(sorted(VALID)), min_size=1, max_size=2))
    fields = VALID | {name: data.draw(odd_values(name), label=name) for name in changed}
    candidate = SimpleNamespace(**fields)
    if message_module._plainly_valid(candidate):  # type: ignore[arg-type]
        message_module._check_fields(candidate)  # type: ignore[arg-type]


def test_the_usual_messages_take_the_quick_check() -> None:
    assert message_module._plainly_valid(make_message())
    chat = make_message(prompt=None, messages=[{"role": "user", "content": "hi"}], tier=0)
    assert message_module._plainly_valid(chat)


class _Float(float):
    pass


class _Text(str):
    pass


USUAL = [
    make_message(),
    make_message(prompt='ünïcode ✓ 😀 "quoted" \\ back\nslash\t\x00\x1f\u2028'),
    make_message(prompt=None, messages=[{"role": "user", "content": "hï", "name": None}]),
    make_message(prompt="", sampling={}, labels={}, slo_ttft_s=None),
    make_message(
        sampling={
            "temperature": 0.0,
            "top_p": 1e-07,
            "seed": 2**70,
            "logprobs": True,
            "echo": False,
            "user": None,
            "stop": ["\n", "é"],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "response_format": {"type": "json_schema", "json_schema": {"strict": True}},
            "tool_choice": "auto",
            "ü": "ß",
        }
    ),
    make_message(labels={"z": "1", "a": "é", "": ""}, tenant="tënant", model="m/ü"),
    make_message(trace={"traceparent": "00-ab-cd-01", "tracestate": "k=v"}),
    make_message(attempt=3, partial_text="Once ü", partial_tokens=2, replay_output_tokens=120),
    make_message(slo_e2e_s=1e16, slo_ttft_s=5e-324, submitted_at=1_767_000_000.123456),
    make_message(submitted_at=0.0, slo_e2e_s=0.1 + 0.2, slo_ttft_s=None),
]
"""Messages of every usual kind: each is written by the template (``_templated``)."""
UNUSUAL = [
    make_message(slo_e2e_s=30, submitted_at=1_700_000_000),  # ints as floats
    make_message(slo_e2e_s=_Float(30.5)),
    make_message(prompt=_Text("x")),
    make_message(prompt_tokens=Tier.BATCH),
]
"""Messages of values of other types, written by ``_encoded`` (a dict through ``_ENCODER``)."""


@pytest.mark.parametrize(
    ("message", "usual"), [(m, True) for m in USUAL] + [(m, False) for m in UNUSUAL]
)
def test_the_template_writes_the_bytes_the_encoder_writes(
    message: QueuedRequest, usual: bool
) -> None:
    assert (message_module._templated(message) is not None) == usual
    raw = message.encode()
    assert raw == message_module._encoded(message).encode()
    assert QueuedRequest.decode(raw) == QueuedRequest.decode(json.dumps(json.loads(raw)).encode())
    assert QueuedRequest.decode(raw) == message


def _outcome(write: Any, message: Any) -> Any:
    """What ``write`` gives for ``message``: its text, or the type of the error it raises."""
    try:
        return write(message)
    except (ValueError, TypeError, OverflowError) as exc:
        return type(exc)


EDGE = st.one_of(
    SCALARS,
    st.sampled_from(
        [math.nan, math.inf, -0.0, 1e300, 5e-324, 2**80, _Float(1.0), _Text("t"), *Tier]
    ),
)
NESTED = st.dictionaries(
    st.one_of(st.text(max_size=2), st.sampled_from([1, 2.5, None, True])),
    st.one_of(EDGE, st.lists(EDGE, max_size=2), st.dictionaries(st.text(max_size=2), EDGE)),
    max_size=3,
)
"""Nested values: mostly flat objects, with every kind of scalar and key."""
ODDER = st.one_of(ODD, EDGE)
TOP = sorted(set(VALID) - {"sampling", "labels", "trace", "messages"})


@settings(max_examples=2000, deadline=None)
@given(st.data())
def test_the_template_writes_what_the_encoder_writes_for_any_values(data: st.DataObject) -> None:
    """Any values, valid or not (``QueuedRequest`` would refuse some): the template writes
    what the encoder writes, or gives way (``None``) to it; an error is the same error."""
    changed = data.draw(st.lists(st.sampled_from(TOP), max_size=2))
    fields = VALID | {name: data.draw(ODDER, label=name) for name in changed}
    for name in ("sampling", "labels", "trace"):
        fields[name] = data.draw(NESTED, label=name)
    fields["messages"] = data.draw(st.one_of(st.none(), st.lists(NESTED, max_size=2)))
    candidate = SimpleNamespace(**fields)
    fast = _outcome(message_module._templated, candidate)
    assert fast is None or fast == _outcome(message_module._encoded, candidate)


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.one_of(st.none(), st.text()),
    tenant=st.text(min_size=1),
    floats=st.lists(st.floats(min_value=1e-300, max_value=1e300), min_size=3, max_size=3),
    sampling=st.dictionaries(st.text(max_size=5), SCALARS.filter(lambda v: v == v), max_size=4),
    labels=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
    trace=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
)
def test_any_valid_message_is_written_by_the_template_and_decodes_to_itself(
    prompt: str | None,
    tenant: str,
    floats: list[float],
    sampling: dict[str, Any],
    labels: dict[str, str],
    trace: dict[str, str],
) -> None:
    e2e, ttft, at = sorted(floats, reverse=True)
    sampling = {k: v for k, v in sampling.items() if v not in (math.inf, -math.inf)}
    message = make_message(
        prompt=prompt,
        tenant=tenant,
        slo_e2e_s=e2e,
        slo_ttft_s=ttft,
        submitted_at=at,
        sampling=sampling,
        labels=labels,
        trace=trace,
    )
    raw = message.encode()
    assert message_module._templated(message) is not None
    assert raw == message_module._encoded(message).encode()
    assert QueuedRequest.decode(raw) == message


def _reference_strings(value: object) -> bool:
    return type(value) is dict and all(type(k) is str and type(v) is str for k, v in value.items())


def _reference_sampling(value: object) -> bool:
    scalar = message_module._is_scalar
    return type(value) is dict and all(
        k not in message_module.OBJECT_PARAMETERS
        and (scalar(v) or (type(v) is list and all(map(scalar, v))))
        for k, v in value.items()
    )


def _reference_messages(value: object) -> bool:
    return type(value) is list and all(
        type(item) is dict and all(type(k) is str for k in item) for item in value
    )


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_the_quick_checks_of_containers_decide_as_their_definitions(data: st.DataObject) -> None:
    """Each quick check of a container field decides as the one-line definition it stands for
    (every value of ``all`` over the items)."""
    keys = st.one_of(st.sampled_from(["temperature", "stop", "tools"]), st.text(max_size=2))
    value = data.draw(
        st.one_of(
            ODD,
            st.dictionaries(st.one_of(keys, st.integers()), ODD, max_size=3),
            st.lists(st.one_of(ODD, st.dictionaries(keys, ODD, max_size=2)), max_size=3),
        )
    )
    assert message_module._plain_strings(value) == _reference_strings(value)
    assert message_module._plain_sampling(value) == _reference_sampling(value)
    assert message_module._plain_messages(value) == _reference_messages(value)
