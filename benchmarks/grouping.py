"""Grouping speed: classify one new request online among ~1,000 existing groups, and re-cluster
100,000 queued requests (paper §4, Algorithm 1). Targets on the 2-core development machine:
classification ≤ 0.2 ms median, re-clustering ≤ 1 s. Prints figures; asserts nothing.

The queue: 100,000 requests with ShareGPT lengths and Poisson arrivals (``synthetic``), the W_A mix
(four models, interactive 20 s and batch 300 s classes) over them. Classification is timed twice:
among the groups of that mix (~1,100, spread over 8 partitions) and, as the worst case, with ~1,000
groups all in the one partition the new requests fall into (single model and class).

It also prints how many group ids survive a re-clustering after 5 % of the queue was dispatched and
as many requests arrived.

Reproduce: .venv/bin/python benchmarks/grouping.py [--requests N] [--repeat N] [--churn-rounds N]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from qlm.domain import Request
from qlm.groups import Grouper
from qlm.sim.traces import load_lengths, synthetic
from qlm.sim.workload import create_workload


def queued_requests(workload: str, n: int, *, seed: int = 0) -> list[Request]:
    """``n`` requests of ``workload`` over ShareGPT lengths, all waiting at once."""
    trace = synthetic(load_lengths("sharegpt"), rate=100.0, n=n, seed=seed)
    return create_workload(workload, trace, seed=seed)


def grouped(requests: list[Request]) -> Grouper:
    """A grouper holding ``requests``, re-clustered once (as a controller's would be)."""
    grouper = Grouper()
    for r in requests:
        grouper.add(r, now=r.arrival_s)
    grouper.recluster(now=requests[-1].arrival_s)
    return grouper


def bench_classification(label: str, grouper: Grouper, arrivals: list[Request]) -> None:
    """Time ``add`` of each new request (then take it out again, so the groups stay as they are)."""
    times_ms = []
    for r in arrivals:
        t0 = time.perf_counter_ns()
        grouper.add(r, now=r.arrival_s)
        times_ms.append((time.perf_counter_ns() - t0) / 1e6)
        grouper.remove(r.id)
    median, p99 = np.percentile(times_ms, [50, 99])
    print(
        f"classify one request, {label}: {len(grouper):,} groups; over {len(arrivals):,} requests "
        f"median {median:.3f} ms, p99 {p99:.3f} ms (target median ≤ 0.2 ms)"
    )


def bench_recluster(requests: list[Request], repeat: int) -> Grouper:
    """Wall time of ``recluster`` over every queued request: first from the groups online
    classification formed, then again over the unchanged queue. Returns the grouper."""
    grouper = Grouper()
    for r in requests:
        grouper.add(r, now=r.arrival_s)
    walls = []
    for i in range(repeat):
        t0 = time.perf_counter()
        result = grouper.recluster(now=1e6 + i)
        walls.append(time.perf_counter() - t0)
        print(
            f"re-cluster {result.requests:,} requests, run {i + 1}: {walls[-1]:.3f} s -> "
            f"{len(grouper):,} groups ({len(result.kept)} ids kept, {len(result.created)} created, "
            f"{len(result.removed)} removed)"
        )
    print(
        f"re-cluster {len(requests):,} requests: median {np.median(walls):.3f} s, "
        f"worst {max(walls):.3f} s (target ≤ 1 s)"
    )
    return grouper


def bench_churn(grouper: Grouper, arrivals: list[Request], rounds: int) -> None:
    """Id stability: per round, 5 % of the queue is dispatched (the head of a random group) and as
    many requests arrive, then the queue is re-clustered; prints the share of ids kept."""
    rng = np.random.default_rng(0)
    step = max(1, grouper.num_requests // 20)
    for i in range(rounds):
        for _ in range(step):
            ids = grouper.group_ids()
            grouper.pop(ids[int(rng.integers(len(ids)))])
        for r in arrivals[i * step : (i + 1) * step]:
            grouper.add(r, now=r.arrival_s)
        before = len(grouper)
        t0 = time.perf_counter()
        result = grouper.recluster(now=2e6 + i)
        wall = time.perf_counter() - t0
        print(
            f"5 % churn, round {i + 1}: re-cluster {wall:.3f} s; {len(result.kept)} of {before} ids "
            f"kept ({100 * len(result.kept) / before:.0f} %), {len(result.created)} created, "
            f"{len(result.removed)} removed"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--arrivals", type=int, default=5_000)
    parser.add_argument("--churn-rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}; "
        f"W_A mix over ShareGPT lengths"
    )

    extra = max(args.arrivals, args.churn_rounds * (args.requests // 20))
    mix = queued_requests("wa", args.requests + extra)
    queued, arrivals = mix[: args.requests], mix[args.requests :]
    bench_classification("W_A mix (8 partitions)", grouped(queued), arrivals[: args.arrivals])
    # ~1,000 groups in one partition: the default workload (one model, one class), 90,000 requests.
    single = queued_requests("default", 90_000 + args.arrivals, seed=1)
    bench_classification(
        "worst case (all in one partition)", grouped(single[:90_000]), single[90_000:]
    )
    grouper = bench_recluster(queued, args.repeat)
    bench_churn(grouper, arrivals, args.churn_rounds)
    print(
        f"reproduce: .venv/bin/python benchmarks/grouping.py --requests {args.requests} "
        f"--repeat {args.repeat} --arrivals {args.arrivals} --churn-rounds {args.churn_rounds}"
    )


if __name__ == "__main__":
    main()
