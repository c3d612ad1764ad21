"""How long does the controller's whole re-plan take at 10k, 100k and 400k waiting requests?

A re-plan is ``QlmPolicy.plan``: from the groups of waiting requests in the virtual queues to the
new orders, everything included — collecting the groups (``groups``), their aggregates from the
estimator (``estimate``), the scenarios and the plan problem (``problem``), the fluid models and
the concurrency choice (``concurrency``), cost-aware admission (``admission``), the solver
(``solve``), the capacity signal (``capacity``) and applying the orders (``apply``). The policy
is the production one (wall-time budget, ``--budget`` seconds a plan, the setting
``QLM_PLANNER__BUDGET_S``) on 16 simulated A100s serving Llama-3-8B.

Set-up, per size (not timed): N requests of W_B (its SLO classes and tiers, Azure-conversation
lengths, the trace repeated with fresh ids), arrived uniformly over the last minute, handed to the
policy in one step (grouped, reclustered, placed, planned once, each instance pulling up to its
limit). Then ``--plans`` re-plans, each after a control step 1.1 s later in which a hundred
requests arrive and as many complete (the estimator's beliefs move, some groups change): the
re-plans a controller makes while it serves a backlog. Requests are not reclustered between
re-plans (a recluster is the grouping benchmark's, ``benchmarks/grouping.py``).

Per size it prints the median and the longest re-plan, the budget, the time by stage (median over
the re-plans, seconds; ``other``: what the stages leave out), the CPU time of the re-plans (this
process's: on a shared host the wall time also counts the time other work held the cores), the
same by stage, the peak RSS of the process (after the set-up, which holds the requests) and the
full garbage collections that ran during the re-plans (how many, their seconds). Targets: the
longest re-plan within the budget + 20 %, at 400,000 waiting requests <= 0.5 s, peak RSS <= 1 GB. ``--json``: a list of ``{"waiting",
"instances", "seconds", "budget_s", "peak_rss_mb", "stages"}``, one per size (``waiting``: the
requests the queues hold, the others running; ``seconds``: the longest re-plan).

    .venv/bin/python benchmarks/replan.py
    .venv/bin/python benchmarks/replan.py --sizes 400000 --budget 0.4 --json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from qlm.domain import ModelTier, Request
from qlm.planner.budget import Budget
from qlm.planner.config import PlannerConfig
from qlm.planner.policy import Completion, DispatchContext, InstanceLoad
from qlm.planner.qlm_policy import QlmPolicy
from qlm.sim.traces import load_trace
from qlm.sim.workload import create_workload, repeated

SIZES = "10000,100000,400000"
TARGET_S = {400_000: 0.5}
OVER = 1.2  # a re-plan may take its budget + 20 %
RSS_TARGET_MB = 1024.0
MODEL = "llama-3-8b"
TOKEN_CAPACITY = 419_168  # a simulated A100's KV capacity for Llama-3-8B (tokens)
STAGES = (
    "groups", "estimate", "problem", "concurrency", "admission", "solve", "capacity", "apply"
)  # fmt: skip


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_requests(count: int, now: float, tag: str = "") -> list[Request]:
    """``count`` requests of W_B on Azure-conversation lengths (the trace repeated with fresh ids),
    arrived uniformly over the minute before ``now``."""
    return repeated(
        create_workload("wb", load_trace("azure-conv", seed=0), seed=0), count, now, tag
    )


def instances(count: int, policy: QlmPolicy | None = None) -> tuple[InstanceLoad, ...]:
    """``count`` simulated A100s, each with what the policy's agents sent it running."""
    out = []
    for k in range(count):
        name = f"a100-{k}"
        running = len(policy.books.inflight.get(name, {})) if policy is not None else 0
        out.append(
            InstanceLoad(
                name=name,
                models=(MODEL,),
                outstanding_requests=running,
                max_running=256,
                token_capacity=TOKEN_CAPACITY,
                gpu="A100",
                active_model=MODEL,
                model_tiers=((MODEL, ModelTier.ACTIVE),),
            )
        )
    return tuple(out)


class Stages:
    """Seconds a re-plan spends in each stage: the policy's and its modules' functions wrapped
    (a stage's own time: what a stage nested in it takes is counted in that one)."""

    def __init__(self, policy: QlmPolicy) -> None:
        import qlm.planner.family as family_module
        import qlm.planner.qlm_policy as module

        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}  # the same in this process's CPU time
        self._stack: list[tuple[float, float]] = []
        wrap = self._wrap
        policy._groups = wrap("groups", policy._groups)  # type: ignore[method-assign]
        policy._family = wrap("problem", policy._family)  # type: ignore[method-assign]
        policy._ready = wrap("estimate", policy._ready)  # type: ignore[method-assign]
        family_module.ProblemFamily.problem = wrap(  # type: ignore[method-assign]
            "problem", family_module.ProblemFamily.problem
        )
        estimator = policy.estimator
        estimator.group_loads = wrap("estimate", estimator.group_loads)  # type: ignore[method-assign]
        family_module.build_family = wrap("problem", family_module.build_family)
        module.build_family = wrap("problem", module.build_family)
        fluid = policy._fluid_models
        fluid.evaluate = wrap("concurrency", fluid.evaluate)  # type: ignore[method-assign]
        module.choose_limits = wrap("concurrency", module.choose_limits)
        for name in ("hopeless_all", "in_time", "subset"):
            if hasattr(module, name):  # (the names of the commits this script times)
                setattr(module, name, wrap("admission", getattr(module, name)))
        policy._deferred_in = wrap("admission", policy._deferred_in)  # type: ignore[method-assign]
        module.solve = wrap("solve", module.solve)
        module.capacity_needed = wrap("capacity", module.capacity_needed)
        policy.queues.set_orders = wrap("apply", policy.queues.set_orders)  # type: ignore[method-assign]

    def _wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self._stack.append((0.0, 0.0))  # wall and CPU time in stages nested in this one
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent, used = time.perf_counter() - t0, time.process_time() - c0
                inner, inner_cpu = self._stack.pop()
                self.seconds[stage] = self.seconds.get(stage, 0.0) + spent - inner
                self.cpu[stage] = self.cpu.get(stage, 0.0) + used - inner_cpu
                if self._stack:
                    wall, cpu = self._stack[-1]
                    self._stack[-1] = (wall + spent, cpu + used)

        return run

    @contextlib.contextmanager
    def measure(self) -> Iterator[tuple[dict[str, float], dict[str, float]]]:
        """Per stage, (wall seconds, CPU seconds) of what runs inside."""
        self.seconds, self.cpu = {}, {}
        out: dict[str, float] = {}
        cpu: dict[str, float] = {}
        yield out, cpu
        out.update(self.seconds)
        cpu.update(self.cpu)


def fill(count: int, n_instances: int, budget_s: float) -> tuple[QlmPolicy, float, list[Request]]:
    """A policy holding ``count`` waiting requests, planned once; the clock at that plan."""
    config = PlannerConfig(budget=Budget(time_s=budget_s))
    policy = QlmPolicy(config=config, measure_solve_time=False)  # one step groups everything
    now = 1_000.0
    requests = make_requests(count, now)
    policy.decide(DispatchContext(now, tuple(requests), instances(n_instances)))
    return policy, now, requests


def step(policy: QlmPolicy, now: float, n_instances: int, fresh: list[Request]) -> None:
    """A control step at ``now``: ``fresh`` arrive, as many running requests complete."""
    finished = []
    for name, running in policy.books.inflight.items():
        for rid, item in list(running.items())[: max(1, len(fresh) // n_instances)]:
            output = item.request.replay_output_tokens or 1
            finished.append(
                Completion(item.request, name, output, item.pulled_s, item.pulled_s + 0.5, now)
            )
            del rid
    ctx = DispatchContext(
        now, tuple(fresh), instances(n_instances, policy), finished=tuple(finished)
    )
    policy.decide(ctx)


class FullCollections:
    """Full (oldest-generation) garbage collections while counting, and their seconds: with
    the requests of a backlog held, each one visits every tracked object (~0.2 s at 400k)."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._t0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        gc.callbacks.append(self)
        try:
            yield
        finally:
            gc.callbacks.remove(self)


def bench(count: int, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    policy, now, _ = fill(count, args.instances, args.budget)
    setup_s = time.perf_counter() - t0
    stages = Stages(policy)
    seconds: list[float] = []
    cpus: list[float] = []  # this process's CPU time: steadier than the wall on a shared host
    splits: list[dict[str, float]] = []
    cpu_splits: list[dict[str, float]] = []
    records = []
    full = FullCollections()
    for k in range(args.plans):
        now += 1.1
        step(policy, now, args.instances, make_requests(100, now, tag=f"p{k}-"))
        with stages.measure() as (split, cpu_split), full.counting():
            t0, c0 = time.perf_counter(), time.process_time()
            record = policy.plan(now, "period")
            wall = time.perf_counter() - t0
            cpus.append(time.process_time() - c0)
        split["other"] = wall - sum(split.values())
        cpu_split["other"] = cpus[-1] - sum(cpu_split.values())
        seconds.append(wall)
        splits.append(split)
        cpu_splits.append(cpu_split)
        records.append(record)
    median = {s: statistics.median(sp.get(s, 0.0) for sp in splits) for s in (*STAGES, "other")}
    median_cpu = {
        s: statistics.median(sp.get(s, 0.0) for sp in cpu_splits) for s in (*STAGES, "other")
    }
    last = records[-1]
    out = {
        "waiting": policy.grouper.num_requests,
        "requests": count,
        "instances": args.instances,
        "seconds": max(seconds),
        "budget_s": args.budget,
        "peak_rss_mb": round(rss_mb(), 1),
        "stages": {k: round(v, 4) for k, v in median.items()},
        "stages_cpu": {k: round(v, 4) for k, v in median_cpu.items()},
        "median_s": statistics.median(seconds),
        "cpu_s": [round(c, 4) for c in cpus],
        "groups": last.groups,
        "setup_s": setup_s,
        "methods": sorted({r.method for r in records}),
        "solve_s": [round(r.solve_s, 4) for r in records],
        "full_gcs": full.count,
        "full_gc_s": round(full.seconds, 4),
    }
    if not args.json:
        ok = max(seconds) <= OVER * args.budget
        target = TARGET_S.get(count)
        verdict = "" if target is None else f"; target {target:g} s: "
        if target is not None:
            verdict += "ok" if max(seconds) <= target else "MISSED"
        print(
            f"{count:>7,} waiting ({out['waiting']:,} held, {last.groups:,} groups, "
            f"{args.instances} instances; set-up {setup_s:.1f} s): re-plan median "
            f"{out['median_s']:.3f} s, longest {out['seconds']:.3f} s (CPU median "
            f"{statistics.median(cpus):.3f} s, most {max(cpus):.3f} s) "
            f"(budget {args.budget:g} s + 20 %: {'ok' if ok else 'MISSED'}{verdict}), "
            f"peak RSS {out['peak_rss_mb']:.0f} MB (<= 1 GB: "
            f"{'ok' if out['peak_rss_mb'] <= RSS_TARGET_MB else 'MISSED'}); solver: "
            f"{', '.join(out['methods'])}; full garbage collections in the re-plans: "
            f"{full.count} ({full.seconds:.3f} s)",
            flush=True,
        )
        print(
            "  by stage (median s): "
            + ", ".join(f"{s} {median[s]:.3f}" for s in (*STAGES, "other")),
            flush=True,
        )
        print(
            "  by stage, CPU (median s): "
            + ", ".join(f"{s} {median_cpu[s]:.3f}" for s in (*STAGES, "other")),
            flush=True,
        )
    return out


def parse_budgets(text: str, default: float) -> dict[int, float]:
    """``"400000=0.4"`` -> {400000: 0.4}; sizes not named get ``default``."""
    out: dict[int, float] = {}
    for item in filter(None, text.split(",")):
        size, seconds = item.split("=")
        out[int(size)] = float(seconds)
    return out


def run_size(count: int, budget_s: float, args: argparse.Namespace) -> dict[str, Any]:
    """One size in a process of its own, so that its peak RSS is its own."""
    args = argparse.Namespace(**{**vars(args), "budget": budget_s})
    return bench(count, args)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default=SIZES, help="waiting requests, comma-separated")
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--budget", type=float, default=0.1, help="seconds per plan")
    parser.add_argument(
        "--budgets", default="", help="per size, e.g. 400000=0.4 (others: --budget)"
    )
    parser.add_argument("--plans", type=int, default=5, help="re-plans timed per size")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    budgets = parse_budgets(args.budgets, args.budget)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if not args.json:
        print(
            f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
            f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
            flush=True,
        )
    results = []
    context = multiprocessing.get_context("spawn")
    for count in sizes:
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            budget_s = budgets.get(count, args.budget)
            results.append(pool.submit(run_size, count, budget_s, args).result())
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    else:
        cmd = f".venv/bin/python benchmarks/replan.py --sizes {','.join(map(str, sizes))} " + (
            f"--budget {args.budget:g} --plans {args.plans} --instances {args.instances}"
            + (f" --budgets {args.budgets}" if args.budgets else "")
        )
        print(f"reproduce: {cmd}")


if __name__ == "__main__":
    main()
