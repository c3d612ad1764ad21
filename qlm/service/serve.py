"""``qlm serve``: the all-in-one process — one global queue shared in process (or RabbitMQ), the
controller service with its agents, and the REST API (uvicorn on ``QLM_API__HOST``:
``QLM_API__PORT``, default 127.0.0.1:8080) sharing the queue, the store and the controller, so
results stream from the controller's hub and cancels reach it at once. With ``replay_s`` it
replays the demo trace through the service instead of serving the API, and exits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from qlm.api.app import create_app
from qlm.api.server import ApiServer, bind, until_signalled
from qlm.domain import Request
from qlm.errors import ConfigError, QLMError, WorkloadError
from qlm.service import (
    build_controller,
    check_profiled,
    instance_configs,
    open_queue,
    open_store,
)
from qlm.service.replay import ReplayProgress, ReplayResult, replay
from qlm.service.sim_servers import SimServers
from qlm.settings import Settings
from qlm.sim.traces import load_trace, scale_rate, window
from qlm.sim.workload import create_workload
from qlm.wiring import rct_profile

log = logging.getLogger(__name__)

REPLAY_PROGRESS_S = 5.0
"""How often ``qlm serve --replay`` logs where its replay stands."""


class ProgressLog:
    """Logs a replay's progress: its first report, then at most one every ``every_s`` seconds,
    and the one that finds every request final."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.logged_at: float | None = None

    def __call__(self, p: ReplayProgress) -> None:
        last = p.final == p.total and p.submitted == p.total
        if not last and self.logged_at is not None and p.wall_s < self.logged_at + self.every_s:
            return
        self.logged_at = p.wall_s
        log.info(
            "replay: %d of %d requests submitted, %d of them done, after %.0f s",
            p.submitted,
            p.total,
            p.final,
            p.wall_s,
            extra={"submitted": p.submitted, "done": p.final, "total": p.total},
        )


class ReplayStopped(QLMError):
    """``qlm serve --replay`` stopped by SIGINT or SIGTERM before the replay ended."""


async def serve(settings: Settings, *, replay_s: float | None = None) -> ReplayResult | None:
    """Run until SIGINT/SIGTERM, or until a replay of ``replay_s`` trace seconds is served.

    It starts in the order that writes nothing before it knows it can run: the API's address
    (bound, unless replaying), the instances and the profile (read and checked), the broker
    (reached), then the store (opened: connected and migrated, which creates an SQLite file)
    and the controller, which records its instances there. Each failure is one line."""
    sock = bind(settings.api.host, settings.api.port) if replay_s is None else None
    try:
        async with contextlib.AsyncExitStack() as stack:
            return await _serve(settings, stack, sock, replay_s)
    finally:
        if sock is not None:
            sock.close()  # a no-op once the server closed it


def replayed(settings: Settings, replay_s: float) -> list[Request]:
    """The first ``replay_s`` seconds of the demo trace (``QLM_DEMO__*``) as requests; a trace
    or workload that cannot be had is one line naming its setting."""
    demo = settings.demo
    try:
        trace = load_trace(demo.trace, seed=demo.seed)
    except WorkloadError as exc:
        raise ConfigError(f"setting QLM_DEMO__TRACE: {exc}") from None
    trace = window(scale_rate(trace, demo.rate_scale), 0.0, replay_s)
    try:
        return create_workload(demo.workload, trace, seed=demo.seed)
    except WorkloadError as exc:
        raise ConfigError(f"setting QLM_DEMO__WORKLOAD: {exc}") from None


async def _serve(
    settings: Settings,
    stack: contextlib.AsyncExitStack,
    sock: socket.socket | None,
    replay_s: float | None,
) -> ReplayResult | None:
    configs = instance_configs(settings)
    check_profiled(settings.controller.policy, rct_profile(settings), configs)
    requests = None if replay_s is None else replayed(settings, replay_s)
    queue = open_queue(settings)
    await queue.reach()
    stack.push_async_callback(queue.close)
    if settings.instances_file is None and settings.controller.sim_over_http:
        servers = SimServers()
        stack.callback(servers.stop)
        configs = await servers.start(configs, time_scale=settings.controller.sim_time_scale)
        log.info("simulated instances over HTTP: %s", ", ".join(c.spec.url for c in configs))
    store = await asyncio.to_thread(open_store, settings)
    stack.push_async_callback(asyncio.to_thread, store.close)
    service = build_controller(settings, queue=queue, store=store, configs=configs)
    await service.start()
    stack.push_async_callback(service.stop)
    if requests is not None:
        log.info("replaying %d requests of %s", len(requests), settings.demo.trace)
        replaying = asyncio.ensure_future(
            replay(
                requests,
                queue,
                store,
                service.runtime.clock,
                time_scale=settings.controller.sim_time_scale,
                progress=ProgressLog(REPLAY_PROGRESS_S),
            )
        )
        # SIGINT or SIGTERM stop the replay as they stop a service: the controller stops
        # cleanly (its state published as stopped), then the queue and the store close.
        await until_signalled(also=replaying.done)
        if not replaying.done():
            replaying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replaying
            raise ReplayStopped("the replay was stopped by a signal before it ended")
        return replaying.result()
    app = create_app(
        settings, queue=queue, store=store, controller=service, clock=service.runtime.clock.now
    )
    api = ApiServer(
        app,
        host=settings.api.host,
        port=settings.api.port,
        sock=sock,
        log_level=settings.log_level,
        access_log=settings.api.access_log,
    )
    await api.start()
    try:
        await until_signalled(also=lambda: api.done)
    finally:
        await api.stop()
    return None
