"""Replay a real trace through the live service path: publish each request to the global queue
at its arrival time (wall clock), let the controller serve it, read the outcome from the store.

This is what ``qlm serve --replay`` runs: the same requests ``qlm demo`` simulates in virtual time,
here through the broker, the controller service, the agents and the engines in real time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qlm.clock import Clock
from qlm.domain import Request
from qlm.global_queue import GlobalQueue, QueuedRequest
from qlm.store import Store


@dataclass(frozen=True, slots=True)
class ReplayResult:
    requests: int
    finished: int
    slo_met: int
    failed: int
    wall_s: float

    @property
    def attainment(self) -> float:
        return self.slo_met / self.requests if self.requests else 0.0


REPLAY_TENANT = "replay"
"""The tenant a replay's requests are recorded under: the workload's per-class tenants are the
simulator's device for attainment per class, not clients of this service. The class goes into
the ``class`` label, which the SLO report breaks attainment down by."""


def to_message(request: Request, submitted_at: float, run: str) -> QueuedRequest:
    """A trace request as a client would submit it (its id made unique to this run), under
    the ``replay`` tenant, labelled with its run and its SLO class."""
    return QueuedRequest(
        id=f"{run}-{request.id}",
        model=request.model,
        prompt_tokens=request.input_tokens,
        max_tokens=request.max_tokens,
        slo_e2e_s=request.slo.e2e_s,
        slo_ttft_s=request.slo.ttft_s,
        submitted_at=submitted_at,
        tenant=REPLAY_TENANT,
        tier=int(request.tier),
        labels={"replay": run, "class": request.slo_class, **dict(request.labels)},
        replay_output_tokens=request.replay_output_tokens,
    )


@dataclass(frozen=True, slots=True)
class ReplayProgress:
    """Where a replay stands: requests published so far, those of them with an outcome
    recorded (finished, failed or cancelled), of ``total``, ``wall_s`` seconds after it began."""

    submitted: int
    final: int
    total: int
    wall_s: float


async def replay(
    requests: Sequence[Request],
    queue: GlobalQueue,
    store: Store,
    clock: Clock,
    *,
    time_scale: float = 1.0,
    progress: Callable[[ReplayProgress], None] | None = None,
    poll_s: float = 0.5,
) -> ReplayResult:
    """Publish ``requests`` at their arrival offsets (real seconds = trace seconds /
    ``time_scale``, stamped with the service's ``clock``), wait until every one is final in the
    store, and count what it says. ``progress`` is told where it stands every ``poll_s``
    while it publishes and while it waits, and once more when every request is final."""
    run = uuid.uuid4().hex[:8]
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    t0 = time.monotonic()
    ids: list[str] = []
    publishing = asyncio.create_task(_publish(ordered, queue, clock, run, ids, t0, time_scale))
    total = len(ordered)
    try:
        while True:
            published = publishing.done()
            if published:
                publishing.result()  # (a publish that failed stops the replay)
            final = len(await asyncio.to_thread(store.final_ids, list(ids)))
            if progress is not None:
                progress(ReplayProgress(len(ids), final, total, time.monotonic() - t0))
            if published and final == total:
                break
            if published:
                await asyncio.sleep(poll_s)
            else:
                await asyncio.wait({publishing}, timeout=poll_s)
    finally:
        if not publishing.done():
            publishing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publishing
    rows = [await asyncio.to_thread(store.get, rid) for rid in ids]
    return ReplayResult(
        requests=total,
        finished=sum(r is not None and r.status.name == "FINISHED" for r in rows),
        slo_met=sum(r is not None and bool(r.slo_met) for r in rows),
        failed=sum(r is not None and r.status.name == "FAILED" for r in rows),
        wall_s=time.monotonic() - t0,
    )


async def _publish(
    ordered: Sequence[Request],
    queue: GlobalQueue,
    clock: Clock,
    run: str,
    ids: list[str],
    t0: float,
    time_scale: float,
) -> None:
    """Publish each request at its arrival offset, appending its id to ``ids`` once the
    queue took it."""
    origin = ordered[0].arrival_s if ordered else 0.0
    for req in ordered:
        delay = (req.arrival_s - origin) / time_scale - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        msg = to_message(req, clock.now(), run)
        await queue.publish(msg)
        ids.append(msg.id)
