"""How fast does a controller take over a large backlog? (issue 6)

Publishes N requests (default 100,000; W_B's SLO classes and tiers, real Azure-conversation
lengths) to the global queue, then starts a controller service (the production one: store
writes, groups, estimator, planner, agents) on simulated instances serving meanwhile, and
measures three times: until every request is held, recorded, grouped and placed in a virtual
queue (by the planner's online placement, §4); until the estimator has checked that order against
the SLOs (a predicted violation re-plans at once); and until the next whole plan (periodic, every
``period_s`` = 10 s, when no violation is predicted). And the peak memory (RSS) of the process.
Target here (issue 6): <= 60 s and <= 1.5 GB.

    .venv/bin/python benchmarks/controller_backlog.py    # in-process queue, SQLite file
    .venv/bin/python benchmarks/controller_backlog.py \
        --broker amqp://guest:guest@127.0.0.1:5672/%2F --shards 2

With RabbitMQ one consumer can hold at most 65,535 un-acked deliveries per shard (AMQP's prefetch
limit; quorum queues turn "unlimited" into 2,000), so the controller holds
min(N, shards × 65,535) and the rest wait in the broker; the script says so and measures what is
held. The run's queues are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import resource
import sys
import tempfile
import time
import uuid
from pathlib import Path

from qlm.agents.executor import AgentRuntime
from qlm.clock import EpochClock
from qlm.controller import Controller
from qlm.global_queue import GlobalQueue, open_global_queue
from qlm.planner import create_policy
from qlm.planner.qlm_policy import QlmPolicy
from qlm.service import ControllerService
from qlm.service.instances import build_engines, default_instances
from qlm.service.replay import to_message
from qlm.sim.traces import load_trace
from qlm.sim.workload import create_workload
from qlm.store import Store

MAX_PREFETCH = 65535


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def main(args: argparse.Namespace) -> None:
    base = create_workload("wb", load_trace("azure-conv", seed=0), seed=0)
    requests = [  # the trace repeated with fresh ids until there are enough
        dataclasses.replace(r, id=f"{k}-{r.id}")
        for k in range(-(-args.requests // len(base)))
        for r in base
    ][: args.requests]
    names = {}
    if args.broker:
        prefix = f"qlm.bench.{uuid.uuid4().hex[:8]}"
        names = {
            "queue": prefix,
            "dead_letter_exchange": f"{prefix}.dlx",
            "dead_letter_queue": f"{prefix}.dead",
        }
    queue: GlobalQueue = open_global_queue(args.broker, shards=args.shards, **names)
    run = uuid.uuid4().hex[:6]
    now = time.time()
    t0 = time.perf_counter()
    for start in range(0, len(requests), 500):
        await asyncio.gather(
            *(queue.publish(to_message(r, now, run)) for r in requests[start : start + 500])
        )
    publish_s = time.perf_counter() - t0
    print(f"published {len(requests):,} requests in {publish_s:.1f} s", flush=True)
    base_rss = rss_mb()

    db = Path(tempfile.mkdtemp()) / "backlog.db"
    store = Store.open(f"sqlite:///{db}")
    configs = default_instances(args.instances)
    policy = create_policy("qlm")
    runtime = AgentRuntime(
        Controller(policy, [c.spec for c in configs]),
        build_engines(configs),
        clock=EpochClock(),
    )
    service = ControllerService(queue, store, runtime, name="bench")
    capacity = args.shards * MAX_PREFETCH
    expect = len(requests) if not args.broker else min(len(requests), capacity)
    t0 = time.perf_counter()
    await service.start()
    assert isinstance(policy, QlmPolicy)
    held_s = checked_s = planned_s = None
    handed_at: float | None = None
    received_at: float | None = None  # the controller has them all: the next step takes them
    next_report = 5.0
    while time.perf_counter() - t0 < args.timeout:
        await asyncio.sleep(0.05)
        if args.verbose and time.perf_counter() - t0 >= next_report:
            next_report += 5.0
            last = policy.plans[-1] if policy.plans else None
            print(
                f"  {time.perf_counter() - t0:5.1f} s: held {service.received:,}, "
                f"{len(policy.grouper):,} groups of {policy.grouper.num_requests:,} requests, "
                f"{len(policy.plans)} plans"
                + (f" (last: {last.groups} groups, {last.solve_s:.2f} s)" if last else "")
                + f", {runtime.steps} steps",
                flush=True,
            )
        held = service.received
        if received_at is None and held >= expect:
            received_at = runtime.clock.now()
        if handed_at is None and held >= expect and not runtime.controller.has_arrivals:
            held_s = time.perf_counter() - t0  # held, recorded and handed to the policy
            handed_at = runtime.clock.now()
        if (
            handed_at is not None
            and received_at is not None
            and checked_s is None
            and (policy.last_checked_s >= received_at)
        ):
            checked_s = time.perf_counter() - t0  # the order judged against the SLOs since
        if handed_at is not None and policy.plans and policy.plans[-1].at_s >= received_at:
            planned_s = time.perf_counter() - t0  # a plan over every group since
            break
    peak = rss_mb()
    print(
        f"controller: held {service.received:,} of {len(requests):,} "
        + (
            f"(RabbitMQ, {args.shards} shard(s): holds at most {capacity:,})"
            if args.broker
            else "(in-process queue)"
        )
    )
    if planned_s is None or held_s is None:
        print(f"did not finish within {args.timeout:.0f} s")
    else:
        last = policy.plans[-1]
        print(
            f"all held, recorded in the store, grouped and placed in virtual queues after "
            f"{held_s:.1f} s"
        )
        if checked_s is not None:
            print(f"their order checked against the SLOs (violation check) after {checked_s:.1f} s")
        print(
            f"re-planned as a whole after {planned_s:.1f} s (the next periodic plan, unless a "
            f"violation is predicted first): {len(policy.grouper):,} groups, "
            f"plan {last.status} in {last.solve_s:.2f} s ({len(policy.plans)} plans so far)"
        )
    print(f"peak RSS {peak:,.0f} MB (after publishing: {base_rss:,.0f} MB)")
    print("reproduce: .venv/bin/python " + " ".join(sys.argv))
    await service.stop()
    store.close()
    if args.broker:
        await delete_queues(args.broker, names, args.shards)


async def delete_queues(url: str, names: dict[str, str], shards: int) -> None:
    import aio_pika

    from qlm.global_queue.rabbitmq import shard_names

    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        for name in [*shard_names(names["queue"], shards), names["dead_letter_queue"]]:
            await channel.queue_delete(name)
        await channel.exchange_delete(names["dead_letter_exchange"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--broker", default=None, help="amqp:// URL (default: in-process)")
    parser.add_argument("--shards", type=int, default=1, help="global-queue shards (RabbitMQ)")
    parser.add_argument("--instances", default="16xA100:llama-3-8b")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--verbose", action="store_true", help="progress every 5 s")
    asyncio.run(main(parser.parse_args()))
