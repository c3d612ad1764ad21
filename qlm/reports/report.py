"""The SLO report's figures, from the requests of a window (as ``GET /v1/requests`` lists them)
and the store's attainment per day before it (``GET /v1/admin/attainment``): attainment overall
and by tier, SLO class, tenant and model with its denominators, attainment over the window and
across days against a target, latency percentiles, the worst-served tenants and why requests
missed. Plain data: ``markdown``, ``page`` (HTML) and ``qlm ops report`` render it.

What counts: a request meets its SLO when it finished within every deadline; a failed request
is a miss; cancelled requests are left out; requests not final yet are counted but not judged.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

FINAL = ("finished", "failed", "cancelled")
"""Request states that do not change any more."""

DIMENSIONS = ("tier", "class", "tenant", "model")
"""What the attainment tables break the requests down by."""

CAUSES: dict[str, str] = {
    "failed": "it failed (the reasons are listed below)",
    "instance down": "it was dispatched again without being evicted: its instance went down, "
    "its stream broke, or its controller stopped",
    "evicted": "it was evicted to make room for more urgent work, and resumed later",
    "queued too long": "its run on the instance fit within the deadline it missed; its wait "
    "in the queue before it did not",
    "slow on its instance": "its run on the instance alone, from dispatch, took longer than the "
    "deadline it missed",
}
"""Why a request missed its SLO, the first that holds in this order, and what each means."""

LATENCIES: dict[str, str] = {
    "ttft": "time to first token",
    "e2e": "end to end",
    "queue": "queue wait",
}
"""The latencies measured from submission: to the first token, to the end of a finished
request, and to its first dispatch to an instance."""

PERCENTILES = (50, 90, 99)
TIER_ORDER = ("interactive", "standard", "batch")
WORST_TENANTS = 5
FAILURE_REASONS = 10


@dataclass(slots=True)
class Tally:
    """How many requests of one group there were and how their SLOs went."""

    requests: int = 0
    pending: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    met: int = 0
    ttft_judged: int = 0
    ttft_met: int = 0

    def add(self, r: Mapping[str, Any]) -> None:
        self.requests += 1
        status = r["status"]
        if status not in FINAL:
            self.pending += 1
            return
        self.finished += status == "finished"
        self.failed += status == "failed"
        self.cancelled += status == "cancelled"
        if status != "cancelled":
            self.met += bool(r.get("slo_met"))
        if r.get("ttft_met") is not None:
            self.ttft_judged += 1
            self.ttft_met += bool(r["ttft_met"])

    @property
    def judged(self) -> int:
        """Requests whose SLO is decided: finished or failed."""
        return self.finished + self.failed

    @property
    def missed(self) -> int:
        return self.judged - self.met

    @property
    def attainment(self) -> float | None:
        return self.met / self.judged if self.judged else None

    @property
    def ttft_attainment(self) -> float | None:
        return self.ttft_met / self.ttft_judged if self.ttft_judged else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "pending": self.pending,
            "finished": self.finished,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "judged": self.judged,
            "slo_met": self.met,
            "attainment": self.attainment,
            "ttft_judged": self.ttft_judged,
            "ttft_met": self.ttft_met,
            "ttft_attainment": self.ttft_attainment,
        }


@dataclass(frozen=True, slots=True)
class Percentiles:
    """Nearest-rank percentiles (``PERCENTILES``) of ``count`` observations, seconds."""

    count: int
    values: tuple[float, ...]  # one per PERCENTILES, empty without observations
    max: float | None

    @classmethod
    def of(cls, observations: Iterable[float]) -> Percentiles:
        ordered = sorted(observations)
        n = len(ordered)
        if n == 0:
            return cls(0, (), None)
        return cls(
            n, tuple(ordered[max(0, math.ceil(p / 100 * n) - 1)] for p in PERCENTILES), ordered[-1]
        )

    def as_dict(self) -> dict[str, Any]:
        values = dict(zip((f"p{p}" for p in PERCENTILES), self.values, strict=True))
        return {"count": self.count, **{f"p{p}": values.get(f"p{p}") for p in PERCENTILES}} | {
            "max": self.max
        }


@dataclass(frozen=True, slots=True)
class Bucket:
    """Attainment of the requests submitted in ``[start, end)``."""

    start: float
    end: float
    requests: int
    judged: int
    met: int

    @property
    def attainment(self) -> float | None:
        return self.met / self.judged if self.judged else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "requests": self.requests,
            "judged": self.judged,
            "slo_met": self.met,
            "attainment": self.attainment,
        }


@dataclass(frozen=True, slots=True)
class Trend:
    """The least-squares line through the days' attainment (days without a judged request
    left out): its slope, in attainment per day, and the line's values at the first and last of
    those days."""

    slope_per_day: float
    first: tuple[float, float]  # (day start, attainment on the line)
    last: tuple[float, float]

    @classmethod
    def of(cls, days: Sequence[Bucket]) -> Trend | None:
        points = [(d.start, d.attainment) for d in days if d.attainment is not None]
        if len(points) < 2:
            return None
        xs = [(x - points[0][0]) / 86400.0 for x, _ in points]
        ys = [y for _, y in points if y is not None]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx

        def at(x: float) -> float:
            return my + slope * (x - mx)

        return cls(slope, (points[0][0], at(xs[0])), (points[-1][0], at(xs[-1])))


@dataclass(frozen=True, slots=True)
class TenantMisses:
    name: str
    tally: Tally
    causes: dict[str, int]  # cause -> misses, most first


@dataclass(frozen=True, slots=True)
class SloReport:
    """Everything the report shows, computed once (``build``)."""

    title: str
    since: float
    until: float
    target: float
    tenant: str | None
    overall: Tally
    by: dict[str, list[tuple[str, Tally]]]  # DIMENSIONS -> (name, tally), in display order
    latency: dict[str, list[tuple[str, Percentiles]]]  # LATENCIES -> ("all" and each tier)
    over_window: list[Bucket]
    days: list[Bucket]
    trend: Trend | None
    causes: dict[str, int]  # every CAUSES key, in its order
    failures: list[tuple[str, int]]  # the commonest failure reasons, most first
    worst_tenants: list[TenantMisses] = field(default_factory=list)

    @property
    def window_step(self) -> float:
        w = self.over_window
        return w[0].end - w[0].start if w else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``qlm ops report --format json``)."""
        return {
            "title": self.title,
            "since": self.since,
            "until": self.until,
            "target": self.target,
            "tenant": self.tenant,
            "overall": self.overall.as_dict(),
            "by": {
                dim: [{"name": name, **t.as_dict()} for name, t in rows]
                for dim, rows in self.by.items()
            },
            "latency_s": {
                kind: [{"group": name, **p.as_dict()} for name, p in rows]
                for kind, rows in self.latency.items()
            },
            "over_window": [b.as_dict() for b in self.over_window],
            "days": [b.as_dict() for b in self.days],
            "trend_per_day": None if self.trend is None else self.trend.slope_per_day,
            "miss_causes": self.causes,
            "failures": [{"reason": r, "requests": n} for r, n in self.failures],
            "worst_tenants": [
                {"tenant": w.name, **w.tally.as_dict(), "miss_causes": w.causes}
                for w in self.worst_tenants
            ],
        }


def slo_class(r: Mapping[str, Any]) -> str:
    """A request's SLO class: its ``class`` label when it has one, else its deadlines
    (``"30 s, TTFT 2 s"``)."""
    named = (r.get("labels") or {}).get("class")
    if named:
        return str(named)
    e2e, ttft = r.get("slo_seconds"), r.get("ttft_slo_seconds")
    return f"{e2e:g} s" + ("" if ttft is None else f", TTFT {ttft:g} s")


def miss_cause(r: Mapping[str, Any]) -> str | None:
    """Why a request missed its SLO (a ``CAUSES`` key); None when it did not miss (met it,
    was cancelled, or is not final)."""
    status = r["status"]
    if status == "failed":
        return "failed"
    if status != "finished" or r.get("slo_met") is not False:
        return None
    if r.get("attempts", 0) > r.get("evictions", 0) + 1:
        return "instance down"
    if r.get("evictions", 0) > 0:
        return "evicted"
    submitted, dispatched = r["submitted_at"], r.get("dispatched_at")
    finished, first = r.get("finished_at"), r.get("first_token_at")
    if dispatched is None:
        return "queued too long"
    if finished is not None and finished - submitted > r["slo_seconds"]:
        run, deadline = finished - dispatched, r["slo_seconds"]
    elif r.get("ttft_met") is False and first is not None and r.get("ttft_slo_seconds"):
        run, deadline = first - dispatched, r["ttft_slo_seconds"]
    else:
        return "slow on its instance"
    return "queued too long" if run <= deadline else "slow on its instance"


def failure_reason(error: str | None) -> str:
    """A failure's reason without what is particular to one request: the text before its
    first ``": "`` (``"dead-lettered: ..."``)."""
    text = (error or "no reason recorded").strip()
    head = text.split(": ", 1)[0]
    return head if len(head) <= 80 else head[:77] + "..."


def latencies(r: Mapping[str, Any]) -> dict[str, float]:
    """The request's ``LATENCIES`` that it has reached, seconds."""
    sub = r["submitted_at"]
    out = {}
    if r.get("first_token_at") is not None:
        out["ttft"] = r["first_token_at"] - sub
    if r["status"] == "finished" and r.get("finished_at") is not None:
        out["e2e"] = r["finished_at"] - sub
    if r.get("dispatched_at") is not None:
        out["queue"] = r["dispatched_at"] - sub
    return {k: max(0.0, v) for k, v in out.items()}  # hosts' clocks may differ by a little


NICE_STEPS_S = (60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 7 * 86400)
MAX_WINDOW_BUCKETS = 48


def window_step(span_s: float) -> float:
    """The bucket of the attainment-over-the-window chart: the shortest of ``NICE_STEPS_S``
    that cuts the span into at most ``MAX_WINDOW_BUCKETS``."""
    for step in NICE_STEPS_S:
        if span_s / step <= MAX_WINDOW_BUCKETS:
            return float(step)
    return float(math.ceil(span_s / MAX_WINDOW_BUCKETS))


def _order(dim: str, names: Iterable[str]) -> list[str]:
    if dim == "tier":
        return sorted(names, key=lambda n: (TIER_ORDER.index(n) if n in TIER_ORDER else 99, n))
    return sorted(names)


def build(
    requests: Iterable[Mapping[str, Any]],
    *,
    since: float,
    until: float,
    target: float,
    title: str = "SLO attainment",
    tenant: str | None = None,
    days: Sequence[Mapping[str, Any]] = (),
) -> SloReport:
    """The report of ``requests`` (submitted in ``[since, until)``), with ``days`` the store's
    attainment per day before ``until`` (``GET /v1/admin/attainment`` buckets, oldest first)."""
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target}")
    if not until > since:
        raise ValueError(f"until ({until}) must be after since ({since})")
    overall = Tally()
    by: dict[str, dict[str, Tally]] = {dim: defaultdict(Tally) for dim in DIMENSIONS}
    seen: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in LATENCIES}
    step = window_step(until - since)
    count = math.ceil((until - since) / step)
    window = [[0, 0, 0] for _ in range(count)]  # requests, judged, met
    causes: Counter[str] = Counter()
    tenant_causes: dict[str, Counter[str]] = defaultdict(Counter)
    failures: Counter[str] = Counter()
    for r in requests:
        overall.add(r)
        keys = {"tier": str(r["tier"]), "class": slo_class(r)}
        keys |= {"tenant": str(r["tenant"]), "model": str(r["model"])}
        for dim, name in keys.items():
            by[dim][name].add(r)
        for kind, value in latencies(r).items():
            seen[kind]["all"].append(value)
            seen[kind][keys["tier"]].append(value)
        i = min(count - 1, max(0, int((r["submitted_at"] - since) // step)))
        window[i][0] += 1
        if r["status"] in ("finished", "failed"):
            window[i][1] += 1
            window[i][2] += bool(r.get("slo_met"))
        cause = miss_cause(r)
        if cause is not None:
            causes[cause] += 1
            tenant_causes[keys["tenant"]][cause] += 1
        if r["status"] == "failed":
            failures[failure_reason(r.get("error"))] += 1
    tenants = by["tenant"]
    judged = [(t.attainment, -t.missed, name) for name, t in tenants.items() if t.judged]
    worst = [
        TenantMisses(name, tenants[name], dict(tenant_causes[name].most_common()))
        for attainment, _, name in sorted(judged)
        if attainment is not None and attainment < target
    ][:WORST_TENANTS]
    day_buckets = [
        Bucket(
            float(d["start"]),
            float(d["end"]),
            int(d["requests"]),
            int(d["finished"]) + int(d["failed"]),
            int(d["slo_met"]),
        )
        for d in days
    ]
    return SloReport(
        title=title,
        since=since,
        until=until,
        target=target,
        tenant=tenant,
        overall=overall,
        by={dim: [(n, by[dim][n]) for n in _order(dim, by[dim])] for dim in DIMENSIONS},
        latency={
            kind: [
                (name, Percentiles.of(seen[kind][name]))
                for name in ["all", *_order("tier", (n for n in seen[kind] if n != "all"))]
            ]
            if seen[kind]
            else [("all", Percentiles.of(()))]
            for kind in LATENCIES
        },
        over_window=[
            Bucket(since + i * step, min(since + (i + 1) * step, until), n, j, m)
            for i, (n, j, m) in enumerate(window)
        ],
        days=day_buckets,
        trend=Trend.of(day_buckets),
        causes={c: causes[c] for c in CAUSES},
        failures=failures.most_common(FAILURE_REASONS),
        worst_tenants=worst,
    )


# --- tables, for the terminal, Markdown and HTML ---------------------------------------------


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100.0 * x:.1f} %"


def share(k: int, n: int) -> str:
    """``"97.0 % (97 of 100)"``: a share with its denominator."""
    return "-" if n == 0 else f"{100.0 * k / n:.1f} % ({k:,} of {n:,})"


def seconds(x: float | None) -> str:
    if x is None:
        return "-"
    if x < 10:
        return f"{x:.2f} s"
    return f"{x:,.1f} s" if x < 1000 else f"{x:,.0f} s"


ATTAINMENT_COLUMNS = ("requests", "pending", "failed", "cancelled", "SLO met", "TTFT met")


def attainment_row(name: str, t: Tally) -> list[str]:
    return [
        name,
        f"{t.requests:,}",
        f"{t.pending:,}",
        f"{t.failed:,}",
        f"{t.cancelled:,}",
        share(t.met, t.judged),
        share(t.ttft_met, t.ttft_judged),
    ]


@dataclass(frozen=True, slots=True)
class Table:
    key: str  # a stable name: "overall", "by tier", "latency", ...
    title: str
    columns: tuple[str, ...]
    rows: list[list[str]]
    note: str = ""


def tables(report: SloReport) -> list[Table]:
    """The report's tables, in the order every format shows them."""
    out = [
        Table(
            "overall",
            "Overall",
            ("", *ATTAINMENT_COLUMNS),
            [attainment_row("all", report.overall)],
            "SLO met: of the finished and failed requests (failures are misses; cancelled and "
            "pending requests are left out). TTFT met: of those with a first-token deadline.",
        )
    ]
    for dim, rows in report.by.items():
        note = (
            "A request's class: its `class` label, else its deadlines (end to end, first token)."
            if dim == "class"
            else ""
        )
        out.append(
            Table(
                f"by {dim}",
                f"By {'SLO class' if dim == 'class' else dim}",
                (dim, *ATTAINMENT_COLUMNS),
                [attainment_row(name, t) for name, t in rows],
                note,
            )
        )
    latency_rows = []
    for kind, groups in report.latency.items():
        for name, p in groups:
            values = [seconds(v) for v in p.values] or ["-"] * len(PERCENTILES)
            latency_rows.append([LATENCIES[kind], name, f"{p.count:,}", *values, seconds(p.max)])
    out.append(
        Table(
            "latency",
            "Latency percentiles",
            ("latency", "tier", "requests", *(f"p{p}" for p in PERCENTILES), "max"),
            latency_rows,
            "From submission: to the first token, to the end (finished requests), to the "
            "first dispatch to an instance.",
        )
    )
    missed = sum(report.causes.values())
    out.append(
        Table(
            "causes",
            "Why requests missed their SLO",
            ("cause", "misses", "what it means"),
            [[c, share(n, missed), CAUSES[c]] for c, n in report.causes.items()],
            "Each missed request counts once, under the first cause that holds, in this order.",
        )
    )
    out.append(
        Table(
            "worst tenants",
            "Worst-served tenants",
            ("tenant", "SLO met", "misses", "main causes"),
            [
                [
                    w.name,
                    share(w.tally.met, w.tally.judged),
                    f"{w.tally.missed:,}",
                    ", ".join(f"{c} {n:,}" for c, n in list(w.causes.items())[:3]) or "-",
                ]
                for w in report.worst_tenants
            ],
            f"Tenants below the target ({pct(report.target)}), worst first (at most "
            f"{WORST_TENANTS}).",
        )
    )
    out.append(
        Table(
            "failures",
            "Failure reasons",
            ("reason", "requests"),
            [[reason, f"{n:,}"] for reason, n in report.failures],
        )
    )
    if report.days:
        out.append(
            Table(
                "days",
                "Attainment by day",
                ("day", "requests", "SLO met"),
                [
                    [day_label(d.start, d.end), f"{d.requests:,}", share(d.met, d.judged)]
                    for d in report.days
                ],
                "" if report.trend is None else f"Trend: {trend_text(report.trend)}.",
            )
        )
    return out


def trend_text(trend: Trend) -> str:
    points = 100.0 * trend.slope_per_day
    return f"{points:+.2f} points a day"


def day_label(start: float, end: float | None = None) -> str:
    """The local date of a day bucket: at its middle (a bucket that ends at a report's time of
    day is named after the day it mostly covers)."""
    mid = start if end is None else start + (end - start) / 2
    return time.strftime("%Y-%m-%d", time.localtime(mid))


def time_label(at: float, step: float) -> str:
    """A bucket's start, local time: the date for buckets of a day or more, else the hour."""
    return time.strftime("%m-%d" if step >= 86400 else "%H:%M", time.localtime(at))
