"""QLM's overhead as the queue grows (paper §8.3, Fig. 19): what grouping and planning a queue of
N waiting requests costs, in all and per request, up to 400,000.

The paper plans a queue of 400,000 requests (an A100 serving a 7B model, large groups) at "5 s per
request group (i.e., 5 ms per request)". Here, per size N (``--sizes``), in a process of its own:
N requests of W_B (its SLO classes and tiers, Azure-conversation lengths, the trace repeated with
fresh ids), arrived over the last minute, are handed to the production ``QlmPolicy`` (wall-time
budget ``--budget`` seconds a plan, ``QLM_PLANNER__BUDGET_S``; groups of at most δ × 8 = 32) on
``--instances`` simulated A100s serving Llama-3-8B, in one control step. Measured (CPU seconds of
the process, so that other work on the machine does not count; wall seconds beside them):

- **hand-over**: that step — every request classified into a group, the groups re-clustered
  (k-means) and placed, one plan, the agents' first pulls; split into ``group`` (classification
  and placement), ``recluster``, ``plan`` and ``act`` (the rest);
- **re-plan**: ``--plans`` further plans (``QlmPolicy.plan``) after control steps in which a
  hundred requests arrive and as many complete; the median and the largest;
- **per request**: hand-over ÷ N, and a re-plan ÷ N; **per group**: a re-plan ÷ the groups it
  ordered.

Prints the table and writes ``results/overhead.json`` and ``overhead.png``. (The re-plan's split
by stage is ``benchmarks/replan.py``'s, where that benchmark is present.)

Reproduce: .venv/bin/python experiments/overhead.py
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from stamp import write_result

from qlm.domain import ModelTier
from qlm.engines.sim import SimEngine, SimEngineConfig
from qlm.planner.budget import Budget
from qlm.planner.config import PlannerConfig
from qlm.planner.policy import Completion, DispatchContext, InstanceLoad
from qlm.planner.qlm_policy import QlmPolicy
from qlm.rct.profile import default_profile
from qlm.sim.traces import load_trace
from qlm.sim.workload import create_workload, repeated

MODEL = "llama-3-8b"
GPU = "A100"


class Clocks:
    """CPU and wall seconds of each call of the wrapped functions, by stage."""

    def __init__(self) -> None:
        self.cpu: dict[str, list[float]] = {}
        self.wall: dict[str, list[float]] = {}

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            c0, w0 = time.process_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu.setdefault(stage, []).append(time.process_time() - c0)
                self.wall.setdefault(stage, []).append(time.perf_counter() - w0)

        return timed

    def reset(self) -> None:
        self.cpu, self.wall = {}, {}


def token_capacity() -> int:
    """A simulated A100's KV cache for Llama-3-8B, in tokens (what its engine reports)."""
    from qlm.engines.perf_table import default_catalog

    catalog = default_catalog()
    gpu = catalog.gpu(GPU)
    engine = SimEngine(
        "probe",
        {MODEL: catalog.perf_model(MODEL, GPU, 1)},
        SimEngineConfig.for_gpu(gpu.memory_gb, gpu.name),
    )
    return engine.token_capacity()


def loads(count: int, capacity: int, policy: QlmPolicy) -> tuple[InstanceLoad, ...]:
    out = []
    for k in range(count):
        name = f"a100-{k}"
        out.append(
            InstanceLoad(
                name=name,
                models=(MODEL,),
                outstanding_requests=len(policy.books.inflight.get(name, {})),
                max_running=256,
                token_capacity=capacity,
                gpu=GPU,
                active_model=MODEL,
                model_tiers=((MODEL, ModelTier.ACTIVE),),
            )
        )
    return tuple(out)


def measure(count: int, instances: int, budget_s: float, plans: int) -> dict[str, Any]:
    base = create_workload("wb", load_trace("azure-conv", seed=0), seed=0)
    capacity = token_capacity()
    config = PlannerConfig(budget=Budget(time_s=budget_s))
    # Plans spaced by the event clock, not by their compute: one step groups everything.
    policy = QlmPolicy(default_profile(), config=config, measure_solve_time=False)
    clocks = Clocks()
    policy.plan = clocks.wrap("plan", policy.plan)  # type: ignore[method-assign]
    policy.grouper.recluster = clocks.wrap("recluster", policy.grouper.recluster)  # type: ignore[method-assign]
    now = 1_000.0
    requests = repeated(base, count, now, "q")
    step = clocks.wrap("step", policy.decide)
    step(DispatchContext(now, tuple(requests), loads(instances, capacity, policy)))
    del requests
    held = policy.grouper.num_requests  # the rest were pulled by the instances
    cpu = {k: sum(v) for k, v in clocks.cpu.items()}
    wall = {k: sum(v) for k, v in clocks.wall.items()}
    handover = {
        "cpu_s": cpu["step"],
        "wall_s": wall["step"],
        "recluster_cpu_s": cpu.get("recluster", 0.0),
        "plan_cpu_s": cpu.get("plan", 0.0),
    }
    replans_cpu: list[float] = []
    replans_wall: list[float] = []
    groups: list[int] = []
    for k in range(plans):
        now += 1.1
        finished = []
        for name, running in policy.books.inflight.items():
            for item in list(running.values())[: max(1, 100 // instances)]:
                output = item.request.replay_output_tokens or 1
                finished.append(
                    Completion(item.request, name, output, item.pulled_s, item.pulled_s + 0.5, now)
                )
        fresh = repeated(base, 100, now, f"p{k}-")
        ctx = DispatchContext(
            now, tuple(fresh), loads(instances, capacity, policy), finished=tuple(finished)
        )
        policy.decide(ctx)
        clocks.reset()
        record = policy.plan(now, "period")
        replans_cpu.append(clocks.cpu["plan"][0])
        replans_wall.append(clocks.wall["plan"][0])
        groups.append(record.groups)
    replan = statistics.median(replans_cpu)
    mean_groups = statistics.mean(groups)
    return {
        "waiting": count,
        "held": held,
        "instances": instances,
        "budget_s": budget_s,
        "handover": handover,
        "handover_group_cpu_s": handover["cpu_s"]
        - handover["recluster_cpu_s"]
        - handover["plan_cpu_s"],
        "replan_cpu_s": replans_cpu,
        "replan_wall_s": replans_wall,
        "replan_median_cpu_s": replan,
        "groups": groups,
        "handover_per_request_ms": 1000 * handover["cpu_s"] / count,
        "replan_per_request_us": 1e6 * replan / count,
        "replan_per_group_ms": 1000 * replan / mean_groups if mean_groups else 0.0,
        "requests_per_group": count / mean_groups if mean_groups else 0.0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="1000,10000,100000,400000", help="waiting requests")
    ap.add_argument("--instances", type=int, default=16, help="simulated A100s")
    ap.add_argument("--budget", type=float, default=0.1, help="seconds per plan (production's)")
    ap.add_argument("--plans", type=int, default=3, help="re-plans timed per size")
    ap.add_argument("--name", default="overhead")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    context = multiprocessing.get_context("spawn")
    for count in sizes:  # one at a time, each in a fresh process (its own memory and RSS)
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            row = pool.submit(measure, count, args.instances, args.budget, args.plans).result()
        rows.append(row)
        h = row["handover"]
        print(
            f"{count:>8,} waiting ({row['held']:,} held after the first pulls) on "
            f"{args.instances} A100s: hand-over {h['cpu_s']:.2f} CPU-s "
            f"({h['wall_s']:.2f} s wall; group {row['handover_group_cpu_s']:.2f}, recluster "
            f"{h['recluster_cpu_s']:.2f}, plan {h['plan_cpu_s']:.2f}) = "
            f"{row['handover_per_request_ms']:.3f} ms per request; re-plan median "
            f"{row['replan_median_cpu_s']:.3f} CPU-s (largest {max(row['replan_cpu_s']):.3f}; "
            f"budget {args.budget:g} s) over {statistics.mean(row['groups']):,.0f} groups = "
            f"{row['replan_per_request_us']:.2f} µs per request, "
            f"{row['replan_per_group_ms']:.3f} ms per group; peak RSS {row['peak_rss_mb']:.0f} MB",
            flush=True,
        )
    given = argv if argv is not None else sys.argv[1:]
    out = write_result(args.name, "overhead.py", given, {"args": vars(args), "rows": rows})
    plot(rows, out.with_suffix(".png"), args)
    return 0


def plot(rows: list[dict[str, Any]], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [r["waiting"] for r in rows]
    a1.plot(
        xs, [r["handover"]["cpu_s"] for r in rows], marker="o", label="hand-over (group + plan)"
    )
    a1.plot(xs, [r["replan_median_cpu_s"] for r in rows], marker="o", label="re-plan (median)")
    a1.set(xscale="log", yscale="log", xlabel="waiting requests", ylabel="CPU seconds")
    a2.plot(xs, [r["handover_per_request_ms"] for r in rows], marker="o", label="hand-over")
    a2.plot(xs, [r["replan_per_request_us"] / 1000 for r in rows], marker="o", label="re-plan")
    a2.set(xscale="log", yscale="log", xlabel="waiting requests", ylabel="ms per request")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"W_B waiting on {args.instances} simulated A100s, plan budget {args.budget:g} s",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
