"""Everything one API app holds, built once at start-up and reached by routes through
``ContextDep`` (``qlm.api.deps``). No module-level state: two apps in one process (tests) share
nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from qlm.api.auth import Authenticator
from qlm.api.control import ControlView
from qlm.api.limits import QueuedCounter, RateLimiter
from qlm.api.ports import LocalController
from qlm.api.results import Results
from qlm.api.risk import AtRiskFlags
from qlm.api.submission import Submitter
from qlm.api.threads import StoreThreads
from qlm.global_queue import GlobalQueue
from qlm.settings import ApiSettings
from qlm.store import Store

log = logging.getLogger(__name__)

WRITERS = 3
"""Batches of submissions recorded at once on PostgreSQL (``qlm.api.submission``)."""


@dataclass
class ApiContext:
    settings: ApiSettings
    store: Store
    queue: GlobalQueue
    controller: LocalController | None
    clock: Callable[[], float]
    """The control plane's clock (unix seconds; sped up with simulated instances): stamps
    ``submitted_at`` so that deadlines mean the same to the API and the controller."""
    auth: Authenticator
    limiter: RateLimiter
    queued: QueuedCounter
    submitter: Submitter
    results: Results
    control: ControlView
    at_risk: AtRiskFlags
    threads: StoreThreads
    """Every blocking store call of the app runs through it (``qlm.api.threads``)."""
    submissions: Counter[tuple[str, str]] = field(default_factory=Counter)
    """``(tenant, outcome)`` -> count since start: accepted, replayed, rate_limited, ..."""
    started_at: float = field(default_factory=time.time)
    background: set[asyncio.Task[None]] = field(default_factory=set)

    @classmethod
    def build(
        cls,
        settings: ApiSettings,
        store: Store,
        queue: GlobalQueue,
        *,
        controller: LocalController | None = None,
        clock: Callable[[], float] = time.time,
    ) -> ApiContext:
        threads = StoreThreads()
        return cls(
            settings=settings,
            store=store,
            queue=queue,
            controller=controller,
            clock=clock,
            auth=Authenticator(store, settings, threads=threads),
            limiter=RateLimiter(settings.rate_per_s, settings.rate_burst),
            queued=QueuedCounter(store, settings.queued_count_ttl_s, threads=threads),
            submitter=Submitter(
                store,
                queue,
                max_batch=settings.commit_max_batch,
                writers=WRITERS if store.backend == "postgresql" else 1,
                threads=threads,
            ),
            results=Results(
                store,
                hub=controller.hub if controller is not None else None,
                poll_interval_s=settings.poll_interval_s,
                threads=threads,
            ),
            control=ControlView(
                store, controller=controller, ttl_s=settings.snapshot_ttl_s, threads=threads
            ),
            at_risk=AtRiskFlags(store, threads=threads),
            threads=threads,
        )

    def start(self) -> None:
        self.submitter.start()
        self.at_risk.start()

    async def close(self) -> None:
        """Stop the background work, in order, then wait for every store call still running
        in a thread: the store may be closed once this returns, not before."""
        await self.submitter.close()  # no new request is recorded (flagged at risk)
        await self.at_risk.close()  # the flags of those recorded
        await self.results.close()
        for task in list(self.background):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.threads.join()

    def spawn(self, coro: object, name: str) -> None:
        """Run ``coro`` in the background, kept referenced, errors logged."""
        task: asyncio.Task[None] = asyncio.create_task(coro, name=name)  # type: ignore[arg-type]
        self.background.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    def count(self, tenant: str, outcome: str) -> None:
        self.submissions[(tenant, outcome)] += 1
