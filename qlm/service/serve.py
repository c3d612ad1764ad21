"""``qlm serve``: the all-in-one process — one global queue shared in process (or RabbitMQ), the
controller service with its agents, and (with ``replay_s``) a replay of the demo trace through it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from qlm.service import build_controller, open_queue, open_store
from qlm.service.replay import ReplayResult, replay
from qlm.settings import Settings
from qlm.sim.traces import load_trace, scale_rate, window
from qlm.sim.workload import create_workload

log = logging.getLogger(__name__)


async def serve(settings: Settings, *, replay_s: float | None = None) -> ReplayResult | None:
    """Run until SIGINT/SIGTERM, or until a replay of ``replay_s`` trace seconds is served."""
    queue = open_queue(settings)
    store = open_store(settings)
    service = build_controller(settings, queue=queue, store=store)
    await service.start()
    try:
        if replay_s is not None:
            demo = settings.demo
            trace = window(
                scale_rate(load_trace(demo.trace, seed=demo.seed), demo.rate_scale), 0.0, replay_s
            )
            requests = create_workload(demo.workload, trace, seed=demo.seed)
            log.info("replaying %d requests of %s", len(requests), demo.trace)
            return await replay(
                requests,
                queue,
                store,
                service.runtime.clock,
                time_scale=settings.controller.sim_time_scale,
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        return None
    finally:
        await service.stop()
        await asyncio.to_thread(store.close)
