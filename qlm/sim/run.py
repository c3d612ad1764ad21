"""What ``qlm simulate`` and ``qlm demo`` run: a workload from a trace (or synthetic arrivals with
a trace's lengths), a fleet, a policy by name, replayed on simulated instances; the summary gains
what the planner did.

``prepare_simulation`` builds the run, so that a caller can show progress against its number of
requests before it starts; ``run_simulation`` builds and runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from qlm.domain import InstanceSpec, Request
from qlm.engines.perf_model import HardwareCatalog
from qlm.errors import QLMError, WorkloadError
from qlm.fleet import parse_instances
from qlm.planner import BaselineConfig, PlannerConfig, Policy, create_policy
from qlm.rct.profile import RctProfile, default_profile
from qlm.sim.cluster import SimResult, simulate
from qlm.sim.traces import load_lengths, load_trace, scale_rate, synthetic, window
from qlm.sim.workload import create_workload, preset_spec, with_ttft


@dataclass(frozen=True, slots=True)
class Simulation:
    """A run ready to replay: its requests, the fleet and the policy."""

    requests: Sequence[Request]
    instances: Sequence[InstanceSpec]
    policy: Policy
    max_wait: bool = False  # the policy has a starvation guard (its promotions are reported)
    catalog: HardwareCatalog | None = None  # the performance models (None: the shipped ones)

    def run(self, progress: Callable[[int, int], None] | None = None) -> SimResult:
        """Replay the requests; ``progress(done, total)`` is called as requests finish."""
        result = simulate(
            self.requests, self.instances, self.policy, progress=progress, catalog=self.catalog
        )
        return with_planner_summary(result, max_wait=self.max_wait)


def prepare_simulation(
    *,
    trace: str,
    workload: str,
    instances: str,
    policy: str,
    seed: int,
    start_s: float,
    duration_s: float | None,
    rate_scale: float,
    slo_scale: float,
    synthetic_rate: float | None,
    arrival: Literal["poisson", "gamma"],
    cv: float,
    profile: Callable[[], RctProfile] = default_profile,
    planner: PlannerConfig | None = None,
    ttft_slo: Mapping[str, float] | None = None,
    baselines: BaselineConfig | None = None,
    catalog: HardwareCatalog | None = None,
) -> Simulation:
    """The run ``qlm simulate`` describes: the trace window (or ``synthetic_rate`` arrivals with
    the lengths of ``trace``), the workload preset's requests, the fleet and the policy.
    ``profile`` gives the estimator's profile, read once the trace, the workload and the fleet
    are known to be valid (their errors come first); ``planner``: the ``qlm`` policy's settings
    (default: ``PlannerConfig.for_simulation()``); ``ttft_slo``: time-to-first-token SLOs by SLO
    class (seconds, scaled by ``slo_scale``), in any workload; ``baselines``: the baselines'
    parameters; ``catalog``: the performance models the instances run on
    (``qlm.engines.perf_table.load_catalog``; default: the shipped ones). A single-model workload
    serves the fleet's models when the fleet does not serve its own (``preset_spec``)."""
    if ttft_slo:
        classes = preset_spec(workload, slo_scale=slo_scale).slo_classes
        try:
            with_ttft(classes, ttft_slo)
        except WorkloadError as exc:
            raise WorkloadError(f"--ttft-slo: {exc}") from None
    if synthetic_rate is not None:
        if duration_s is None:
            raise QLMError("--duration is required with --rate (a synthetic workload)")
        tr = synthetic(
            load_lengths(trace),
            rate=synthetic_rate,
            duration_s=duration_s,
            arrival=arrival,
            cv=cv,
            seed=seed,
        )
    else:
        tr = load_trace(trace, seed=seed)
        if rate_scale != 1.0:
            tr = scale_rate(tr, rate_scale)
        if start_s > 0 or duration_s is not None:
            end = start_s + duration_s if duration_s is not None else tr.duration_s + 1.0
            tr = window(tr, start_s, end)
    specs = parse_instances(instances, catalog)
    requests = create_workload(
        workload,
        tr,
        seed=seed,
        slo_scale=slo_scale,
        ttft_slo=ttft_slo,
        fleet_models=[m for spec in specs for m in spec.models],
    )
    config = planner or PlannerConfig.for_simulation()
    pol = create_policy(policy, profile=profile(), planner=config, baselines=baselines)
    return Simulation(
        requests,
        specs,
        pol,
        max_wait=policy == "qlm" and bool(config.max_wait_s),
        catalog=catalog,
    )


def run_simulation(
    *,
    trace: str,
    workload: str,
    instances: str,
    policy: str,
    seed: int,
    start_s: float,
    duration_s: float | None,
    rate_scale: float,
    slo_scale: float,
    synthetic_rate: float | None,
    arrival: Literal["poisson", "gamma"],
    cv: float,
    profile: Callable[[], RctProfile] = default_profile,
    planner: PlannerConfig | None = None,
    ttft_slo: Mapping[str, float] | None = None,
    progress: Callable[[int, int], None] | None = None,
    catalog: HardwareCatalog | None = None,
) -> SimResult:
    """``prepare_simulation``, then run it."""
    return prepare_simulation(
        trace=trace,
        workload=workload,
        instances=instances,
        policy=policy,
        seed=seed,
        start_s=start_s,
        duration_s=duration_s,
        rate_scale=rate_scale,
        slo_scale=slo_scale,
        synthetic_rate=synthetic_rate,
        arrival=arrival,
        cv=cv,
        profile=profile,
        planner=planner,
        ttft_slo=ttft_slo,
        catalog=catalog,
    ).run(progress)


def with_planner_summary(result: SimResult, *, max_wait: bool = False) -> SimResult:
    """Add what the planner did (``qlm`` only) to the summary: plans, their status, the groups
    left at risk and the scale-up signal (capacity needed to meet every SLO); with
    ``max_wait`` (a starvation guard is set) the requests it pulled ahead of the plan's order
    (``max_wait_promoted``)."""
    plans = result.plans
    if plans:
        needed = [p.capacity_needed for p in plans]
        result.summary["planner"] = {
            "plans": len(plans),
            "status": {st: sum(p.status == st for p in plans) for st in {p.status for p in plans}},
            "plans_with_groups_at_risk": sum(bool(p.at_risk) for p in plans),
            "max_capacity_needed": None
            if any(c is None for c in needed)
            else max(c for c in needed if c is not None),
            "solve_s_total": sum(p.solve_s for p in plans),
        }
        if max_wait:
            result.summary["planner"]["max_wait_promoted"] = result.overdue_pulls
    return result
