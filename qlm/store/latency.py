"""Latency histograms of finished requests, kept as counters in the store: time to first token,
end to end, and the wait in the queue (from submission until first dispatched to an instance),
per tier and model, in fixed buckets (``BUCKETS_S``).

Why counters in the store rather than counting the stored requests at each scrape: a
Prometheus histogram is a set of counters that only grow, and retention deletes old requests
(their counts would fall, which Prometheus reads as a restart); and counting them all costs a
scan, per scrape, of every request retention keeps (30 days by default). So each finished
request adds its observations once, in the transaction that records its outcome
(``Requests.record_outcome``: the outcome is written once, so the observations are too), and a
scrape reads a few rows — the same rows from every API replica.

Within a transaction the observations are gathered in the session (``tally``) and written when
it commits, one upsert per bucket touched, in key order: the controller's writer commits up to
hundreds of outcomes at once, which then cost a few statements, and the bucket rows — which
every outcome touches — are locked only for the last moment of the transaction, always in the
same order, so two writers never wait on each other in a cycle. What it costs the writer,
measured on SQLite (batches of 200 finished outcomes, 6,000 requests): 95–133 µs per outcome
without the histograms, 129–139 µs with them.

A row per (histogram, tier, model, bucket) holds how many observations fell in that bucket
(not cumulatively) and their sum: the bucket's upper bound is stored as a number, so a later
change of ``BUCKETS_S`` keeps the old counts under the next bound above them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from qlm.domain import Tier
from qlm.store.models import LatencyBucketModel
from qlm.store.rows import LatencyBucketRow

Histogram = Literal["ttft", "e2e", "queue"]

BUCKETS_S: tuple[float, ...] = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, math.inf,
)  # fmt: skip
"""Upper bounds, seconds: from a chat's sub-second first token to batch jobs of an hour (the
batch tier's default SLO) and past it; the last catches everything."""

_TALLY = "qlm_latency_tally"
_B = LatencyBucketModel


def bucket_of(seconds: float) -> float:
    """The upper bound of the bucket ``seconds`` falls in (the smallest bound >= it)."""
    return BUCKETS_S[bisect.bisect_left(BUCKETS_S, seconds)]


@dataclass(slots=True)
class LatencyTally:
    """Observations of one transaction, by (histogram, tier, model, bucket): [count, sum]."""

    cells: dict[tuple[str, int, str, float], list[float]] = field(default_factory=dict)

    def observe(self, histogram: Histogram, tier: int, model: str, seconds: float) -> None:
        seconds = max(0.0, seconds)  # hosts' clocks may differ by a little
        cell = self.cells.setdefault((histogram, tier, model, bucket_of(seconds)), [0, 0.0])
        cell[0] += 1
        cell[1] += seconds

    def finished(
        self,
        *,
        tier: int,
        model: str,
        submitted_at: float,
        dispatched_at: float | None,
        first_token_at: float | None,
        finished_at: float,
    ) -> None:
        """A finished request's observations, from its stored timestamps: end to end always;
        time to first token and queue wait when it has them (the first dispatch ends the wait;
        the first token ever counts, not a resumed run's)."""
        self.observe("e2e", tier, model, finished_at - submitted_at)
        if first_token_at is not None:
            self.observe("ttft", tier, model, first_token_at - submitted_at)
        if dispatched_at is not None:
            self.observe("queue", tier, model, dispatched_at - submitted_at)


def tally(session: Session) -> LatencyTally:
    """The observations ``session``'s transaction will write when it commits."""
    found = session.info.get(_TALLY)
    if not isinstance(found, LatencyTally):
        found = session.info[_TALLY] = LatencyTally()
    return found


def write_tally(session: Session) -> None:
    """Add the transaction's observations to the stored counters (the write sessions'
    ``before_commit`` hook; a transaction rolled back takes its session, and its tally, with
    it)."""
    pending = session.info.pop(_TALLY, None)
    if not isinstance(pending, LatencyTally) or not pending.cells:
        return
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(_B)
    stmt = stmt.on_conflict_do_update(
        index_elements=[_B.histogram, _B.tier, _B.model, _B.le],
        set_={"count": _B.count + stmt.excluded.count, "sum": _B.sum + stmt.excluded.sum},
    )
    params = [
        {"histogram": h, "tier": t, "model": m, "le": le, "count": int(c), "sum": s}
        for (h, t, m, le), (c, s) in sorted(pending.cells.items())
    ]
    session.execute(stmt, params)


def read(session: Session) -> list[LatencyBucketRow]:
    """Every stored bucket, by histogram, tier, model and bound."""
    query = select(_B).order_by(_B.histogram, _B.tier, _B.model, _B.le)
    return [
        LatencyBucketRow(m.histogram, Tier(m.tier), m.model, m.le, m.count, m.sum)
        for m in session.scalars(query)
    ]


def cumulative(rows: Iterable[LatencyBucketRow]) -> list[tuple[float, int]]:
    """One histogram's stored buckets as Prometheus wants them: ``(bound, observations at or
    below it)`` for every bound of ``BUCKETS_S``; a row whose bound is not one of them (stored
    under other bounds) counts from the next bound above it."""
    counts = [0] * len(BUCKETS_S)
    for row in rows:
        counts[BUCKETS_S.index(bucket_of(row.le))] += row.count
    out, total = [], 0
    for bound, n in zip(BUCKETS_S, counts, strict=True):
        total += n
        out.append((bound, total))
    return out
