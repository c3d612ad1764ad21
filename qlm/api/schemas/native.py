"""The native API's bodies (``POST /v1/requests``, ``GET /v1/requests/...``): unknown fields are
refused (a typo gets a 422 naming it); ``RequestOut.of`` shapes a stored row for the client."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from qlm.api.schemas.common import (
    NULL,
    ChatMessage,
    JsonBody,
    Name,
    SamplingIn,
    SloIn,
    StatusName,
    Text,
    TierName,
    ToolsIn,
    add_rule,
    status_name,
    tier_name,
    tools_rules,
)
from qlm.store import RequestRow


def _submit_rules(schema: dict[str, Any]) -> None:
    """A prompt or messages, not both; tools with messages only."""
    tools_rules(schema)
    add_rule(
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
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        le=2**31 - 1,
        description="Most output tokens (<= QLM_API__MAX_TOKENS_LIMIT); default: "
        "QLM_API__DEFAULT_MAX_TOKENS, as on the OpenAI endpoints.",
    )

    def sampling(self) -> dict[str, Any]:
        """The sampling parameters, and the tools (passed to vLLM with them)."""
        out = super().sampling()
        if self.tools:  # without tools there are no tool parameters
            out.update(self.tool_parameters())
        return out


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
    missed: bool = Field(
        description="Its deadline passed without it finishing: final without meeting its SLO, "
        "or not final yet (it can no longer meet it)."
    )
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
    def of(cls, row: RequestRow, now: float) -> RequestOut:
        """``row`` as answered at ``now`` (the API's clock: whether it is missed yet)."""
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
            missed=row.missed(now),
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
