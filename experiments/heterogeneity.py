"""Heterogeneous fleets (paper Fig. 14): four instances, 0–100 % of them A10s and the rest
A100s, all serving Llama-3-8B, under QLM, under QLM's ordering behind round-robin placement
(``qlm-rr``: the paper's baseline — each group goes to the next instance in turn, whatever its
speed, and the planner only orders each queue), and under FCFS behind round-robin dispatch
(``fcfs-rr``: vLLM behind a load balancer that ignores how fast each instance is).

W_B on the first ``--end`` seconds of the Azure conversation trace at ``--rate`` × its arrival
rate, seed 0. QLM's planner assigns groups by each instance's own throughput (from its hardware
profile and online calibration) and caps each one's batch; round robin gives every instance the
same share. Prints SLO attainment and throughput per mix and writes
``experiments/results/heterogeneity.json`` and ``heterogeneity.png``.

Reproduce: .venv/bin/python experiments/heterogeneity.py
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from stamp import write_result

from qlm.fleet import parse_instances
from qlm.planner import PlannerConfig, create_policy
from qlm.sim.cluster import ClusterSimulation
from qlm.sim.traces import load_trace, scale_rate, window
from qlm.sim.workload import create_workload

FLEET = 4


def fleet(a10: int) -> str:
    parts = []
    if a10:
        parts.append(f"{a10}xA10:llama-3-8b")
    if FLEET - a10:
        parts.append(f"{FLEET - a10}xA100:llama-3-8b")
    return ",".join(parts)


def run_one(job: tuple[str, int, float, float, int]) -> dict[str, Any]:
    policy_name, a10, rate, end_s, seed = job
    trace = window(scale_rate(load_trace("azure-conv", seed=seed), rate), 0.0, end_s)
    requests = create_workload("wb", trace, seed=seed)
    policy = create_policy(policy_name, planner=PlannerConfig.for_simulation())
    result = ClusterSimulation(parse_instances(fleet(a10)), policy).run(requests)
    s = result.summary
    return {
        "policy": policy_name,
        "a10_share": a10 / FLEET,
        "fleet": fleet(a10),
        "requests": len(requests),
        "slo_attainment": s["slo_attainment"],
        "throughput_rps": s["throughput_rps"],
        "failed": s["failed"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rate", type=float, default=4.0, help="multiple of the trace's arrival rate")
    ap.add_argument("--end", type=float, default=600.0, help="seconds of the trace to replay")
    ap.add_argument("--policies", default="qlm,qlm-rr,fcfs-rr")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    policies = args.policies.split(",")
    jobs = [(p, a10, args.rate, args.end, args.seed) for a10 in range(FLEET + 1) for p in policies]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(run_one, jobs))
    print(f"W_B, Azure conv x{args.rate:g}, first {args.end:g} s, {FLEET} instances")
    print(f"{'A10 share':>10}" + "".join(f"{p + ' SLO %':>16}{p + ' req/s':>16}" for p in policies))
    for a10 in range(FLEET + 1):
        cells = ""
        for p in policies:
            r = next(x for x in rows if x["policy"] == p and x["a10_share"] == a10 / FLEET)
            cells += f"{100 * r['slo_attainment']:>16.1f}{r['throughput_rps']:>16.2f}"
        print(f"{100 * a10 / FLEET:>9.0f}%" + cells)
    given = argv if argv is not None else sys.argv[1:]
    out = write_result(
        "heterogeneity", "heterogeneity.py", given, {"args": vars(args), "rows": rows}
    )
    plot(rows, policies, out.with_suffix(".png"))
    return 0


def plot(rows: list[dict[str, Any]], policies: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for p in policies:
        pts = sorted(
            (r["a10_share"], r["slo_attainment"], r["throughput_rps"])
            for r in rows
            if r["policy"] == p
        )
        a1.plot([100 * x for x, _, _ in pts], [100 * y for _, y, _ in pts], marker="o", label=p)
        a2.plot([100 * x for x, _, _ in pts], [t for _, _, t in pts], marker="o", label=p)
    a1.set(xlabel="A10 share of the fleet (%)", ylabel="SLO attainment (%)", ylim=(0, 102))
    a2.set(xlabel="A10 share of the fleet (%)", ylabel="throughput (requests/s)")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
