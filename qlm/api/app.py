"""The API app: ``create_app(settings)`` (docs/api.md).

Given only settings, the app opens its own store (``QLM_DATABASE_URL``, SQLite ``./qlm.db``
without it) and global-queue client (``QLM_BROKER_URL``; the in-process queue without it — only
useful with a controller in the same process) when it starts, and closes them when it stops
(``uvicorn --factory qlm.api.app:app_factory``). ``qlm api`` opens them itself before serving,
so that a store or broker it cannot reach is one line, not uvicorn's failed lifespan
(``qlm.api.server.run_api``). ``qlm serve`` passes the queue and store it shares with the
in-process controller, and the controller itself (results then stream from its hub, cancels
reach it at once). The app leaves whatever it was given open.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qlm.api import docs, errors
from qlm.api.context import ApiContext
from qlm.api.errors import TOO_LARGE, ApiError
from qlm.api.hotpath import SubmitFastPath
from qlm.api.ports import LocalController
from qlm.api.routes import admin, health, openai, requests
from qlm.api.schemas.common import with_limits
from qlm.global_queue import GlobalQueue, open_global_queue
from qlm.settings import Settings
from qlm.store import Store

DESCRIPTION = """\
Queue-management control plane for LLM serving: submit requests with SLOs, and QLM decides which
instance serves each and when. Every call needs `Authorization: Bearer <key>` (`qlm keys create`)
except the probes. Errors are `{"error": {"message", "type", "param", "code"}}`, naming the field
or limit at fault.
"""


class BodyLimit:
    """Refuse bodies over ``max_bytes`` with 413 naming the limit: from Content-Length up front,
    and by counting when the body is streamed without one."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> ApiError:
        return ApiError(
            413,
            f"request body of {size} is over the limit of {self.max_bytes} bytes "
            "(QLM_API__MAX_BODY_BYTES)",
            type=TOO_LARGE,
            param="body",
            code="max_body_bytes",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is None:
            # Only Content-Length lets the app read straight from the socket; a body of
            # unknown length is read here first (the app reads it whole anyway).
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                await self._buffered(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        try:
            length = int(declared)
        except ValueError:
            length = -1
        if length < 0:
            response = errors.error_response(
                400,
                f"invalid Content-Length header: {declared.decode('latin-1')!r}",
                errors.INVALID,
                "Content-Length",
                "invalid_content_length",
            )
            await response(scope, receive, send)
        elif length > self.max_bytes:
            await self._too_large(f"{length} bytes").response()(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _buffered(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(f"more than {self.max_bytes} bytes").response()(
                    scope, receive, send
                )
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class Api(FastAPI):
    """The QLM app: FastAPI with the ingest hot path (``qlm.api.hotpath``) in front of FastAPI's
    own middlewares while they have nothing to add to it.

    Inside FastAPI's stack, a submission first goes through ``FastAPI.__call__`` (which asks
    OpenTelemetry whether it is configured, reading the environment three times per call) and
    three middlewares (Starlette's error middleware, FastAPI's exception telemetry and body
    limit) before the hot path: ~10 µs, about 5 % of the API's CPU per submission. While the app runs and
    FastAPI's native telemetry is off (checked when the app starts: ``open_front_door``), a
    ``POST`` goes to the hot path first, under Starlette's ``ServerErrorMiddleware`` with the
    app's handler (an unexpected error is the same 500), taking only a body whose declared
    Content-Length is within the limit; everything it does not serve itself takes the whole
    stack, as before. With FastAPI's telemetry on, every call takes the whole stack (the hot path
    still serves submissions inside it), so the telemetry sees every request."""

    front_door: ASGIApp | None = None
    """The hot path in front of the stack, while the app runs with FastAPI's telemetry off."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        front = self.front_door
        if front is not None and scope["type"] == "http" and scope["method"] == "POST":
            if self.root_path:
                scope["root_path"] = self.root_path  # as FastAPI.__call__ sets it
            scope["app"] = self  # as Starlette.__call__ sets it
            await front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def whole_stack(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The call as FastAPI serves it: every middleware, the hot path among them."""
        await super().__call__(scope, receive, send)

    def open_front_door(self, max_body_bytes: int, ctx: ApiContext | None = None) -> None:
        """Put the hot path in front of the stack, unless FastAPI's native telemetry is on;
        ``ctx``: the app's context (``app.state.ctx``) for as long as the door is open."""
        telemetry = getattr(self, "_native_telemetry", None)  # FastAPI >= 0.130
        if telemetry is not None and telemetry.enabled():
            return
        self.front_door = ServerErrorMiddleware(
            SubmitFastPath(self.whole_stack, max_body_bytes=max_body_bytes, ctx=ctx),
            handler=self.exception_handlers.get(Exception),
            debug=self.debug,
        )

    def close_front_door(self) -> None:
        self.front_door = None


def freeze_startup_objects() -> None:
    """Exempt everything made until the app started (modules, the app and its schemas, pydantic
    validators, SQLAlchemy's metadata, the clients) from the cyclic garbage collector.

    Those objects live as long as the process; without this, each full collection traverses them
    all again: ~100 ms on the 2-core development machine, several times a minute under load, and
    each one stalls the event loop: they were the ingest p99. What requests allocate is still
    collected (``gc.freeze``)."""
    gc.collect()
    gc.freeze()


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A parameter's schema without the ``null`` FastAPI adds for an optional one: a header or
    a query parameter is absent or a string, and the text ``null`` is no value of it."""
    branches = [b for b in schema.get("anyOf", ()) if b != {"type": "null"}]
    if "anyOf" not in schema or len(branches) == len(schema["anyOf"]):
        return schema
    rest = {k: v for k, v in schema.items() if k != "anyOf"}
    return {**branches[0], **rest} if len(branches) == 1 else {**rest, "anyOf": branches}


def open_store(settings: Settings) -> Store:
    """The store at ``QLM_DATABASE_URL`` (SQLite ``./qlm.db`` without it), migrated."""
    return Store.open(settings.database_url)


def open_queue(settings: Settings) -> GlobalQueue:
    """The publishing side of the global queue, not yet connected; the API never consumes."""
    return open_global_queue(settings.broker_url, **settings.broker.queue_options())


def create_app(
    settings: Settings | None = None,
    *,
    queue: GlobalQueue | None = None,
    store: Store | None = None,
    controller: LocalController | None = None,
    clock: Callable[[], float] = time.time,
    freeze_gc: bool = False,
) -> FastAPI:
    """The API for ``settings`` (module docstring). ``clock`` stamps submissions: pass the
    controller's clock when it runs sped up over simulated instances. ``freeze_gc``: a server
    process of its own (``freeze_startup_objects`` once started; ``qlm api`` and ``qlm serve``
    do it in ``ApiServer``)."""
    settings = settings if settings is not None else Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Api) -> AsyncIterator[None]:
        own_store = store is None
        own_queue = queue is None
        the_store: Store = (
            store if store is not None else await asyncio.to_thread(open_store, settings)
        )
        the_queue = queue if queue is not None else open_queue(settings)
        ctx = ApiContext.build(
            settings.api, the_store, the_queue, controller=controller, clock=clock
        )
        app.state.ctx = ctx
        ctx.start()
        app.open_front_door(settings.api.max_body_bytes, ctx)
        if freeze_gc:
            freeze_startup_objects()
        try:
            yield
        finally:
            app.close_front_door()
            await ctx.close()
            if own_queue:
                await the_queue.close()
            if own_store:
                await asyncio.to_thread(the_store.close)

    app = Api(
        title="QLM",
        version="1",
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # docs.install serves both pages without a CDN
        redoc_url=None,
        openapi_tags=[
            {"name": "requests", "description": "The native API: queue requests with SLOs."},
            {"name": "openai", "description": "OpenAI-compatible endpoints."},
            {"name": "admin", "description": "Operators (admin keys only)."},
            {"name": "health", "description": "Probes and metrics."},
        ],
    )
    errors.install(app)
    docs.install(app)
    app.include_router(requests.router)
    app.include_router(openai.router)
    app.include_router(admin.router)
    app.include_router(health.router)
    app.add_middleware(SubmitFastPath)  # POST /v1/requests, the hot path (qlm.api.hotpath)
    app.add_middleware(BodyLimit, max_bytes=settings.api.max_body_bytes)  # outside it

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
                tags=app.openapi_tags,
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(errors.error_schemas())
            with_limits(components, settings.api)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    for parameter in operation.get("parameters", ()):
                        parameter["schema"] = _not_null(parameter["schema"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def app_factory() -> Any:
    """For ``uvicorn --factory qlm.api.app:app_factory``: the settings from the environment."""
    from qlm.settings import get_settings

    return create_app(get_settings(), freeze_gc=True)
