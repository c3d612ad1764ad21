"""The wire format of the vLLM-compatible server (``qlm.engines.server``): the request bodies
as vLLM 0.32 reads them (``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``), as far as
the simulation honours them, and how each endpoint words its answer (``AnswerFormat``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaBody(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class ResponseFormatBody(BaseModel):
    """OpenAI's ``response_format``, as vLLM reads it."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaBody | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormatBody:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self


class GenerationBody(BaseModel):
    """The fields of both endpoints that the simulation honours; others are accepted and
    ignored (sampling parameters do not change a simulated output). A ``response_format``
    makes the answer a JSON document of its schema (``qlm.structured``)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    ignore_eos: bool = False
    response_format: ResponseFormatBody | None = None
    return_token_ids: bool | None = False

    def sampling(self) -> tuple[tuple[str, Any], ...]:
        """What the simulated engine honours of the sampling parameters: the format, and a
        chat's tools (``qlm.structured.planned_call``)."""
        out: list[tuple[str, Any]] = []
        if self.response_format is not None:
            fmt = self.response_format.model_dump(by_alias=True, exclude_none=True)
            out.append(("response_format", fmt))
        extra = self.model_extra or {}
        for name in ("tools", "tool_choice"):
            if extra.get(name) is not None:
                out.append((name, extra[name]))
        return tuple(out)


class CompletionBody(GenerationBody):
    """vLLM's ``CompletionRequest``, as far as simulated: ``max_tokens`` null is its default,
    16, as in vLLM 0.32."""

    prompt: str | list[Annotated[int, Field(ge=0)]]
    max_tokens: int | None = 16

    @model_validator(mode="after")
    def _default_max_tokens(self) -> CompletionBody:
        if self.max_tokens is None:
            self.max_tokens = 16
        return self


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The message's string, or its text parts joined."""
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


def chat_text(messages: Sequence[ChatMessage]) -> str:
    """A chat as this server's model reads it: its messages' text, joined by spaces (no chat
    template: module docstring)."""
    return " ".join(m.text() for m in messages)


class ChatBody(GenerationBody):
    """vLLM's ``ChatCompletionRequest``, as far as simulated: ``max_completion_tokens`` wins over
    the deprecated ``max_tokens``; with neither, the rest of the context (as in vLLM)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_way_to_end_the_prompt(self) -> ChatBody:
        if self.continue_final_message and self.add_generation_prompt:  # as vLLM, in its words
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        return self

    def role(self) -> str:
        """The role of the answer (vLLM's ``get_chat_request_role``): the assistant's, or, when
        the last message is continued, that message's."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def rendered(self) -> str:
        return chat_text(self.messages)

    def output_limit(self) -> tuple[int | None, str]:
        """``max_completion_tokens``, else the deprecated ``max_tokens``, and its name."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def message_dicts(self) -> tuple[dict[str, Any], ...]:
        return tuple(m.model_dump(exclude_none=True) for m in self.messages)


class TokenizeBody(BaseModel):
    """vLLM's ``TokenizeRequest``: a prompt, or a chat (rendered as ``ChatBody`` renders it)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeBody:
        if self.prompt is None and self.messages is None:
            raise ValueError("either prompt or messages is required")
        return self

    def text(self) -> str:
        return self.prompt if self.prompt is not None else chat_text(self.messages or ())


@dataclass(frozen=True, slots=True)
class AnswerFormat:
    """How an endpoint words its answer: id prefix, object names, choices. ``role`` is set for a
    chat: its answer is a message, streamed as deltas after one that announces the role.

    Token ids (``return_token_ids``; ``None`` without it, as vLLM sends them) go where vLLM 0.32
    puts them: a completion's choice has ``token_ids`` and ``prompt_token_ids`` (a stream's first
    chunk only); a chat's choice has ``token_ids`` and its answer (or its stream's first chunk,
    the role's) has ``prompt_token_ids`` at the top level."""

    id_prefix: str
    answer_object: str
    chunk_object: str
    role: str | None = None

    def choice(
        self,
        text: str,
        finish: str | None,
        *,
        stream: bool,
        calls: Sequence[Mapping[str, Any]] = (),
        token_ids: Sequence[int] | None = None,
        prompt_ids: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """One choice; a chat's tool calls (whole, or a stream's deltas) replace its content."""
        out: dict[str, Any] = {"index": 0}
        ids = None if token_ids is None else list(token_ids)
        if self.role is None:
            out |= {"text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            prompt = None if prompt_ids is None else list(prompt_ids)
            if stream:
                return out | {"prompt_token_ids": prompt, "token_ids": ids}
            return out | {"token_ids": ids, "prompt_logprobs": None, "prompt_token_ids": prompt}
        if stream:
            out["delta"] = {"tool_calls": list(calls)} if calls else {"content": text}
        elif calls:
            out["message"] = {"role": self.role, "content": None, "tool_calls": list(calls)}
        else:
            out["message"] = {"role": self.role, "content": text}
        out |= {"logprobs": None, "finish_reason": finish}
        if finish is not None or not stream:  # (a chat stream says it on its last chunk only)
            out["stop_reason"] = None
        return out | {"token_ids": ids}

    def opening(self) -> dict[str, Any] | None:
        """A chat stream's first choice, before any token: the role and empty content."""
        if self.role is None:
            return None
        delta = {"role": self.role, "content": ""}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}


COMPLETION = AnswerFormat("cmpl-", "text_completion", "text_completion")


def chat_format(role: str) -> AnswerFormat:
    return AnswerFormat("chatcmpl-", "chat.completion", "chat.completion.chunk", role)
