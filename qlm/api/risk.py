"""The at-risk flag of a request admitted against the plan's advice (``QLM_API__ADMISSION=accept``):
recorded in the store after the 202, so that ``GET /v1/requests/{id}`` says ``at_risk`` before the
controller's first prediction does.

The 202 does not wait for it, and the store may be briefly away when it is written (a PostgreSQL
restart): one task records the flags waiting, in batches (``Store.record_predictions``), and
retries a batch that failed after a back-off that doubles up to ``max_backoff_s``. A retry
records only the requests the controller has not predicted yet: a flag from admission must not
overwrite the controller's own, later prediction. Final requests are skipped by the store.

At most ``max_pending`` flags wait (memory stays bounded while the store is down); past that the
oldest is given up, with an error in the log naming it. Requests are only accepted while the
store takes their rows, so that takes a store that records rows but refuses predictions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from qlm.api.threads import StoreThreads
from qlm.store import Store

log = logging.getLogger(__name__)


class AtRiskFlags:
    """The recorder (module docstring). ``start`` before ``add``, ``close`` after."""

    def __init__(
        self,
        store: Store,
        *,
        max_pending: int = 100_000,
        max_batch: int = 512,
        first_backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        threads: StoreThreads | None = None,
    ) -> None:
        self._store = store
        self._threads = threads if threads is not None else StoreThreads()
        self._max_pending = max_pending
        self._max_batch = max_batch
        self._first_backoff_s = first_backoff_s
        self._max_backoff_s = max_backoff_s
        self._sleep = sleep
        self._pending: dict[str, float | None] = {}  # request id -> predicted start; in order
        self._retrying: set[str] = set()  # failed once: check the controller's prediction first
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self.recorded = 0
        self.failures = 0
        self.given_up = 0

    @property
    def pending(self) -> int:
        """Flags not recorded yet."""
        return len(self._pending)

    def start(self) -> None:
        self._task = asyncio.create_task(self._record_forever(), name="qlm-api-flag-at-risk")

    def add(self, request_id: str, predicted_start_at: float | None) -> None:
        """Record that ``request_id`` is at risk, predicted to start at ``predicted_start_at``."""
        if request_id not in self._pending and len(self._pending) >= self._max_pending:
            oldest = next(iter(self._pending))
            del self._pending[oldest]
            self._retrying.discard(oldest)
            self.given_up += 1
            log.error(
                "%d at-risk flags wait for the store: gave up the oldest, %s's",
                self._max_pending,
                oldest,
            )
        self._pending[request_id] = predicted_start_at
        self._idle.clear()
        self._wake.set()

    async def flushed(self) -> None:
        """Return once no flag waits (every one added so far is recorded, or given up)."""
        await self._idle.wait()

    async def close(self) -> None:
        """Stop the task, after one last try at what still waits (logged when it fails)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._pending:
            with contextlib.suppress(Exception):
                await self._record_batch()
        if self._pending:
            log.error(
                "shutting down with %d at-risk flags not recorded: %s",
                len(self._pending),
                ", ".join(list(self._pending)[:20]),
            )

    async def _record_forever(self) -> None:
        backoff_s = self._first_backoff_s
        while True:
            if not self._pending:
                self._idle.set()
                await self._wake.wait()
            self._wake.clear()
            try:
                await self._record_batch()
            except Exception as exc:
                self.failures += 1
                log.warning(
                    "could not record %d at-risk flags (retrying in %.1f s): %s",
                    min(len(self._pending), self._max_batch),
                    backoff_s,
                    exc,
                )
                await self._sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self._max_backoff_s)
            else:
                backoff_s = self._first_backoff_s

    async def _record_batch(self) -> None:
        batch = dict(list(self._pending.items())[: self._max_batch])
        retried = self._retrying & batch.keys()
        try:
            self.recorded += await self._threads.run(self._record, batch, retried)
        except BaseException:
            self._retrying.update(batch)
            raise
        for request_id, at in batch.items():
            if request_id in self._pending and self._pending[request_id] == at:
                del self._pending[request_id]  # (unless added again meanwhile)
                self._retrying.discard(request_id)

    def _record(self, batch: dict[str, float | None], retried: set[str]) -> int:
        """In a worker thread: the flags of ``batch``, those of ``retried`` only if the
        controller has not predicted the request meanwhile; how many were written."""
        flags = {}
        for request_id, at in batch.items():
            if request_id in retried:
                row = self._store.get(request_id)
                if row is None or row.is_final or row.predicted_completion_at is not None:
                    continue
            flags[request_id] = (at, True)
        self._store.record_predictions(flags)
        return len(flags)
