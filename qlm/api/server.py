"""Serving the app with uvicorn inside an event loop QLM owns: ``qlm api`` (the API alone) and
``qlm serve`` (next to the controller, sharing its queue and store).

uvicorn runs as a task of the caller's loop rather than owning the process: the socket is bound
first (``bind``: so a taken port is one clear error, not uvicorn's ``sys.exit``, and it is known
before anything is written), and uvicorn's own signal handling is off, so the caller decides how
to stop (``qlm serve`` stops the API first, then the controller). ``qlm api`` runs on uvloop and uvicorn parses HTTP with httptools: both are
dependencies of QLM (uvloop except on Windows, where asyncio's loop is used); the ingest figures
in docs/api.md were measured with both.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import logging
import signal
import socket
import time
from collections.abc import Callable, Generator
from typing import Any

import uvicorn
from fastapi import FastAPI

from qlm.errors import ConfigError
from qlm.settings import Settings

log = logging.getLogger(__name__)


_STARTED: contextvars.ContextVar[float] = contextvars.ContextVar("qlm_api_request_started")
"""When the request being answered reached the app (``time.perf_counter``), in its task."""


class _Timed:
    """The app, noting when each request reaches it, for its access line's ``duration_s``
    (only with the access log on)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        token = _STARTED.set(time.perf_counter())
        try:
            await self.app(scope, receive, send)
        finally:
            _STARTED.reset(token)


class AccessFields(logging.Filter):
    """Gives each line of the HTTP server's access log (``uvicorn.access``, on with
    ``QLM_API__ACCESS_LOG=true``) its parts as fields of its own — ``client``, ``method``,
    ``path`` (with the query), ``http_version``, ``status`` and ``duration_s`` (from the
    request reaching the app to its response starting: uvicorn logs the line then) — so that
    a JSON log's reader filters on them rather than parsing the message. The message stays as
    uvicorn writes it."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5:  # uvicorn: '%s - "%s %s HTTP/%s" %d'
            client, method, path, version, status = args
            record.client, record.method, record.path = client, method, path
            record.http_version, record.status = version, status
            started = _STARTED.get(None)
            if started is not None:  # logged in the request's task, as uvicorn does
                record.duration_s = round(time.perf_counter() - started, 6)
        return True


def log_access_fields() -> None:
    """Give the access log its fields (``AccessFields``), once per process."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, AccessFields) for f in access.filters):
        access.addFilter(AccessFields())


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the owner of the loop handles signals


def bind(
    host: str, port: int, *, settings: tuple[str, str] = ("QLM_API__HOST", "QLM_API__PORT")
) -> socket.socket:
    """A socket bound to ``host:port`` (0: any free port), not yet listening: connections are
    refused until the server starts on it. A start-up binds before it opens the store or
    writes anything, so that a port in use stops it with one line and nothing written;
    ``settings`` name what sets the host and the port, for that line."""
    host_setting, port_setting = settings
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} is in use on {host} ({reason}: another QLM or another server "
                f"listens there); choose another with {port_setting}"
            ) from None
        raise ConfigError(
            f"cannot listen on {host}:{port} ({reason}); check {host_setting} (an address of "
            f"this machine) and {port_setting} (below 1024 needs privileges)"
        ) from None
    return sock


API_KEEPALIVE_S = 60
"""How long the API keeps an idle client connection open (uvicorn's default is 5 s)."""


class ApiServer:
    """``app`` served by uvicorn on ``host:port`` (0: any free port; see ``port`` once bound),
    or on ``sock``, bound already (``bind``)."""

    def __init__(
        self,
        app: FastAPI,
        *,
        host: str,
        port: int,
        sock: socket.socket | None = None,
        log_level: str = "info",
        access_log: bool = False,
    ) -> None:
        self.host = host
        self.port = port if sock is None else sock.getsockname()[1]
        self._sock = sock
        if access_log:
            log_access_fields()
        self._config = uvicorn.Config(
            _Timed(app) if access_log else app,
            host=host,
            port=port,
            log_level=log_level.lower(),
            log_config=None,  # its lines go to QLM's handler, in QLM's format (qlm.cli.logs)
            access_log=access_log,
            lifespan="on",
            timeout_graceful_shutdown=5,
            # An idle connection is kept well past a client's reuse of it (httpx: 5 s, uvicorn's
            # own default too): at equal times a request written on a connection the server is
            # closing gets a reset, seen by clients polling the API on a busy host.
            timeout_keep_alive=API_KEEPALIVE_S,
        )
        self._server = _Server(self._config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Bind (unless given a socket), start serving, and return once the app's lifespan
        started."""
        if self._sock is None:
            self._sock = bind(self.host, self.port)
            self.port = self._sock.getsockname()[1]
        sock = self._sock
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="qlm-api")
        while not self._server.started:
            if self._task.done():
                await self._task  # raises what stopped it
                raise ConfigError(f"the API on {self.url} stopped during start-up (see the log)")
            await asyncio.sleep(0.02)
        from qlm.api.app import freeze_startup_objects

        freeze_startup_objects()  # a server process: what start-up made lives as long as it
        log.info("API listening on %s", self.url)

    @property
    def done(self) -> bool:
        return self._task is not None and self._task.done()

    async def stop(self) -> None:
        """Stop taking connections, finish the requests in flight (5 s at most), stop the app;
        or, never started, let go of the socket."""
        if self._task is None:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None


async def until_signalled(*, also: Callable[[], bool] = lambda: False) -> None:
    """Return on SIGINT or SIGTERM (or once ``also()`` is true, checked every half second)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    while not stop.is_set() and not also():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def run_api(settings: Settings) -> None:
    """``qlm api``: the API alone (a controller runs elsewhere), until SIGINT/SIGTERM.

    It starts in the order that writes nothing before it knows it can run: ``QLM_BROKER_URL``
    (set), the address (bound), the broker (reached: an API that cannot make a request durable must not take
    it), then the store (opened: connected and migrated, which creates an SQLite file). Each
    failure is one line. The app is given the queue and the store opened here: opened in its
    lifespan, a failure would be uvicorn's tracebacks and its exit code 3."""
    from qlm.api.app import create_app, open_queue, open_store

    settings.require_broker("`qlm api`")
    api = settings.api
    sock = bind(api.host, api.port)
    try:
        queue = open_queue(settings)
        await queue.reach()
        try:
            store = await asyncio.to_thread(open_store, settings)
        except BaseException:
            await queue.close()
            raise
    except BaseException:
        sock.close()
        raise
    server = ApiServer(
        create_app(settings, queue=queue, store=store),
        host=api.host,
        port=api.port,
        sock=sock,
        log_level=settings.log_level,
        access_log=api.access_log,
    )
    try:
        await server.start()
        await until_signalled(also=lambda: server.done)
    finally:
        await server.stop()
        await queue.close()
        await asyncio.to_thread(store.close)
