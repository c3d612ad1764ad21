"""``POST /v1/requests`` without FastAPI's per-request machinery: the ingest hot path.

FastAPI spends more CPU on a submission than QLM does: routing through every route of the app,
solving the dependency tree (context, bearer scheme, principal, header), its exception and
async-exit-stack middlewares, and re-parsing the content type. Profiled under load that was about
a third of the API process (docs/api.md, "Ingest throughput"). This ASGI middleware serves a
well-formed submission itself, doing exactly what the route does with the same code
(``qlm.api.routes.requests.submit``): parse and validate the body with ``SubmitIn`` in one pass
(its validator's ``validate_json``, as ``model_validate_json`` calls it, with pydantic-core's JSON
parser: what FastAPI's ``json.loads`` then
``SubmitIn`` make of it, a test compares them; a body that parser refuses, such as UTF-16 text
or a byte-order mark, goes to the route, which reads it with ``json.loads``), read the bearer
key as ``HTTPBearer`` does, check ``Idempotency-Key`` as the route's header declares it, then
answer from the same function, its 202 sent as the two ASGI messages Starlette's ``Response``
would send (same headers), without building one. It is installed twice: in front of FastAPI's
whole stack while FastAPI's telemetry is off (``qlm.api.app.Api``: none of FastAPI's own
middlewares runs for a submission it serves), and as the innermost user middleware, which
serves submissions when the front one is not open (a submission the front one declines reaches
the inner one too, which declines it again).

Anything it does not recognise as a well-formed call — another path or method, a content type
other than ``application/json``, a body that does not parse or validate, a malformed or repeated
``Idempotency-Key`` — goes to the FastAPI route unchanged (the body replayed), so every error is
FastAPI's own, in the one error shape. The route stays the documented one (OpenAPI).
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qlm.api import errors
from qlm.api.context import ApiContext
from qlm.api.routes.requests import submit
from qlm.api.schemas.common import SHALLOW, shallow
from qlm.api.schemas.native import SubmitIn

PATH = "/v1/requests"
_KEY = re.compile(r"[\x20-\x7e]{1,255}")  # the route's IDEMPOTENCY_KEY_PATTERN


class SubmitFastPath:
    """The middleware (module docstring). Inside ``BodyLimit``, which has checked the size, it
    takes no ``max_body_bytes``; in front of the whole app (``qlm.api.app.Api``) it takes only a
    body whose Content-Length is declared and at most ``max_body_bytes``, and leaves the rest to
    ``app`` unread (``BodyLimit`` answers those)."""

    def __init__(
        self, app: ASGIApp, *, max_body_bytes: int | None = None, ctx: ApiContext | None = None
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        # The app's context when it is known for the middleware's life (the front door, opened
        # once the context is made); otherwise read from ``app.state`` at each call.
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or _route_path(scope) != PATH:
            await self.app(scope, receive, send)
            return
        content_type = authorization = length = None
        keys: list[bytes] = []
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value if content_type is None else content_type
            elif name == b"authorization":
                authorization = value if authorization is None else authorization
            elif name == b"idempotency-key":
                keys.append(value)
            elif name == b"content-length":
                length = value if length is None else length
        if self.max_body_bytes is not None and not _within(length, self.max_body_bytes):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            return  # the client went away
        ctx = self.ctx
        if ctx is None:  # State has no such attribute until it is set: a raised AttributeError
            ctx = getattr(scope["app"].state, "ctx", None)
        parsed = _parse(content_type, body, keys)
        if parsed is None or ctx is None:
            # FastAPI answers, errors included
            await self.app(scope, _replaying(body, receive), send)
            return
        submission, key = parsed
        try:
            principal = await ctx.auth.authenticate(_bearer(authorization))
            answer = await submit(ctx, principal, submission, key)
        except Exception as exc:
            response = errors.response_for(exc)
            if response is None:
                raise  # ServerErrorMiddleware: 500, as for the route
            await response(scope, _replaying(body, receive), send)
            return
        # The headers Starlette's Response would send, without building one.
        headers = [
            *answer.headers,
            (b"content-length", str(len(answer.body)).encode()),
            (b"content-type", b"application/json"),
        ]
        await send({"type": "http.response.start", "status": 202, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body})


def _route_path(scope: Scope) -> str:
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _within(length: bytes | None, max_bytes: int) -> bool:
    """Whether a declared Content-Length is a size ``BodyLimit`` lets through unread."""
    if length is None or not length.isdigit():
        return False  # none, or one BodyLimit refuses (a sign is no digit)
    return int(length) <= max_bytes


def _parse(
    content_type: bytes | None, body: bytes, keys: list[bytes]
) -> tuple[SubmitIn, str | None] | None:
    """The validated body and Idempotency-Key, or None for FastAPI to answer."""
    if content_type != b"application/json" and (  # the usual header, as it is
        content_type is None
        or content_type.split(b";", 1)[0].strip().lower() != b"application/json"
    ):
        return None
    key: str | None = None
    if keys:
        if len(keys) > 1:
            return None
        key = keys[0].decode("latin-1")  # as Starlette decodes headers
        if _KEY.fullmatch(key) is None:
            return None
    try:
        context = SHALLOW if shallow(body) else None
        # What model_validate_json does, without its wrapper (~0.5 µs of keywords and checks)
        submission: SubmitIn = SubmitIn.__pydantic_validator__.validate_json(body, context=context)
    except Exception:  # not JSON, not UTF-8, too deep, invalid: FastAPI's
        return None
    return submission, key


def _bearer(authorization: bytes | None) -> str | None:
    """The key, as ``HTTPBearer(auto_error=False)`` reads it: None unless ``Bearer <key>``."""
    if not authorization:
        return None
    scheme, _, credentials = authorization.decode("latin-1").partition(" ")
    credentials = credentials.strip()
    if not scheme or not credentials or scheme.lower() != "bearer":
        return None
    return credentials


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the next app: the body read already, then what the client sends."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
