"""What the API's bodies share: text and identifier rules, tiers and statuses by name, the
JSON nesting bound, chat messages and tools, structured output (``response_format``), sampling and
SLO fields; and ``with_limits``, which writes the limits that are settings into the bodies' JSON
schemas."""

from __future__ import annotations

import copy
import functools
import json
import math
from typing import Annotated, Any, Literal, get_args

from fastapi import Path
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    PlainSerializer,
    ValidationInfo,
    WrapSerializer,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

from qlm.api.prompts import CHARS_PER_TOKEN
from qlm.domain import MAX_API_SLO_S, MIN_SLO_S, RequestStatus, Tier
from qlm.settings import ApiSettings
from qlm.structured import schema_problem

TierName = Literal["interactive", "standard", "batch"]
StatusName = Literal["queued", "running", "finished", "failed", "cancelled"]


def clean_text(value: str) -> str:
    """Text the store can keep on every backend: no NUL character, valid Unicode."""
    if "\x00" in value:
        raise ValueError("must not contain the NUL character (\\u0000)")
    if not value.isascii():  # ASCII text has no surrogate
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
    tier = _TIER_OF.get(name)
    return tier if tier is not None else Tier.parse(name)


_TIER_OF: dict[str, Tier] = {name: Tier.parse(name) for name in get_args(TierName)}


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


def add_rule(schema: dict[str, Any], rule: dict[str, Any]) -> None:
    """Add ``rule`` to a model's JSON schema (every rule must hold)."""
    schema.setdefault("allOf", []).append(copy.deepcopy(rule))


NULL = {"type": "null"}
NOT_NULL = {"not": NULL}


def _message_rules(schema: dict[str, Any]) -> None:
    """``ChatMessage``'s validator as JSON Schema, one branch per role."""
    add_rule(
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
    add_rule(
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
        response format is the default: left out). Given only as numbers and strings (the
        usual call), they are read off the model as they are, which is what ``model_dump``
        makes of them (a test compares both); anything else takes ``model_dump``."""
        names = _plain_sampling_fields(type(self))
        if names is None:
            return self._dumped_sampling()
        values = self.__dict__
        out: dict[str, Any] = {}
        for name in names:
            value = values[name]
            if value is not None:
                if type(value) not in _PLAIN:
                    return self._dumped_sampling()
                out[name] = value
        return out

    def _dumped_sampling(self) -> dict[str, Any]:
        out = self.model_dump(include=_sampling_fields(), exclude_none=True, by_alias=True)
        if out.get("response_format") == {"type": "text"}:
            del out["response_format"]
        return out


_PLAIN = frozenset({float, int, str, bool})
"""Types whose values ``model_dump`` returns as they are."""


@functools.cache
def _sampling_fields() -> set[str]:
    """``SamplingIn``'s fields (a set made once: building it per call cost half of
    ``sampling``)."""
    return set(SamplingIn.model_fields)


@functools.cache
def _plain_sampling_fields(model: type[SamplingIn]) -> tuple[str, ...] | None:
    """``SamplingIn``'s fields in the order ``model_dump`` writes them for ``model``; None
    (every call takes ``model_dump``) when ``model`` may write one of them otherwise than as
    it is: an alias, an exclusion, a serializer."""
    names = tuple(name for name in model.model_fields if name in _sampling_fields())
    decorators = model.__pydantic_decorators__
    if decorators.field_serializers or decorators.model_serializers:
        return None
    for name in names:
        info = model.model_fields[name]
        if info.alias or info.serialization_alias or info.exclude:
            return None
        if any(isinstance(m, PlainSerializer | WrapSerializer) for m in info.metadata):
            return None
    return names


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


def tools_rules(schema: dict[str, Any]) -> None:
    """A ``tool_choice`` other than ``none`` needs tools. (That a named choice names one of
    them, and that no two have one name, JSON Schema cannot say: codes
    ``tool_choice_not_offered``, ``duplicate_function_name``.)"""
    add_rule(
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

    model_config = ConfigDict(json_schema_extra=tools_rules)

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
