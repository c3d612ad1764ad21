"""Request group size (paper §8.3, Fig. 18): SLO attainment and planning time as δ varies.

QLM bounds every request group at δ × the average batch size (``GroupingConfig.delta`` ×
``avg_batch_size``; the policy ships δ = 4 × 8 = 32 requests, ``DEFAULT_GROUPING``). Small groups
let the planner decide finely and cost it more groups to order; large groups are cheap and coarse.
For each δ this runs ``qlm`` with that bound (nothing else changed) on W_B over the Azure
conversation trace at each load of ``--rates``, and measures:

- SLO attainment, and its degradation from the smallest δ (the paper's y axis);
- the planning overhead: CPU seconds in ``QlmPolicy.plan`` (concurrency choice, admission, the
  solver and applying the plan) per plan, mean and largest, and in re-clustering the groups, over
  the run; the groups per plan. The solver's budget is counted in scored orders (5,000 a plan),
  so a plan's compute grows with its groups; the simulator charges plans no virtual time, so
  the overhead does not delay decisions here (in production a plan is bounded by its time budget
  and spaced by what it costs).

Prints the table and writes ``results/group_size.json`` and ``group_size.png``.

Reproduce: .venv/bin/python experiments/group_size.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from stamp import write_result

from qlm.planner import PlannerConfig
from qlm.planner.config import DEFAULT_GROUPING
from qlm.planner.qlm_policy import QlmPolicy
from qlm.profiling import simulated_fleet
from qlm.sim.cluster import ClusterSimulation
from qlm.sim.traces import load_trace, scale_rate, window
from qlm.sim.workload import create_workload


class Timer:
    """CPU seconds of each call of a wrapped function (this process's; a simulation runs in one
    thread, k-means' threads included in the process's time)."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls.append(time.process_time() - t0)

        return timed


def run_one(job: tuple[float, float, float, str, int, int]) -> dict[str, Any]:
    delta, rate, end_s, instances, seed, evaluations = job
    trace = window(scale_rate(load_trace("azure-conv", seed=seed), rate), 0.0, end_s)
    catalog, specs, profile = simulated_fleet(instances)
    models = [m for spec in specs for m in spec.models]
    requests = create_workload("wb", trace, seed=seed, fleet_models=models)
    grouping = dataclasses.replace(DEFAULT_GROUPING, delta=delta)
    policy = QlmPolicy(profile, config=PlannerConfig.for_simulation(evaluations), grouping=grouping)
    plans, reclusters = Timer(), Timer()
    policy.plan = plans.wrap(policy.plan)  # type: ignore[method-assign]
    policy.grouper.recluster = reclusters.wrap(policy.grouper.recluster)  # type: ignore[method-assign]
    cpu0 = time.process_time()
    result = ClusterSimulation(specs, policy, catalog=catalog).run(requests)
    cpu = time.process_time() - cpu0
    s = result.summary
    groups = [p.groups for p in result.plans]
    return {
        "delta": delta,
        "max_group_size": delta * grouping.avg_batch_size,
        "rate": rate,
        "requests": len(requests),
        "slo_attainment": s["slo_attainment"],
        "by_tier": {k: v["slo_attainment"] for k, v in s["slo_attainment_by_tier"].items()},
        "throughput_rps": s["throughput_rps"],
        "plans": len(plans.calls),
        "plan_cpu_s": sum(plans.calls),
        "plan_cpu_mean_ms": 1000 * sum(plans.calls) / max(len(plans.calls), 1),
        "plan_cpu_max_ms": 1000 * max(plans.calls, default=0.0),
        "groups_mean": sum(groups) / max(len(groups), 1),
        "groups_max": max(groups, default=0),
        "reclusters": len(reclusters.calls),
        "recluster_cpu_s": sum(reclusters.calls),
        "run_cpu_s": cpu,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--deltas", default="1,2,4,8,16", help="δ values (group bound: δ × 8)")
    ap.add_argument("--rates", default="2.8,3.6", help="arrival-rate multipliers of Azure conv")
    ap.add_argument("--end", type=float, default=300.0, help="seconds of the trace to replay")
    ap.add_argument("--instances", default="2xA100:llama-3-8b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--evaluations", type=int, default=5000, help="planner budget per plan")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--name", default="group_size")
    args = ap.parse_args(argv)
    deltas = [float(d) for d in args.deltas.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    jobs = [
        (d, r, args.end, args.instances, args.seed, args.evaluations) for r in rates for d in deltas
    ]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(run_one, jobs))
    report(rows, rates, args)
    given = argv if argv is not None else sys.argv[1:]
    out = write_result(args.name, "group_size.py", given, {"args": vars(args), "rows": rows})
    plot(rows, rates, out.with_suffix(".png"), args)
    return 0


def report(rows: list[dict[str, Any]], rates: list[float], args: argparse.Namespace) -> None:
    print(f"\nW_B on {args.instances}, first {args.end:g} s of Azure conv, seed {args.seed}")
    print(
        f"{'load':>6}{'δ':>5}{'group ≤':>9}{'SLO %':>8}{'vs min δ':>10}{'req/s':>7}{'plans':>7}"
        f"{'groups':>8}{'plan ms':>9}{'max ms':>8}{'plan s':>8}{'recl. s':>8}{'run s':>7}"
    )
    for rate in rates:
        sub = sorted((r for r in rows if r["rate"] == rate), key=lambda r: r["delta"])
        base = sub[0]["slo_attainment"]
        for r in sub:
            print(
                f"×{rate:<5g}{r['delta']:>5g}{r['max_group_size']:>9.0f}"
                f"{100 * r['slo_attainment']:>8.1f}{100 * (r['slo_attainment'] - base):>+10.1f}"
                f"{r['throughput_rps']:>7.2f}{r['plans']:>7}{r['groups_mean']:>8.1f}"
                f"{r['plan_cpu_mean_ms']:>9.1f}{r['plan_cpu_max_ms']:>8.0f}{r['plan_cpu_s']:>8.1f}"
                f"{r['recluster_cpu_s']:>8.1f}{r['run_cpu_s']:>7.0f}"
            )
    print("(plan ms: CPU per plan, mean and largest; plan s / recl. s / run s: CPU over the run)")


def plot(
    rows: list[dict[str, Any]], rates: list[float], path: Path, args: argparse.Namespace
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for rate in rates:
        sub = sorted((r for r in rows if r["rate"] == rate), key=lambda r: r["delta"])
        base = sub[0]["slo_attainment"]
        xs = [r["delta"] for r in sub]
        a1.plot(
            xs, [100 * (base - r["slo_attainment"]) for r in sub], marker="o", label=f"×{rate:g}"
        )
        a2.plot(xs, [r["plan_cpu_mean_ms"] for r in sub], marker="o", label=f"×{rate:g}")
    a1.set(
        xscale="log", xlabel="δ (group ≤ δ × 8 requests)", ylabel="SLO points lost vs smallest δ"
    )
    a2.set(xscale="log", xlabel="δ (group ≤ δ × 8 requests)", ylabel="CPU per plan (ms)")
    for ax in (a1, a2):
        ax.set_xticks(sorted({r["delta"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"W_B on {args.instances}, first {args.end:g} s of Azure conv", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
