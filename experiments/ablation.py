"""Ablation of the agents' operations (paper Figs. 8–13): QLM with every operation, with
each one removed, and the FCFS and EDF baselines, on W_A (several models sharing GPUs), W_B (one
model, several SLO classes) and W_C (W_A with mega prompts).

Variants (all on the same trace window, seed and simulated instances):

- ``qlm-all``: the shipped defaults: warm start, eviction and KV swap on;
- ``qlm-no-warm``: no CPU memory for warm models (every switch loads from disk);
- ``qlm-no-evict``: KV swap only; ``qlm-no-swap``: eviction only;
- ``qlm-no-preempt``: neither eviction nor KV swap;
- ``fcfs`` (vLLM as deployed: the engine switches models first come first served), ``edf``.

Prints SLO attainment and throughput per workload and variant and writes
``experiments/results/ablation.json`` and ``ablation.png``.

Reproduce: .venv/bin/python experiments/ablation.py
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from stamp import write_result

from qlm.agents import AgentConfig
from qlm.planner import PlannerConfig, create_policy
from qlm.profiling import simulated_fleet
from qlm.sim.cluster import ClusterSimulation
from qlm.sim.traces import load_trace, scale_rate, window
from qlm.sim.workload import create_workload

ALL = AgentConfig()
VARIANTS: dict[str, tuple[str, AgentConfig | None, dict[str, Any]]] = {
    "qlm-all": ("qlm", ALL, {}),
    "qlm-no-warm": ("qlm", ALL, {"cpu_model_cache_gb": 0.0}),
    "qlm-no-evict": ("qlm", AgentConfig(evict=False, swap=True), {}),
    "qlm-no-swap": ("qlm", AgentConfig(evict=True, swap=False), {}),
    "qlm-no-preempt": ("qlm", AgentConfig(evict=False, swap=False), {}),
    "fcfs": ("fcfs", None, {}),
    "edf": ("edf", None, {}),
}
WORKLOADS = {
    # W_A's three smaller models share two A100s; Llama-2-70B needs two A100s of its own (its
    # weights alone are 140 GB), so it gets a 2-GPU instance.
    "wa": ("2xA100:llama-3-8b+llama-2-7b+llama-2-13b,1xA100/2:llama-2-70b", 0.5),
    "wb": ("1xA100:llama-3-8b", 1.8),
    "wc": ("2xA100:llama-3-8b+llama-2-7b+llama-2-13b,1xA100/2:llama-2-70b", 0.5),
}


def run_one(job: tuple[str, str, float, float, int, str, str]) -> dict[str, Any]:
    workload, variant, rate, end_s, seed, perf_model, kv_memory = job
    instances = WORKLOADS[workload][0]
    policy_name, agent, engine = VARIANTS[variant]
    trace = window(scale_rate(load_trace("azure-conv", seed=seed), rate), 0.0, end_s)
    catalog, specs, profile = simulated_fleet(instances, perf_model, kv_memory)
    fleet_models = [m for spec in specs for m in spec.models]
    requests = create_workload(workload, trace, seed=seed, fleet_models=fleet_models)
    planner = PlannerConfig.for_simulation(5000, agent=agent) if agent is not None else None
    policy = create_policy(policy_name, planner=planner, profile=profile)
    t0 = time.perf_counter()
    sim = ClusterSimulation(specs, policy, engine_config=engine, catalog=catalog)
    result = sim.run(requests)
    s = result.summary
    return {
        "workload": workload,
        "variant": variant,
        "instances": instances,
        "rate": rate,
        "requests": len(requests),
        "failed": s["failed"],
        "slo_attainment": s["slo_attainment"],
        "throughput_rps": s["throughput_rps"],
        "model_switches": s["model_switches"],
        "evictions": sum(r.evictions for r in result.records),
        "swaps": sum(r.swaps for r in result.records),
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workloads", default="wa,wb,wc")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--end", type=float, default=900.0, help="seconds of the trace to replay")
    ap.add_argument("--rates", default="", help="e.g. wa=0.5,wb=1.8,wc=0.5 (default: per workload)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--perf-model", default="default", help="default, splitwise or a CSV file")
    ap.add_argument("--kv-memory", default="vllm", help="vllm or splitwise")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--name", default="ablation")
    args = ap.parse_args(argv)
    rates = {w: r for w, (_, r) in WORKLOADS.items()}
    for item in filter(None, args.rates.split(",")):
        w, _, r = item.partition("=")
        rates[w] = float(r)
    jobs = [
        (w, v, rates[w], args.end, args.seed, args.perf_model, args.kv_memory)
        for w in args.workloads.split(",")
        for v in args.variants.split(",")
    ]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(run_one, jobs))
    for w in args.workloads.split(","):
        print(f"\n{w.upper()} on {WORKLOADS[w][0]}, Azure conv x{rates[w]:g}, first {args.end:g} s")
        print(
            f"{'variant':<14}{'SLO %':>8}{'req/s':>8}{'switches':>10}{'evict':>7}{'swap':>6}{'failed':>7}"
        )
        for r in rows:
            if r["workload"] == w:
                print(
                    f"{r['variant']:<14}{100 * r['slo_attainment']:>8.1f}{r['throughput_rps']:>8.2f}"
                    f"{r['model_switches']:>10}{r['evictions']:>7}{r['swaps']:>6}{r['failed']:>7}"
                )
    given = argv if argv is not None else sys.argv[1:]
    out = write_result(args.name, "ablation.py", given, {"args": vars(args), "rows": rows})
    plot(rows, out.with_suffix(".png"))
    return 0


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.2 * len(workloads)), squeeze=False)
    for k, w in enumerate(workloads):
        sub = [r for r in rows if r["workload"] == w]
        names = [r["variant"] for r in sub]
        axes[k][0].barh(names, [100 * r["slo_attainment"] for r in sub], color="tab:blue")
        axes[k][0].set(xlabel="SLO attainment (%)", title=f"{w.upper()}", xlim=(0, 100))
        axes[k][1].barh(names, [r["throughput_rps"] for r in sub], color="tab:green")
        axes[k][1].set(xlabel="throughput (requests/s)", title=f"{w.upper()}")
        for ax in axes[k]:
            ax.invert_yaxis()
            ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
