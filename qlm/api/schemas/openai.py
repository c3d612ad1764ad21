"""The OpenAI-compatible API's bodies (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``): fields QLM does not use are ignored, as OpenAI-compatible servers do; those whose
meaning it cannot honour (``n`` > 1, ``logprobs``, ...) are refused, naming them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from qlm.api.schemas.common import (
    NO_NUL,
    ChatMessage,
    JsonBody,
    JsonSchemaRules,
    Name,
    SamplingIn,
    SloIn,
    ToolCall,
    ToolsIn,
    clean_text,
)


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
        out = super().sampling()
        if self.tools:  # without tools there are no tool parameters
            out.update(self.tool_parameters())
        return out


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
