"""Policy comparison (paper §8.1): SLO attainment and throughput as load rises.

W_B (one model, llama-3-8b; classes interactive 20 s 40 %, standard 60 s 30 %, batch 300 s 30 %)
on the Azure conversation trace's arrivals and lengths, one simulated A100, every policy behind the
same harness (``ClusterSimulation``), trace and seed. Dispatch is by request pulling: a policy
hands an instance requests while it has room (``max_num_seqs`` running, prompts within the KV
cache); the agents issue adds evictions, swaps and warm starts. The load is the trace's arrival rate
times ``--rates``; the sweep rises until FCFS attains less than 50 % of SLOs (and ``--extra`` loads
past that).

Prints a table of SLO attainment (all requests, and per tier) and throughput per policy and load,
checks the targets — ``qlm`` within 2 points of the best baseline at every load, and at least 40
points above FCFS at the first load where FCFS drops below 50 % — and writes
``experiments/results/policies.json`` and ``policies.png``.

Reproduce: .venv/bin/python experiments/policies.py
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

from qlm.domain import Request, Tier
from qlm.planner import POLICIES, PlannerConfig, create_policy
from qlm.planner.config import DEFAULT_GROUPING
from qlm.planner.policy import Policy
from qlm.planner.qlm_policy import QlmPolicy
from qlm.profiling import simulated_fleet
from qlm.rct.estimator import RCTEstimator
from qlm.rct.profile import RctProfile, default_profile
from qlm.sim.cluster import ClusterSimulation
from qlm.sim.traces import load_trace, scale_rate, window
from qlm.sim.workload import create_workload

BASELINES = tuple(p for p in POLICIES if p not in ("qlm", "fcfs-rr"))
ORACLE = "qlm-oracle"  # qlm told the true output lengths (--oracle): not a policy, a yardstick
FIXED = "qlm-b"  # qlm-b64: qlm with its concurrency limit fixed at 64 (--fixed-concurrency)
NO_DEFER = "qlm-nodefer"  # qlm with cost-aware admission off (--no-defer)
RATIO = "qlm-ratio"  # qlm-ratio1e9: qlm with GroupingConfig.input_ratio 1e9, the rule off (--input-ratio)
WEIGHTS = "qlm-w"  # qlm-w1/1/1: qlm with tier weights interactive/standard/batch (--tier-weights)
TOLERANCE = "qlm-t"  # qlm-t0.05: qlm with PlannerConfig.throughput_tolerance 0.05
FLOOR = "qlm-f"  # qlm-f0.95: qlm with PlannerConfig.throughput_floor 0.95 (--throughput-floor)


class OracleEstimator(RCTEstimator):
    """The RCT estimator told every request's true output length (the trace's): what the planner
    would do if the unknown it plans around were known. Only for measuring that; nothing else
    changes (profile, calibration, concurrency model, planner)."""

    def output_moments(self, request: Request, generated: int = 0) -> tuple[float, float]:
        return max(true_output(request) - generated, 0.0), 0.0


def true_output(request: Request) -> float:
    """The trace's output length (``max_tokens`` when the request has none), within the cap."""
    return float(min(request.replay_output_tokens or request.max_tokens, request.max_tokens))


def make_policy(name: str, planner: PlannerConfig, profile: RctProfile | None = None) -> Policy:
    """A policy by name; ``qlm-oracle``, ``qlm-b<N>`` (qlm with its concurrency limit fixed at
    ``N`` instead of chosen by its fluid model), ``qlm-nodefer`` (qlm without cost-aware
    admission, ``PlannerConfig.defer_expensive`` off), ``qlm-f<x>`` (qlm with throughput floor
    ``x``) and ``qlm-w<i>/<s>/<b>`` (qlm with those
    tier weights) are variants measured by this experiment only."""
    if name.startswith(FIXED):
        policy = QlmPolicy(profile, config=planner)
        policy.fix_concurrency(int(name.removeprefix(FIXED)))
        return policy
    if name.startswith(RATIO):
        ratio = float(name.removeprefix(RATIO))
        grouping = dataclasses.replace(DEFAULT_GROUPING, input_ratio=ratio)
        return QlmPolicy(profile, config=planner, grouping=grouping)
    if name.startswith(WEIGHTS):
        values = [float(w) for w in name.removeprefix(WEIGHTS).split("/")]
        weights = dict(zip((Tier.INTERACTIVE, Tier.STANDARD, Tier.BATCH), values, strict=True))
        return QlmPolicy(profile, config=dataclasses.replace(planner, tier_weights=weights))
    if name.startswith(TOLERANCE):
        tolerance = float(name.removeprefix(TOLERANCE))
        config = dataclasses.replace(planner, throughput_tolerance=tolerance)
        return QlmPolicy(profile, config=config)
    if name.startswith(FLOOR):
        floor = float(name.removeprefix(FLOOR))
        return QlmPolicy(profile, config=dataclasses.replace(planner, throughput_floor=floor))
    if name == NO_DEFER:
        return QlmPolicy(profile, config=dataclasses.replace(planner, defer_expensive=False))
    if name == ORACLE:
        return QlmPolicy(
            config=planner,
            estimator=OracleEstimator(profile or default_profile()),
            predict_output=true_output,
        )
    return create_policy(name, planner=planner, profile=profile)


def run_one(args: tuple[str, float, float, str, int, int, str, str]) -> dict[str, Any]:
    policy_name, rate, end_s, instances, seed, evaluations, perf_model, kv_memory = args
    trace = window(scale_rate(load_trace("azure-conv", seed=seed), rate), 0.0, end_s)
    catalog, specs, profile = simulated_fleet(instances, perf_model, kv_memory)
    fleet_models = [m for spec in specs for m in spec.models]
    requests = create_workload("wb", trace, seed=seed, fleet_models=fleet_models)
    planner = PlannerConfig.for_simulation(evaluations)
    policy = make_policy(policy_name, planner, profile)
    t0 = time.perf_counter()
    result = ClusterSimulation(specs, policy, catalog=catalog).run(requests)
    wall = time.perf_counter() - t0
    s = result.summary
    tiers = {k: v["slo_attainment"] for k, v in s["slo_attainment_by_tier"].items()}
    row: dict[str, Any] = {
        "policy": policy_name,
        "rate": rate,
        "requests": len(requests),
        "slo_attainment": s["slo_attainment"],
        "by_tier": tiers,
        "throughput_rps": s["throughput_rps"],
        "throughput_output_tps": s["throughput_output_tps"],
        "wall_s": wall,
    }
    plans = result.plans
    if plans:
        row["plans"] = len(plans)
        row["plan_compute_s"] = sum(p.solve_s for p in plans)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rates", default="1,1.5,2,2.5,3,3.5,4,5,6", help="arrival-rate multipliers")
    ap.add_argument("--extra", type=int, default=1, help="loads to run after FCFS drops below 50%%")
    ap.add_argument("--end", type=float, default=1200.0, help="seconds of the trace to replay")
    ap.add_argument("--instances", default="1xA100:llama-3-8b")
    ap.add_argument("--policies", default=",".join((*BASELINES, "qlm")))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--perf-model", default="default", help="default, splitwise or a CSV file")
    ap.add_argument("--kv-memory", default="vllm", help="vllm or splitwise")
    ap.add_argument("--evaluations", type=int, default=5000, help="qlm planner budget per plan")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--name", default="policies")
    ap.add_argument(
        "--oracle",
        action="store_true",
        help=f"also run {ORACLE}: qlm told the true output lengths (a yardstick, not a policy)",
    )
    ap.add_argument(
        "--no-defer",
        action="store_true",
        help=f"also run {NO_DEFER}: qlm with cost-aware admission (defer_expensive) off",
    )
    ap.add_argument(
        "--input-ratio",
        default="",
        help="also run qlm with GroupingConfig.input_ratio at each of these (1e9: the rule off)",
    )
    ap.add_argument(
        "--tier-weights",
        default="",
        help="also run qlm with these tier weights, interactive/standard/batch (e.g. 1/1/1)",
    )
    ap.add_argument(
        "--throughput-floor",
        default="",
        help="also run qlm with PlannerConfig.throughput_floor at each of these (e.g. 0.95)",
    )
    ap.add_argument(
        "--fixed-concurrency",
        default="",
        help="also run qlm with its concurrency limit fixed at each of these (e.g. 64,128)",
    )
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    policies = args.policies.split(",") + ([ORACLE] if args.oracle else [])
    policies += [NO_DEFER] if args.no_defer else []
    policies += [f"{RATIO}{r.strip()}" for r in args.input_ratio.split(",") if r.strip()]
    policies += [f"{FIXED}{int(b)}" for b in args.fixed_concurrency.split(",") if b.strip()]
    policies += [f"{FLOOR}{f.strip()}" for f in args.throughput_floor.split(",") if f.strip()]
    policies += [f"{WEIGHTS}{w.strip()}" for w in args.tier_weights.split(",") if w.strip()]
    rows: list[dict[str, Any]] = []
    extra_left = args.extra
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for rate in rates:
            jobs = [
                (
                    p,
                    rate,
                    args.end,
                    args.instances,
                    args.seed,
                    args.evaluations,
                    args.perf_model,
                    args.kv_memory,
                )
                for p in policies
            ]
            batch = list(pool.map(run_one, jobs))
            rows.extend(batch)
            line = "  ".join(f"{r['policy']}={r['slo_attainment']:.3f}" for r in batch)
            print(f"rate x{rate:g}: {line}", flush=True)
            fcfs = next((r for r in batch if r["policy"] == "fcfs"), None)
            if fcfs is not None and fcfs["slo_attainment"] < 0.5:
                if extra_left <= 0:
                    break
                extra_left -= 1
    report(rows, policies)
    ok = check(rows, policies)
    given = argv if argv is not None else sys.argv[1:]
    out = write_result(args.name, "policies.py", given, {"args": vars(args), "rows": rows})
    plot(rows, policies, out.with_suffix(".png"), args)
    return 0 if ok else 1


def report(rows: list[dict[str, Any]], policies: list[str]) -> None:
    rates = sorted({r["rate"] for r in rows})
    by = {(r["policy"], r["rate"]): r for r in rows}
    print("\nSLO attainment (%) — all requests [interactive/standard/batch]")
    print("load  " + "".join(f"{p:>22}" for p in policies))
    for rate in rates:
        cells = []
        for p in policies:
            r = by.get((p, rate))
            if r is None:
                cells.append(f"{'-':>22}")
                continue
            t = r["by_tier"]
            tiers = "/".join(
                f"{100 * t.get(k, float('nan')):.0f}" for k in ("interactive", "standard", "batch")
            )
            cells.append(f"{100 * r['slo_attainment']:>8.1f} [{tiers:>11}]")
        print(f"x{rate:<4g}" + "".join(cells))
    print("\nthroughput (requests/s)")
    print("load  " + "".join(f"{p:>12}" for p in policies))
    for rate in rates:
        print(
            f"x{rate:<4g}"
            + "".join(
                f"{by[(p, rate)]['throughput_rps']:>12.2f}" if (p, rate) in by else f"{'-':>12}"
                for p in policies
            )
        )
    qlm_rows = [r for r in rows if not _baseline(r["policy"]) and "plans" in r]
    for r in qlm_rows:
        print(
            f"{r['policy']} at x{r['rate']:g}: {r['plans']} plans, {r['plan_compute_s']:.1f} s planning, run {r['wall_s']:.0f} s"
        )


def _baseline(policy: str) -> bool:
    return policy not in ("qlm", ORACLE, NO_DEFER) and not policy.startswith(
        (FIXED, RATIO, WEIGHTS, FLOOR, TOLERANCE)
    )


def check(rows: list[dict[str, Any]], policies: list[str]) -> bool:
    if "qlm" not in policies or "fcfs" not in policies:
        return True
    rates = sorted({r["rate"] for r in rows})
    by = {(r["policy"], r["rate"]): r["slo_attainment"] for r in rows}
    ok = True
    for rate in rates:
        base = {p: by[(p, rate)] for p in policies if _baseline(p) and (p, rate) in by}
        best = max(base, key=lambda p: base[p])
        diff = 100 * (by[("qlm", rate)] - base[best])
        good = diff >= -2.0
        ok &= good
        print(
            f"x{rate:g}: qlm {100 * by[('qlm', rate)]:.1f} vs best baseline {best} {100 * base[best]:.1f} ({diff:+.1f} points) {'ok' if good else 'MISSED (target: within 2 points)'}"
        )
    knee = next((rate for rate in rates if by[("fcfs", rate)] < 0.5), None)
    if knee is None:
        print("FCFS never dropped below 50 %: raise --rates")
        return False
    gain = 100 * (by[("qlm", knee)] - by[("fcfs", knee)])
    good = gain >= 40.0
    print(
        f"first load with FCFS < 50 %: x{knee:g}; qlm - fcfs = {gain:+.1f} points {'ok' if good else 'MISSED (target: >= 40)'}"
    )
    for p in policies:
        if not _baseline(p) and p != "qlm" and (p, knee) in by:
            print(f"  {p} - fcfs = {100 * (by[(p, knee)] - by[('fcfs', knee)]):+.1f} points")
    return ok and good


def plot(
    rows: list[dict[str, Any]], policies: list[str], path: Path, args: argparse.Namespace
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for p in policies:
        pts = sorted(
            (r["rate"], r["slo_attainment"], r["throughput_rps"]) for r in rows if r["policy"] == p
        )
        if not pts:
            continue
        style: dict[str, Any] = {"linewidth": 2.5, "color": "black"} if p == "qlm" else {}
        if not _baseline(p) and p != "qlm":
            style = {"linewidth": 1.2, "linestyle": "--"}
        a1.plot([x for x, _, _ in pts], [100 * y for _, y, _ in pts], marker="o", label=p, **style)
        a2.plot([x for x, _, _ in pts], [t for _, _, t in pts], marker="o", label=p, **style)
    a1.set(xlabel="arrival rate × Azure conv", ylabel="SLO attainment (%)", ylim=(0, 102))
    a2.set(xlabel="arrival rate × Azure conv", ylabel="throughput (requests/s)")
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    a2.grid(alpha=0.3)
    fig.suptitle(f"W_B on {args.instances}, first {args.end:g} s of Azure conv (seed {args.seed})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
