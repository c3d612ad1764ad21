"""Per-tenant limits on submissions: a rate (token bucket) and a ceiling on queued requests.

Both are kept **per API replica**: the bucket lives in this process, so N replicas behind a load
balancer admit up to N times ``QLM_API__RATE_PER_S`` in all (divide the setting by the replica
count). The queued count comes from the store (shared by all replicas), refreshed in the background once it is
older than ``QLM_API__QUEUED_COUNT_TTL_S`` seconds (submissions meanwhile are checked against the
count it replaces: none waits for the store); submissions this replica made since are added
locally, so a burst cannot overshoot by more than what other replicas admit within that time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from qlm.api.threads import StoreThreads
from qlm.store import Store

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    """A token bucket per tenant: ``rate`` tokens per second, at most ``burst`` saved up."""

    def __init__(
        self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def take(self, tenant: str) -> float:
        """Take one token: 0.0 when allowed, else the seconds until one is available."""
        now = self._clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(float(self.burst), now)
        else:
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
            bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate


def retry_after(seconds: float) -> str:
    """A ``Retry-After`` value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


@dataclass(slots=True)
class _Count:
    queued: int
    fetched_at: float
    added: int = 0


class QueuedCounter:
    """How many requests each tenant has queued, for its limit (module docstring)."""

    def __init__(
        self,
        store: Store,
        ttl_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        threads: StoreThreads | None = None,
    ) -> None:
        self._store = store
        self._threads = threads if threads is not None else StoreThreads()
        self._ttl_s = ttl_s
        self._clock = clock
        self._counts: dict[str, _Count] = {}
        self._refreshing: dict[str, asyncio.Future[_Count]] = {}
        self._background: set[asyncio.Task[_Count]] = set()
        self._stale: set[str] = set()  # tenants whose count is being refreshed in the background

    async def reserve(self, tenant: str, limit: int) -> bool:
        """Count one more queued request for ``tenant`` unless that passes ``limit``.

        A count older than ``ttl_s`` is refreshed in the background and this call is checked
        against the count it replaces (with what this process added since), so no submission
        waits for the store's count but a tenant's first one, and every one when ``ttl_s`` is
        0 (exact counts)."""
        count = self._counts.get(tenant)
        if count is None or self._ttl_s <= 0:
            count = await self._refresh(tenant)
        elif self._clock() - count.fetched_at > self._ttl_s and tenant not in self._stale:
            self._refresh_soon(tenant)
        if count.queued + count.added >= limit:
            return False
        count.added += 1
        return True

    def _refresh_soon(self, tenant: str) -> None:
        self._stale.add(tenant)
        task = asyncio.create_task(self._refresh(tenant), name="qlm-api-queued-count")
        self._background.add(task)
        task.add_done_callback(lambda done: self._settled(tenant, done))

    def _settled(self, tenant: str, task: asyncio.Task[_Count]) -> None:
        self._stale.discard(tenant)
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # The stale count stays in use; the next call past the TTL tries again.
            log.warning("could not refresh a tenant's queued count: %s", task.exception())

    def release(self, tenant: str) -> None:
        """A reserved request was not queued after all (refused, or a replay)."""
        count = self._counts.get(tenant)
        if count is not None and count.added > 0:
            count.added -= 1

    async def _refresh(self, tenant: str) -> _Count:
        pending = self._refreshing.get(tenant)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[_Count] = asyncio.get_running_loop().create_future()
        self._refreshing[tenant] = future
        try:
            at = self._clock()
            before = self._counts.get(tenant)
            added_before = before.added if before is not None else 0
            queued = await self._threads.run(self._store.queued_count, tenant)
            # Reserved while the store counted: perhaps not in its count yet, so kept.
            added = before.added - added_before if before is not None else 0
            count = _Count(queued, at, max(0, added))
            self._counts[tenant] = count
            future.set_result(count)
            return count
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it, nobody else must log it
            raise
        finally:
            del self._refreshing[tenant]
