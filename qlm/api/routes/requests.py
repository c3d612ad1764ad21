"""The native API: submit, read, list, cancel, and wait for or stream a request's result."""

from __future__ import annotations

import json
import json.encoder
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Header, Query, Response
from fastapi.responses import StreamingResponse

from qlm.api import sse
from qlm.api.auth import Principal
from qlm.api.context import ApiContext
from qlm.api.deps import ContextDep, JsonBodyDep, PrincipalDep
from qlm.api.errors import CONFLICT, PERMISSION, ApiError, documented, invalid, not_found
from qlm.api.intake import Submission, admit
from qlm.api.results import Chunk, Final, Restart
from qlm.api.schemas.common import NO_NUL, RequestIdPath, StatusName, status_name, tier_of
from qlm.api.schemas.native import RequestListOut, RequestOut, SubmitIn, SubmitOut
from qlm.domain import RequestStatus
from qlm.frozen import fast_init
from qlm.outcomes import log_outcome
from qlm.store import RequestRow

router = APIRouter(prefix="/v1/requests", tags=["requests"])

IDEMPOTENCY_KEY_PATTERN = r"^[\x20-\x7e]+$"
"""Printable ASCII, spaces included (docs/api.md). HTTP drops the spaces a header value starts or
ends with, so those are not part of the key."""
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        pattern=IDEMPOTENCY_KEY_PATTERN,
        description="Retrying with the same key returns the first request instead of a new one "
        "(per tenant). Printable ASCII (spaces included), at most 255 characters.",
    ),
]


LABEL_PATTERN = r"^[^=\u0000]+=[^\u0000]*$"
"""A ``label`` filter: ``key=value``, the key not empty (the route checks it: ``label_format``,
``nul_character``; the pattern says it in the schema)."""
NO_NUL_QUERY = {"pattern": NO_NUL}


class EventStream(StreamingResponse):
    media_type = "text/event-stream"


async def own_row(ctx: ApiContext, principal: Principal, request_id: str) -> RequestRow:
    """The caller's request ``request_id``; 404 for another tenant's (admins see every one)."""
    tenant = None if principal.admin else principal.tenant
    row = await ctx.threads.run(ctx.store.get, request_id, tenant=tenant)
    if row is None:
        raise not_found(f"request {request_id!r}", "request_id", code="request_not_found")
    return row


@router.post(
    "",
    status_code=202,
    response_model=SubmitOut,
    responses=documented(400, 401, 404, 409, 413, 415, 422, 429, 503),
    dependencies=[JsonBodyDep],
    summary="Queue a request",
)
async def submit_request(
    body: SubmitIn, ctx: ContextDep, principal: PrincipalDep, idempotency_key: IdempotencyKey = None
) -> Response:
    """Queue a completion (``prompt``) or a chat (``messages``) with its SLO. Answers 202 only
    once the store recorded it and the broker confirmed it; any error means nothing was kept."""
    answer = await submit(ctx, principal, body, idempotency_key)
    return Response(
        answer.body,
        status_code=202,
        media_type="application/json",
        headers={k.decode("latin-1"): v.decode("latin-1") for k, v in answer.headers},
    )


_COMPACT = json.JSONEncoder(separators=(",", ":"))
"""``json.dumps(..., separators=(",", ":"))`` without making an encoder per call."""


@fast_init
@dataclass(frozen=True, slots=True)
class Submitted:
    """The 202 answer to a submission: its JSON body and its headers other than the content's
    type and length."""

    body: bytes
    headers: list[tuple[bytes, bytes]]


async def submit(
    ctx: ApiContext, principal: Principal, body: SubmitIn, idempotency_key: str | None
) -> Submitted:
    """What ``POST /v1/requests`` does once its inputs are valid, for the route above and for
    the fast path that serves the same call without FastAPI's machinery (``qlm.api.hotpath``).
    Raises ``ApiError``, ``StoreError`` or ``QueueUnavailable``."""
    if body.tools and body.messages is None:
        raise invalid(
            "tools", "tools need a chat: give messages, not prompt", code="tools_need_chat"
        )
    submission = Submission(
        model=body.model,
        max_tokens=body.max_tokens or ctx.settings.default_max_tokens,
        prompt=body.prompt,
        messages=[m.model_dump(exclude_none=True) for m in body.messages]
        if body.messages is not None
        else None,
        sampling=body.sampling(),
        slo_s=body.slo_seconds,
        ttft_slo_s=body.ttft_slo_seconds,
        tier=tier_of(body.tier) if body.tier is not None else None,
        labels=body.labels or {},
    )
    admitted = await admit(ctx, principal, submission, idempotency_key)
    accepted = admitted.accepted
    # Built by hand: this is the hot path, and the response model only documents it. A request
    # recorded just now is answered from what was recorded, without building its row.
    if accepted.stored is None:
        new = accepted.new
        request_id, model, submitted_at = new.id, new.model, new.submitted_at
        status, deadline_at, at_risk = "queued", submitted_at + new.slo_e2e_s, False
    else:
        row = accepted.stored
        request_id, model, submitted_at = row.id, row.model, row.submitted_at
        status, deadline_at, at_risk = status_name(row.status), row.deadline_at, row.at_risk
    text = submitted_body(
        request_id,
        status,
        model,
        submitted_at,
        deadline_at,
        at_risk or not admitted.verdict.feasible,
        accepted.replayed,
    )
    headers = [(b"location", f"/v1/requests/{request_id}".encode("latin-1"))]
    if accepted.replayed:
        headers.append((b"idempotent-replayed", b"true"))
    return Submitted(text, headers)


def submitted_body(
    request_id: str,
    status: str,
    model: str,
    submitted_at: float,
    deadline_at: float,
    at_risk: bool,
    replayed: bool,
) -> bytes:
    """The 202's JSON (``SubmitOut``'s fields in order, compact): the text ``_COMPACT`` writes
    for them, its constant parts written once. Values of other types than the usual ones (a
    float that is not finite, a subclass) take ``_COMPACT`` itself; a test compares both."""
    if (
        type(request_id) is str
        and type(status) is str
        and type(model) is str
        and type(submitted_at) is float
        and type(deadline_at) is float
        and -_INF < submitted_at < _INF
        and -_INF < deadline_at < _INF
        and type(at_risk) is bool
        and type(replayed) is bool
    ):
        return (
            f'{{"id":{_STRING(request_id)},"object":"request","status":{_STRING(status)},'
            f'"model":{_STRING(model)},"submitted_at":{_FLOAT(submitted_at)},'
            f'"deadline_at":{_FLOAT(deadline_at)},"at_risk":{_BOOLEAN[at_risk]},'
            f'"replayed":{_BOOLEAN[replayed]}}}'
        ).encode()
    out = {
        "id": request_id,
        "object": "request",
        "status": status,
        "model": model,
        "submitted_at": submitted_at,
        "deadline_at": deadline_at,
        "at_risk": at_risk,
        "replayed": replayed,
    }
    return _COMPACT.encode(out).encode()


_STRING = json.encoder.encode_basestring_ascii  # what _COMPACT writes a string with
_FLOAT = float.__repr__  # and a finite float
_BOOLEAN = {True: "true", False: "false"}
_INF = float("inf")


@router.get(
    "/{request_id}",
    response_model=RequestOut,
    responses=documented(401, 404, 422, 503),
    summary="Read a request (optionally wait for its result)",
)
async def get_request(
    request_id: RequestIdPath,
    ctx: ContextDep,
    principal: PrincipalDep,
    wait: Annotated[
        float,
        Query(
            ge=0,
            le=3600,
            description="Long-poll: wait up to this many seconds (capped by "
            "QLM_API__MAX_LONG_POLL_S) for the request to be final.",
        ),
    ] = 0.0,
) -> RequestOut:
    """Status, timestamps, the predicted completion while it waits, and the output once final."""
    row = await own_row(ctx, principal, request_id)
    if wait > 0 and not row.is_final:
        final = await ctx.results.wait(row, min(wait, ctx.settings.max_long_poll_s))
        row = final.row
    return RequestOut.of(row, ctx.clock())


@router.get(
    "/{request_id}/events",
    response_class=EventStream,
    responses={
        200: {
            "description": "Server-sent events: `token` (new text, when the controller runs in "
            "the API's process), `restart` (the output starts over: drop the text so far; a "
            "structured answer that was evicted), then one `done` whose data is the request "
            "(GET /v1/requests/{id})."
        },
        **documented(401, 404, 422, 503),
    },
    summary="Stream a request's progress and result (server-sent events)",
)
async def stream_request(
    request_id: RequestIdPath, ctx: ContextDep, principal: PrincipalDep
) -> StreamingResponse:
    row = await own_row(ctx, principal, request_id)
    return EventStream(_events(ctx, row), headers=sse.HEADERS)


async def _events(ctx: ApiContext, row: RequestRow) -> AsyncIterator[bytes]:
    """The request's events. Text the stream did not carry as it was generated — all of it for
    a request that ended before the stream opened, or that another process served (no token
    stream here) — comes from the store in one ``token`` event before ``done``, so every client
    sees the whole output as tokens, however late it subscribed."""
    events = ctx.results.events(row, ctx.settings.wait_timeout_s)
    sent = ""
    async for event in sse.with_keepalive(events):
        if event is None:
            yield sse.KEEPALIVE
        elif isinstance(event, Chunk):
            sent += event.text
            yield sse.event({"text": event.text, "tokens": event.tokens}, "token")
        elif isinstance(event, Restart):
            sent = ""
            yield sse.event({"tokens": 0}, "restart")
        elif isinstance(event, Final):
            final = event.row
            text = final.output_text or ""
            # A subscriber that came in mid-answer streamed a tail, not the start: nothing to
            # add to that (``done`` carries the whole output).
            if final.is_final and len(text) > len(sent) and text.startswith(sent):
                rest = {"text": text[len(sent) :], "tokens": final.output_tokens}
                yield sse.event(rest, "token")
            body = RequestOut.of(final, ctx.clock()).model_dump(mode="json")
            yield sse.event(body, "timeout" if event.timed_out else "done")
            return


@router.get(
    "",
    response_model=RequestListOut,
    responses=documented(401, 403, 422, 503),
    summary="List requests",
)
async def list_requests(
    ctx: ContextDep,
    principal: PrincipalDep,
    status: Annotated[StatusName | None, Query(description="Only this status.")] = None,
    model: Annotated[
        str | None,
        Query(max_length=256, description="Only this model.", json_schema_extra=NO_NUL_QUERY),
    ] = None,
    label: Annotated[
        str | None,
        Query(
            max_length=322,
            description="Only requests carrying this label, as key=value.",
            json_schema_extra={"pattern": LABEL_PATTERN},
        ),
    ] = None,
    since: Annotated[
        float | None, Query(ge=0, le=1e11, description="Submitted at or after (unix seconds).")
    ] = None,
    until: Annotated[
        float | None, Query(ge=0, le=1e11, description="Submitted before (unix seconds).")
    ] = None,
    tenant: Annotated[
        str | None,
        Query(
            max_length=256,
            description="Admins: only this tenant's.",
            json_schema_extra=NO_NUL_QUERY,
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="Page size.")] = 100,
    cursor: Annotated[
        str | None,
        Query(
            max_length=512,
            description="`next_cursor` of the previous page, as it was (422 `invalid_cursor` "
            "for any other).",
            json_schema_extra=NO_NUL_QUERY,
        ),
    ] = None,
) -> RequestListOut:
    """Newest first, a page at a time; a tenant sees only its own requests."""
    if tenant is not None and not principal.admin and tenant != principal.tenant:
        raise ApiError(
            403,
            "only admin keys may list another tenant's requests",
            type=PERMISSION,
            param="tenant",
            code="admin_required",
        )
    scope = tenant if principal.admin else principal.tenant
    pair: tuple[str, str] | None = None
    if label is not None:
        key, sep, value = label.partition("=")
        if not sep or not key:
            raise invalid("label", "label must be key=value", code="label_format")
        pair = (key, value)
    for name, text in (("model", model), ("label", label), ("tenant", tenant), ("cursor", cursor)):
        if text is not None and "\x00" in text:
            raise invalid(name, f"{name} must not contain the NUL character", code="nul_character")
    now = ctx.clock()
    rows, next_cursor = await ctx.threads.run(
        ctx.store.list_requests,
        tenant=scope,
        status=RequestStatus[status.upper()] if status is not None else None,
        model=model,
        label=pair,
        since=since,
        until=until,
        limit=limit,
        cursor=cursor,
    )
    return RequestListOut(data=[RequestOut.of(r, now) for r in rows], next_cursor=next_cursor)


@router.delete(
    "/{request_id}",
    response_model=RequestOut,
    responses={
        202: {"model": RequestOut, "description": "Running: the abort was requested."},
        **documented(401, 404, 409, 503),
    },
    summary="Cancel a request",
)
async def cancel_request(
    request_id: RequestIdPath, ctx: ContextDep, principal: PrincipalDep, response: Response
) -> RequestOut:
    """A queued request is removed at once (200, `cancelled`); a running one is aborted (202,
    `running` with `cancel_requested`; it ends `cancelled`, keeping the text generated so far).
    A request already final answers 409."""
    row = await own_row(ctx, principal, request_id)
    status = await cancel(ctx, row.id)
    row = await own_row(ctx, principal, request_id)
    if status is not None and status.is_final and status is not RequestStatus.CANCELLED:
        raise ApiError(
            409,
            f"request {request_id!r} is already {status_name(status)}",
            type=CONFLICT,
            param="request_id",
            code="already_final",
        )
    if row.status is RequestStatus.CANCELLED:
        return RequestOut.of(row, ctx.clock())
    response.status_code = 202
    return RequestOut.of(row, ctx.clock())


async def cancel(ctx: ApiContext, request_id: str) -> RequestStatus | None:
    """Cancel in the store (durable; a controller elsewhere polls it), then tell a controller in
    this process at once. A queued request's end is recorded here, not by a controller: its
    outcome line (``qlm.outcomes``) is logged here too."""
    status, outcome = await ctx.threads.run(ctx.store.cancel_row, request_id, at=ctx.clock())
    if outcome is not None:
        log_outcome(outcome)
    if ctx.controller is not None and status in (RequestStatus.CANCELLED, RequestStatus.RUNNING):
        await ctx.controller.cancel(request_id)
    return status
