"""What the API reads of the control plane: the controller's published state (virtual queues,
groups, instances, counters, plan), the models the fleet serves, and the admission check.

With a controller in process that leads the queue its ``snapshot()`` is read directly;
otherwise (none, or a standby) the most recent *active* controller's row in the store
(``Store.controller_states``), cached for ``QLM_API__SNAPSHOT_TTL_S``. The model list comes from the store's instances, cached alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from qlm.api.ports import LocalController
from qlm.api.threads import StoreThreads
from qlm.frozen import fast_init
from qlm.store import Store

SnapshotDoc = Mapping[str, Any]


@fast_init
@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a new request can meet its deadline, as far as the current plan tells."""

    feasible: bool
    reason: str = ""
    predicted_start_at: float | None = None


UNKNOWN = Verdict(True)
"""Feasible, as far as nothing known says otherwise (no snapshot, no instance of the model)."""


def assess(snapshot: SnapshotDoc | None, *, model: str, deadline_at: float, now: float) -> Verdict:
    """Admission from the controller's plan, EDF-style (pure; ``now`` on the snapshot's clock).

    The plan orders each virtual queue; a request due at ``deadline_at`` runs, at best, after
    every group due before it on the instance it lands on. So on each instance that serves
    ``model`` and is up and not draining, the latest predicted completion of the groups due
    earlier is when it could start at the soonest; the best instance decides. If even that is
    past the deadline, the plan cannot meet the SLO. Without a snapshot, or without predictions,
    nothing is known and the request is feasible.
    """
    if not snapshot:
        return UNKNOWN
    instances = [i for i in snapshot.get("instances", []) if model in (i.get("models") or [])]
    if not instances:
        return UNKNOWN  # the model check is the caller's; nothing known here
    ready = [i for i in instances if i.get("up", True) and not i.get("draining", False)]
    if not ready:
        names = ", ".join(sorted(str(i.get("name")) for i in instances))
        return Verdict(False, f"no instance serving {model!r} is up and not draining ({names})")
    queues = {q.get("instance"): q for q in snapshot.get("queues", [])}
    best: float | None = None
    best_name = ""
    for instance in ready:
        start = now
        for group in (queues.get(instance.get("name")) or {}).get("groups", []):
            due = group.get("earliest_deadline_at")
            done = group.get("predicted_completion_at")
            if (
                isinstance(due, int | float)
                and isinstance(done, int | float)
                and due <= deadline_at
            ):
                start = max(start, float(done))
        if best is None or start < best:
            best, best_name = start, str(instance.get("name"))
    assert best is not None
    if best > deadline_at:
        return Verdict(
            False,
            f"the plan completes the work due before this request on {best_name} (the best "
            f"instance for {model!r}) {best - now:.1f} s from now, past its deadline "
            f"{deadline_at - now:.1f} s from now",
            best,
        )
    return Verdict(True, predicted_start_at=best)


class ControlView:
    """Cached reads of the control plane's state (module docstring)."""

    def __init__(
        self,
        store: Store,
        *,
        controller: LocalController | None = None,
        ttl_s: float = 1.0,
        models_ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        threads: StoreThreads | None = None,
    ) -> None:
        self._store = store
        self._threads = threads if threads is not None else StoreThreads()
        self.controller = controller
        self._ttl_s = ttl_s
        self._models_ttl_s = models_ttl_s
        self._clock = clock
        self._snapshot: tuple[float, SnapshotDoc | None, float | None] | None = None
        self._models: tuple[float, frozenset[str]] | None = None
        # One refresh at a time: under load every caller finds the cache expired at once.
        self._snapshot_lock = asyncio.Lock()
        self._models_lock = asyncio.Lock()

    async def snapshot(self) -> SnapshotDoc | None:
        """The active controller's state document, None when no controller published one."""
        if self.controller is None or not self.controller.active:  # the cache, when fresh
            cached = self._snapshot
            if cached is not None and self._clock() - cached[0] <= self._ttl_s:
                return cached[1]
        doc, _ = await self.snapshot_with_time()
        return doc

    async def snapshot_with_time(self) -> tuple[SnapshotDoc | None, float | None]:
        """The document and when it was published (store time), None for an in-process one
        (read directly while it leads the queue; a standby's is not the one to read)."""
        if self.controller is not None and self.controller.active:
            return self.controller.snapshot(), None
        cached = self._snapshot
        if cached is not None and self._clock() - cached[0] <= self._ttl_s:
            return cached[1], cached[2]
        async with self._snapshot_lock:
            cached = self._snapshot
            if cached is not None and self._clock() - cached[0] <= self._ttl_s:
                return cached[1], cached[2]
            now = self._clock()
            rows = await self._threads.run(self._store.controller_states)
            row = next((r for r in rows if r.active), rows[0] if rows else None)
            doc = dict(row.snapshot) if row is not None else None
            published = row.updated_at if row is not None else None
            self._snapshot = (now, doc, published)
            return doc, published

    async def models(self) -> frozenset[str]:
        """Every model some known instance serves."""
        cached = self._models
        if cached is not None and self._clock() - cached[0] <= self._models_ttl_s:
            return cached[1]
        async with self._models_lock:
            cached = self._models
            if cached is not None and self._clock() - cached[0] <= self._models_ttl_s:
                return cached[1]
            now = self._clock()
            instances = await self._threads.run(self._store.instances)
            models = frozenset(m for i in instances for m in i.models)
            self._models = (now, models)
            return models
