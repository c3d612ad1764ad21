"""How fast does a controller take over a large backlog?

Publishes N requests (default 100,000; W_B's SLO classes and tiers, real Azure-conversation
lengths), recorded in the store first as the API records them, to the global queue, then
starts a controller service (the production one: store writes, groups, estimator, planner,
agents) and measures three times: until every request is held, recorded, grouped and placed in
a virtual queue (by the planner's online placement, §4); until the estimator has checked that
order against the SLOs (a predicted violation re-plans at once); and until the next whole plan
(periodic, every ``period_s`` = 10 s, when no violation is predicted). And the peak memory
(RSS) of the controller's process. Target: 100,000 requests taken over, grouped and planned
<= 15 s with RabbitMQ and PostgreSQL, <= 1 GB.

What runs where, so that the figures are the controller's alone: the controller runs on the
event loop ``qlm controller`` runs on (``qlm.eventloop``: uvloop); the instances are ``qlm
sim-engine serve`` processes (16 simulated A100s by default), driven over vLLM's HTTP API as
production drives vLLM (``--in-process-engines``: simulated in the controller's process, as
``qlm serve`` does by default). With ``--broker`` the requests are recorded and published by a
process of its own, which has ended before the controller starts, so the controller's process
holds only what the controller holds (with the in-process queue the queue's messages live in it
too). The store is SQLite in a temporary file, or PostgreSQL with ``--database
postgresql://...`` (a schema of the run's own, dropped afterwards). The time split by stage
sums every control step of the take-over (nested: ``plan`` holds ``solve``; ``gcN``: Python's
garbage collections) against the wall time; the rest is the intake (deliveries, store reads,
acks) and the event loop's other work.

It also prints the longest control step, ``longest control step: X s``: the wall time of the
longest single ``Controller.step`` (the controller's event loop records no outcome, acks nothing
and publishes nothing while one runs), with what that step spent its time in. Target: <= 1 s.
``--redeliver 2400`` then delivers 2,400 more requests at once to the controller holding its
plan (what a broker restart does: it delivers again every message the leader held) and prints
the longest step of that too; with ``--drained`` they arrive while every instance is drained (a
leader whose engines have not answered yet), and the instances come back once all are held, so
that one plan places every group.

    .venv/bin/python benchmarks/controller_backlog.py \
        --broker amqp://guest:guest@127.0.0.1:5672/%2F \
        --database postgresql://postgres@127.0.0.1:5432/test
    .venv/bin/python benchmarks/controller_backlog.py    # in-process queue, SQLite file
    .venv/bin/python benchmarks/controller_backlog.py --requests 2400 --redeliver 2400
    .venv/bin/python benchmarks/controller_backlog.py --redeliver 2400 --drained

With RabbitMQ one consumer can hold at most 65,535 un-acked deliveries per shard (AMQP's prefetch
limit; quorum queues turn "unlimited" into 2,000), so the controller holds
min(N, shards × 65,535) and the rest wait in the broker; the script says so and measures what is
held (``--shards 2`` holds 100,000). The run's queues are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import gc
import multiprocessing
import resource
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from qlm import eventloop
from qlm.clock import EpochClock
from qlm.controller import Controller
from qlm.domain import PlanRecord
from qlm.global_queue import GlobalQueue, open_global_queue
from qlm.planner import create_policy
from qlm.planner.qlm_policy import QlmPolicy
from qlm.service import ControllerService
from qlm.service.instances import build_engines, default_instances
from qlm.service.replay import to_message
from qlm.service.runtime import AgentRuntime
from qlm.service.sim_servers import SimServers
from qlm.service.upkeep import new_request
from qlm.sim.traces import load_trace
from qlm.sim.workload import create_workload
from qlm.store import Store
from qlm.store.database import scratch_schema

MAX_PREFETCH = 65535


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepTimer:
    """Wall time of every ``Controller.step``: the controller's event loop does nothing else
    while one runs (no outcome recorded, no ack, no state published)."""

    def __init__(
        self, controller: Controller, policy: QlmPolicy, profile: Path | None = None
    ) -> None:
        self.policy = policy
        self.profile = profile  # where the longest step's profile goes (per phase: ``reset``)
        self.plans: list[PlanRecord] = []  # every plan, from the steps' outputs
        self.longest = 0.0
        self.longest_cpu = 0.0  # the controller thread's CPU time in it (the rest: waiting)
        self.steps = 0
        self.what = ""
        self.parts: dict[str, float] = {}  # seconds in each part of the step under way
        self.longest_parts: dict[str, float] = {}
        self.total_parts: dict[str, float] = {}  # summed over the phase's steps
        self.step_s = 0.0  # wall time in the phase's steps
        self._watch_parts()
        self._gc_started = 0.0

        def collecting(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                self._gc_started = time.perf_counter()
            else:
                spent = time.perf_counter() - self._gc_started
                name = f"gc{info.get('generation', '')}"
                self.parts[name] = self.parts.get(name, 0.0) + spent

        gc.callbacks.append(collecting)
        step = controller.step

        def timed(now: float, views: Any) -> Any:
            held = policy.grouper.num_requests
            plans = len(self.plans)
            self.parts = {}
            profiler = cProfile.Profile() if self.profile is not None else None
            t0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                if profiler is not None:
                    profiler.enable()
                output = step(now, views)
                self.plans += output.plans
                return output
            finally:
                wall = time.perf_counter() - t0
                cpu = time.thread_time() - cpu0
                if profiler is not None:
                    profiler.disable()
                self.steps += 1
                self.step_s += wall
                for name, spent in self.parts.items():
                    self.total_parts[name] = self.total_parts.get(name, 0.0) + spent
                if wall > self.longest:
                    self.longest, self.longest_cpu = wall, cpu
                    self.longest_parts = self.parts
                    if profiler is not None and self.profile is not None:
                        profiler.dump_stats(self.profile)
                    made = self.plans[plans:]
                    self.what = f"{policy.grouper.num_requests - held:+,} requests held" + "".join(
                        f"; plan ({p.trigger}) of {p.groups:,} groups, {p.status} "
                        f"{p.method} in {p.solve_s:.2f} s"
                        for p in made
                    )

        controller.step = timed  # type: ignore[method-assign]

    def _watch_parts(self) -> None:
        """Time the parts of a step (nested: a plan holds the solver's time)."""
        import qlm.planner.qlm_policy as module

        def timed(name: str, fn: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0

            return run

        policy = self.policy
        for obj, names in (
            (policy, ("decide", "_place", "_trigger", "_family", "plan")),
            (policy.agents, ("act", "_remember")),  # the act stage (``qlm.planner.act``)
            (policy.grouper, ("add", "recluster")),
            (policy.queues, ("sync",)),
            (policy.estimator, ("observe",)),
        ):
            for name in names:
                setattr(obj, name, timed(name.lstrip("_"), getattr(obj, name)))
        fluid = policy._fluid_models  # the concurrency choice's fluid models
        fluid.evaluate = timed("fluid", fluid.evaluate)  # type: ignore[method-assign]
        for name in ("solve", "capacity_needed", "build_family"):
            setattr(module, name, timed(name, getattr(module, name)))

    def reset(self) -> None:
        """A new phase: its longest step, profiled into ``FILE-burst`` (the take-over's stays)."""
        self.longest, self.steps, self.what = 0.0, 0, ""
        self.total_parts, self.step_s = {}, 0.0
        if self.profile is not None:
            self.profile = self.profile.with_name(f"{self.profile.stem}-burst{self.profile.suffix}")

    def split(self, wall_s: float) -> str:
        """The phase's time by stage: every step's parts summed, against ``wall_s``."""
        parts = ", ".join(
            f"{name} {t:.1f}" for name, t in sorted(self.total_parts.items(), key=lambda kv: -kv[1])
        )
        return (
            f"time by stage: {self.step_s:.1f} s of {wall_s:.1f} s in {self.steps:,} control "
            f"steps (seconds, nested: plan holds solve: {parts}); the other "
            f"{max(0.0, wall_s - self.step_s):.1f} s: intake (deliveries, store, acks) and the "
            "event loop's other work"
        )

    def report(self, phase: str) -> str:
        parts = ", ".join(
            f"{name} {t:.3f}"
            for name, t in sorted(self.longest_parts.items(), key=lambda kv: -kv[1])
        )
        return (
            f"longest control step: {self.longest:.3f} s ({phase}; {self.longest_cpu:.3f} s of it "
            f"on the CPU in the controller's thread, the rest waiting for the GIL or a core; "
            f"{self.steps:,} steps; "
            f"longest: {self.what}; seconds in: {parts})"
        )


def make_requests(count: int, tag: str) -> list[Any]:
    """``count`` requests of W_B on Azure-conversation lengths, the trace repeated with fresh
    ids (prefixed with ``tag``) until there are enough."""
    base = create_workload("wb", load_trace("azure-conv", seed=0), seed=0)
    return [
        dataclasses.replace(r, id=f"{tag}{k}-{r.id}")
        for k in range(-(-count // len(base)))
        for r in base
    ][:count]


async def publish(queue: GlobalQueue, store: Store, requests: Sequence[Any], run: str) -> float:
    """Record ``requests`` in the store, then publish them, as the API does (in batches)."""
    now = time.time()
    t0 = time.perf_counter()
    for start in range(0, len(requests), 1000):
        messages = [to_message(r, now, run) for r in requests[start : start + 1000]]
        store.add_requests([new_request(m) for m in messages])
        for errors in await asyncio.gather(
            *(queue.publish_many(messages[i : i + 250]) for i in range(0, len(messages), 250))
        ):
            failed = [e for e in errors if e is not None]
            if failed:
                raise failed[0]
    return time.perf_counter() - t0


def publish_process(
    broker: str, options: dict[str, Any], shards: int, database: str, count: int, tag: str, run: str
) -> float:
    """``publish`` from a process of its own (``publish_elsewhere``): the requests never live in
    the controller's process."""

    async def main() -> float:
        queue = open_global_queue(broker, shards=shards, **options)
        try:
            with Store.open(database) as store:
                return await publish(queue, store, make_requests(count, tag), run)
        finally:
            await queue.close()

    return asyncio.run(main())


async def publish_elsewhere(
    args: argparse.Namespace, options: dict[str, Any], database: str, count: int, tag: str, run: str
) -> float:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return await asyncio.get_running_loop().run_in_executor(
            pool, publish_process, args.broker, options, args.shards, database, count, tag, run
        )


@dataclasses.dataclass
class Taken:
    """Seconds from the start until every request expected was held and handed to the policy,
    until their order was checked against the SLOs, and until a whole plan covered them."""

    held_s: float | None = None
    checked_s: float | None = None
    planned_s: float | None = None
    emptied: bool = False  # every request was pulled before a plan came: none waits to plan


async def take(
    service: ControllerService,
    policy: QlmPolicy,
    plans: Sequence[PlanRecord],
    expect: int,
    args: argparse.Namespace,
) -> Taken:
    """Wait until the controller has received ``expect`` requests in all, handed them to the
    policy, checked their order and re-planned them as a whole."""
    runtime = service.runtime
    out = Taken()
    handed_at: float | None = None
    received_at: float | None = None  # the controller has them all: the next step takes them
    t0 = time.perf_counter()
    next_report = 5.0
    while time.perf_counter() - t0 < args.timeout:
        await asyncio.sleep(0.05)
        if args.verbose and time.perf_counter() - t0 >= next_report:
            next_report += 5.0
            last = plans[-1] if plans else None
            print(
                f"  {time.perf_counter() - t0:5.1f} s: held {service.received:,}, "
                f"{len(policy.grouper):,} groups of {policy.grouper.num_requests:,} requests, "
                f"{len(plans)} plans"
                + (f" (last: {last.groups} groups, {last.solve_s:.2f} s)" if last else "")
                + f", {runtime.steps} steps",
                flush=True,
            )
        held = service.received
        if received_at is None and held >= expect:
            received_at = runtime.clock.now()
        handed = not runtime.controller.has_arrivals and not policy.ungrouped
        if handed_at is None and held >= expect and handed:
            out.held_s = time.perf_counter() - t0  # held, recorded and handed to the policy
            handed_at = runtime.clock.now()
        if (
            handed_at is not None
            and received_at is not None
            and out.checked_s is None
            and (policy.last_checked_s >= received_at)
        ):
            out.checked_s = time.perf_counter() - t0  # the order judged against the SLOs since
        if (
            handed_at is not None
            and received_at is not None
            and plans
            and plans[-1].at_s >= received_at
        ):
            out.planned_s = time.perf_counter() - t0  # a plan over every group since
            break
        if handed_at is not None and not len(policy.grouper):
            out.planned_s, out.emptied = time.perf_counter() - t0, True
            break
    return out


def report(
    taken: Taken, policy: QlmPolicy, plans: Sequence[PlanRecord], args: argparse.Namespace
) -> None:
    if taken.planned_s is None or taken.held_s is None:
        print(f"did not finish within {args.timeout:.0f} s")
        return
    print(
        f"all held, recorded in the store, grouped and placed in virtual queues after "
        f"{taken.held_s:.1f} s"
    )
    if taken.checked_s is not None:
        print(
            f"their order checked against the SLOs (violation check) after {taken.checked_s:.1f} s"
        )
    if taken.emptied:
        print(f"all pulled after {taken.planned_s:.1f} s: none waits to be planned")
        return
    last = plans[-1]
    print(
        f"re-planned as a whole after {taken.planned_s:.1f} s (the next periodic plan, unless a "
        f"violation is predicted first): {len(policy.grouper):,} groups, "
        f"plan {last.status} in {last.solve_s:.2f} s ({len(plans)} plans so far)"
    )


async def main(args: argparse.Namespace) -> None:
    names = {}
    if args.broker:
        prefix = f"qlm.bench.{uuid.uuid4().hex[:8]}"
        names = {
            "queue": prefix,
            "dead_letter_exchange": f"{prefix}.dlx",
            "dead_letter_queue": f"{prefix}.dead",
        }
    with contextlib.ExitStack() as stack:
        if args.database:
            database = stack.enter_context(scratch_schema(args.database, "qlm_backlog"))
        else:
            database = f"sqlite:///{Path(tempfile.mkdtemp()) / 'backlog.db'}"
        try:
            await run_backlog(args, names, database)
        finally:
            if args.broker:
                await delete_queues(args.broker, names, args.shards)


async def run_backlog(args: argparse.Namespace, names: dict[str, str], database: str) -> None:
    options: dict[str, Any] = dict(names)
    queue: GlobalQueue = open_global_queue(args.broker, shards=args.shards, **options)
    store = Store.open(database)
    run = uuid.uuid4().hex[:6]
    if args.broker:
        publish_s = await publish_elsewhere(args, options, database, args.requests, "", run)
    else:  # the in-process queue: the messages live in this process
        publish_s = await publish(queue, store, make_requests(args.requests, ""), run)
    print(f"recorded and published {args.requests:,} requests in {publish_s:.1f} s", flush=True)
    configs = default_instances(args.instances)
    servers = SimServers()
    if not args.in_process_engines:
        t0 = time.perf_counter()
        configs = await servers.start(configs)
        print(
            f"{len(configs)} qlm sim-engine serve processes ready in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    gc.collect()
    base_rss = rss_mb()
    policy = create_policy("qlm")
    assert isinstance(policy, QlmPolicy)
    controller = Controller(policy, [c.spec for c in configs])
    timer = StepTimer(controller, policy, args.profile_longest)
    runtime = AgentRuntime(controller, build_engines(configs), clock=EpochClock())
    service = ControllerService(queue, store, runtime, name="bench")
    capacity = args.shards * MAX_PREFETCH
    expect = args.requests if not args.broker else min(args.requests, capacity)
    cpu0 = time.process_time()
    await service.start()
    peak = base_rss
    try:
        taken = await take(service, policy, timer.plans, expect, args)
        peak = rss_mb()
        cpu_s = time.process_time() - cpu0
        print(
            f"controller: held {service.received:,} of {args.requests:,} "
            + (
                f"(RabbitMQ, {args.shards} shard(s): holds at most {capacity:,})"
                if args.broker
                else "(in-process queue)"
            )
        )
        report(taken, policy, timer.plans, args)
        print(
            f"CPU time of the controller's process (every thread) in the take-over: {cpu_s:.1f} s"
        )
        print(timer.split(taken.planned_s if taken.planned_s is not None else args.timeout))
        print(timer.report(f"take-over of {args.requests:,} queued requests"), flush=True)
        if args.redeliver and taken.planned_s is not None:
            # The broker hands the leader a burst at once (as after a broker restart, when every
            # un-acked message is delivered again): the controller holds a plan already.
            timer.reset()
            instances = [c.spec.name for c in configs]
            expect = service.received + args.redeliver
            if args.drained:  # no instance to put them on yet: every group waits for the planner
                for name in instances:
                    runtime.set_draining(name, True)
            if args.broker:
                publish_s = await publish_elsewhere(
                    args, options, database, args.redeliver, "again-", run
                )
            else:
                burst = make_requests(args.redeliver, "again-")
                publish_s = await publish(queue, store, burst, run)
            print(
                f"delivered {args.redeliver:,} more requests at once (published in "
                f"{publish_s:.1f} s) to the controller holding {policy.grouper.num_requests:,} "
                "requests and a plan" + (", every instance drained" if args.drained else ""),
                flush=True,
            )
            if args.drained:
                while (
                    service.received < expect or runtime.controller.has_arrivals or policy.ungrouped
                ):
                    await asyncio.sleep(0.05)
                for name in instances:
                    runtime.set_draining(name, False)
                print(
                    f"all held; the instances are back: {len(policy.grouper):,} groups to plan",
                    flush=True,
                )
            taken = await take(service, policy, timer.plans, expect, args)
            report(taken, policy, timer.plans, args)
            print(timer.report(f"{args.redeliver:,} requests delivered at once"), flush=True)
            peak = rss_mb()
        where = "in process" if args.in_process_engines else "in their own processes"
        print(
            f"peak RSS of the controller's process {peak:,.0f} MB (before the controller "
            f"started: {base_rss:,.0f} MB; engines {where})"
        )
        print("reproduce: .venv/bin/python " + " ".join(sys.argv))
    except BaseException:
        traceback.print_exc()  # now: stopping what runs may take a while
        raise
    finally:
        await service.stop()
        servers.stop()
        store.close()
        await queue.close()


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
    parser.add_argument(
        "--database",
        default=None,
        help="a postgresql:// URL: the store in a schema of the run's own (default: SQLite file)",
    )
    parser.add_argument(
        "--in-process-engines",
        action="store_true",
        help="simulate the instances in the controller's process instead of qlm sim-engine "
        "serve processes",
    )
    parser.add_argument("--shards", type=int, default=1, help="global-queue shards (RabbitMQ)")
    parser.add_argument("--instances", default="16xA100:llama-3-8b")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--verbose", action="store_true", help="progress every 5 s")
    parser.add_argument(
        "--profile-longest",
        type=Path,
        default=None,
        metavar="FILE",
        help="profile every step (cProfile: slower) and keep the longest one's stats in FILE (the burst's in FILE-burst)",
    )
    parser.add_argument(
        "--redeliver",
        type=int,
        default=0,
        metavar="N",
        help="after the take-over, deliver N more requests at once (a broker restart "
        "redelivers what the leader held) and time that too",
    )
    parser.add_argument(
        "--drained",
        action="store_true",
        help="with --redeliver: the burst arrives while every instance is drained (a leader "
        "whose engines have not answered yet) and they come back once it is held, so one plan "
        "places every group",
    )
    eventloop.run(main(parser.parse_args()))
