"""The paper's §8 sweeps (Figs. 8, 9, 12, 15, 16, 20): SLO attainment and throughput of every
policy as one property of the workload rises.

One workload (``--workload``: ``wa``, ``wb`` or ``wc``) on the Azure conversation trace's arrivals
and lengths, one fleet, every policy behind the same harness (``ClusterSimulation``), trace window
and seed. ``--vary`` names what rises, ``--values`` its values:

- ``rate``: the trace's arrival rate times the value (load);
- ``mega``: W_C's share of mega prompts (Fig. 15; ``wc`` only), at ``--rate``;
- ``interactive``: the interactive class's share, the others rescaled (Figs. 9 and 12);
- ``tail``: W_A's tail models' total share (Fig. 8; ``wa`` and ``wc``);
- ``slo``: every SLO times the value (Appendix A.1, Fig. 20);
- ``backlog``: a queue of that many requests waiting at time 0, on top of the trace at ``--rate``
  (Fig. 16, the growing queue): the backlog is the trace's requests that follow the window,
  every one arriving at 0 (ids ``b…``), with the workload's models and SLO classes.

Each row has SLO attainment (all requests, per tier, the backlog's and the trace's apart),
throughput over the makespan, the mean number waiting (Little's law: requests × mean queueing time
/ makespan), GPU memory utilisation (Appendix A.2, Fig. 21), model switches, evictions and swaps,
and for ``qlm`` the plans and the CPU seconds they took (the simulator charges plans no virtual
time; production bounds each by its budget). Prints the table and writes
``results/<name>.json`` and ``<name>.png``.

Reproduce: .venv/bin/python experiments/sweep.py --workload wc --vary rate --values 0.25,0.5,0.75,1
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from stamp import write_result

from qlm.domain import Request
from qlm.planner import PlannerConfig, create_policy
from qlm.profiling import simulated_fleet
from qlm.sim.cluster import ClusterSimulation
from qlm.sim.traces import load_trace, scale_rate, window
from qlm.sim.workload import create_workload

FLEETS = {
    # W_A's three smaller models share two A100s; Llama-2-70B (140 GB of weights) gets a 2-GPU
    # instance of its own (as in experiments/ablation.py).
    "wa": "2xA100:llama-3-8b+llama-2-7b+llama-2-13b,1xA100/2:llama-2-70b",
    "wb": "1xA100:llama-3-8b",
    "wc": "2xA100:llama-3-8b+llama-2-7b+llama-2-13b,1xA100/2:llama-2-70b",
}
VARY = ("rate", "mega", "interactive", "tail", "slo", "backlog")
POLICIES = "fcfs,edf,sedf,priority,proserve,shepherd,qlm"
TIERS = ("interactive", "standard", "batch")


def build(
    workload: str, vary: str, value: float, rate: float, end_s: float, seed: int, models: list[str]
) -> list[Request]:
    """The requests of one point of the sweep."""
    load = value if vary == "rate" else rate
    trace = scale_rate(load_trace("azure-conv", seed=seed), load)
    knobs: dict[str, Any] = {"seed": seed, "fleet_models": models}
    if vary == "mega":
        knobs["mega_share"] = value
    elif vary == "interactive":
        knobs["interactive_share"] = value
    elif vary == "tail":
        knobs["tail_share"] = value
    elif vary == "slo":
        knobs["slo_scale"] = value
    requests = create_workload(workload, window(trace, 0.0, end_s), **knobs)
    if vary != "backlog" or value < 1:
        return requests
    later = window(trace, end_s, trace.arrival_s[-1] + 1.0)
    extra = create_workload(workload, later, **{**knobs, "seed": seed + 1})[: int(value)]
    if len(extra) < int(value):
        raise SystemExit(f"the trace has only {len(extra)} requests after {end_s:g} s")
    backlog = [dataclasses.replace(r, id=f"b{r.id}", arrival_s=0.0) for r in extra]
    return sorted(backlog + requests, key=lambda r: r.arrival_s)


def run_one(job: tuple[str, str, float, str, float, float, int, str, int]) -> dict[str, Any]:
    workload, vary, value, policy_name, rate, end_s, seed, instances, evaluations = job
    catalog, specs, profile = simulated_fleet(instances)
    models = [m for spec in specs for m in spec.models]
    requests = build(workload, vary, value, rate, end_s, seed, models)
    planner = PlannerConfig.for_simulation(evaluations)
    policy = create_policy(policy_name, planner=planner, profile=profile)
    cpu0, t0 = time.process_time(), time.perf_counter()
    result = ClusterSimulation(specs, policy, catalog=catalog).run(requests)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    s = result.summary
    met = {r.request.id for r in result.records if r.slo_met}
    backlog = [r.request.id for r in result.records if r.request.id.startswith("b")]
    steady = [r.request.id for r in result.records if not r.request.id.startswith("b")]
    row: dict[str, Any] = {
        "workload": workload,
        "vary": vary,
        "value": value,
        "policy": policy_name,
        "requests": len(requests),
        "failed": s["failed"],
        "slo_attainment": s["slo_attainment"],
        "by_tier": {k: v["slo_attainment"] for k, v in s["slo_attainment_by_tier"].items()},
        "throughput_rps": s["throughput_rps"],
        "makespan_s": s["makespan_s"],
        "mean_waiting": len(requests) * s["queue_s"]["mean"] / s["makespan_s"],
        "queue_s_p50": s["queue_s"]["p50"],
        "gpu_memory_utilization": s["gpu_memory_utilization"],
        "model_switches": s["model_switches"],
        "evictions": s["evictions"],
        "swaps": s["swaps"],
        "cpu_s": cpu,
        "wall_s": wall,
    }
    if backlog:
        row["backlog_attainment"] = sum(i in met for i in backlog) / len(backlog)
        row["steady_attainment"] = sum(i in met for i in steady) / max(len(steady), 1)
    if result.plans:
        row["plans"] = len(result.plans)
        row["plan_solve_s"] = sum(p.solve_s for p in result.plans)
        row["mean_groups"] = sum(p.groups for p in result.plans) / len(result.plans)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", choices=sorted(FLEETS), default="wc")
    ap.add_argument("--vary", choices=VARY, default="rate")
    ap.add_argument("--values", default="0.25,0.5,0.75,1", help="values of --vary")
    ap.add_argument("--rate", type=float, default=0.5, help="load when --vary is not rate")
    ap.add_argument("--end", type=float, default=600.0, help="seconds of the trace to replay")
    ap.add_argument("--instances", default="", help="default: the workload's fleet (FLEETS)")
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--evaluations", type=int, default=5000, help="qlm planner budget per plan")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--name", default="", help="result name (default: sweep_<workload>_<vary>)")
    args = ap.parse_args(argv)
    if args.vary == "mega" and args.workload != "wc":
        ap.error("--vary mega needs --workload wc")
    if args.vary == "tail" and args.workload == "wb":
        ap.error("--vary tail needs --workload wa or wc")
    instances = args.instances or FLEETS[args.workload]
    values = [float(v) for v in args.values.split(",")]
    policies = args.policies.split(",")
    jobs = [
        (
            args.workload,
            args.vary,
            v,
            p,
            args.rate,
            args.end,
            args.seed,
            instances,
            args.evaluations,
        )
        for v in values
        for p in policies
    ]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(run_one, jobs))
    report(rows, policies, values, args, instances)
    name = args.name or f"sweep_{args.workload}_{args.vary}"
    given = argv if argv is not None else sys.argv[1:]
    payload = {"args": vars(args), "instances": instances, "rows": rows}
    out = write_result(name, "sweep.py", given, payload)
    plot(rows, policies, out.with_suffix(".png"), args, instances)
    return 0


def _label(args: argparse.Namespace) -> str:
    return {
        "rate": "arrival rate × Azure conv",
        "mega": "mega prompts (share of requests)",
        "interactive": "interactive share",
        "tail": "tail models' share",
        "slo": "SLO scale",
        "backlog": "requests waiting at 0 s",
    }[args.vary]


def report(
    rows: list[dict[str, Any]],
    policies: list[str],
    values: list[float],
    args: argparse.Namespace,
    instances: str,
) -> None:
    by = {(r["policy"], r["value"]): r for r in rows}
    fixed = "" if args.vary == "rate" else f", load ×{args.rate:g}"
    print(
        f"\n{args.workload.upper()} on {instances}, first {args.end:g} s of Azure conv{fixed}, "
        f"seed {args.seed}; rows: {_label(args)}"
    )
    for title, key, fmt in (
        ("SLO attainment (%)", "slo_attainment", "{:.1f}"),
        ("throughput (requests/s)", "throughput_rps", "{:.2f}"),
        ("mean waiting (requests, Little's law)", "mean_waiting", "{:.0f}"),
        ("GPU memory utilisation (%)", "gpu_memory_utilization", "{:.0f}"),
    ):
        scale = 100.0 if key in ("slo_attainment", "gpu_memory_utilization") else 1.0
        print(f"\n{title}")
        print(f"{'':>8}" + "".join(f"{p:>10}" for p in policies))
        for v in values:
            cells = "".join(
                f"{fmt.format(scale * by[(p, v)][key]):>10}" if (p, v) in by else f"{'-':>10}"
                for p in policies
            )
            print(f"{v:>8g}{cells}")
    if any("backlog_attainment" in r for r in rows):
        print("\nSLO attainment (%) of the backlog / of the trace's requests")
        for v in values:
            cells = "".join(
                f"{100 * by[(p, v)].get('backlog_attainment', float('nan')):>6.1f}/"
                f"{100 * by[(p, v)].get('steady_attainment', by[(p, v)]['slo_attainment']):<5.1f}"
                for p in policies
                if (p, v) in by
            )
            print(f"{v:>8g} {cells}")
    if "qlm" in policies and "fcfs" in policies:
        print("\nqlm − fcfs, qlm − best other policy (points); qlm / fcfs throughput")
        for v in values:
            q = by[("qlm", v)]
            others = [by[(p, v)] for p in policies if p != "qlm" and (p, v) in by]
            best = max(others, key=lambda r: r["slo_attainment"])
            print(
                f"{v:>8g}  {100 * (q['slo_attainment'] - by[('fcfs', v)]['slo_attainment']):+6.1f}"
                f"  {100 * (q['slo_attainment'] - best['slo_attainment']):+6.1f} ({best['policy']})"
                f"  {q['throughput_rps'] / by[('fcfs', v)]['throughput_rps']:.2f}×"
            )
    for r in rows:
        if "plans" in r:
            print(
                f"{r['policy']} at {r['value']:g}: {r['plans']} plans of {r['mean_groups']:.0f} "
                f"groups on average, {r['plan_solve_s']:.1f} s solving, run {r['cpu_s']:.0f} CPU-s"
            )


def plot(
    rows: list[dict[str, Any]],
    policies: list[str],
    path: Path,
    args: argparse.Namespace,
    instances: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for p in policies:
        pts = sorted(
            (r["value"], r["slo_attainment"], r["throughput_rps"]) for r in rows if r["policy"] == p
        )
        style: dict[str, Any] = {"linewidth": 2.5, "color": "black"} if p == "qlm" else {}
        a1.plot([x for x, _, _ in pts], [100 * y for _, y, _ in pts], marker="o", label=p, **style)
        a2.plot([x for x, _, _ in pts], [t for _, _, t in pts], marker="o", label=p, **style)
    a1.set(xlabel=_label(args), ylabel="SLO attainment (%)", ylim=(0, 102))
    a2.set(xlabel=_label(args), ylabel="throughput (requests/s)")
    a1.legend(fontsize=8)
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    fixed = "" if args.vary == "rate" else f", ×{args.rate:g} load"
    fig.suptitle(
        f"{args.workload.upper()} on {instances}, first {args.end:g} s of Azure conv{fixed}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
