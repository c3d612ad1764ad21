"""OpenAI-compatible endpoints, so that existing clients work unchanged: ``/v1/completions``,
``/v1/chat/completions`` (streaming and not) and ``/v1/models``.

A call is queued like any other request and answered when its result is in (or streamed as it is
generated when the controller runs in this process; otherwise the text comes in one piece when
final). QLM's SLO metadata rides in extra body fields (``slo_seconds``, ``ttft_slo_seconds``,
``tier``, ``labels``) or headers (``x-qlm-slo-seconds``, ``x-qlm-ttft-slo-seconds``,
``x-qlm-tier``, llm-d's ``x-llm-d-slo-ttft-ms``); a body field wins over its header.

An answer says how the request fared, so that a caller needs no second call: headers
(``x-qlm-request-id``, ``x-qlm-deadline-at``, ``x-qlm-slo-met``, ``x-qlm-ttft-met``,
``x-qlm-queue-seconds``) and a ``qlm`` object in the body (``outcome``). A stream's headers go
out before the request is served, so they carry only what is known then (its id and deadline);
its last chunk before ``[DONE]`` carries the ``qlm`` object.

A client that disconnects before its result cancels the request (as vLLM aborts one), since no
one will read it. A wait longer than ``QLM_API__WAIT_TIMEOUT_S`` answers 504 naming the request
id (it keeps running; ``GET /v1/requests/{id}`` has it) with ``x-should-retry: false`` so that
OpenAI's clients do not submit it again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.responses import JSONResponse

from qlm.api import sse
from qlm.api.context import ApiContext
from qlm.api.deps import ContextDep, JsonBodyDep, PrincipalDep
from qlm.api.errors import (
    CONFLICT,
    TIMEOUT,
    UPSTREAM,
    ApiError,
    documented,
    invalid,
    not_found,
)
from qlm.api.intake import Submission, admit
from qlm.api.results import Chunk, Final, Restart
from qlm.api.routes.requests import EventStream, IdempotencyKey, cancel
from qlm.api.schemas.common import ModelPath, TierName, tier_of
from qlm.api.schemas.openai import (
    GUIDED,
    ChatCompletionIn,
    ChatCompletionOut,
    CompletionIn,
    CompletionOut,
    ModelListOut,
    ModelOut,
)
from qlm.domain import MAX_API_SLO_S, MIN_SLO_S, RequestStatus
from qlm.store import RequestRow

router = APIRouter(prefix="/v1", tags=["openai"])

NO_RETRY = {"x-should-retry": "false"}


@dataclass(frozen=True, slots=True)
class SloHeaders:
    slo_s: float | None
    ttft_s: float | None
    ttft_param: str
    tier: TierName | None


async def slo_headers(
    slo_seconds: Annotated[
        float | None,
        Header(
            alias="x-qlm-slo-seconds",
            ge=MIN_SLO_S,
            le=MAX_API_SLO_S,
            allow_inf_nan=False,
            description="End-to-end SLO (s).",
        ),
    ] = None,
    ttft_slo_seconds: Annotated[
        float | None,
        Header(
            alias="x-qlm-ttft-slo-seconds",
            ge=MIN_SLO_S,
            le=MAX_API_SLO_S,
            allow_inf_nan=False,
            description="TTFT SLO (s).",
        ),
    ] = None,
    tier: Annotated[
        TierName | None, Header(alias="x-qlm-tier", description="interactive, standard, batch.")
    ] = None,
    llmd_ttft_ms: Annotated[
        float | None,
        Header(
            alias="x-llm-d-slo-ttft-ms",
            ge=MIN_SLO_S * 1000,
            le=MAX_API_SLO_S * 1000,
            allow_inf_nan=False,
            description="llm-d's TTFT SLO in milliseconds (x-qlm-ttft-slo-seconds wins).",
        ),
    ] = None,
) -> SloHeaders:
    if ttft_slo_seconds is not None:
        return SloHeaders(slo_seconds, ttft_slo_seconds, "x-qlm-ttft-slo-seconds", tier)
    if llmd_ttft_ms is not None:
        return SloHeaders(slo_seconds, llmd_ttft_ms / 1000.0, "x-llm-d-slo-ttft-ms", tier)
    return SloHeaders(slo_seconds, None, "x-qlm-ttft-slo-seconds", tier)


SloHeadersDep = Annotated[SloHeaders, Depends(slo_headers)]


def _submission(
    ctx: ApiContext,
    body: CompletionIn | ChatCompletionIn,
    headers: SloHeaders,
    *,
    prompt: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    max_tokens: int | None = None,
) -> Submission:
    if body.n not in (None, 1):
        raise invalid("n", "only n=1 is supported", code="unsupported")
    for name in GUIDED:  # constraints QLM would otherwise drop without a word
        if getattr(body, name) is not None:
            raise invalid(name, f"{name} is not supported: use response_format", code="unsupported")
    dropped = body.unhonoured()
    if dropped is not None:
        raise invalid(dropped[0], dropped[1], code="unsupported")
    tier = body.tier if body.tier is not None else headers.tier
    return Submission(
        model=body.model,
        max_tokens=max_tokens or ctx.settings.default_max_tokens,
        prompt=prompt,
        messages=messages,
        sampling=body.sampling(),
        slo_s=body.slo_seconds if body.slo_seconds is not None else headers.slo_s,
        ttft_slo_s=body.ttft_slo_seconds if body.ttft_slo_seconds is not None else headers.ttft_s,
        tier=tier_of(tier) if tier is not None else None,
        labels=body.labels or {},
        slo_param="slo_seconds" if body.slo_seconds is not None else "x-qlm-slo-seconds",
        ttft_param="ttft_slo_seconds" if body.ttft_slo_seconds is not None else headers.ttft_param,
    )


def finish_reason(row: RequestRow) -> str:
    """``length`` when ``max_tokens`` came out (a call cut there is not a call to make), else
    ``tool_calls`` when the answer called tools — ``stop`` under a named ``tool_choice``, as
    vLLM and OpenAI answer — else ``stop``."""
    if row.output_tokens >= row.max_tokens:
        return "length"
    if row.output_tool_calls and not isinstance(row.sampling.get("tool_choice"), dict):
        return "tool_calls"
    return "stop"


def assistant_message(row: RequestRow) -> dict[str, Any]:
    """A chat answer: its text, or (content null when it wrote none) the tools it called."""
    calls = row.output_tool_calls
    if not calls:
        return {"role": "assistant", "content": row.output_text or ""}
    return {"role": "assistant", "content": row.output_text or None, "tool_calls": calls}


def usage(row: RequestRow) -> dict[str, int]:
    return {
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.output_tokens,
        "total_tokens": row.prompt_tokens + row.output_tokens,
    }


def outcome(row: RequestRow) -> dict[str, Any]:
    """The ``qlm`` object of a final answer (``OutcomeOut``): its id, deadline, whether it met
    its SLOs, and how long it waited in the queue (to its first dispatch, to the millisecond;
    hosts' clocks may differ by a little, so never below 0)."""
    queue_s = None
    if row.dispatched_at is not None:
        queue_s = round(max(0.0, row.dispatched_at - row.submitted_at), 3)
    return {
        "request_id": row.id,
        "deadline_at": row.deadline_at,
        "slo_met": row.slo_met,
        "ttft_met": row.ttft_met,
        "queue_seconds": queue_s,
    }


def start_headers(row: RequestRow) -> dict[str, str]:
    """What an answer's headers can say before the request is served: its id and deadline."""
    return {"x-qlm-request-id": row.id, "x-qlm-deadline-at": repr(row.deadline_at)}


def outcome_headers(row: RequestRow) -> dict[str, str]:
    """A final answer's headers: ``outcome`` as ``x-qlm-*`` (the body's names, dashed); one
    whose value is null (no TTFT SLO, never dispatched) is left out."""
    headers = start_headers(row)
    found = outcome(row)
    for key in ("slo_met", "ttft_met"):
        if found[key] is not None:
            headers["x-qlm-" + key.replace("_", "-")] = "true" if found[key] else "false"
    if found["queue_seconds"] is not None:
        headers["x-qlm-queue-seconds"] = repr(found["queue_seconds"])
    return headers


def restarted_error(row: RequestRow, *, evicted: bool = False) -> ApiError:
    """A stream whose text is not the start of the answer: another controller took the request
    over after this one had streamed part of it (a failover) and wrote its own answer, or
    (``evicted``) a structured answer went back to the queue and starts over. The text already
    sent cannot be taken back; the client is told to read the result."""
    why = (
        "was interrupted after this stream began and its answer, which cannot be continued "
        "(structured output, tool calls, or only whitespace so far), is generated again"
        if evicted
        else "was taken over by another controller after this stream began, and its answer "
        "differs from the text streamed"
    )
    return ApiError(
        502,
        f"request {row.id} {why}: read it with GET /v1/requests/{row.id}",
        type=UPSTREAM,
        code="stream_restarted",
        headers={**NO_RETRY, "x-qlm-request-id": row.id},
    )


def outcome_error(row: RequestRow, waited_s: float, timed_out: bool) -> ApiError | None:
    """The error a final row that is not a result turns into (None: it is a result)."""
    if timed_out:
        return ApiError(
            504,
            f"request {row.id} is still {row.status.name.lower()} after {waited_s:g} s "
            f"(QLM_API__WAIT_TIMEOUT_S); it goes on: GET /v1/requests/{row.id}",
            type=TIMEOUT,
            param=None,
            code="wait_timeout",
            headers={**NO_RETRY, "x-qlm-request-id": row.id},
        )
    if row.status is RequestStatus.FAILED:
        return ApiError(
            502,
            f"request {row.id} failed: {row.error or 'unknown error'}",
            type=UPSTREAM,
            code="request_failed",
            headers={**NO_RETRY, "x-qlm-request-id": row.id},
        )
    if row.status is RequestStatus.CANCELLED:
        return ApiError(
            409,
            f"request {row.id} was cancelled",
            type=CONFLICT,
            code="cancelled",
            headers={**NO_RETRY, "x-qlm-request-id": row.id},
        )
    return None


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read already, so only that comes)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def wait_result(ctx: ApiContext, request: Request, row: RequestRow) -> Final | None:
    """The final row, or None when the client left first (the request is then cancelled)."""
    waiter = asyncio.ensure_future(ctx.results.wait(row, ctx.settings.wait_timeout_s))
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if waiter in done:
            return waiter.result()
        ctx.spawn(cancel(ctx, row.id), name="qlm-api-cancel-abandoned")
        return None
    finally:
        for task in (waiter, watcher):
            if not task.done():
                task.cancel()


async def _stream(
    ctx: ApiContext, row: RequestRow, *, chat: bool, include_usage: bool, model: str
) -> AsyncIterator[bytes]:
    """OpenAI's streaming format: ``data: {chunk}`` events, then ``data: [DONE]``."""
    ident = ("chatcmpl-" if chat else "cmpl-") + row.id
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    def chunk(
        text: str | None,
        reason: str | None = None,
        *,
        role: bool = False,
        calls: list[dict[str, Any]] | None = None,
        qlm: dict[str, Any] | None = None,
    ) -> bytes:
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if calls:  # whole, each with its index (OpenAI's deltas of one chunk)
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": reason,
            }
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        body: dict[str, Any] = {
            "id": ident,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if include_usage:
            body["usage"] = None
        if qlm is not None:
            body["qlm"] = qlm
        return sse.event(body)

    completed = False
    sent = ""
    try:
        if chat:
            yield chunk("", role=True)
        events = ctx.results.events(row, ctx.settings.wait_timeout_s)
        async for event in sse.with_keepalive(events):
            if event is None:
                yield sse.KEEPALIVE
            elif isinstance(event, Chunk):
                sent += event.text
                yield chunk(event.text)
            elif isinstance(event, Restart | Final):
                error = None
                if isinstance(event, Restart):
                    if not sent:
                        continue  # nothing shown yet: the answer can still stream whole
                    error = restarted_error(row, evicted=True)
                    completed = True  # the request goes on; the client reads it later
                else:
                    final = event.row
                    error = outcome_error(final, ctx.settings.wait_timeout_s, event.timed_out)
                    if error is None and not (final.output_text or "").startswith(sent):
                        error = restarted_error(final)
                if error is not None:
                    yield sse.event(
                        {
                            "error": {
                                "message": error.message,
                                "type": error.type,
                                "param": error.param,
                                "code": error.code,
                            }
                        }
                    )
                else:
                    text = final.output_text or ""
                    rest = text[len(sent) :] if text.startswith(sent) else ""
                    if rest:
                        yield chunk(rest)
                    if chat and final.output_tool_calls:
                        yield chunk(None, calls=final.output_tool_calls)
                    # The outcome rides on the last chunk: the usage chunk when there is one.
                    fared = outcome(final)
                    reason = finish_reason(final)
                    yield chunk(None if chat else "", reason, qlm=None if include_usage else fared)
                    if include_usage:
                        yield sse.event(
                            {
                                "id": ident,
                                "object": obj,
                                "created": created,
                                "model": model,
                                "choices": [],
                                "usage": usage(final),
                                "qlm": fared,
                            }
                        )
                break
        yield b"data: [DONE]\n\n"
        completed = True
    finally:
        if not completed:  # the client went away mid-stream: nobody will read the rest
            ctx.spawn(cancel(ctx, row.id), name="qlm-api-cancel-abandoned")


def _header(description: str) -> dict[str, Any]:
    return {"description": description, "schema": {"type": "string"}}


_RESPONSES = {
    200: {
        "description": "The result; with `stream: true`, server-sent events in OpenAI's "
        "streaming format ending with `data: [DONE]`, the last chunk before it carrying `qlm`.",
        "content": {"text/event-stream": {}},
        "headers": {
            "x-qlm-request-id": _header("The request's id in QLM."),
            "x-qlm-deadline-at": _header("Unix seconds: submission + slo_seconds."),
            "x-qlm-slo-met": _header(
                "`true` or `false`: finished within every deadline (not on a stream)."
            ),
            "x-qlm-ttft-met": _header(
                "`true` or `false`: first token within ttft_slo_seconds (absent without a "
                "TTFT SLO, and on a stream)."
            ),
            "x-qlm-queue-seconds": _header(
                "Submission to first dispatch, seconds (absent if never dispatched, and on a "
                "stream)."
            ),
        },
    },
    **documented(400, 401, 404, 409, 413, 415, 422, 429, 502, 503, 504),
}


@router.post(
    "/completions",
    dependencies=[JsonBodyDep],
    response_model=CompletionOut,
    responses=_RESPONSES,
    summary="Create a completion (OpenAI-compatible)",
)
async def create_completion(
    body: CompletionIn,
    request: Request,
    ctx: ContextDep,
    principal: PrincipalDep,
    headers: SloHeadersDep,
    idempotency_key: IdempotencyKey = None,
) -> Response:
    """OpenAI's completions, behind QLM's queue. Deviations: one prompt and n=1 only; no
    logprobs, echo, suffix or best_of > 1; usage counts prompt tokens by estimate."""
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise invalid("prompt", "exactly one prompt per request", code="unsupported")
        prompt = prompt[0]
    if not prompt:
        raise invalid("prompt", "prompt must not be empty", code="empty_prompt")
    if body.echo:
        raise invalid("echo", "echo is not supported", code="unsupported")
    for name, value in (("logprobs", body.logprobs), ("suffix", body.suffix)):
        if value is not None:  # (logprobs: 0 asks for the chosen token's: set too)
            raise invalid(name, f"{name} is not supported", code="unsupported")
    if body.best_of not in (None, 1):
        raise invalid("best_of", "only best_of=1 is supported", code="unsupported")
    submission = _submission(ctx, body, headers, prompt=prompt, max_tokens=body.max_tokens)
    answer = await _answer(ctx, request, principal, submission, idempotency_key, body, chat=False)
    if isinstance(answer, Response):
        return answer
    done = answer
    out = {
        "id": "cmpl-" + done.id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {
                "index": 0,
                "text": done.output_text or "",
                "logprobs": None,
                "finish_reason": finish_reason(done),
            }
        ],
        "usage": usage(done),
        "qlm": outcome(done),
    }
    return JSONResponse(out, headers=outcome_headers(done))


async def _answer(
    ctx: ApiContext,
    request: Request,
    principal: Any,
    submission: Any,
    idempotency_key: str | None,
    body: Any,
    *,
    chat: bool,
) -> Response | RequestRow:
    """Both OpenAI endpoints after validation: queue the request, then stream it, or wait
    behind the queue and return its final row (a failed or timed-out one raises)."""
    admitted = await admit(ctx, principal, submission, idempotency_key)
    row = admitted.accepted.row
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(
            _stream(ctx, row, chat=chat, include_usage=include, model=body.model),
            headers={**sse.HEADERS, **start_headers(row)},
        )
    final = await wait_result(ctx, request, row)
    if final is None:
        return Response(status_code=499)
    error = outcome_error(final.row, ctx.settings.wait_timeout_s, final.timed_out)
    if error is not None:
        raise error
    return final.row


@router.post(
    "/chat/completions",
    dependencies=[JsonBodyDep],
    response_model=ChatCompletionOut,
    responses=_RESPONSES,
    summary="Create a chat completion (OpenAI-compatible)",
)
async def create_chat_completion(
    body: ChatCompletionIn,
    request: Request,
    ctx: ContextDep,
    principal: PrincipalDep,
    headers: SloHeadersDep,
    idempotency_key: IdempotencyKey = None,
) -> Response:
    """OpenAI's chat completions, behind QLM's queue; the messages reach vLLM's chat endpoint,
    which applies the model's chat template (docs/api.md). Deviations: n=1 only; no
    logprobs; tool calls come whole at the end of a stream."""
    if body.logprobs:
        raise invalid("logprobs", "logprobs is not supported", code="unsupported")
    if body.functions is not None or body.function_call is not None:
        name = "functions" if body.functions is not None else "function_call"
        raise invalid(name, f"{name} (legacy) is not supported: use tools", code="unsupported")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    submission = _submission(
        ctx,
        body,
        headers,
        messages=messages,
        max_tokens=body.max_completion_tokens or body.max_tokens,
    )
    answer = await _answer(ctx, request, principal, submission, idempotency_key, body, chat=True)
    if isinstance(answer, Response):
        return answer
    done = answer
    out = {
        "id": "chatcmpl-" + done.id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {
                "index": 0,
                "message": assistant_message(done),
                "logprobs": None,
                "finish_reason": finish_reason(done),
            }
        ],
        "usage": usage(done),
        "qlm": outcome(done),
    }
    return JSONResponse(out, headers=outcome_headers(done))


@router.get(
    "/models",
    response_model=ModelListOut,
    responses=documented(401, 503),
    summary="List served models (OpenAI-compatible)",
)
async def list_models(ctx: ContextDep, principal: PrincipalDep) -> ModelListOut:
    """Every model some known instance serves."""
    models = await ctx.control.models()
    return ModelListOut(data=[ModelOut(id=m) for m in sorted(models)])


@router.get(
    "/models/{model:path}",
    response_model=ModelOut,
    responses=documented(401, 404, 503),
    summary="Describe a served model (OpenAI-compatible)",
)
async def get_model(model: ModelPath, ctx: ContextDep, principal: PrincipalDep) -> ModelOut:
    if model not in await ctx.control.models():
        raise not_found(f"model {model!r}", "model", code="model_not_found")
    return ModelOut(id=model)
