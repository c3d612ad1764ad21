"""HTTP bodies: what clients send (``*In``), what the API answers (``*Out``). Stored rows
(``qlm.store.RequestRow``) never leave the process as they are; ``RequestOut.of`` shapes them.

Native bodies forbid unknown fields (a typo gets a 422 naming it). OpenAI-compatible bodies ignore
the fields QLM does not use, as OpenAI-compatible servers do, but refuse the ones whose meaning it
cannot honour (``n`` > 1, ``logprobs``, ``tools``, ...), naming them. A ``response_format``
(structured output) is passed through on every endpoint.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from typing import Annotated, Any, Literal

from fastapi import Path
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

from qlm.api.prompts import CHARS_PER_TOKEN
from qlm.domain import MAX_API_SLO_S, MIN_SLO_S, RequestStatus, Tier
from qlm.settings import ApiSettings
from qlm.store import RequestRow
from qlm.structured import schema_problem

TierName = Literal["interactive", "standard", "batch"]
StatusName = Literal["queued", "running", "finished", "failed", "cancelled"]


def clean_text(value: str) -> str:
    """Text the store can keep on every backend: no NUL character, valid Unicode."""
    if "\x00" in value:
        raise ValueError("must not contain the NUL character (\\u0000)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    return value


class JsonSchemaRules:
    """Adds ``rules`` to a type's JSON schema: what its validators check that the schema
    generated from the type would not say (the OpenAPI schema says what the API accepts: a
    client, or a fuzzer, can trust a body the schema admits). Models add theirs with
    ``json_schema_extra``."""

    def __init__(self, **rules: Any) -> None:
        self.rules = rules

    def __get_pydantic_json_schema__(
        self, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core_schema)
        schema.update(self.rules)
        return schema


NO_NUL = r"^[^\u0000]*$"
"""``clean_text`` as a pattern. (The lone surrogates it refuses too have no pattern in JSON
Schema's regular expressions.)"""

Text = Annotated[str, AfterValidator(clean_text), JsonSchemaRules(pattern=NO_NUL)]
Name = Annotated[
    str,
    Field(min_length=1, max_length=256),
    AfterValidator(clean_text),
    JsonSchemaRules(pattern=NO_NUL),
]
LabelKey = Annotated[str, Field(min_length=1, max_length=64), AfterValidator(clean_text)]
LabelValue = Annotated[
    str, Field(max_length=256), AfterValidator(clean_text), JsonSchemaRules(pattern=NO_NUL)
]
Stop = Annotated[
    str,
    Field(min_length=1, max_length=256),
    AfterValidator(clean_text),
    JsonSchemaRules(pattern=NO_NUL),
]
Seconds = Annotated[float, Field(ge=MIN_SLO_S, le=MAX_API_SLO_S, allow_inf_nan=False)]

ID_MAX_CHARS = 256
ID_PATTERN = r"^[^\x00-\x1f\x7f/]+$"
"""What a request id or an instance name in a path may be: no control character (NUL among
them, which PostgreSQL cannot hold in text: such an id cannot exist, and must not reach the
store) and no slash. ``MODEL_PATTERN`` is the same with slashes (model names have them)."""
MODEL_PATTERN = r"^[^\x00-\x1f\x7f]+$"
RequestIdPath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=ID_MAX_CHARS,
        pattern=ID_PATTERN,
        description="The request's id, as `POST /v1/requests` answered it.",
    ),
]
GroupIdPath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=ID_MAX_CHARS,
        pattern=ID_PATTERN,
        description="The group's id (GET /v1/admin/groups).",
    ),
]
InstanceNamePath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=ID_MAX_CHARS,
        pattern=ID_PATTERN,
        description="The instance's name (GET /v1/admin/instances).",
    ),
]
ModelPath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=ID_MAX_CHARS,
        pattern=MODEL_PATTERN,
        description="A model's name (GET /v1/models).",
    ),
]


def tier_of(name: TierName) -> Tier:
    return Tier.parse(name)


def tier_name(tier: Tier) -> TierName:
    names: dict[Tier, TierName] = {
        Tier.INTERACTIVE: "interactive",
        Tier.STANDARD: "standard",
        Tier.BATCH: "batch",
    }
    return names[tier]


def status_name(status: RequestStatus) -> StatusName:
    names: dict[RequestStatus, StatusName] = {
        RequestStatus.QUEUED: "queued",
        RequestStatus.RUNNING: "running",
        RequestStatus.FINISHED: "finished",
        RequestStatus.FAILED: "failed",
        RequestStatus.CANCELLED: "cancelled",
    }
    return names[status]


# --- shared pieces ----------------------------------------------------------------------------

MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects a body may have. The deepest that QLM reads are
JSON schemas (``qlm.structured`` takes 16 levels of them, about 40 of JSON in a body);
free-form values inside them (``default``, ``enum``, ``const``) are kept and passed on as they
are, and a body nested a thousand levels deep would have every later reader of the queue
message or the stored row decode it at the edge of Python's recursion limit."""


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests arrays and objects deeper than ``limit`` levels;
    without recursion, whatever the depth."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


SHALLOW = {"qlm.nesting": "checked"}
"""A validation context (``model_validate(..., context=SHALLOW)``) saying that the body's JSON
text cannot nest deeper than ``MAX_JSON_DEPTH`` (``shallow``): ``JsonBody`` then skips its walk
over the parsed body."""


def shallow(text: bytes) -> bool:
    """Whether JSON ``text`` surely nests arrays and objects no deeper than ``MAX_JSON_DEPTH``:
    it holds no more ``[`` and ``{`` than that (a tenth of the walk's cost)."""
    return text.count(b"[") + text.count(b"{") <= MAX_JSON_DEPTH


class JsonBody(BaseModel):
    """A request body: refused as a whole when it nests deeper than ``MAX_JSON_DEPTH``."""

    @model_validator(mode="before")
    @classmethod
    def _not_too_deep(cls, data: Any, info: ValidationInfo) -> Any:
        if info.context is SHALLOW:
            return data
        if isinstance(data, dict | list) and _deeper_than(data, MAX_JSON_DEPTH):
            raise PydanticCustomError(
                "json_too_deep",
                "nests arrays and objects deeper than {limit} levels",
                {"limit": MAX_JSON_DEPTH},
            )
        return data


class TextPart(BaseModel):
    """One part of a message's content; only text parts are supported."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"] = Field(description="Only `text` parts are supported.")
    text: Text = Field(max_length=4_194_304)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Name
    arguments: Text = Field(max_length=1_048_576, description="JSON text, as the model wrote it.")


class ToolCall(BaseModel):
    """A tool call of an earlier assistant turn, as the conversation carries it."""

    model_config = ConfigDict(extra="ignore")

    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


def _rule(schema: dict[str, Any], rule: dict[str, Any]) -> None:
    """Add ``rule`` to a model's JSON schema (every rule must hold)."""
    schema.setdefault("allOf", []).append(copy.deepcopy(rule))


NULL = {"type": "null"}
NOT_NULL = {"not": NULL}


def _message_rules(schema: dict[str, Any]) -> None:
    """``ChatMessage``'s validator as JSON Schema, one branch per role."""
    _rule(
        schema,
        {
            "oneOf": [
                {
                    "properties": {
                        "role": {"enum": ["system", "developer", "user"]},
                        "content": NOT_NULL,
                        "tool_calls": NULL,
                        "tool_call_id": NULL,
                    },
                    "required": ["content"],
                },
                {
                    "properties": {"role": {"const": "assistant"}, "tool_call_id": NULL},
                    "anyOf": [
                        {"properties": {"content": NOT_NULL}, "required": ["content"]},
                        {
                            "properties": {"tool_calls": {"type": "array", "minItems": 1}},
                            "required": ["tool_calls"],
                        },
                    ],
                },
                {
                    "properties": {
                        "role": {"const": "tool"},
                        "content": NOT_NULL,
                        "tool_calls": NULL,
                        "tool_call_id": {"type": "string"},
                    },
                    "required": ["content", "tool_call_id"],
                },
            ]
        },
    )


class ChatMessage(BaseModel):
    """One message of a conversation. Earlier turns of a tool-using conversation keep their
    ``tool_calls`` (assistant) and ``tool_call_id`` (tool) on their way to vLLM's chat template."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_message_rules)

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="Who wrote it."
    )
    content: Text | list[TextPart] | None = Field(
        default=None,
        description="The text, or a list of text parts; may be null on an assistant turn that "
        "made tool calls.",
    )
    name: Name | None = Field(default=None, description="Optional author name.")
    tool_calls: list[ToolCall] | None = Field(
        default=None, max_length=128, description="Assistant turns: the calls it made."
    )
    tool_call_id: Name | None = Field(
        default=None, description="Tool turns: the call this answers (required there)."
    )

    @model_validator(mode="after")
    def _tool_fields_where_they_belong(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool_call_id is required on tool messages, and only there")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (null only on an assistant turn with tool_calls)")
        return self


MAX_SCHEMA_CHARS = 65_536
"""The longest JSON schema accepted for structured output, as compact JSON."""


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="Letters, digits, _ and -.")
    description: Text | None = Field(default=None, max_length=4096)
    schema_: dict[str, Any] = Field(
        default_factory=dict, alias="schema", description="The JSON Schema of the answer."
    )
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _a_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        return cls.check_schema(schema)

    @staticmethod
    def check_schema(schema: dict[str, Any]) -> dict[str, Any]:
        """``schema`` if it is a JSON Schema of a size QLM takes (ValueError saying why not)."""
        size = len(json.dumps(schema, separators=(",", ":")))
        if size > MAX_SCHEMA_CHARS:
            raise PydanticCustomError(
                "schema_too_large",
                "is {size} characters as JSON; at most {limit}",
                {"size": size, "limit": MAX_SCHEMA_CHARS},
            )
        problem = schema_problem(schema)
        unclean = _unclean_text(schema)
        if problem is None and unclean is not None:
            problem = f"{unclean}: a text the store cannot keep (NUL, or a lone surrogate)"
        if problem is not None:
            # Which JSON Schemas QLM takes is checked here, not described by the OpenAPI
            # schema (it would be a copy of JSON Schema's own metaschema).
            raise PydanticCustomError("invalid_schema", "{problem}", {"problem": problem})
        return schema


def _unclean_text(value: Any) -> str | None:
    """The JSON pointer of the first key or string in ``value`` (parsed JSON) that
    ``clean_text`` refuses, None when there is none: free-form JSON is stored as it is."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, pointer = stack.pop()
        if isinstance(item, str):
            try:
                clean_text(item)
            except ValueError:
                return pointer or "/"
        elif isinstance(item, dict):
            for key, child in item.items():
                at = f"{pointer}/{str(key).replace('~', '~0').replace('/', '~1')}"
                stack.append((key, at))
                stack.append((child, at))
        elif isinstance(item, list):
            stack.extend((child, f"{pointer}/{i}") for i, child in enumerate(item))
    return None


def _format_rules(schema: dict[str, Any]) -> None:
    _rule(
        schema,
        {
            "oneOf": [
                {
                    "properties": {
                        "type": {"enum": ["text", "json_object"]},
                        "json_schema": NULL,
                    }
                },
                {
                    "properties": {
                        "type": {"const": "json_schema"},
                        "json_schema": {"type": "object"},
                    },
                    "required": ["json_schema"],
                },
            ]
        },
    )


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text (the default), any JSON object, or a JSON
    document of a schema. vLLM enforces it with a grammar; such an answer is never resumed
    after an eviction but started again (docs/api.md, "Structured output")."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_format_rules)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(
        default=None, description="Required with type json_schema, refused otherwise."
    )

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self


class SamplingIn(BaseModel):
    """Sampling parameters, passed through to the serving engine untouched."""

    model_config = ConfigDict(allow_inf_nan=False)

    temperature: float | None = Field(default=None, ge=0, le=2, description="0 = greedy.")
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000, description="-1 = off (vLLM).")
    seed: int | None = Field(
        default=None,
        ge=-(2**63),
        lt=2**63,
        # JSON Schema validators compare numbers as doubles, which cannot tell 2**63 from its
        # neighbours: the published bounds are the nearest doubles inside int64, so that every
        # value the schema admits is one the API takes.
        json_schema_extra={"minimum": -(2**63) + 1024, "maximum": 2**63 - 1024},
    )
    stop: Stop | Annotated[list[Stop], JsonSchemaRules(maxItems=4)] | None = Field(
        default=None, description="Up to 4 sequences that end the output."
    )
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10, description="vLLM.")
    response_format: ResponseFormat | None = Field(
        default=None, description="Structured output (JSON, or JSON of a schema)."
    )

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop

    def sampling(self) -> dict[str, Any]:
        """The parameters that were given, for the queue message and the store (a ``text``
        response format is the default: left out)."""
        out = self.model_dump(include=_sampling_fields(), exclude_none=True, by_alias=True)
        if out.get("response_format") == {"type": "text"}:
            del out["response_format"]
        return out


@functools.cache
def _sampling_fields() -> set[str]:
    """``SamplingIn``'s fields (a set made once: building it per call cost half of
    ``sampling``)."""
    return set(SamplingIn.model_fields)


def _label_keys(schema: dict[str, Any]) -> None:
    for branch in schema.get("anyOf", ()):
        if branch.get("type") == "object":
            branch.setdefault("propertyNames", {})["pattern"] = NO_NUL


class SloIn(BaseModel):
    """QLM's SLO metadata. OpenAI-style calls may instead send the ``x-qlm-*`` headers; a body
    field wins over its header."""

    slo_seconds: Seconds | None = Field(
        default=None,
        description="End-to-end deadline in seconds from submission; default: by tier "
        "(QLM_API__INTERACTIVE_SLO_S, STANDARD_SLO_S, BATCH_SLO_S).",
    )
    ttft_slo_seconds: Seconds | None = Field(
        default=None, description="Time-to-first-token deadline in seconds (<= slo_seconds)."
    )
    tier: TierName | None = Field(
        default=None,
        description="Priority tier: interactive, standard (default) or batch.",
    )
    labels: dict[LabelKey, LabelValue] | None = Field(
        default=None,
        description="Free-form key=value labels (at most QLM_API__MAX_LABELS); "
        "GET /v1/requests filters by one.",
        json_schema_extra=_label_keys,
    )


class FunctionSpec(BaseModel):
    """A function the model may call (OpenAI's ``tools[].function``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="Letters, digits, _ and -.")
    description: Text | None = Field(default=None, max_length=16_384)
    parameters: dict[str, Any] | None = Field(
        default=None, description="The JSON Schema of its arguments."
    )
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _a_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if schema is None else JsonSchemaFormat.check_schema(schema)


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the function to call."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: ChosenFunction


def _tools_rules(schema: dict[str, Any]) -> None:
    """A ``tool_choice`` other than ``none`` needs tools. (That a named choice names one of
    them, and that no two have one name, JSON Schema cannot say: codes
    ``tool_choice_not_offered``, ``duplicate_function_name``.)"""
    _rule(
        schema,
        {
            "anyOf": [
                {"properties": {"tool_choice": {"enum": [None, "none"]}}},
                {
                    "properties": {"tools": {"type": "array", "minItems": 1}},
                    "required": ["tools"],
                },
            ]
        },
    )


class ToolsIn(BaseModel):
    """Functions a chat's model may call (OpenAI's ``tools``, ``tool_choice``,
    ``parallel_tool_calls``), passed to vLLM with the sampling parameters (docs/api.md)."""

    model_config = ConfigDict(json_schema_extra=_tools_rules)

    tools: list[Tool] | None = Field(
        default=None, max_length=128, description="Functions the model may call (a chat only)."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="Default: auto with tools, none without."
    )
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in tools or ()]
        if len(set(names)) != len(names):
            raise PydanticCustomError("duplicate_function_name", "two functions have the same name")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_the_tools(
        cls, choice: str | NamedToolChoice | None, info: ValidationInfo
    ) -> str | NamedToolChoice | None:
        names = [t.function.name for t in info.data.get("tools") or ()]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise PydanticCustomError(
                "tool_choice_not_offered",
                "names {name}, which is not in tools",
                {"name": repr(choice.function.name)},
            )
        if choice not in (None, "none") and not names:
            raise PydanticCustomError(
                "tool_choice_without_tools",
                "tool_choice needs tools (vLLM refuses it without them)",
            )
        return choice

    def tool_parameters(self) -> dict[str, Any]:
        """The tool fields that were given, for the queue message and the store."""
        out: dict[str, Any] = {}
        if not self.tools:
            return out  # no tools: nothing to choose among (``none`` is what happens anyway)
        out["tools"] = [t.model_dump(by_alias=True, exclude_none=True) for t in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            out["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
        if self.parallel_tool_calls is not None:
            out["parallel_tool_calls"] = self.parallel_tool_calls
        return out


# --- native API --------------------------------------------------------------------------------


def _submit_rules(schema: dict[str, Any]) -> None:
    """A prompt or messages, not both; tools with messages only."""
    _tools_rules(schema)
    _rule(
        schema,
        {
            "oneOf": [
                {
                    "properties": {
                        "prompt": {"type": "string"},
                        "messages": NULL,
                        "tools": {"type": ["array", "null"], "maxItems": 0},
                    },
                    "required": ["prompt"],
                },
                {
                    "properties": {"messages": {"type": "array"}, "prompt": NULL},
                    "required": ["messages"],
                },
            ]
        },
    )


class SubmitIn(JsonBody, SamplingIn, SloIn, ToolsIn):
    """A request to queue: a prompt or chat messages, the output cap, sampling, tools (with
    messages) and SLO."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra=_submit_rules)

    model: Name = Field(description="A model some instance serves (GET /v1/models).")
    prompt: Text | None = Field(
        default=None, min_length=1, description="The prompt (or give `messages`)."
    )
    messages: list[ChatMessage] | None = Field(
        default=None, min_length=1, max_length=4096, description="Chat messages (or `prompt`)."
    )
    max_tokens: int = Field(
        ge=1, le=2**31 - 1, description="Most output tokens (<= QLM_API__MAX_TOKENS_LIMIT)."
    )

    def sampling(self) -> dict[str, Any]:
        """The sampling parameters, and the tools (passed to vLLM with them)."""
        return super().sampling() | self.tool_parameters()


class SubmitOut(BaseModel):
    """A request the broker confirmed and the store recorded."""

    id: str = Field(description="The request's id; GET /v1/requests/{id} follows it.")
    object: Literal["request"] = "request"
    status: StatusName = Field(description="`queued` when new.")
    model: str
    submitted_at: float = Field(description="Unix seconds on the control plane's clock.")
    deadline_at: float = Field(description="submitted_at + slo_seconds.")
    at_risk: bool = Field(description="The plan expects the deadline to be missed.")
    replayed: bool = Field(
        description="True when an earlier call with the same Idempotency-Key made it."
    )


class OutputOut(BaseModel):
    text: str = Field(description="The generated text (so far, for a cancelled request).")
    tokens: int = Field(description="Output tokens generated.")
    tool_calls: list[dict[str, Any]] | None = Field(
        default=None, description="The tools the answer called (a chat with `tools`)."
    )


class RequestOut(BaseModel):
    """Everything QLM knows of a request (its prompt excepted)."""

    id: str
    object: Literal["request"] = "request"
    tenant: str
    model: str
    status: StatusName
    tier: TierName
    labels: dict[str, str]
    prompt_tokens: int = Field(description="Estimated prompt length the planner used.")
    max_tokens: int
    slo_seconds: float
    ttft_slo_seconds: float | None
    submitted_at: float = Field(description="Unix seconds.")
    deadline_at: float
    dispatched_at: float | None = Field(description="First sent to an instance.")
    first_token_at: float | None
    finished_at: float | None
    predicted_completion_at: float | None = Field(
        description="The estimator's latest prediction while the request waits or runs."
    )
    at_risk: bool = Field(description="Predicted to miss its deadline.")
    instance: str | None
    cancel_requested: bool
    evictions: int
    swaps: int
    attempts: int
    output: OutputOut | None = Field(description="Set once the request is final.")
    slo_met: bool | None = Field(description="Finished within every deadline; null until final.")
    ttft_met: bool | None
    error: str | None = Field(description="Why it failed.")

    @classmethod
    def of(cls, row: RequestRow) -> RequestOut:
        output = None
        if row.is_final:
            output = OutputOut(
                text=row.output_text or "",
                tokens=row.output_tokens,
                tool_calls=row.output_tool_calls,
            )
        return cls(
            id=row.id,
            tenant=row.tenant,
            model=row.model,
            status=status_name(row.status),
            tier=tier_name(row.tier),
            labels=dict(row.labels),
            prompt_tokens=row.prompt_tokens,
            max_tokens=row.max_tokens,
            slo_seconds=row.slo_e2e_s,
            ttft_slo_seconds=row.slo_ttft_s,
            submitted_at=row.submitted_at,
            deadline_at=row.deadline_at,
            dispatched_at=row.dispatched_at,
            first_token_at=row.first_token_at,
            finished_at=row.finished_at,
            predicted_completion_at=row.predicted_completion_at,
            at_risk=row.at_risk,
            instance=row.instance,
            cancel_requested=row.cancel_requested,
            evictions=row.evictions,
            swaps=row.swaps,
            attempts=row.attempts,
            output=output,
            slo_met=row.slo_met,
            ttft_met=row.ttft_met,
            error=row.error,
        )


class RequestListOut(BaseModel):
    object: Literal["list"] = "list"
    data: list[RequestOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null: last.")


# --- OpenAI-compatible API --------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


ONLY_NULL: dict[str, Any] = {"type": "null"}
"""The JSON schema of a field refused whatever its value."""
Prompt = Annotated[str, AfterValidator(clean_text), JsonSchemaRules(pattern=NO_NUL, minLength=1)]
"""An OpenAI completion's prompt: refused empty by the route (``empty_prompt``)."""


class _OpenAiIn(JsonBody, SamplingIn, SloIn):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Name
    max_tokens: int | None = Field(
        default=None, ge=1, le=2**31 - 1, description="Default: QLM_API__DEFAULT_MAX_TOKENS."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Fields QLM cannot honour are refused by ``unhonoured`` and the routes (a 422 naming
    # them); the schema says which values are accepted.
    n: int | None = Field(
        default=None, description="Only 1 is supported.", json_schema_extra={"enum": [1, None]}
    )
    user: str | None = Field(default=None, max_length=256, description="Ignored.")
    structured_outputs: Any = Field(
        default=None, description="vLLM's; not supported (422).", json_schema_extra=ONLY_NULL
    )
    guided_json: Any = Field(
        default=None, description="vLLM's (old); not supported (422).", json_schema_extra=ONLY_NULL
    )
    guided_regex: Any = Field(
        default=None, description="vLLM's (old); not supported (422).", json_schema_extra=ONLY_NULL
    )
    guided_choice: Any = Field(
        default=None, description="vLLM's (old); not supported (422).", json_schema_extra=ONLY_NULL
    )
    guided_grammar: Any = Field(
        default=None, description="vLLM's (old); not supported (422).", json_schema_extra=ONLY_NULL
    )
    logit_bias: dict[str, Any] | None = Field(
        default=None,
        description="Not supported (422 when set).",
        json_schema_extra={"maxProperties": 0},
    )
    top_logprobs: int | None = Field(
        default=None, description="Not supported (422 when set).", json_schema_extra=ONLY_NULL
    )
    min_tokens: int | None = Field(
        default=None,
        description="vLLM's; not supported (422 unless 0).",
        json_schema_extra={"enum": [0, None]},
    )
    min_p: float | None = Field(
        default=None,
        description="vLLM's; not supported (422 unless 0).",
        json_schema_extra={"enum": [0, None]},
    )
    ignore_eos: bool | None = Field(
        default=None,
        description="vLLM's; not supported (422 when true).",
        json_schema_extra={"enum": [False, None]},
    )
    modalities: list[str] | None = Field(
        default=None,
        description='Only ["text"] is supported.',
        json_schema_extra={"enum": [["text"], None]},
    )
    audio: Any = Field(
        default=None, description="Not supported (422 when set).", json_schema_extra=ONLY_NULL
    )

    def unhonoured(self) -> tuple[str, str] | None:
        """The first field set to something QLM would silently drop: (name, message)."""
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.top_logprobs is not None:
            return "top_logprobs", "top_logprobs is not supported (nor logprobs)"
        if self.min_tokens:
            return "min_tokens", "min_tokens is not supported"
        if self.min_p:
            return "min_p", "min_p is not supported"
        if self.ignore_eos:
            return "ignore_eos", "ignore_eos is not supported"
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities", "only text output is supported"
        if self.audio is not None:
            return "audio", "audio output is not supported"
        return None


GUIDED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""vLLM's own output constraints, refused rather than ignored (``response_format`` is the way)."""


class CompletionIn(_OpenAiIn):
    """OpenAI's ``POST /v1/completions`` body, plus QLM's SLO fields."""

    prompt: Prompt | Annotated[list[Prompt], JsonSchemaRules(minItems=1, maxItems=1)] = Field(
        description="One prompt, not empty (or a list of exactly one)."
    )
    echo: bool | None = Field(
        default=None,
        description="Not supported (422 when true).",
        json_schema_extra={"enum": [False, None]},
    )
    logprobs: int | None = Field(
        default=None, description="Not supported (422 when set).", json_schema_extra=ONLY_NULL
    )
    best_of: int | None = Field(
        default=None, description="Only 1 is supported.", json_schema_extra={"enum": [1, None]}
    )
    suffix: str | None = Field(
        default=None, description="Not supported (422 when set).", json_schema_extra=ONLY_NULL
    )


class ChatCompletionIn(_OpenAiIn, ToolsIn):
    """OpenAI's ``POST /v1/chat/completions`` body, plus QLM's SLO fields."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(
        default=None, ge=1, le=2**31 - 1, description="Same as max_tokens (newer name)."
    )
    logprobs: bool | None = Field(
        default=None,
        description="Not supported (422 when true).",
        json_schema_extra={"enum": [False, None]},
    )
    functions: list[Any] | None = Field(
        default=None, description="Legacy: use tools (422).", json_schema_extra=ONLY_NULL
    )
    function_call: Any = Field(
        default=None, description="Legacy: use tool_choice (422).", json_schema_extra=ONLY_NULL
    )

    def sampling(self) -> dict[str, Any]:
        """The sampling parameters, and the tools (passed to vLLM with them)."""
        return super().sampling() | self.tool_parameters()


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Estimated (about 4 characters per token).")
    completion_tokens: int
    total_tokens: int


class OutcomeOut(BaseModel):
    """QLM's extension of an OpenAI answer (``qlm``): how the request fared against its SLO,
    so that a caller needs no second call to know (``GET /v1/requests/{id}`` has the rest)."""

    request_id: str = Field(description="The request's id in QLM.")
    deadline_at: float = Field(description="Unix seconds: submission + slo_seconds.")
    slo_met: bool | None = Field(
        description="Finished within every deadline (null only if not judged)."
    )
    ttft_met: bool | None = Field(
        description="The first token came within ttft_slo_seconds; null without a TTFT SLO."
    )
    queue_seconds: float | None = Field(
        description="Wait in the queue: submission to first dispatch to an instance (ms "
        "resolution); null if never dispatched."
    )


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionOut(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    qlm: OutcomeOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(
        default=None, description="The tools it called (a chat with `tools`); content may be null."
    )


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionOut(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    qlm: OutcomeOut


class ModelOut(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "qlm"


class ModelListOut(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelOut]


def with_limits(components: dict[str, Any], settings: ApiSettings) -> None:
    """Write the limits that are settings into the bodies' JSON schemas (``components`` of the
    OpenAPI schema), so that the app's schema says what it accepts: ``max_tokens`` (and
    ``max_completion_tokens``) up to ``QLM_API__MAX_TOKENS_LIMIT``, at most
    ``QLM_API__MAX_LABELS`` labels, a prompt of at most 4 characters per token of
    ``QLM_API__MAX_PROMPT_TOKENS`` (``qlm.api.prompts``; chat messages count in sum, which JSON
    Schema cannot say: ``max_prompt_tokens``)."""
    limits = {
        "max_tokens": {"maximum": settings.max_tokens_limit},
        "max_completion_tokens": {"maximum": settings.max_tokens_limit},
        "labels": {"maxProperties": settings.max_labels},
        "prompt": {"maxLength": settings.max_prompt_tokens * CHARS_PER_TOKEN},
    }
    for name in ("SubmitIn", "CompletionIn", "ChatCompletionIn"):
        properties = components.get(name, {}).get("properties", {})
        for field, limit in limits.items():
            schema = properties.get(field)
            if schema is None:
                continue
            for branch in [schema, *schema.get("anyOf", ())]:
                # Each keyword constrains its own type only (maxLength strings, ...): set on
                # the branches where it applies, and on the items of a list of prompts.
                if "maximum" in limit and branch.get("type") == "integer":
                    branch["maximum"] = min(branch.get("maximum", math.inf), limit["maximum"])
                if "maxProperties" in limit and branch.get("type") == "object":
                    branch.update(limit)
                if "maxLength" in limit and branch.get("type") == "string":
                    branch.update(limit)
                if "maxLength" in limit and branch.get("type") == "array":
                    branch.get("items", {}).update(limit)


# --- operator API -----------------------------------------------------------------------------


class GroupOut(BaseModel):
    """One request group in a virtual queue."""

    model_config = ConfigDict(extra="allow")

    id: str
    model: str
    size: int = Field(description="Requests in the group.")
    tier: str
    slo_class: str | None = None
    earliest_deadline_at: float | None = None
    latest_deadline_at: float | None = None
    predicted_completion_at: float | None = None
    p_meet_slo: float | None = Field(default=None, description="P(group meets its SLO).")
    at_risk: bool = Field(
        default=False, description="Predicted to miss its SLO (P(meet SLO) below the planner's Δ)."
    )
    missed: int | None = Field(
        default=None,
        description="Its requests already past their deadline when the state was published.",
    )
    tenants: dict[str, int] | None = Field(
        default=None, description="Its requests per tenant, most first."
    )
    instance: str | None = Field(default=None, description="The virtual queue holding it.")
    position: int | None = Field(default=None, description="0 = the head of its queue.")


class VirtualQueueOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    instance: str
    predicted_drain_at: float | None = None
    size: int = Field(description="Requests in the queue (the sum of its groups).")
    at_risk_requests: int = Field(description="Requests of its groups at risk.")
    missed_requests: int = Field(
        default=0, description="Requests already past their deadline (their groups are at risk)."
    )
    groups: list[GroupOut]


class QueuesOut(BaseModel):
    controller: str | None = Field(description="The controller that published this state.")
    at: float | None = Field(description="When it was published (unix seconds).")
    policy: str | None = None
    queues: list[VirtualQueueOut]


class GroupsOut(BaseModel):
    controller: str | None
    at: float | None
    data: list[GroupOut]


class RequestBriefOut(BaseModel):
    """A request as an operator scans it in a list: who, when due, where it is."""

    id: str
    tenant: str
    model: str
    tier: TierName
    status: StatusName
    submitted_at: float
    deadline_at: float
    dispatched_at: float | None
    first_token_at: float | None
    predicted_completion_at: float | None
    at_risk: bool = Field(description="Predicted to miss its deadline.")
    missed: bool = Field(
        description="Past its deadline and not final yet, or final without meeting its SLO."
    )
    instance: str | None
    tokens: int = Field(description="Output tokens generated so far (all of them once final).")
    evictions: int

    @classmethod
    def of(cls, row: RequestRow, now: float) -> RequestBriefOut:
        return cls(
            id=row.id,
            tenant=row.tenant,
            model=row.model,
            tier=tier_name(row.tier),
            status=status_name(row.status),
            submitted_at=row.submitted_at,
            deadline_at=row.deadline_at,
            dispatched_at=row.dispatched_at,
            first_token_at=row.first_token_at,
            predicted_completion_at=row.predicted_completion_at,
            at_risk=row.at_risk,
            missed=row.slo_met is False if row.is_final else now > row.deadline_at,
            instance=row.instance,
            tokens=row.output_tokens if row.is_final else row.partial_tokens,
            evictions=row.evictions,
        )


class GroupDetailOut(BaseModel):
    """One group and the requests it holds, as the controller last published them."""

    controller: str | None
    at: float | None = Field(description="When the state was published (unix seconds).")
    group: GroupOut
    requests: list[RequestBriefOut] = Field(
        description="Its requests in FCFS order (the first ``listed`` of them, as the store has them)."
    )
    listed: int = Field(
        description="How many of its requests the controller named: all of them unless its "
        "queues held more than 5,000 requests."
    )


class RunningOut(BaseModel):
    """The requests one instance runs."""

    instance: str
    max_running: int | None = Field(description="Its concurrency limit.")
    requests: list[RequestBriefOut]


class RunningListOut(BaseModel):
    controller: str | None
    at: float | None = Field(description="When the state was published (unix seconds).")
    data: list[RunningOut]


class InstanceOut(BaseModel):
    name: str
    url: str
    gpu: str
    gpu_count: int
    models: list[str]
    state: Literal["up", "down", "draining"] = Field(description="As recorded in the store.")
    tiers: dict[str, Literal["active", "warm", "cold"]] = Field(
        description="Where each model's weights are."
    )
    active_model: str | None = None
    outstanding: int | None = Field(default=None, description="Requests it runs now.")
    max_running: int | None = None
    up: bool | None = Field(default=None, description="The controller's latest health check.")
    updated_at: float


class InstancesOut(BaseModel):
    object: Literal["list"] = "list"
    data: list[InstanceOut]


class PlanOut(BaseModel):
    """One planning event and why it happened."""

    id: int
    controller: str
    at: float
    trigger: str = Field(description="Why the planner ran (violation, instance change, ...).")
    groups: int
    status: str = Field(description="Solver status (optimal, timeout, infeasible, ...).")
    method: str = Field(description="milp, or the heuristic it fell back to.")
    objective: float = Field(description="Expected weighted SLO violation of the plan.")
    edf_objective: float = Field(description="The same for plain EDF: what planning gained.")
    at_risk: list[str] = Field(description="Groups expected to miss their SLO anyway.")
    capacity_needed: float | None = Field(
        description="Fleet multiple needed to meet every SLO (null: beyond what was searched)."
    )
    solve_s: float
    evaluations: int
    concurrency: dict[str, int]
    deferred: int = Field(
        default=0,
        description="Groups cost-aware admission put behind the others (served as capacity allows).",
    )


class PlansOut(BaseModel):
    object: Literal["list"] = "list"
    data: list[PlanOut]


class ControllerOut(BaseModel):
    name: str
    active: bool
    updated_at: float
    age_s: float = Field(description="Seconds since it last published its state.")
    stopped_at: float | None = Field(
        default=None, description="When it stopped cleanly; null while it runs (or if it died)."
    )


class ControllersOut(BaseModel):
    object: Literal["list"] = "list"
    data: list[ControllerOut]


class SloBucketOut(BaseModel):
    start: float = Field(description="Submitted at or after (unix seconds).")
    end: float = Field(description="Submitted before (unix seconds).")
    requests: int
    finished: int
    failed: int
    cancelled: int
    pending: int = Field(description="Not final yet: queued or running.")
    slo_met: int
    attainment: float | None = Field(
        description="slo_met / (finished + failed): failures count as misses, cancelled and "
        "pending requests are left out; null when none is decided."
    )


class AttainmentOut(BaseModel):
    object: Literal["list"] = "list"
    step: float = Field(description="Seconds per bucket (the last may be shorter).")
    data: list[SloBucketOut] = Field(description="Every bucket, oldest first, empty ones too.")


class CheckOut(BaseModel):
    ok: bool
    detail: str


class ReadyOut(BaseModel):
    status: Literal["ready", "unavailable"]
    checks: dict[str, CheckOut] = Field(description="broker, store, controller")


class HealthOut(BaseModel):
    status: Literal["ok"] = "ok"
