"""The controller service end to end in one process: in-memory global queue, SQLite store,
simulated instances on the wall clock at 50x. Waits poll with a deadline; no timing asserts."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
from builders import make_catalog, make_profile, make_request

from qlm.clock import WallClock
from qlm.controller import Controller
from qlm.domain import InstanceSpec, RequestStatus, Tier
from qlm.engines.wallclock import WallClockEngine, count_tokens, filler_text
from qlm.errors import ConfigError
from qlm.global_queue import (
    DeadLetter,
    GlobalQueue,
    MemoryBroker,
    MemoryGlobalQueue,
    QueuedRequest,
)
from qlm.planner import PlannerConfig, create_policy
from qlm.service import ControllerService
from qlm.service.backlog_gc import BacklogGC
from qlm.service.runtime import AgentRuntime
from qlm.service.upkeep import ORPHAN_ERROR
from qlm.store import NewRequest, Store, StoreError
from qlm.store.rows import InstanceState
from qlm.virtual_queues import GroupSnapshot, QueueSnapshot, VirtualQueuesSnapshot

SCALE = 50.0


def make_service(
    store: Store,
    broker: MemoryBroker,
    policy: str = "qlm",
    name: str = "c0",
    queue: GlobalQueue | None = None,
    step_ms: float | None = None,
    max_running: int | None = None,
) -> ControllerService:
    """``step_ms``: the engines' time per decode step (the catalog's base), to slow them."""
    catalog = make_catalog() if step_ms is None else make_catalog(compute_base_ms=step_ms)
    engines = [
        WallClockEngine.from_catalog(n, "m", "G", 1, time_scale=SCALE, catalog=catalog)
        for n in ("i0", "i1")
    ]
    pol = create_policy(policy, profile=make_profile(), planner=PlannerConfig.for_simulation(500))
    runtime = AgentRuntime(
        Controller(pol, [InstanceSpec(e.name, "G", ("m",)) for e in engines]),
        engines,
        clock=WallClock(SCALE),
        tick_s=0.02,
        health_interval_s=0.05,
        max_running=None if max_running is None else dict.fromkeys(("i0", "i1"), max_running),
    )
    return ControllerService(
        queue if queue is not None else MemoryGlobalQueue(broker=broker),
        store,
        runtime,
        name=name,
        flush_s=0.01,
        poll_s=0.02,
    )


def message(i: int, at: float, **kw: Any) -> QueuedRequest:
    fields: dict[str, Any] = {
        "id": f"q{i:04d}",
        "model": "m",
        "prompt_tokens": 8,
        "max_tokens": 400,
        "slo_e2e_s": 120.0,
        "submitted_at": at,
        "tenant": "acme",
        "prompt": "say something long",
        "replay_output_tokens": 40 + i,
    }
    return QueuedRequest(**(fields | kw))


async def eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60.0
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        await asyncio.sleep(0.01)


def run(scenario: Callable[[Store], Awaitable[None]]) -> None:
    store = Store.open("sqlite://")
    try:
        asyncio.run(scenario(store))
    finally:
        store.close()


def final(store: Store, ids: list[str]) -> bool:
    return store.final_ids(ids) == set(ids)


def test_published_requests_finish_are_recorded_and_acked() -> None:
    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker)
        await service.start()
        producer = MemoryGlobalQueue(broker=broker)
        now = service.runtime.clock.now()
        ids = [f"q{i:04d}" for i in range(30)]
        for i in range(30):
            await producer.publish(message(i, now))
        await eventually(lambda: final(store, ids), "every request is final")
        await service.wait_idle()
        await service.stop()
        for i, rid in enumerate(ids):
            row = store.get(rid, tenant="acme")
            assert row is not None and row.status is RequestStatus.FINISHED, rid
            assert row.output_tokens == 40 + i == count_tokens(row.output_text or "")
            assert row.slo_met is True and row.instance in ("i0", "i1")
            assert row.dispatched_at is not None and row.first_token_at is not None
        assert service.settled == 30 and broker.ready == 0 and not broker.dead
        # Recorded and acked: the controller keeps nothing of them (a long-running one would
        # otherwise hold every request it ever served).
        assert not list(service.runtime.controller.tracks())
        assert store.latest_plan() is not None  # the planner's history is in the store
        assert {r.state for r in store.instances()} == {"up"}
        # Each finished request is in every latency histogram once (the writer's batches).
        counts: dict[str, int] = {}
        for bucket in store.latency_buckets():
            counts[bucket.histogram] = counts.get(bucket.histogram, 0) + bucket.count
        assert counts == {"ttft": 30, "e2e": 30, "queue": 30}

    run(scenario)


def test_a_large_backlog_is_frozen_out_of_full_collections_until_it_drains() -> None:
    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker)
        service.backlog_gc = BacklogGC(min_held=10)  # "large" at 10 held requests
        producer = MemoryGlobalQueue(broker=broker)
        now = service.runtime.clock.now()
        ids = [f"q{i:04d}" for i in range(30)]
        for i in range(30):
            await producer.publish(message(i, now))
        frozen_before = gc.get_freeze_count()
        try:
            await service.start()
            await eventually(lambda: service.backlog_gc.freezes > 0, "the backlog is frozen")
            assert gc.get_freeze_count() > frozen_before
            await eventually(lambda: final(store, ids), "every request is final")
            await service.wait_idle()
            # drained below a quarter of the largest backlog: collected as usual again
            assert service.backlog_gc.unfreezes >= 1 and not service.backlog_gc.frozen
            assert gc.get_freeze_count() == 0
        finally:
            await service.stop()
            gc.unfreeze()

    run(scenario)


def test_the_controller_forgets_only_requests_that_are_over() -> None:
    controller = Controller(
        create_policy("fcfs", profile=make_profile()), [InstanceSpec("i0", "G", ("m",))]
    )
    waiting, cancelled = (message(i, 0.0).to_request(0.0) for i in (1, 2))
    assert controller.arrive(waiting) and controller.arrive(cancelled)
    assert controller.cancel(cancelled.id) is None  # it waited: nothing to abort
    assert not controller.forget(waiting.id)  # still held
    assert controller.forget(cancelled.id)
    assert not controller.forget(cancelled.id) and not controller.forget("unknown")
    assert [t.request.id for t in controller.tracks()] == [waiting.id]
    # Forgotten, the id is new again (a redelivery of it is answered by the store first).
    assert not controller.arrive(waiting) and controller.arrive(cancelled)


def test_a_request_already_final_is_acked_without_running_and_poison_is_dead_lettered() -> None:
    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker, policy="fcfs")
        now = service.runtime.clock.now()
        done = message(1, now)
        store.add_request(NewRequest.from_request(done.to_request(now)))
        store.record_outcome(done.id, status=RequestStatus.FINISHED, at=now, output_tokens=3)
        producer = MemoryGlobalQueue(broker=broker)
        await producer.publish(done)
        await producer.publish(message(2, now, model="unknown-model"))
        await service.start()
        await eventually(lambda: service.settled == 2, "both settled")
        await service.stop()
        assert store.get(done.id) is not None and store.get(done.id).output_tokens == 3  # type: ignore[union-attr]
        poison = store.get("q0002")
        assert poison is not None and poison.status is RequestStatus.FAILED
        assert "no instance serves model 'unknown-model'" in (poison.error or "")
        assert [d.reason for d in broker.dead] == ["no instance serves model 'unknown-model'"]
        assert not service.runtime.controller.tracks() or all(
            t.request.id != done.id for t in service.runtime.controller.tracks()
        )

    run(scenario)


def test_a_message_whose_row_the_store_refuses_is_dead_lettered_and_a_down_store_holds_all() -> (
    None
):
    """A request the store cannot record (its row refused while the store records others) is
    dead-lettered with the store's reason instead of holding the deliveries behind it; while
    the store records nothing at all, every delivery waits in the queue."""

    async def scenario(store: Store) -> None:
        record = store.ensure_requests
        down = threading.Event()
        tried_while_down: list[str] = []

        def refusing(news: list[NewRequest]) -> dict[str, Any]:
            if down.is_set():
                tried_while_down.extend(n.id for n in news)
            if down.is_set() or any(n.id == "q0001" for n in news):
                raise StoreError("cannot record requests: value refused")
            return record(news)

        def states() -> Any:
            if down.is_set():
                raise StoreError("the database is gone")
            return []

        store.ensure_requests = refusing  # type: ignore[method-assign]
        store.controller_states = states  # type: ignore[method-assign]
        broker = MemoryBroker()
        service = make_service(store, broker, policy="fcfs")
        producer = MemoryGlobalQueue(broker=broker)
        now = service.runtime.clock.now()
        for i in range(3):
            await producer.publish(message(i, now))
        await service.start()
        await eventually(lambda: final(store, ["q0000", "q0002"]), "the others are final")
        await eventually(lambda: len(broker.dead) == 1, "the refused one is dead-lettered")
        assert b"q0001" in broker.dead[0].raw
        assert "could not be recorded: cannot record requests: value refused" in (
            broker.dead[0].reason
        )
        down.set()
        await producer.publish(message(3, service.runtime.clock.now()))
        await eventually(lambda: len(tried_while_down) >= 3, "the delivery is tried again")
        assert len(broker.dead) == 1
        down.clear()
        await eventually(lambda: final(store, ["q0003"]), "recorded once the store is back")
        await service.stop()

    run(scenario)


def test_a_request_the_policy_cannot_plan_fails_alone_and_the_service_goes_on() -> None:
    """An SLO of 1e-300 s (from a client older than the API's minimum, or a message already in
    the queue) breaks the deadline arithmetic: that request is recorded failed with the reason
    and dead-lettered, the others finish, and so does one published after."""

    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker)
        await service.start()
        producer = MemoryGlobalQueue(broker=broker)
        now = service.runtime.clock.now()
        # submitted on an epoch clock, as in production: its deadline window overflows
        await producer.publish(message(0, 1.7e9, slo_e2e_s=1e-300))
        await producer.publish(message(1, now))
        await eventually(lambda: final(store, ["q0000", "q0001"]), "both are final")
        await producer.publish(message(2, service.runtime.clock.now()))
        await eventually(lambda: final(store, ["q0002"]), "one sent after it finishes")
        await service.wait_idle()
        await service.stop()
        poison = store.get("q0000")
        assert poison is not None and poison.status is RequestStatus.FAILED
        assert "could not be planned (OverflowError" in (poison.error or "")
        assert len(broker.dead) == 1 and b"q0000" in broker.dead[0].raw
        assert "could not be planned" in broker.dead[0].reason
        for rid in ("q0001", "q0002"):
            row = store.get(rid)
            assert row is not None and row.status is RequestStatus.FINISHED

    run(scenario)


def test_a_request_published_twice_runs_once_and_both_deliveries_are_settled() -> None:
    """A client's resend or an API's retry after a lost confirm puts a request on the queue
    twice: in the same batch, or while the first delivery's request runs. It runs once and
    every delivery is acked with its outcome (one was left un-acked for good)."""

    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker)
        producer = MemoryGlobalQueue(broker=broker)
        now = service.runtime.clock.now()
        await producer.publish_many([message(0, now), message(0, now)])  # one batch
        await service.start()
        await eventually(lambda: service.holds("q0000"), "the first is held")
        long = message(1, now, replay_output_tokens=3000, max_tokens=3000)
        await producer.publish(long)
        await eventually(lambda: engines_running(service) >= 1, "it runs")
        await producer.publish(long)  # again, while it runs
        await eventually(lambda: final(store, ["q0000", "q0001"]), "both finished")
        await service.wait_idle()
        await eventually(lambda: broker.unacked == 0, "every delivery settled")
        await service.stop()
        assert broker.ready == 0 and not broker.dead
        for rid in ("q0000", "q0001"):
            row = store.get(rid)
            assert row is not None and row.status is RequestStatus.FINISHED
            assert row.dispatched_at is not None and row.evictions == 0

    run(scenario)


def test_a_leading_controller_is_active_before_its_first_request() -> None:
    """The queue says at once who leads: a controller whose queue is still empty is active (it
    serves whatever arrives) and publishes so, not standby until its first delivery; before
    the queue told it, it is starting; the one behind it is standby."""

    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        first, second = (make_service(store, broker, name=n) for n in ("c0", "c1"))
        first.publish_s = second.publish_s = 0.02
        assert first.role == "starting" and not first.active
        await first.start()
        await second.start()
        assert first.role == "active" and first.active and first.received == 0
        assert second.role == "standby" and not second.active

        def published() -> dict[str, Any]:
            return {s.name: s for s in store.controller_states()}

        await eventually(lambda: set(published()) == {"c0", "c1"}, "both published")
        states = published()
        assert states["c0"].active and states["c0"].snapshot["role"] == "active"
        assert not states["c1"].active and states["c1"].snapshot["role"] == "standby"
        await second.stop()
        await first.stop()
        assert first.role == "stopping" and not first.active

    run(scenario)


class SlowLock(MemoryGlobalQueue):
    """A queue whose consumer takes the lead only once ``granted`` is set (RabbitMQ's leader
    lock, taken while another connection still holds it)."""

    def __init__(self, broker: MemoryBroker) -> None:
        super().__init__(broker=broker)
        self.granted = asyncio.Event()

    async def consume(self, handler: Any, *, on_leader: Any = None) -> None:
        await self.granted.wait()
        await super().consume(handler, on_leader=on_leader)


def test_a_controller_taking_the_lead_publishes_starting_then_active() -> None:
    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        queue = SlowLock(broker)
        service = make_service(store, broker, queue=queue)
        service.publish_s = 0.02
        starting = asyncio.create_task(service.start())

        def role() -> str | None:
            states = store.controller_states()
            return states[0].snapshot.get("role") if states else None

        await eventually(lambda: role() == "starting", "it published that it is starting")
        assert not store.controller_states()[0].active and not service.active
        queue.granted.set()
        await starting
        await eventually(lambda: role() == "active", "it published that it leads")
        assert store.controller_states()[0].active
        await service.stop()

    run(scenario)


def test_a_standby_controller_takes_over_and_each_request_ends_once() -> None:
    async def scenario(store: Store) -> None:
        broker = MemoryBroker(delivery_limit=10)
        # one request at a time per instance: a busy host that starves the process lets the
        # engines' clock jump (and what runs finish), but every wave needs control steps, so
        # most requests still wait when the first controller dies
        first, standby = (
            make_service(store, broker, name="c0", max_running=1),
            make_service(store, broker, name="c1", max_running=1),
        )
        first.publish_s = 0.02
        await first.start()
        await standby.start()  # waits: single active consumer
        producer = MemoryGlobalQueue(broker=broker)
        now = first.runtime.clock.now()
        ids = [f"q{i:04d}" for i in range(40)]
        for i in range(40):
            await producer.publish(
                message(i, now, replay_output_tokens=100 + 40 * i, max_tokens=2000)
            )
        await eventually(
            lambda: len(store.final_ids(ids)) >= 5, "the first controller finished some"
        )
        assert first.active and not standby.active  # the standby waits behind the first
        await eventually(
            lambda: any(s.name == "c0" for s in store.controller_states()), "c0 published"
        )
        # The first controller dies: no graceful stop, nothing flushed, its deliveries return.
        await first.crash()
        left = 40 - len(store.final_ids(ids))
        assert left > 0
        await eventually(lambda: final(store, ids), "the standby finished the rest")
        await standby.wait_idle()
        await standby.stop()
        rows = [store.get(rid) for rid in ids]
        assert all(r is not None and r.status is RequestStatus.FINISHED for r in rows)
        assert [r.output_tokens for r in rows if r] == [100 + 40 * i for i in range(40)]
        assert broker.ready == 0 and not broker.dead
        assert standby.received >= left  # everything not final came back to it
        assert not standby.active  # stopped
        # The stopped one said so as it left; the killed one could not.
        stopped = {s.name: s.stopped_at is not None for s in store.controller_states()}
        assert stopped == {"c0": False, "c1": True}

    run(scenario)


def engines_running(service: ControllerService) -> int:
    return sum(
        engine.stats_nowait().running  # type: ignore[attr-defined]
        for engine in service.runtime.engines()
    )


def spy_release(service: ControllerService) -> list[int]:
    """How many requests each of the service's releases (step-downs) stopped, as they happen."""
    released: list[int] = []
    release = service.runtime.release

    async def spy(ids: Any) -> int:
        released.append(await release(ids))
        return released[-1]

    service.runtime.release = spy  # type: ignore[method-assign]
    return released


async def serving(store: Store, requests: int, tokens: int) -> tuple[ControllerService, list[str]]:
    """A started service alone on a fresh in-process broker, running some of ``requests``
    published requests of ``tokens`` output tokens each."""
    broker = MemoryBroker()
    service = make_service(store, broker)
    await service.start()
    producer = MemoryGlobalQueue(broker=broker)
    now = service.runtime.clock.now()
    ids = [f"q{i:04d}" for i in range(requests)]
    for i in range(requests):
        await producer.publish(message(i, now, replay_output_tokens=tokens, max_tokens=8000))
    await eventually(lambda: engines_running(service) >= 2, "it runs some")
    return service, ids


def test_a_controller_that_lost_the_lead_stops_what_the_leader_took_over() -> None:
    async def scenario(store: Store) -> None:
        broker = MemoryBroker(delivery_limit=10)
        # The first's engines are slow (4,000 tokens: ~4 s of wall time against ~0.5 s) so
        # that what it runs is still running when it learns that the second leads: a loaded
        # machine can take longer than half a second to get there, and a standby whose
        # requests all finished meanwhile has nothing to step down from.
        first, second = (
            make_service(store, broker, name="c0", step_ms=50.0),
            make_service(store, broker, name="c1"),
        )
        first.publish_s = second.publish_s = 0.05  # their state in the store: who leads
        released = spy_release(first)  # by the first controller, when it steps down
        await first.start()
        await second.start()  # waits: single active consumer
        producer = MemoryGlobalQueue(broker=broker)
        now = first.runtime.clock.now()
        ids = [f"q{i:04d}" for i in range(20)]
        for i in range(20):
            await producer.publish(message(i, now, replay_output_tokens=4000, max_tokens=5000))
        await eventually(lambda: engines_running(first) >= 2, "the first controller runs some")
        # Its connection drops: the broker hands everything it held to the second, and it comes
        # back as a standby. Once it sees the second lead (its state in the store), it stops
        # what it ran and writes nothing more for it.
        first.queue.drop_connection()  # type: ignore[attr-defined]
        assert not first.active
        await eventually(lambda: second.active, "the second controller leads")
        await eventually(lambda: bool(released), "the first stepped down")
        assert released[0] >= 2 and not first.held  # what ran there was stopped
        reported: list[str] = []  # by the first controller's agents, from now on
        for event in ("finished", "failed", "cancelled", "returned"):
            setattr(first, event, lambda rid, *_, **__: reported.append(str(rid)))
        await eventually(
            lambda: engines_running(first) == 0 and first.runtime.idle, "the first let go"
        )
        assert not list(first.runtime.controller.tracks())
        await eventually(lambda: final(store, ids), "the leader finished them all")
        await second.wait_idle()
        rows = [store.get(rid) for rid in ids]
        assert all(r is not None and r.status is RequestStatus.FINISHED for r in rows)
        assert all(r.output_tokens == 4000 for r in rows if r)
        assert engines_running(first) == 0 and reported == []  # nothing ran on there
        assert broker.ready == 0 and not broker.dead
        await first.stop()
        await second.stop()

    run(scenario)


class SlowLeaderRead:
    """A store whose ``controller_states`` answers late — once, the first time it shows another
    controller active and publishing (after ``armed``), until ``gate`` is set."""

    def __init__(self, inner: Store, name: str) -> None:
        self.inner = inner
        self.name = name
        self.seen: dict[str, float] | None = None
        self.armed = False
        self.blocked = threading.Event()
        self.gate = threading.Event()

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    def controller_states(self) -> Any:
        rows = self.inner.controller_states()
        now = {r.name: r.updated_at for r in rows if r.active and r.name != self.name}
        moved = self.seen is not None and any(
            n in self.seen and self.seen[n] != u for n, u in now.items()
        )
        self.seen = {r.name: r.updated_at for r in rows}
        if self.armed and moved:
            self.armed = False
            self.blocked.set()
            self.gate.wait(30)
        return rows


def test_a_controller_leading_again_while_it_looked_for_the_leader_keeps_its_requests() -> None:
    async def scenario(store: Store) -> None:
        broker = MemoryBroker(delivery_limit=50)
        c0, c1 = make_service(store, broker, name="c0"), make_service(store, broker, name="c1")
        c0.publish_s = c1.publish_s = 0.05
        slow = SlowLeaderRead(store, "c0")
        c0.store = slow  # type: ignore[assignment]
        await c0.start()
        await c1.start()
        producer = MemoryGlobalQueue(broker=broker)
        now = c0.runtime.clock.now()
        ids = [f"q{i:04d}" for i in range(4)]
        for i in range(4):
            await producer.publish(message(i, now, replay_output_tokens=3000, max_tokens=3100))
        await eventually(lambda: engines_running(c0) >= 2, "c0 runs them")
        slow.armed = True
        try:
            c0.queue.drop_connection()  # type: ignore[attr-defined]  # c1 leads, c0 watches
            await eventually(lambda: slow.blocked.is_set(), "c0 reads that c1 leads (slowly)")
            c1.queue.drop_connection()  # type: ignore[attr-defined]  # back to c0 meanwhile
            await eventually(lambda: not c0.standby, "c0 leads again")
            await eventually(lambda: c0.redelivered >= 4, "its requests delivered again")
        finally:
            slow.gate.set()  # the read answers, late: c1 led — but c0 leads now
        await eventually(lambda: final(store, ids), "all finished")
        rows = [store.get(rid) for rid in ids]
        assert all(r is not None and r.status is RequestStatus.FINISHED for r in rows)
        assert broker.ready == 0 and not broker.dead
        await c0.stop()
        await c1.stop()

    run(scenario)


def test_a_standby_with_no_other_leader_in_sight_keeps_running_what_it_held() -> None:
    """RabbitMQ can answer "locked" to a reconnect while the broker has not yet dropped the
    controller's own old connection: no other controller leads, so nothing is stopped."""

    async def scenario(store: Store) -> None:
        service, ids = await serving(store, 6, 7000)
        # what the queue says when its own old connection holds the lock:
        service.leader_changed(False)
        assert not service.active
        assert service.watching_leader
        looks = [0]
        read = store.controller_states

        def counted() -> Any:
            looks[0] += 1
            return read()

        store.controller_states = counted  # type: ignore[method-assign]
        await eventually(lambda: looks[0] >= 10, "ten looks at the store for another leader")
        assert service.watching_leader and service.held == 6 and engines_running(service) >= 2
        service.leader_changed(True)
        await eventually(lambda: final(store, ids), "all finished")
        await service.wait_idle()
        rows = [store.get(rid) for rid in ids]
        assert all(r is not None and r.output_tokens == 7000 and r.evictions == 0 for r in rows)
        assert service.active and not service.watching_leader
        await service.stop()

    run(scenario)


def test_a_controller_whose_connection_drops_while_alone_keeps_running_what_it_held() -> None:
    async def scenario(store: Store) -> None:
        # Long enough (~1 s of wall time each) that a starved event loop does not see them all
        # start and finish between two of the wait's looks.
        service, ids = await serving(store, 10, 5000)
        broker = service.queue.broker  # type: ignore[attr-defined]
        running = engines_running(service)
        service.queue.drop_connection()  # type: ignore[attr-defined]
        # Alone, it leads again at once: the redeliveries find their requests still running
        # (none stopped; more may have started since they were counted).
        assert service.active and engines_running(service) >= running
        await eventually(lambda: final(store, ids), "all finished")
        await service.wait_idle()
        rows = [store.get(rid) for rid in ids]
        assert all(r is not None and r.status is RequestStatus.FINISHED for r in rows)
        assert all(r.output_tokens == 5000 and r.evictions == 0 for r in rows if r)
        assert service.settled == 10 and broker.ready == 0 and not broker.dead
        await service.stop()

    run(scenario)


def test_retention_deletes_ended_requests_and_old_plans() -> None:
    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker)
        # 60 s on its clock (50x): about a second here; checked every 20 ms.
        service.retain_s, service.retain_plans, service.retain_every_s = 60.0, 2, 0.02
        await service.start()
        producer = MemoryGlobalQueue(broker=broker)
        now = service.runtime.clock.now()
        ids = [f"q{i:04d}" for i in range(5)]
        for i in range(5):
            await producer.publish(message(i, now, replay_output_tokens=5))
        await eventually(lambda: final(store, ids), "they ended")
        ended = max(r.finished_at or 0.0 for r in map(store.get, ids) if r)
        await eventually(lambda: all(store.get(rid) is None for rid in ids), "deleted")
        assert service.runtime.clock.now() >= ended + 60.0  # not before their time
        await eventually(lambda: len(store.plans(limit=10)) <= 2, "old plans deleted")
        # (that requests still queued or running are never deleted: the store's contract)
        await service.stop()

    run(scenario)


def test_cancels_made_in_the_store_reach_the_controller() -> None:
    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker, policy="edf", max_running=1)
        await service.start()
        producer = MemoryGlobalQueue(broker=broker)
        now = service.runtime.clock.now()
        for i in range(4):
            await producer.publish(
                message(i, now + i * 1e-3, replay_output_tokens=3000, max_tokens=4000)
            )
        await eventually(
            lambda: (r := store.get("q0000")) is not None and r.first_token_at is not None,
            "q0 runs",
        )
        assert store.cancel("q0000") is RequestStatus.RUNNING
        assert store.cancel("q0003") is RequestStatus.CANCELLED  # still queued
        ids = [f"q{i:04d}" for i in range(4)]
        await eventually(lambda: final(store, ids), "all settled")
        await service.wait_idle()
        await service.stop()
        got = {rid: store.get(rid) for rid in ids}
        assert got["q0000"].status is RequestStatus.CANCELLED  # type: ignore[union-attr]
        assert 0 < got["q0000"].output_tokens < 3000  # type: ignore[union-attr]
        assert got["q0003"].status is RequestStatus.CANCELLED  # type: ignore[union-attr]
        assert got["q0001"].status is RequestStatus.FINISHED  # type: ignore[union-attr]
        assert broker.ready == 0

    run(scenario)


def test_snapshots_predictions_drain_and_streamed_results() -> None:
    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker, max_running=1)
        service.publish_s = 0.02
        store.upsert_instance(InstanceSpec("i1", "G", ("m",)), state=InstanceState.DRAINING)
        # Predictions are written by the writer, in its transaction (beside it, PostgreSQL found
        # the two batches deadlocked).
        in_batch: list[bool] = []
        record = store.record_predictions

        def spy(predictions: Any) -> None:
            in_batch.append(store.in_batch)
            record(predictions)

        store.record_predictions = spy  # type: ignore[method-assign]
        await service.start()
        producer = MemoryGlobalQueue(broker=broker)
        now = service.runtime.clock.now()
        watched = service.hub.subscribe("q0000")
        ids = [f"q{i:04d}" for i in range(12)]
        for i in range(12):
            await producer.publish(message(i, now, replay_output_tokens=200))

        def waiting_predicted() -> bool:
            rows = [store.get(rid) for rid in ids]
            return any(
                r is not None
                and r.status is RequestStatus.QUEUED
                and r.predicted_completion_at is not None
                for r in rows
            )

        await eventually(waiting_predicted, "a waiting request has a predicted completion")
        assert in_batch and all(in_batch)
        states = store.controller_states()
        assert states and states[0].name == "c0" and states[0].active
        assert states[0].stopped_at is None
        snap = states[0].snapshot
        queued = [g for q in snap["queues"] for g in q["groups"]]
        assert queued and all(q["instance"] == "i0" for q in snap["queues"] if q["groups"])
        assert {i["name"]: i["draining"] for i in snap["instances"]} == {"i0": False, "i1": True}
        await eventually(lambda: final(store, ids), "all finished")
        await service.wait_idle()
        events = []
        while not watched.empty():
            events.append(watched.get_nowait())
        await service.stop()
        assert {store.get(rid).instance for rid in ids} == {"i0"}  # type: ignore[union-attr]
        assert events[-1].done and events[-1].status is RequestStatus.FINISHED
        text = "".join(e.text for e in events)
        assert text == store.get("q0000").output_text  # type: ignore[union-attr]
        assert [r.state for r in store.instances() if r.name == "i1"] == [InstanceState.DRAINING]
        [last] = store.controller_states()
        assert last.active is False and last.stopped_at is not None

    run(scenario)


def test_capped_prediction_writes_go_to_the_oldest_requests_first_and_catch_up() -> None:
    async def scenario(store: Store) -> None:
        service = make_service(store, MemoryBroker())
        service.prediction_writes = 2
        reqs = [make_request(i, arrival_s=t) for i, t in enumerate((5.0, 1.0, 3.0, 4.0))]

        group = GroupSnapshot(
            "g", 0, "m", Tier.STANDARD, "default", 4, 100.0, 50.0, requests=tuple(reqs)
        )
        snap = VirtualQueuesSnapshot(0.0, 0.9, (QueueSnapshot("i0", (group,)),))
        assert set(service.predictions_to_write(snap)) == {"r0001", "r0002"}
        assert set(service.predictions_to_write(snap)) == {"r0003", "r0000"}
        assert service.predictions_to_write(snap) == {}  # all written, nothing moved
        with pytest.raises(ConfigError, match="prediction_writes"):
            ControllerService(service.queue, store, service.runtime, prediction_writes=0)

    run(scenario)


def test_a_slow_ack_holds_neither_the_store_writes_nor_the_next_acks_back() -> None:
    """Acks go out beside the writer: while the broker is slow to take one, the outcomes of
    other requests are still recorded, and the ack follows once the broker takes it."""

    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker)
        queue = service.queue
        real_ack = queue.ack
        release = asyncio.Event()
        acked: list[str] = []

        async def slow_first_ack(delivery: Any) -> None:
            if not acked:
                acked.append("waiting")
                await release.wait()
            await real_ack(delivery)
            acked.append(delivery.message.id)

        queue.ack = slow_first_ack  # type: ignore[method-assign]
        await service.start()
        producer = MemoryGlobalQueue(broker=broker)
        now = service.runtime.clock.now()
        await producer.publish(message(0, now, replay_output_tokens=5))
        await eventually(lambda: acked == ["waiting"], "the first ack is under way")
        ids = [f"q{i:04d}" for i in range(1, 6)]
        for i in range(1, 6):
            await producer.publish(message(i, now, replay_output_tokens=5))
        await eventually(lambda: final(store, ids), "the later outcomes are recorded")
        await eventually(lambda: len(acked) == 6, "the later ones are acked")
        release.set()
        await service.wait_idle()
        await service.stop()
        assert sorted(acked[1:]) == ["q0000", *ids]
        assert service.settled == 6 and broker.ready == 0

    run(scenario)


def test_a_message_the_broker_gave_up_on_is_recorded_failed_with_the_reason() -> None:
    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker)
        now = service.runtime.clock.now()
        broker.dead.append(DeadLetter(message(7, now).encode(), "delivery_limit"))
        broker.dead.append(DeadLetter(b"not json", "malformed message"))
        real, states = store.ensure_requests, store.controller_states
        down = True

        def ensure(news: Any) -> Any:
            if down:
                raise StoreError("the store is down")
            return real(news)

        def read() -> Any:
            if down:
                raise StoreError("the store is down")
            return states()

        store.ensure_requests = ensure  # type: ignore[method-assign]
        store.controller_states = read  # type: ignore[method-assign]
        with pytest.raises(StoreError):
            await service.reap_once()
        assert len(broker.dead) == 2  # nothing left the dead-letter queue
        down = False
        assert await service.reap_once() == 1
        row = store.get("q0007", tenant="acme")
        assert row is not None and row.status is RequestStatus.FAILED
        assert row.error == "dead-lettered: delivery_limit"
        assert not broker.dead and await service.reap_once() == 0

    run(scenario)


def test_a_dead_letter_whose_row_the_store_refuses_is_logged_and_holds_up_no_other(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The store refuses one dead letter's row while it records the others': the others are
    recorded failed, and the refused one leaves the dead-letter queue with an error log that
    carries its message (kept, it would be read again every round and hold the orphan sweep)."""

    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker)
        now = service.runtime.clock.now()
        for i in (1, 2, 3):
            broker.dead.append(DeadLetter(message(i, now).encode(), "delivery_limit"))
        real = store.ensure_requests

        def refusing(news: Any) -> Any:
            if any(n.id == "q0002" for n in news):
                raise StoreError("cannot record requests: value refused")
            return real(news)

        store.ensure_requests = refusing  # type: ignore[method-assign]
        assert await service.reap_once() == 2
        for id in ("q0001", "q0003"):
            row = store.get(id, tenant="acme")
            assert row is not None and row.status is RequestStatus.FAILED
        assert store.get("q0002", tenant="acme") is None
        assert not broker.dead and await service.reap_once() == 0
        (dropped,) = [r for r in caplog.records if "dropped" in r.getMessage()]
        assert dropped.levelname == "ERROR"
        assert "q0002" in dropped.getMessage() and "value refused" in dropped.getMessage()
        assert '"id":"q0002"' in dropped.getMessage()  # the message itself

    run(scenario)


def test_a_stored_prediction_is_rewritten_only_when_it_moves_by_its_slack() -> None:
    from qlm.service.publishing import _moved

    now = 1_000.0
    assert _moved(None, (now + 10, False), now) == math.inf  # never written
    assert _moved((now + 10, False), (now + 10, True), now) == math.inf  # the risk flipped
    assert _moved((now + 10, False), (now + 10.5, False), now) == 0.5  # within the 1 s floor
    assert _moved((now + 10, False), (now + 11.5, False), now) == 1.5
    # An hour out the slack is 5 % of the time to go (180 s), not 1 s.
    assert _moved((now + 3_600, False), (now + 3_700, False), now) < 1
    assert _moved((now + 3_600, False), (now + 3_900, False), now) > 1


def test_prediction_writes_are_capped_per_publish_and_catch_up() -> None:
    """Under a backlog every re-plan moves most predictions: a publish writes at most
    ``prediction_writes`` of them (the rest at the next ones), never all of them at once."""

    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker, max_running=1)
        service.publish_s = 0.02
        service.prediction_writes = 2
        sizes: list[int] = []
        record = store.record_predictions

        def spy(predictions: Any) -> None:
            sizes.append(len(predictions))
            record(predictions)

        store.record_predictions = spy  # type: ignore[method-assign]
        await service.start()
        producer = MemoryGlobalQueue(broker=broker)
        now = service.runtime.clock.now()
        ids = [f"q{i:04d}" for i in range(12)]
        for i in range(12):
            await producer.publish(message(i, now, replay_output_tokens=400))

        def predicted() -> int:
            rows = [store.get(rid) for rid in ids]
            return sum(1 for r in rows if r is not None and r.predicted_completion_at is not None)

        await eventually(lambda: predicted() >= 8, "most requests have a predicted completion")
        await service.stop()
        assert sizes and max(sizes) == 2

    run(scenario)


def test_a_controller_becoming_active_learns_output_lengths_from_recent_completions() -> None:
    """A restarted or failed-over controller plans with what the fleet has been answering (here
    7 tokens, against the profile's ~70), not with the profile's prior alone; completions of a
    model no instance serves teach nothing, and ``history_outputs=0`` turns it off."""

    async def expected_after_start(store: Store, history: int) -> tuple[float, float]:
        broker = MemoryBroker()
        service = make_service(store, broker)
        service.history_outputs = history
        policy = service.runtime.controller.policy
        probe = message(999, 0.0).to_request(0.0)
        before = policy.estimator.expected_output(probe)  # type: ignore[attr-defined]
        await service.start()
        now = service.runtime.clock.now()
        await MemoryGlobalQueue(broker=broker).publish(message(1, now))
        await eventually(lambda: final(store, ["q0001"]), "the request is final")
        await service.wait_idle()
        await service.stop()
        return before, policy.estimator.expected_output(probe)  # type: ignore[attr-defined]

    def history(store: Store) -> None:
        for i in range(60):
            model = "m" if i < 50 else "n"
            done = message(100 + i, 0.0, model=model)
            store.add_request(NewRequest.from_request(done.to_request(0.0)))
            store.record_outcome(done.id, status=RequestStatus.FINISHED, at=1.0, output_tokens=7)

    results: dict[int, tuple[float, float]] = {}

    async def scenario(store: Store) -> None:
        history(store)
        results[1000] = await expected_after_start(store, 1000)

    async def scenario_off(store: Store) -> None:
        history(store)
        results[0] = await expected_after_start(store, 0)

    run(scenario)
    run(scenario_off)
    (before, learnt), (_, off) = results[1000], results[0]
    assert before > 60.0 and off > 60.0  # the profile's prior, and one completion of 41 tokens
    assert learnt < 35.0  # 50 completions of 7 tokens


def test_only_policies_that_estimate_learn_and_only_of_the_models_served() -> None:
    history = [(message(i, 0.0, model="m" if i < 5 else "n").to_request(0.0), 7) for i in range(8)]
    history.append((message(9, 0.0).to_request(0.0), 0))  # nothing generated: nothing to learn
    spec = InstanceSpec("i0", "G", ("m",))
    for name, learnt in (("qlm", 5), ("sedf", 5), ("fcfs", 0), ("edf", 0)):
        policy = create_policy(name, profile=make_profile())
        assert Controller(policy, [spec]).learn_outputs(history) == learnt, name


def test_a_store_that_cannot_give_the_history_only_costs_the_head_start() -> None:
    async def scenario(store: Store) -> None:
        def unavailable(*_: Any) -> Any:
            raise StoreError("database is down")

        broker = MemoryBroker()
        service = make_service(store, broker)
        service.store.recently_finished = unavailable  # type: ignore[method-assign]
        await service.start()
        await MemoryGlobalQueue(broker=broker).publish(message(1, service.runtime.clock.now()))
        await eventually(lambda: final(store, ["q0001"]), "the request is final")
        await service.wait_idle()
        await service.stop()

    run(scenario)


def row(rid: str, at: float) -> NewRequest:
    """A request as an API records it before publishing it."""
    return NewRequest(
        id=rid, tenant="acme", model="m", prompt_tokens=8, max_tokens=400, slo_e2e_s=120.0,
        submitted_at=at, prompt="say something",
    )  # fmt: skip


async def drain_all(service: ControllerService) -> None:
    for name in ("i0", "i1"):
        service.store.set_instance_state(name, InstanceState.DRAINING)
    await eventually(
        lambda: all(i["draining"] for i in service.runtime.instance_states()), "drained"
    )


def test_a_row_no_message_stands_for_is_recorded_failed_by_the_leaders_sweep() -> None:
    """An API that died between the store commit and the broker's confirm leaves a queued row
    with no message: the leader records it failed once two sweeps in a row found it so, and
    never a request it holds, one whose message arrives meanwhile, a young one, or any while
    the broker still has messages to hand out."""

    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker)
        service.orphan_after_s, service.orphan_every_s = 300.0, 3600.0  # swept by hand here
        standby = make_service(store, broker, name="c1")
        standby.orphan_after_s, standby.orphan_every_s = 300.0, 3600.0
        old, now = store.now() - 1000.0, store.now()
        store.ensure_requests([row("orphan", old), row("young", now - 10.0), row("late", old)])
        await service.start()
        await standby.start()
        await drain_all(service)  # what it takes waits, held, for the whole test
        producer = MemoryGlobalQueue(broker=broker)
        await producer.publish(message(1, old))  # submitted as long ago as the orphan
        await eventually(lambda: service.runtime.holds("q0001"), "q0001 is held")
        assert await service.sweep_once() == []  # first seen: only suspected
        assert await standby.sweep_once() == [] == await standby.sweep_once()  # never sweeps
        # A client's retry publishes "late" after all: by the next round it is held or done.
        await producer.publish(message(2, old, id="late"))
        await eventually(lambda: service.runtime.holds("late"), "late is held")
        waiting = service.hub.subscribe("orphan")  # an API of `qlm serve` waiting on it
        assert await service.sweep_once() == ["orphan"]
        event = await asyncio.wait_for(waiting.get(), 5.0)
        assert event.done and event.status is RequestStatus.FAILED
        orphan = store.get("orphan")
        assert orphan is not None and orphan.status is RequestStatus.FAILED
        assert orphan.error == ORPHAN_ERROR
        for rid in ("young", "q0001", "late"):
            kept = store.get(rid)
            assert kept is not None and kept.status is RequestStatus.QUEUED, rid

        # While the broker still has something to hand out (here a dead letter not yet
        # reaped), no row is suspected: its message may be that one.
        store.ensure_requests([row("orphan2", old)])
        broker.dead.append(DeadLetter(b"not json", "malformed message"))
        assert await service.sweep_once() == [] and await service.sweep_once() == []
        broker.dead.clear()
        assert await service.sweep_once() == []
        assert await service.sweep_once() == ["orphan2"]
        assert store.final_ids(["young", "q0001", "late"]) == set()
        for rid in ("q0001", "late"):
            assert await service.cancel(rid)
        await eventually(lambda: final(store, ["q0001", "late"]), "cancelled")
        await standby.stop()
        await service.stop()

    run(scenario)


def test_the_sweep_walks_past_old_requests_it_holds_a_page_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More old requests held than a round reads: the orphans behind them are found over
    the next rounds, and no held request is ever recorded failed."""
    monkeypatch.setattr("qlm.service.upkeep.ORPHAN_PAGE", 2)
    monkeypatch.setattr("qlm.service.upkeep.ORPHAN_PAGES", 1)

    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker)
        service.orphan_after_s, service.orphan_every_s = 300.0, 3600.0
        old = store.now() - 1000.0
        store.ensure_requests([row(f"orphan{i}", old + i) for i in range(3)])
        await service.start()
        await drain_all(service)
        producer = MemoryGlobalQueue(broker=broker)
        held = [f"q{i:04d}" for i in range(5)]
        for i in range(5):  # submitted before the orphans: read first
            await producer.publish(message(i, old - 100.0 + i))
        await eventually(lambda: all(map(service.runtime.holds, held)), "they are held")
        failed: list[str] = []
        for _ in range(12):
            failed += await service.sweep_once()
        assert sorted(failed) == ["orphan0", "orphan1", "orphan2"]
        assert store.final_ids(held) == set()
        for rid in held:
            assert await service.cancel(rid)
        await service.stop()

    run(scenario)


def test_the_sweep_spares_a_request_being_taken_and_a_row_that_ended_meanwhile() -> None:
    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker)
        service.orphan_after_s, service.orphan_every_s = 300.0, 3600.0
        old = store.now() - 1000.0
        store.ensure_requests([row("q0001", old), row("gone", old), row("orphan", old)])
        release = threading.Event()
        real = store.ensure_requests

        def slow(news: Any) -> Any:  # the intake records "q0001" for as long as the test says
            release.wait(30.0)
            return real(news)

        store.ensure_requests = slow  # type: ignore[method-assign]
        await service.start()
        await MemoryGlobalQueue(broker=broker).publish(message(1, old))
        await eventually(lambda: service.holds("q0001"), "q0001 is being taken")
        assert await service.sweep_once() == []
        assert store.cancel("gone", at=store.now()) is RequestStatus.CANCELLED
        assert await service.sweep_once() == ["orphan"]
        release.set()
        await eventually(lambda: final(store, ["q0001"]), "q0001 served")
        served = store.get("q0001")
        assert served is not None and served.status is RequestStatus.FINISHED
        await service.stop()

    run(scenario)


def test_a_request_taken_over_mid_answer_resumes_unless_its_answer_is_structured() -> None:
    """A controller died while three requests ran: the store kept their output so far. The
    next one resumes the plain answer from it, and starts over the structured one (a grammar
    cannot continue a partial document) and the one that had written only whitespace."""
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string"}}}

    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        now = store.now()
        rows = [row("plain", now), replace(row("json", now), sampling={"response_format": fmt})]
        store.ensure_requests([*rows, row("blank", now)])
        for rid in ("plain", "json", "blank"):
            store.mark_dispatched(rid, instance="i0", at=now)
            store.record_partial(rid, text="   " if rid == "blank" else "tok tok tok", tokens=3)
        service = make_service(store, broker)
        await service.start()
        producer = MemoryGlobalQueue(broker=broker)
        await producer.publish(message(0, now, id="plain", replay_output_tokens=40))
        json_msg = message(0, now, id="json", replay_output_tokens=40)
        await producer.publish(replace(json_msg, sampling={"response_format": fmt}))
        await producer.publish(message(0, now, id="blank", replay_output_tokens=40))
        await eventually(lambda: final(store, ["plain", "json", "blank"]), "all finished")
        await service.stop()
        plain, structured = store.get("plain"), store.get("json")
        assert plain is not None and structured is not None
        assert plain.output_text == filler_text(40)[1:] and plain.output_tokens == 40
        assert structured.output_tokens == 40
        assert json.loads(structured.output_text or "") == " ".join(["tok"] * 38)
        blank = store.get("blank")  # only whitespace so far: nothing to continue, started over
        assert blank is not None and blank.output_text == filler_text(40)

    run(scenario)


def test_a_request_resumed_never_writes_more_than_max_tokens_and_a_complete_one_is_not_resent() -> (
    None
):
    """A controller died while two requests ran, one with its whole answer written (40 tokens of
    40) and one a token short: the next controller finishes the first with its output as it
    was, sending nothing, and asks an engine for exactly one token more for the second."""

    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        now = store.now()
        full, short = filler_text(40), filler_text(39)
        store.ensure_requests([replace(row(rid, now), max_tokens=40) for rid in ("done", "one")])
        for rid, text, tokens in (("done", full, 40), ("one", short, 39)):
            store.mark_dispatched(rid, instance="i0", at=now)
            store.record_partial(rid, text=text, tokens=tokens)
        service = make_service(store, broker)
        sent: list[str] = []
        for engine in service.runtime.engines():
            submit = engine.submit

            async def spy(request: Any, on_chunk: Any, submit: Any = submit) -> Any:
                sent.append(request.request_id)
                return await submit(request, on_chunk)

            engine.submit = spy  # type: ignore[method-assign]
        await service.start()
        producer = MemoryGlobalQueue(broker=broker)
        for rid in ("done", "one"):
            await producer.publish(
                message(0, now, id=rid, max_tokens=40, replay_output_tokens=None)
            )
        await eventually(lambda: final(store, ["done", "one"]), "both finished")
        await service.wait_idle()
        await service.stop()
        done, one = store.get("done"), store.get("one")
        assert done is not None and one is not None
        assert done.status is RequestStatus.FINISHED and one.status is RequestStatus.FINISHED
        assert done.output_text == full and done.output_tokens == 40
        assert one.output_tokens == 40 and count_tokens(one.output_text or "") == 40
        assert sent == ["one"]

    run(scenario)


def test_a_request_back_in_the_queue_with_no_output_kept_tells_its_streams_to_start_over() -> None:
    async def scenario(store: Store) -> None:
        service = make_service(store, MemoryBroker())
        stream = service.hub.subscribe("q1")
        service.returned("q1", "tok tok", 2, evicted=True)  # resumed later: the text stands
        assert stream.empty()
        service.returned("q1", "", 0, evicted=True)  # a structured answer, started over
        event = stream.get_nowait()
        assert event.restarted and not event.done and event.text == ""

    run(scenario)
