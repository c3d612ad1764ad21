"""Simulation speed, two figures, each against its target:

1. **FCFS replay**: the full Azure LLM conversation trace (19,366 requests, 58 min) on four
   simulated A100 instances serving Llama-3-8B under FCFS; the CPU time of ``simulate`` (trace
   and workload loaded beforehand; wall time is printed too, but on a machine shared with other
   work it measures the others as well). Target: median ≤ 2 s, and no slower than any checkout given
   with ``--against`` (an older commit: ``git worktree add /tmp/old <commit>``) measured in the
   same run. Each run is a fresh process; the checkouts take turns, round after round, so that a
   change in the host's load falls on all of them alike.
2. **QLM replay**: ``qlm simulate --workload wb --trace azure-code --instances
   1xA100:llama-3-8b --rate-scale 1.8 --duration 1200 --policy qlm``, whose planner is budgeted
   in scored candidate orders (deterministic); the CPU seconds of the whole command, start-up
   included. Target: ≤ 60 s. ``--qlm-duration 0`` skips it.

Writes ``benchmarks/results/sim_speed.json`` (``--out``): every run, the medians, the verdicts
and the command.

Reproduce: .venv/bin/python benchmarks/sim_speed.py [--repeat N] [--against DIR ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FCFS_TARGET_S = 2.0
QLM_TARGET_CPU_S = 60.0


def fcfs_once(instances: str, trace_name: str) -> dict[str, Any]:
    """In a child process, with ``qlm`` importable from the checkout measured: one FCFS replay."""
    from qlm.planner import create_policy
    from qlm.sim.cluster import simulate
    from qlm.sim.traces import load_trace
    from qlm.sim.workload import create_workload

    try:
        from qlm.fleet import parse_instances
    except ImportError:  # a checkout from before ``qlm.fleet``
        from qlm.sim.instances import parse_instances  # type: ignore[no-redef]

    trace = load_trace(trace_name)
    requests = create_workload("default", trace, seed=0)
    specs = parse_instances(instances)
    t0, c0 = time.perf_counter(), time.process_time()
    result = simulate(requests, specs, create_policy("fcfs"))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = result.summary
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "requests": len(requests),
        "trace_min": trace.duration_s / 60,
        "slo_attainment": s["slo_attainment"],
        "makespan_s": s["makespan_s"],
    }


def run_child(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, __file__, "--child", "--instances", args.instances]
    out = subprocess.run(
        [*cmd, "--trace", args.trace], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"FCFS replay in {tree} failed:\n{out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.splitlines()[-1]))


def qlm_replay(duration: float) -> dict[str, Any]:
    """CPU seconds of the QLM-policy replay, as a user runs it (its own process)."""
    cmd = [
        sys.executable,
        "-m",
        "qlm.cli",
        "simulate",
        *("--workload", "wb", "--trace", "azure-code", "--instances", "1xA100:llama-3-8b"),
        *("--rate-scale", "1.8", "--duration", f"{duration:g}", "--policy", "qlm"),
        *("--seed", "0", "--json", "--no-progress"),
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"QLM replay failed:\n{out.stderr[-2000:]}")
    summary = json.loads(out.stdout)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "command": "qlm " + " ".join(cmd[3:]),
        "cpu_s": cpu,
        "wall_s": wall,
        "requests": summary["requests"],
        "slo_attainment": summary["slo_attainment"],
    }


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def command(args: argparse.Namespace) -> str:
    parts = [".venv/bin/python benchmarks/sim_speed.py", f"--repeat {args.repeat}"]
    parts += [f"--against {tree}" for tree in args.against]
    if args.qlm_duration != 1200:
        parts.append(f"--qlm-duration {args.qlm_duration:g}")
    return " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3, help="FCFS runs per checkout")
    parser.add_argument("--instances", default="4xA100:llama-3-8b")
    parser.add_argument("--trace", default="azure-conv")
    parser.add_argument(
        "--against",
        type=Path,
        action="append",
        default=[],
        help="another QLM checkout to time in the same run (repeatable)",
    )
    parser.add_argument("--qlm-duration", type=float, default=1200.0, help="0: skip")
    parser.add_argument("--out", type=Path, default=RESULTS / "sim_speed.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(fcfs_once(args.instances, args.trace)))
        return

    trees = [ROOT, *(tree.resolve() for tree in args.against)]
    runs: dict[str, list[dict[str, Any]]] = {str(t): [] for t in trees}
    for i in range(args.repeat):
        for tree in trees:
            run = run_child(tree, args)
            runs[str(tree)].append(run)
            print(
                f"round {i + 1}, {tree}: FCFS replay {run['cpu_s']:.2f} CPU-s "
                f"({run['wall_s']:.2f} s wall)",
                flush=True,
            )
    first = runs[str(ROOT)][0]
    medians = {t: statistics.median(r["cpu_s"] for r in rs) for t, rs in runs.items()}
    walls = {t: statistics.median(r["wall_s"] for r in rs) for t, rs in runs.items()}
    mine = medians[str(ROOT)]
    checks = {"fcfs_target": mine <= FCFS_TARGET_S}
    print(
        f"\nFCFS replay of {args.trace} ({first['requests']:,} requests over "
        f"{first['trace_min']:.1f} min) on {args.instances}, median of {args.repeat} "
        f"(simulated SLO attainment {100 * first['slo_attainment']:.1f} %):"
    )
    for tree in trees:
        m = medians[str(tree)]
        label = "this checkout" if tree == ROOT else str(tree)
        print(
            f"  {label}: {m:.2f} CPU-s ({walls[str(tree)]:.2f} s wall), "
            f"{first['requests'] / m:,.0f} simulated requests per CPU-second"
            + ("" if tree == ROOT else f"; this checkout takes {mine / m:.2f}× its time")
        )
        if tree != ROOT:
            checks[f"no_slower_than:{tree}"] = mine <= m
    print(f"  target ≤ {FCFS_TARGET_S:g} s: {verdict(checks['fcfs_target'])}")
    for tree in trees[1:]:
        print(f"  no slower than {tree}: {verdict(checks[f'no_slower_than:{tree}'])}")

    qlm = None
    if args.qlm_duration > 0:
        qlm = qlm_replay(args.qlm_duration)
        checks["qlm_cpu_target"] = qlm["cpu_s"] <= QLM_TARGET_CPU_S
        print(
            f"\nQLM replay ({qlm['command']}): {qlm['requests']:,} requests, "
            f"{qlm['cpu_s']:.1f} CPU-s ({qlm['wall_s']:.1f} s wall), SLO attainment "
            f"{100 * qlm['slo_attainment']:.1f} %; target ≤ {QLM_TARGET_CPU_S:g} CPU-s: "
            f"{verdict(checks['qlm_cpu_target'])}"
        )
    record = {
        "command": command(args),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "fcfs": {"instances": args.instances, "trace": args.trace, "runs": runs},
        "fcfs_median_cpu_s": medians,
        "fcfs_median_wall_s": walls,
        "qlm": qlm,
        "checks": checks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nall targets: {verdict(all(checks.values()))}; written to {args.out}")
    print(f"reproduce: {command(args)}")


if __name__ == "__main__":
    main()
