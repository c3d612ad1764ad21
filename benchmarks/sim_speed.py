"""Simulation speed: replay the full Azure LLM conversation trace (19,366 requests, 58 min) on four
simulated A100 instances serving Llama-3-8B under FCFS, and print wall time and simulated requests
per wall second. Target on the 2-core development machine: under 20 s.

Reproduce: .venv/bin/python benchmarks/sim_speed.py [--repeat N]
"""

from __future__ import annotations

import argparse
import platform
import time

from qlm.fleet import parse_instances
from qlm.planner import create_policy
from qlm.sim.cluster import simulate
from qlm.sim.traces import load_trace
from qlm.sim.workload import create_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--instances", default="4xA100:llama-3-8b")
    parser.add_argument("--trace", default="azure-conv")
    args = parser.parse_args()

    t0 = time.perf_counter()
    trace = load_trace(args.trace)
    requests = create_workload("default", trace, seed=0)
    specs = parse_instances(args.instances)
    load_s = time.perf_counter() - t0
    print(
        f"{args.trace}: {len(requests)} requests over {trace.duration_s / 60:.1f} min; "
        f"instances {args.instances}; load + workload build {load_s:.2f} s"
    )
    walls = []
    for i in range(args.repeat):
        t0 = time.perf_counter()
        result = simulate(requests, specs, create_policy("fcfs"))
        wall = time.perf_counter() - t0
        walls.append(wall)
        s = result.summary
        print(
            f"run {i + 1}: wall {wall:.2f} s, {len(requests) / wall:,.0f} simulated requests/s; "
            f"simulated makespan {s['makespan_s']:.0f} s, SLO attainment "
            f"{100 * s['slo_attainment']:.1f} %, preemptions {s['preemptions']}"
        )
    best = min(walls)
    print(
        f"\nbest of {args.repeat}: {best:.2f} s wall, {len(requests) / best:,.0f} simulated "
        f"requests per wall second (target < 20 s) on {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}"
    )
    print(f"reproduce: .venv/bin/python benchmarks/sim_speed.py --repeat {args.repeat}")


if __name__ == "__main__":
    main()
