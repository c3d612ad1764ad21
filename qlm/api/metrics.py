"""``GET /metrics``: the control plane in Prometheus's text format.

Everything is read at scrape time — the active controller's published state, the store, and this
API replica's own counters — into metric families that one collector hands to a registry made
for that scrape, so no ``prometheus_client`` global state is touched and two apps in one process
never share a metric. Store figures cover the requests submitted in the last
``QLM_API__METRICS_WINDOW_S`` (gauges, not counters: they describe the window), but for the
latency histograms, which the store keeps as counters (below).

Metrics (labels in braces):

- ``qlm_queue_depth{instance}``, ``qlm_queue_groups{instance}``,
  ``qlm_queue_at_risk_requests{instance}``, ``qlm_queue_predicted_drain_seconds{instance}``
- ``qlm_instance_up{instance}``, ``qlm_instance_draining{instance}``,
  ``qlm_instance_outstanding{instance}``, ``qlm_instance_max_running{instance}``
- ``qlm_controller_{received,settled,evictions,swaps,model_switches,plans}_total{controller}``
- ``qlm_plan_solve_seconds``, ``qlm_plan_objective``, ``qlm_plan_edf_objective``,
  ``qlm_plan_groups_at_risk``, ``qlm_plan_groups_deferred``, ``qlm_plan_capacity_needed``, ``qlm_plan_info{status,method,trigger}``
- ``qlm_slo_attainment{tier}``, ``qlm_slo_attainment_by_tenant{tenant}`` (0..1)
- ``qlm_requests{tenant,status}`` (window), ``qlm_api_submissions_total{tenant,outcome}`` (replica)
- ``qlm_completion_estimate_error_seconds{quantile}``: finished_at minus the last predicted
  completion of recently finished requests (positive: later than predicted), and
  ``qlm_completion_estimate_abs_error_seconds_mean``
- ``qlm_request_ttft_seconds{tier,model}``, ``qlm_request_e2e_seconds{tier,model}``,
  ``qlm_request_queue_seconds{tier,model}``: histograms of the finished requests' time to first
  token, end-to-end latency and wait in the queue (submission to first dispatch), since the
  store began keeping them. Not counted at scrape time: each finished request adds its
  observations to counters in the store as its outcome is recorded (``qlm.store.latency`` says
  why), so a scrape reads a few rows however large the store, the counters never go down
  (retention deletes requests, not them), and every API replica reports the same values
- ``qlm_controller_state_age_seconds{controller}``: of the controllers alive or recently so
  (``live_controllers``), so that an alert on a stale state fires for a controller that stopped
  publishing and ends once it is gone, not forever
- ``qlm_broker_up``, ``qlm_store_up``: 1 when this replica reaches the broker (it takes messages)
  and the store (it answers), as ``/readyz`` checks them. A store that does not answer leaves
  the scrape standing, with ``qlm_store_up`` 0 and without what the store contributes, so that
  an alert can say which part is down rather than only that the scrape failed (a scrape with an
  admin key still needs the store for the key, once the key cache expires:
  ``QLM_API__KEY_CACHE_S``)
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from qlm.api.context import ApiContext
from qlm.domain import PlanRecord, RequestStatus
from qlm.global_queue import GlobalQueue
from qlm.store import ControllerStateRow, LatencyBucketRow, SloSummaryRow, Store, StoreError
from qlm.store.latency import cumulative

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_ERROR_SAMPLE = 500
_COUNTERS = ("received", "settled", "evictions", "swaps", "model_switches", "plans")
BROKER_TIMEOUT_S = 5.0
"""The longest a check of the broker may take (``/readyz`` and a scrape): a broker that does
not answer within it is down."""


@dataclass(frozen=True, slots=True)
class StoreFigures:
    counts: dict[tuple[str, RequestStatus], int]
    by_tier: list[SloSummaryRow]
    by_tenant: list[SloSummaryRow]
    errors: list[float]
    plan: PlanRecord | None
    controllers: list[ControllerStateRow]
    latencies: list[LatencyBucketRow] = field(default_factory=list)


NO_FIGURES = StoreFigures(counts={}, by_tier=[], by_tenant=[], errors=[], plan=None, controllers=[])
"""What a store that does not answer contributes."""


async def broker_up(queue: GlobalQueue) -> bool:
    """Whether the global queue takes messages now, within ``BROKER_TIMEOUT_S``."""
    try:
        return await asyncio.wait_for(queue.healthy(), BROKER_TIMEOUT_S)
    except TimeoutError:
        return False


def read_store(store: Store, since: float) -> StoreFigures:
    """Everything the store contributes, in one worker-thread call."""
    finished, _ = store.list_requests(
        status=RequestStatus.FINISHED, since=since, limit=_ERROR_SAMPLE
    )
    errors = [
        r.finished_at - r.predicted_completion_at
        for r in finished
        if r.finished_at is not None and r.predicted_completion_at is not None
    ]
    latest = store.latest_plan()
    return StoreFigures(
        counts=store.counts(since=since),
        by_tier=store.slo_summary(since=since, group_by="tier"),
        by_tenant=store.slo_summary(since=since, group_by="tenant"),
        errors=errors,
        plan=None if latest is None else latest.plan,
        controllers=store.controller_states(),
        latencies=store.latency_buckets(),
    )


class _Families:
    """A collector over families built beforehand (one per scrape)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


_HISTOGRAMS = {
    "ttft": ("qlm_request_ttft_seconds", "Time to first token of finished requests."),
    "e2e": ("qlm_request_e2e_seconds", "Submission to finish of finished requests."),
    "queue": (
        "qlm_request_queue_seconds",
        "Wait in the queue (submission to first dispatch) of finished requests.",
    ),
}


def _le(bound: float) -> str:
    """A bucket's ``le`` label as Prometheus's clients write it (``0.5``, ``1.0``, ``+Inf``)."""
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def latency_histograms(rows: Iterable[LatencyBucketRow]) -> list[Metric]:
    """The stored latency buckets as Prometheus histograms, one series per tier and model:
    cumulative buckets up to ``+Inf``, ``_sum`` and ``_count``."""
    cells: dict[tuple[str, str, str], list[LatencyBucketRow]] = {}
    for row in rows:
        cells.setdefault((row.histogram, row.tier.name.lower(), row.model), []).append(row)
    out: list[Metric] = []
    for key, (name, doc) in _HISTOGRAMS.items():
        family = HistogramMetricFamily(name, doc, labels=["tier", "model"])
        for (histogram, tier, model), found in sorted(cells.items()):
            if histogram != key:
                continue
            buckets = [(_le(bound), n) for bound, n in cumulative(found)]
            family.add_metric([tier, model], buckets, sum(r.sum for r in found))
        out.append(family)
    return out


def live_controllers(
    states: Iterable[ControllerStateRow], now: float, gone_s: float
) -> list[ControllerStateRow]:
    """The controllers still reported: all but the gone ones. A controller is gone when it
    stopped cleanly (its last publication says so), or when it published nothing for
    ``gone_s`` (``QLM_API__CONTROLLER_GONE_S``): it was killed, or its host died, or it was
    restarted under another name (the default name, host-pid, changes at every start). Until
    then a silent controller stays, its age growing, so that a staleness alert fires; after,
    its row stays in the store (``GET /v1/admin/controllers`` lists it) but not in the
    metrics."""
    return [s for s in states if s.stopped_at is None and now - s.updated_at < gone_s]


def families(
    doc: Mapping[str, Any] | None,
    figures: StoreFigures,
    submissions: Mapping[tuple[str, str], int],
    *,
    controller_gone_s: float,
    broker_ok: bool = True,
    store_ok: bool = True,
) -> list[Metric]:
    """The metric families of one scrape (pure: the inputs are read already)."""
    out: list[Metric] = []

    def gauge(name: str, doc_: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc_, labels=list(labels))
        out.append(family)
        return family

    doc = doc or {}
    depth = gauge("qlm_queue_depth", "Requests in each virtual queue.", ["instance"])
    ngroups = gauge("qlm_queue_groups", "Request groups in each virtual queue.", ["instance"])
    risk = gauge(
        "qlm_queue_at_risk_requests", "Requests of groups predicted to miss.", ["instance"]
    )
    drain = gauge(
        "qlm_queue_predicted_drain_seconds",
        "Seconds until each virtual queue is predicted empty.",
        ["instance"],
    )
    at = doc.get("at")
    for queue in doc.get("queues") or []:
        name = str(queue.get("instance"))
        groups = queue.get("groups") or []
        depth.add_metric([name], sum(int(g.get("size", 0)) for g in groups))
        ngroups.add_metric([name], len(groups))
        risk.add_metric([name], sum(int(g.get("size", 0)) for g in groups if g.get("at_risk")))
        drain_at = queue.get("predicted_drain_at")
        if isinstance(drain_at, int | float) and isinstance(at, int | float):
            drain.add_metric([name], max(0.0, float(drain_at) - float(at)))

    up = gauge("qlm_instance_up", "1 when the controller's health check passes.", ["instance"])
    draining = gauge("qlm_instance_draining", "1 while draining.", ["instance"])
    outstanding = gauge("qlm_instance_outstanding", "Requests running.", ["instance"])
    max_running = gauge("qlm_instance_max_running", "Concurrency limit.", ["instance"])
    for inst in doc.get("instances") or []:
        name = str(inst.get("name"))
        up.add_metric([name], 1.0 if inst.get("up") else 0.0)
        draining.add_metric([name], 1.0 if inst.get("draining") else 0.0)
        if isinstance(inst.get("outstanding"), int | float):
            outstanding.add_metric([name], float(inst["outstanding"]))
        if isinstance(inst.get("max_running"), int | float):
            max_running.add_metric([name], float(inst["max_running"]))

    counters = doc.get("counters") or {}
    controller = str(doc.get("controller", ""))
    for key in _COUNTERS:
        family = CounterMetricFamily(
            f"qlm_controller_{key}", f"Controller counter {key!r}.", labels=["controller"]
        )
        if isinstance(counters.get(key), int | float):
            family.add_metric([controller], float(counters[key]))
        out.append(family)

    plan = figures.plan
    solve = gauge("qlm_plan_solve_seconds", "Solve time of the latest plan.")
    objective = gauge("qlm_plan_objective", "Expected weighted SLO violation of the latest plan.")
    edf = gauge("qlm_plan_edf_objective", "The same for EDF, on the latest plan's input.")
    at_risk = gauge("qlm_plan_groups_at_risk", "Groups the latest plan leaves at risk.")
    deferred = gauge(
        "qlm_plan_groups_deferred", "Groups cost-aware admission put behind the others."
    )
    capacity = gauge(
        "qlm_plan_capacity_needed", "Fleet multiple every SLO needs (absent: beyond 64x)."
    )
    info = gauge(
        "qlm_plan_info",
        "The latest plan's status, method and trigger.",
        ["status", "method", "trigger"],
    )
    if plan is not None:
        solve.add_metric([], plan.solve_s)
        objective.add_metric([], plan.objective)
        edf.add_metric([], plan.edf_objective)
        at_risk.add_metric([], len(plan.at_risk))
        deferred.add_metric([], plan.deferred)
        if plan.capacity_needed is not None:
            capacity.add_metric([], plan.capacity_needed)
        info.add_metric([plan.status, plan.method, plan.trigger], 1.0)

    by_tier = gauge("qlm_slo_attainment", "SLO attainment (0..1) in the window.", ["tier"])
    for row in figures.by_tier:
        if row.attainment is not None:
            by_tier.add_metric([row.group], row.attainment)
    by_tenant = gauge(
        "qlm_slo_attainment_by_tenant", "SLO attainment (0..1) in the window.", ["tenant"]
    )
    for row in figures.by_tenant:
        if row.attainment is not None:
            by_tenant.add_metric([row.group], row.attainment)

    requests = gauge("qlm_requests", "Requests in the window.", ["tenant", "status"])
    for (tenant, status), n in sorted(figures.counts.items()):
        requests.add_metric([tenant, status.name.lower()], n)
    api = CounterMetricFamily(
        "qlm_api_submissions", "Submissions to this API replica.", labels=["tenant", "outcome"]
    )
    for (tenant, outcome), n in sorted(submissions.items()):
        api.add_metric([tenant, outcome], n)
    out.append(api)

    error = gauge(
        "qlm_completion_estimate_error_seconds",
        "Finish time minus the last predicted completion, recent finished requests.",
        ["quantile"],
    )
    mean_abs = gauge(
        "qlm_completion_estimate_abs_error_seconds_mean",
        "Mean absolute completion-time estimate error, recent finished requests.",
    )
    if figures.errors:
        for q in (0.5, 0.9, 0.99):
            error.add_metric([str(q)], _quantile(figures.errors, q))
        mean_abs.add_metric([], sum(abs(e) for e in figures.errors) / len(figures.errors))

    out.extend(latency_histograms(figures.latencies))

    age = gauge(
        "qlm_controller_state_age_seconds",
        "Seconds since each controller published.",
        ["controller"],
    )
    now = time.time()
    for state in live_controllers(figures.controllers, now, controller_gone_s):
        age.add_metric([state.name], max(0.0, now - state.updated_at))

    gauge("qlm_broker_up", "1 when this API replica reaches the broker.").add_metric(
        [], 1.0 if broker_ok else 0.0
    )
    gauge("qlm_store_up", "1 when this API replica reaches the store.").add_metric(
        [], 1.0 if store_ok else 0.0
    )
    return out


async def render(ctx: ApiContext) -> bytes:
    """One scrape. A store that does not answer is reported (``qlm_store_up`` 0), not raised:
    the families it would fill are left empty, and the controller's state is still read when
    the controller runs in this process."""
    broker_ok = await broker_up(ctx.queue)
    store_ok = True
    try:
        doc = await ctx.control.snapshot()
    except StoreError as exc:
        log.warning("metrics without the controller's state: %s", exc)
        doc, store_ok = None, False
    figures = NO_FIGURES
    if store_ok:
        since = ctx.clock() - ctx.settings.metrics_window_s
        try:
            figures = await ctx.threads.run(read_store, ctx.store, since)
        except StoreError as exc:
            log.warning("metrics without the store's figures: %s", exc)
            store_ok = False
    registry = CollectorRegistry(auto_describe=False)
    collector: Collector = _Families(
        families(
            doc,
            figures,
            dict(ctx.submissions),
            controller_gone_s=ctx.settings.controller_gone_s,
            broker_ok=broker_ok,
            store_ok=store_ok,
        )
    )
    registry.register(collector)
    return generate_latest(registry)
