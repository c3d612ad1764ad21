"""What travels through the global queue: one ``QueuedRequest`` per accepted request, as JSON.

The broker holds the one replica of each queued request (ARCHITECTURE.md §4 rule 5), so the
message carries everything needed to rebuild the request after a controller failover: the prompt,
the planning figures, the SLO, and, for a request resumed after an eviction, the output so far.

The body is versioned (``schema``). A reader accepts only the versions it knows and ignores fields it
does not know, so a producer may add an optional field without bumping the version (rolling
upgrades); a change of meaning bumps it. ``decode`` never lets a ``KeyError`` or ``TypeError``
escape: every defect is a ``MessageError`` naming the field, which the queue puts on the message
when it dead-letters it.

No I/O here: this module imports neither pika nor aio-pika, so the API and tests use it freely.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from qlm import jsontext
from qlm.domain import SLO, Request, Tier
from qlm.errors import QLMError
from qlm.frozen import fast_init
from qlm.structured import resumable

SCHEMA_VERSION = 1
"""The body version this code writes and the only one it reads."""

JsonScalar = str | int | float | bool | None
SamplingValue = JsonScalar | list[JsonScalar] | dict[str, Any] | list[dict[str, Any]]
"""A sampling parameter: a JSON scalar (``temperature``) or a list of them (``stop``); objects
only for the keys in ``OBJECT_PARAMETERS``."""
OBJECT_PARAMETERS: dict[str, tuple[type, ...]] = {
    "response_format": (dict,),
    "tools": (list,),
    "tool_choice": (str, dict),
}
"""Parameters that are JSON objects (or lists of them), with the types they may take."""


class MessageError(QLMError):
    """A queue message body cannot be decoded; the text names the offending field."""


@fast_init
@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """One accepted request as the global queue carries it (schema 1).

    ``prompt_tokens`` is the prompt length the controller plans with (counted by the API).
    ``partial_text`` / ``partial_tokens`` are the output generated before an eviction: a resumed
    request is served as prompt + partial output. ``attempt`` counts those resumptions.
    ``replay_output_tokens`` is only for trace replays against simulated engines
    (``qlm.domain.Request`` says who may read it). Not hashable (dict fields): key it by ``id``.
    """

    id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    slo_e2e_s: float
    submitted_at: float
    tenant: str = "default"
    prompt: str | None = None
    sampling: dict[str, SamplingValue] = field(default_factory=dict)
    slo_ttft_s: float | None = None
    tier: int = int(Tier.STANDARD)
    labels: dict[str, str] = field(default_factory=dict)
    attempt: int = 0
    partial_text: str = ""
    partial_tokens: int = 0
    replay_output_tokens: int | None = None
    messages: list[dict[str, Any]] | None = None
    trace: dict[str, str] = field(default_factory=dict)
    """The W3C trace context of the API's span (``traceparent``, ``tracestate``) when the API
    traces (``qlm.tracing``); written only when not empty."""
    schema: int = SCHEMA_VERSION

    REQUIRED: ClassVar[tuple[str, ...]] = (
        "id",
        "model",
        "prompt_tokens",
        "max_tokens",
        "slo_e2e_s",
        "submitted_at",
    )

    def __post_init__(self) -> None:
        # Values are checked on construction too, so that nothing invalid is ever published.
        if not _plainly_valid(self):
            _check_fields(self)
            object.__setattr__(self, "tier", int(self.tier))  # a plain int, as decode gives it

    def encode(self) -> bytes:
        """Compact UTF-8 JSON with every field, ``schema`` included (``trace`` only when set).

        The text ``_ENCODER`` writes for the fields in order (``_encoded``), its constant parts
        written once; values of other types than the usual ones take ``_ENCODER`` itself."""
        text = _templated(self)
        return (_encoded(self) if text is None else text).encode()

    @classmethod
    def decode(cls, body: bytes) -> QueuedRequest:
        """Parse a body written by ``encode`` (of this schema version); raise ``MessageError``."""
        try:
            data = json.loads(body.decode("utf-8"))  # bytes alone would let json guess UTF-16
        except UnicodeDecodeError as exc:
            raise MessageError(f"body is not UTF-8: {exc.reason} at byte {exc.start}") from None
        except (ValueError, RecursionError) as exc:
            raise MessageError(f"body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise MessageError(f"body must be a JSON object, got {type(data).__name__}")
        if "schema" not in data:
            raise MessageError("missing field 'schema'")
        _check_schema(data["schema"])
        for name in cls.REQUIRED:
            if name not in data:
                raise MessageError(f"missing field {name!r}")
        known = _FIELDS
        kwargs = {k: v for k, v in data.items() if k in known}
        # JSON has no int/float distinction for whole numbers: 30 is a valid slo_e2e_s.
        for name in ("slo_e2e_s", "slo_ttft_s", "submitted_at"):
            value = kwargs.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                kwargs[name] = float(value)
        return cls(**kwargs)

    def to_request(self, arrival_s: float) -> Request:
        """The domain ``Request`` the controller plans with, arrived at ``arrival_s``.

        The caller gives the arrival on its own clock (the controller's clock need not be the
        API's). Fields map one to one: ``partial_*`` is not folded in here, because only the code
        that resumes a request knows how it re-tokenised the partial output.
        """
        return Request(
            id=self.id,
            model=self.model,
            input_tokens=self.prompt_tokens,
            max_tokens=self.max_tokens,
            arrival_s=arrival_s,
            slo=SLO(e2e_s=self.slo_e2e_s, ttft_s=self.slo_ttft_s),
            tier=Tier(self.tier),
            tenant=self.tenant,
            replay_output_tokens=self.replay_output_tokens,
            labels=tuple(sorted(self.labels.items())),
            resumable=resumable(self.sampling),
        )


_TIERS = sorted(int(t) for t in Tier)
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
"""``json.dumps`` with these arguments makes this encoder anew at every call."""
_FIELD_NAMES = tuple(f.name for f in fields(QueuedRequest))
_FIELDS = frozenset(_FIELD_NAMES)


def _encoded(m: QueuedRequest) -> str:
    """``m``'s body as ``_ENCODER`` writes it from a dict of the fields: what ``_templated``
    writes, for any values."""
    body = {name: getattr(m, name) for name in _FIELD_NAMES}
    if not m.trace:
        del body["trace"]  # the body of an untraced request is as it always was
    return _ENCODER.encode(body)


def _templated(m: QueuedRequest) -> str | None:
    """``m``'s body as ``_ENCODER`` writes it, or ``None`` when a field is not of the usual type
    (an ``int`` or ``float`` subclass, a float that is not finite, a string subclass): the
    top-level fields by a template, a nested value by ``jsontext.flat_object`` when flat, by
    ``_ENCODER`` otherwise (its text of a nested value is its text of that value alone)."""
    prompt = m.prompt
    ttft = m.slo_ttft_s
    replay = m.replay_output_tokens
    if not (
        type(m.id) is str
        and type(m.model) is str
        and type(m.tenant) is str
        and (prompt is None or type(prompt) is str)
        and type(m.partial_text) is str
        and type(m.prompt_tokens) is int
        and type(m.max_tokens) is int
        and type(m.tier) is int
        and type(m.attempt) is int
        and type(m.partial_tokens) is int
        and type(m.schema) is int
        and (replay is None or type(replay) is int)
        and type(m.slo_e2e_s) is float
        and -_INF < m.slo_e2e_s < _INF
        and type(m.submitted_at) is float
        and -_INF < m.submitted_at < _INF
        and (ttft is None or (type(ttft) is float and -_INF < ttft < _INF))
    ):
        return None
    if m.attempt == 0 and m.partial_tokens == 0 and replay is None and not m.partial_text:
        resumed = _NOT_RESUMED
    else:
        resumed = (
            f'"attempt":{m.attempt},'
            f'"partial_text":{_STRING(m.partial_text)},"partial_tokens":{m.partial_tokens},'
            f'"replay_output_tokens":{"null" if replay is None else replay}'
        )
    trace = ""
    if m.trace:
        trace = f',"trace":{_FLAT(m.trace, _STRING, ",", ":") or _ENCODER.encode(m.trace)}'
    return (
        f'{{"id":{_STRING(m.id)},"model":{_STRING(m.model)},'
        f'"prompt_tokens":{m.prompt_tokens},"max_tokens":{m.max_tokens},'
        f'"slo_e2e_s":{m.slo_e2e_s!r},"submitted_at":{m.submitted_at!r},'
        f'"tenant":{_STRING(m.tenant)},"prompt":{"null" if prompt is None else _STRING(prompt)},'
        f'"sampling":{_FLAT(m.sampling, _STRING, ",", ":") or _ENCODER.encode(m.sampling)},'
        f'"slo_ttft_s":{"null" if ttft is None else _FLOAT(ttft)},"tier":{m.tier},'
        f'"labels":{_FLAT(m.labels, _STRING, ",", ":") or _ENCODER.encode(m.labels)},'
        f"{resumed},"
        f'"messages":{"null" if m.messages is None else _ENCODER.encode(m.messages)}'
        f'{trace},"schema":{m.schema}}}'
    )


_NOT_RESUMED = '"attempt":0,"partial_text":"","partial_tokens":0,"replay_output_tokens":null'
"""The four fields of a request never evicted, as ``_templated`` writes them."""
_FLAT = jsontext.flat_object
_STRING = jsontext.STRING
_FLOAT = jsontext.FLOAT
_INF = jsontext.INF


def _check_fields(message: QueuedRequest) -> None:
    """Every rule a message keeps, one by one: the first one broken raises ``MessageError``
    naming its field."""
    _check_schema(message.schema)
    for name in ("id", "model", "tenant"):
        _check(name, isinstance(getattr(message, name), str), "a string")
        _check(name, getattr(message, name) != "", "non-empty")
    _check("prompt", message.prompt is None or isinstance(message.prompt, str), "a string or null")
    for name in ("prompt_tokens", "max_tokens"):
        _check_int(name, getattr(message, name), minimum=1)
    for name in ("attempt", "partial_tokens"):
        _check_int(name, getattr(message, name), minimum=0)
    if message.replay_output_tokens is not None:
        _check_int("replay_output_tokens", message.replay_output_tokens, minimum=1)
    _check_float("slo_e2e_s", message.slo_e2e_s)
    _check("slo_e2e_s", message.slo_e2e_s > 0, "> 0", message.slo_e2e_s)
    if message.slo_ttft_s is not None:
        _check_float("slo_ttft_s", message.slo_ttft_s)
        ok = 0 < message.slo_ttft_s <= message.slo_e2e_s
        _check("slo_ttft_s", ok, f"in (0, slo_e2e_s={message.slo_e2e_s}]", message.slo_ttft_s)
    _check_float("submitted_at", message.submitted_at)
    _check("submitted_at", message.submitted_at >= 0, ">= 0 (unix seconds)", message.submitted_at)
    _check_int("tier", message.tier, minimum=None)
    _check("tier", message.tier in _TIERS, f"one of {_TIERS}", message.tier)
    _check("partial_text", isinstance(message.partial_text, str), "a string")
    _check_sampling(message.sampling)
    _check("labels", isinstance(message.labels, dict), "an object")
    for key, value in message.labels.items():
        _check(f"labels.{key}", isinstance(key, str) and isinstance(value, str), "a string")
    _check("trace", isinstance(message.trace, dict), "an object")
    for key, value in message.trace.items():
        _check(f"trace.{key}", isinstance(key, str) and isinstance(value, str), "a string")
    if message.messages is not None:
        _check("messages", isinstance(message.messages, list), "a list or null")
        for i, item in enumerate(message.messages):
            ok = isinstance(item, dict) and all(isinstance(k, str) for k in item)
            _check(f"messages[{i}]", ok, "an object")


def _plainly_valid(m: QueuedRequest) -> bool:
    """Whether ``m`` keeps every rule of ``_check_fields``, decided in one expression with no
    error text made, for the usual message: exact built-in types, plain sampling values, no
    replay length. False does not mean invalid: ``_check_fields`` then decides, naming the
    field (a test checks that whatever passes here passes there)."""
    ttft = m.slo_ttft_s
    return (
        type(m.schema) is int
        and m.schema == SCHEMA_VERSION
        and type(m.id) is str
        and m.id != ""
        and type(m.model) is str
        and m.model != ""
        and type(m.tenant) is str
        and m.tenant != ""
        and (m.prompt is None or type(m.prompt) is str)
        and type(m.prompt_tokens) is int
        and m.prompt_tokens >= 1
        and type(m.max_tokens) is int
        and m.max_tokens >= 1
        and type(m.attempt) is int
        and m.attempt >= 0
        and type(m.partial_tokens) is int
        and m.partial_tokens >= 0
        and m.replay_output_tokens is None
        and type(m.slo_e2e_s) is float
        and 0 < m.slo_e2e_s < math.inf
        and (ttft is None or (type(ttft) is float and 0 < ttft <= m.slo_e2e_s))
        and type(m.submitted_at) is float
        and 0 <= m.submitted_at < math.inf
        and type(m.tier) is int
        and m.tier in _TIERS
        and type(m.partial_text) is str
        and _plain_strings(m.labels)
        and _plain_strings(m.trace)
        and _plain_sampling(m.sampling)
        and (m.messages is None or _plain_messages(m.messages))
    )


def _plain_strings(value: object) -> bool:
    if type(value) is not dict:
        return False
    for k, v in value.items():  # noqa: SIM110 - a loop: half the time of all() over a generator
        if type(k) is not str or type(v) is not str:
            return False
    return True


def _plain_sampling(value: object) -> bool:
    if type(value) is not dict:
        return False
    for k, v in value.items():
        if k in OBJECT_PARAMETERS:
            return False
        if not (_is_scalar(v) or (type(v) is list and all(map(_is_scalar, v)))):
            return False
    return True


def _plain_messages(value: object) -> bool:
    if type(value) is not list:
        return False
    for item in value:
        if type(item) is not dict or not all(type(k) is str for k in item):
            return False
    return True


def _shown(value: object) -> str:
    """``repr`` cut short: the message goes into logs and a dead-letter header."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fail(name: str, rule: str, value: object) -> MessageError:
    return MessageError(f"field {name!r} must be {rule}, got {_shown(value)}")


def _check(name: str, ok: bool, rule: str, value: object = ...) -> None:
    if not ok:
        got = "" if value is ... else f", got {_shown(value)}"
        raise MessageError(f"field {name!r} must be {rule}{got}")


def _check_schema(value: object) -> None:
    if type(value) is not int or value != SCHEMA_VERSION:
        raise MessageError(
            f"field 'schema': unknown version {_shown(value)} (this reader knows {SCHEMA_VERSION})"
        )


def _check_int(name: str, value: object, *, minimum: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(name, "an integer", value)
    if minimum is not None and value < minimum:
        raise _fail(name, f">= {minimum}", value)


def _check_float(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _fail(name, "a number", value)
    if not math.isfinite(value):
        raise _fail(name, "finite", value)


def _is_scalar(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, str | int | bool)


def _check_sampling(sampling: object) -> None:
    if not isinstance(sampling, dict):
        raise _fail("sampling", "an object", sampling)
    for key, value in sampling.items():
        if key in OBJECT_PARAMETERS:
            kinds = OBJECT_PARAMETERS[key]
            names = " or ".join("an object" if k is dict else f"a {k.__name__}" for k in kinds)
            _check(f"sampling.{key}", isinstance(value, kinds), names, value)
            continue
        ok = _is_scalar(value) or (isinstance(value, list) and all(map(_is_scalar, value)))
        _check(f"sampling.{key}", ok, "a JSON scalar or a list of them", value)
