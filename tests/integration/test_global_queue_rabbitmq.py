"""The RabbitMQ global queue against a real broker, beyond the contract every global queue keeps
(``tests/contract/test_global_queue.py``): confirms, shards, the leader lock and failover,
reconnection (after a killed connection and a broker restart), reaping dead letters, and the
arguments it declares.

Every test declares its own ``qlm.test.<uuid>`` queue, dead-letter exchange and queue, and deletes
them afterwards. Waits are bounded polls, never timing assertions.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import aiormq
import pytest
from queue_helpers import Inbox, make_message, poll
from services import broker_names, in_ci
from yarl import URL

from qlm.global_queue import (
    DeadLetter,
    Delivery,
    MemoryBroker,
    QueuedRequest,
    QueueUnavailable,
)
from qlm.global_queue.rabbitmq import (
    DEAD_QUEUE_ARGUMENTS,
    RabbitGlobalQueue,
    queue_arguments,
    shard_names,
    shard_of,
)
from qlm.store import Store

DEFINITIONS = Path(__file__).resolve().parents[2] / "broker" / "definitions.json"


def run(scenario: Callable[[], Awaitable[None]], timeout_s: float = 30.0) -> None:
    asyncio.run(asyncio.wait_for(scenario(), timeout_s))


def rabbitmqctl() -> list[str]:
    """The command that manages the test broker: ``QLM_TEST_RABBITMQCTL`` (e.g. with ``-n node``
    for a private node), else ``rabbitmqctl``. Skip without it (fail under CI=true)."""
    command = shlex.split(os.environ.get("QLM_TEST_RABBITMQCTL", "rabbitmqctl"))
    if not command or shutil.which(command[0]) is None:
        if in_ci():
            pytest.fail(f"{command[:1]} not found (CI=true: broker tests must run)")
        pytest.skip(f"{command[:1]} not found")
    return command


Names = dict[str, str]


@pytest.fixture
def names(amqp_url: str) -> Iterator[Names]:
    """Unique queue and exchange names for one test; deleted afterwards."""
    with broker_names(amqp_url) as names:
        yield names


def open_queue(url: str, names: Names, **options: Any) -> RabbitGlobalQueue:
    return RabbitGlobalQueue(url, reconnect_max_s=1.0, **names, **options)


async def assert_drained(url: str, names: Names, shards: int = 1) -> None:
    """Nothing is left in the queue: a fresh consumer gets only a sentinel published now (a
    message left behind would come first: it is older)."""
    queue = open_queue(url, names, shards=shards)
    inbox = Inbox()
    await queue.consume(inbox)
    await queue.publish(make_message(id="sentinel"))
    await poll(lambda: "sentinel" in inbox.ids(), 10.0, "the sentinel")
    for delivery in inbox.deliveries:
        await queue.ack(delivery)
    await queue.close()
    assert inbox.ids() == ["sentinel"]


# --- no broker needed -------------------------------------------------------------------------


def test_definitions_file_declares_the_arguments_the_code_declares() -> None:
    definitions = json.loads(DEFINITIONS.read_text(encoding="utf-8"))
    queues = {q["name"]: q for q in definitions["queues"]}
    assert queues["qlm.requests"]["durable"] is True
    assert queues["qlm.requests"]["arguments"] == queue_arguments("qlm.dlx", 5)
    assert queues["qlm.dead"]["arguments"] == DEAD_QUEUE_ARGUMENTS
    (exchange,) = definitions["exchanges"]
    assert (exchange["name"], exchange["type"], exchange["durable"]) == ("qlm.dlx", "fanout", True)
    (binding,) = definitions["bindings"]
    assert (binding["source"], binding["destination"]) == ("qlm.dlx", "qlm.dead")


def test_publishing_without_a_broker_raises_queue_unavailable() -> None:
    async def scenario() -> None:
        queue = RabbitGlobalQueue("amqp://guest:guest@127.0.0.1:1/", connect_timeout_s=2.0)
        with pytest.raises(QueueUnavailable, match=r"127\.0\.0\.1:1/"):
            await queue.publish(make_message())
        with pytest.raises(QueueUnavailable, match="next connection attempt"):
            await queue.publish(make_message())  # waits out its back-off instead of retrying
        assert not await queue.healthy()
        await queue.close()

    run(scenario)


# --- against the broker -----------------------------------------------------------------------


def ids_by_shard(shards: int, per_shard: int) -> list[list[str]]:
    """``per_shard`` message ids (``r<i>``) for each of ``shards`` shards."""
    found: list[list[str]] = [[] for _ in range(shards)]
    i = 0
    while min(len(ids) for ids in found) < per_shard:
        shard = found[shard_of(f"r{i}", shards)]
        if len(shard) < per_shard:
            shard.append(f"r{i}")
        i += 1
    return found


async def ready_counts(url: str, queues: list[str]) -> list[int]:
    """Messages ready (not delivered) in each queue."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        counts = []
        for name in queues:
            queue = await channel.declare_queue(name, passive=True)
            counts.append(queue.declaration_result.message_count or 0)
        return counts


@pytest.mark.rabbitmq
def test_deliveries_are_read_while_the_callers_event_loop_is_busy(
    amqp_url: str, names: Names
) -> None:
    """A controller's event loop is busy for a second or two at a time under a backlog
    (planning); a consumer that stops reading meanwhile is reset by the broker. The consumer
    reads on a thread of its own: what is published is received while the caller's loop is
    blocked, then handed to the handler, in order, on the caller's thread, as is the leader
    callback; acks asked for together are all sent."""

    async def scenario() -> None:
        queue = open_queue(amqp_url, names)
        inbox = Inbox()
        threads: set[int] = set()

        async def handler(delivery: Delivery) -> None:
            threads.add(threading.get_ident())
            await inbox(delivery)

        told: list[tuple[bool, int]] = []
        await queue.consume(
            handler, on_leader=lambda leading: told.append((leading, threading.get_ident()))
        )
        here = threading.get_ident()
        assert told == [(True, here)]
        errors: list[QueueUnavailable | None] = []

        async def publish() -> None:  # another process's publisher, say an API's
            publisher = open_queue(amqp_url, names)
            errors.extend(await publisher.publish_many([make_message(i) for i in range(300)]))
            await publisher.close()

        elsewhere = threading.Thread(target=asyncio.run, args=(publish(),))
        elsewhere.start()
        deadline = time.monotonic() + 10.0
        while queue.held < 300:  # blocking this loop: no await
            assert time.monotonic() < deadline, f"only {queue.held} received meanwhile"
            time.sleep(0.01)
        elsewhere.join()
        assert errors == [None] * 300
        assert not inbox.deliveries  # the handler waits for this loop
        await inbox.wait_for(300)
        assert inbox.ids() == [f"r{i}" for i in range(300)] and threads == {here}
        refused: list[BaseException] = []  # an ack from another loop (a daemon thread)

        def ack_elsewhere() -> None:
            try:
                asyncio.run(queue.ack(inbox.deliveries[0]))
            except BaseException as exc:
                refused.append(exc)

        elsewhere = threading.Thread(target=ack_elsewhere, daemon=True)
        elsewhere.start()
        await asyncio.to_thread(elsewhere.join, 5.0)
        assert "the event loop that consumes" in repr(refused)
        await asyncio.gather(*(queue.ack(d) for d in inbox.deliveries))
        assert queue.held == 0
        await queue.close()
        await assert_drained(amqp_url, names)

    run(scenario)


@pytest.mark.rabbitmq
def test_a_held_intake_takes_nothing_in_until_released_or_its_longest_hold_passed(
    amqp_url: str, names: Names, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long control step holds the intake (``hold_intake``): the consumer's thread stands
    still, so that it does not compete with the step for the interpreter; what is published
    meanwhile is confirmed and waits in the broker, and comes in order once the step ends — or
    once the longest hold passed, if nobody releases it."""
    from qlm.global_queue.rabbitmq import consumer

    monkeypatch.setattr(consumer, "INTAKE_HOLD_MAX_S", 60.0)

    async def scenario() -> None:
        queue = open_queue(amqp_url, names)
        publisher = open_queue(amqp_url, names)
        inbox = Inbox()
        await queue.consume(inbox)
        queue.hold_intake(0.0)
        await poll(lambda: queue.standing_still, 10.0, "the consumer standing still")
        assert await publisher.publish_many([make_message(i) for i in range(5)]) == [None] * 5
        await asyncio.sleep(0.3)  # (the hold lasts 60 s: nothing can come meanwhile)
        assert queue.held == 0 and not inbox.deliveries
        queue.release_intake()
        await inbox.wait_for(5)
        assert inbox.ids() == [f"r{i}" for i in range(5)] and not queue.standing_still

        monkeypatch.setattr(consumer, "INTAKE_HOLD_MAX_S", 0.2)
        queue.hold_intake(0.0)  # never released
        assert await publisher.publish_many([make_message(i) for i in range(5, 8)]) == [None] * 3
        await inbox.wait_for(8)
        assert inbox.ids() == [f"r{i}" for i in range(8)]
        await asyncio.gather(*(queue.ack(d) for d in inbox.deliveries))
        queue.release_intake()
        await publisher.close()
        await queue.close()
        await assert_drained(amqp_url, names)

    run(scenario)


@pytest.mark.rabbitmq
def test_counting_and_reaping_connect_on_the_consumers_thread_while_the_callers_loop_is_busy(
    amqp_url: str, names: Names
) -> None:
    """``backlog`` and ``reap_dead`` open short-lived connections; a controller calls them from
    a loop that may be busy planning for longer than a connection's handshake may take. While
    consuming they connect on the consumer's thread: blocked for three times the connect
    timeout, the caller's loop still gets the count, and the dead letters recorded."""

    async def scenario() -> None:
        queue = open_queue(amqp_url, names, connect_timeout_s=0.5)
        inbox = Inbox()
        await queue.consume(inbox)
        await queue.publish(make_message(0))
        (delivery,) = await inbox.wait_for(1)
        await queue.dead_letter(delivery, "parked by the test")
        await poll_async(lambda: queue.backlog(), 1, "the dead letter to be counted")
        counting = asyncio.create_task(queue.backlog())
        await asyncio.sleep(0)  # started: its connection is being opened
        time.sleep(1.5)  # this loop blocked meanwhile
        assert await counting == 1
        recorded: list[DeadLetter] = []

        async def record(letters: list[DeadLetter]) -> None:
            recorded.extend(letters)

        reaping = asyncio.create_task(queue.reap_dead(record))
        await asyncio.sleep(0)
        time.sleep(1.5)
        assert await reaping == 1
        assert [d.reason for d in recorded] == ["parked by the test"]
        assert await queue.backlog() == 0
        await queue.close()
        await assert_drained(amqp_url, names)

    run(scenario)


async def poll_async(value: Callable[[], Awaitable[int]], want: int, what: str) -> None:
    deadline = time.monotonic() + 10.0
    while await value() != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.mark.rabbitmq
def test_acks_sent_just_before_closing_are_applied(amqp_url: str, names: Names) -> None:
    """A quorum queue's channel keeps only a few dozen settlements in flight and drops the rest
    when the connection closes: a controller that acks what it finished and stops at once would
    hand those requests to the next one again. Closing waits for the last acks to be applied."""

    async def scenario() -> None:
        queue = open_queue(amqp_url, names)
        inbox = Inbox()
        await queue.consume(inbox)
        publisher = open_queue(amqp_url, names)
        await publisher.publish_many([make_message(i) for i in range(100)])
        await publisher.close()
        await asyncio.gather(*(queue.ack(d) for d in await inbox.wait_for(100)))
        await queue.close()
        await asyncio.sleep(0.5)  # what the broker took back would be ready again by now
        await assert_drained(amqp_url, names)

    run(scenario)


@pytest.mark.rabbitmq
def test_a_sharded_queue_routes_by_request_id_and_one_consumer_holds_prefetch_per_shard(
    amqp_url: str, names: Names
) -> None:
    async def scenario() -> None:
        by_shard = ids_by_shard(2, 3)
        queue = open_queue(amqp_url, names, shards=2, prefetch=2)
        for ids in by_shard:
            for rid in ids:
                await queue.publish(make_message(id=rid))
        shards = shard_names(names["queue"], 2)
        assert shards == [names["queue"], names["queue"] + ".1"]
        assert await ready_counts(amqp_url, shards) == [3, 3]
        assert await queue.backlog() == 6  # every shard's ready messages
        inbox = Inbox()
        await queue.consume(inbox)
        await inbox.wait_for(4)  # two per shard: 2 × prefetch, more than one consumer's 2
        held = {shard_of(rid, 2) for rid in inbox.ids()}
        assert held == {0, 1}
        assert await ready_counts(amqp_url, shards) == [1, 1]
        assert await queue.backlog() == 2  # the deliveries it holds are not counted
        for delivery in list(inbox.deliveries):
            await queue.ack(delivery)
        await inbox.wait_for(6)
        assert sorted(inbox.ids()) == sorted(by_shard[0] + by_shard[1])
        for delivery in inbox.deliveries[4:]:
            await queue.ack(delivery)
        assert await queue.backlog() == 0
        await queue.close()
        await assert_drained(amqp_url, names, shards=2)

    run(scenario)


@pytest.mark.rabbitmq
def test_one_consumer_leads_every_shard_and_the_standby_takes_them_all_over(
    amqp_url: str, names: Names
) -> None:
    async def scenario() -> None:
        active, standby = (open_queue(amqp_url, names, shards=3) for _ in range(2))
        first, second = Inbox(), Inbox()
        await active.consume(first)
        await poll(lambda: active.leader, 10.0, "the first consumer to lead")
        await standby.consume(second)
        ids = [rid for shard in ids_by_shard(3, 2) for rid in shard]
        for rid in ids:
            await active.publish(make_message(id=rid))
        await first.wait_for(6)
        await active.ack(first.deliveries[0])
        assert second.deliveries == [] and not standby.leader
        await active.close()
        await second.wait_for(5)
        assert standby.leader
        assert sorted(second.ids()) == sorted(set(ids) - {first.ids()[0]})
        assert all(d.redelivered for d in second.deliveries)
        for delivery in second.deliveries:
            await standby.ack(delivery)
        await standby.close()
        await assert_drained(amqp_url, names, shards=3)

    run(scenario)


@pytest.mark.rabbitmq
def test_the_consumer_reconnects_after_the_broker_closes_its_connection(
    amqp_url: str, names: Names
) -> None:
    ctl = rabbitmqctl()

    async def scenario() -> None:
        queue = open_queue(amqp_url, names)
        inbox = Inbox()
        await queue.consume(inbox)
        await queue.publish(make_message(0))
        (before,) = await inbox.wait_for(1)
        consumer_name = f"qlm-consumer {names['queue']}"
        listed = subprocess.run(
            [*ctl, "-q", "list_connections", "pid", "client_properties"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        pids = [line.split("\t")[0] for line in listed.splitlines() if consumer_name in line]
        assert len(pids) == 1, listed
        subprocess.run([*ctl, "-q", "close_connection", pids[0], "test"], check=True)
        (_, after) = await inbox.wait_for(2)
        assert after.message == before.message
        assert after.redelivered and after.delivery_count == 1
        await queue.ack(before)  # its channel is gone: a logged no-op, not a crash
        await queue.ack(after)
        await queue.close()
        await assert_drained(amqp_url, names)

    run(scenario)


def consumer_pids(ctl: list[str], queue: str) -> set[str]:
    """Broker-side ids of the consumer connections on ``queue``."""
    listed = subprocess.run(
        [*ctl, "-q", "list_connections", "pid", "client_properties"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line.split("\t")[0] for line in listed.splitlines() if f"qlm-consumer {queue}" in line}


@pytest.mark.rabbitmq
def test_a_consumer_is_told_when_it_leads_and_when_it_stands_by(
    amqp_url: str, names: Names
) -> None:
    ctl = rabbitmqctl()

    async def scenario() -> None:
        # The standby retries the lock often, so that it wins it now and then.
        first, second = (
            open_queue(amqp_url, names),
            open_queue(amqp_url, names, leader_retry_s=0.002),
        )
        told: list[tuple[str, bool]] = []

        def leads(who: str) -> Callable[[bool], None]:
            return lambda leading: told.append((who, leading))

        one, two = Inbox(), Inbox()
        await first.consume(one, on_leader=leads("first"))
        await poll(lambda: first.leader, 10.0, "the first consumer to lead")
        assert told == [("first", True)]
        pids = consumer_pids(ctl, names["queue"])
        await second.consume(two, on_leader=leads("second"))
        assert told == [("first", True), ("second", False)]  # the lock is held: it stands by
        told.clear()
        await first.publish(make_message(0))
        await one.wait_for(1)
        # The leader's connection drops; it reconnects at once and competes with the standby.
        (pid,) = pids
        subprocess.run([*ctl, "-q", "close_connection", pid, "test"], check=True)
        await poll(lambda: len(one.deliveries) + len(two.deliveries) == 2, 10.0, "a redelivery")
        if two.deliveries:  # the second took the lock: the first, back as a standby, is told
            await poll(lambda: ("first", False) in told, 10.0, "the first to be told")
            assert second.leader and not first.leader and ("second", True) in told
            assert ("first", True) not in told
            (delivery,) = two.deliveries
        else:  # the first won the lock again (or after its old connection was dropped)
            assert first.leader and not second.leader
            # told it stood by as soon as its connection went, before it led again
            assert told == [("first", False), ("first", True)]
            delivery = one.deliveries[1]
        assert delivery.redelivered and delivery.message == make_message(0)
        await (second if two.deliveries else first).ack(delivery)
        await first.close()
        await second.close()
        await assert_drained(amqp_url, names)

    run(scenario)


@pytest.mark.rabbitmq
def test_a_leader_whose_connection_drops_is_told_it_stands_by_until_it_leads_again(
    amqp_url: str, names: Names
) -> None:
    """Alone on the queue: its connection closed by the broker, the consumer is told at once
    that it no longer leads (what it held is the broker's again), then that it leads anew."""
    ctl = rabbitmqctl()

    async def scenario() -> None:
        queue = open_queue(amqp_url, names)
        told: list[bool] = []
        await queue.consume(Inbox(), on_leader=told.append)
        await poll(lambda: queue.leader, 10.0, "the consumer to lead")
        (pid,) = consumer_pids(ctl, names["queue"])
        subprocess.run([*ctl, "-q", "close_connection", pid, "test"], check=True)
        await poll(lambda: len(told) >= 3, 20.0, "the consumer to lead again")
        assert told == [True, False, True] and queue.leader
        await queue.close()

    run(scenario)


@pytest.mark.rabbitmq
def test_a_controller_cut_off_from_the_broker_stops_what_the_standby_took_over(
    amqp_url: str, names: Names
) -> None:
    """Two controller services on the broker; the leader's connection is closed by the broker
    (what a partition ends in). Whichever leads then, every request ends once with its whole
    output; when the standby took the lock, the old leader stopped what it ran."""
    from tests.unit.service.test_controller_service import (
        engines_running,
        final,
        make_service,
        message,
        spy_release,
    )

    ctl = rabbitmqctl()

    async def scenario() -> None:
        store = Store.open("sqlite://")
        # The first's engines are slow (6,000 tokens take it ~30 s) so that what it runs is still
        # running when it learns that the standby leads, however loaded the machine is.
        first = make_service(
            store, MemoryBroker(), name="c0", queue=open_queue(amqp_url, names), step_ms=250.0
        )
        standby_queue = open_queue(amqp_url, names, leader_retry_s=0.002)  # quick to take over
        second = make_service(store, MemoryBroker(), name="c1", queue=standby_queue)
        first.publish_s = second.publish_s = 0.05
        released = spy_release(first)
        producer = open_queue(amqp_url, names)
        try:
            await first.start()
            await poll(lambda: bool(consumer_pids(ctl, names["queue"])), 10.0, "c0 to consume")
            (pid,) = consumer_pids(ctl, names["queue"])
            await second.start()
            now = first.runtime.clock.now()
            ids = [f"q{i:04d}" for i in range(8)]
            for i in range(8):
                await producer.publish(message(i, now, replay_output_tokens=6000, max_tokens=7000))
            await poll(lambda: engines_running(first) >= 2, 30.0, "c0 to run them")
            subprocess.run([*ctl, "-q", "close_connection", pid, "test"], check=True)
            await poll(lambda: final(store, ids), 60.0, "every request to end")
            rows = [store.get(rid) for rid in ids]
            assert all(r is not None and r.status.name == "FINISHED" for r in rows)
            assert all(r.output_tokens == 6000 for r in rows if r)
            if second.active:  # the standby took the lock: the old leader let go of its work
                assert released and released[0] >= 1
                await poll(lambda: engines_running(first) == 0, 10.0, "c0's engines idle")
        finally:
            await first.stop()
            await second.stop()
            await producer.close()
            store.close()
        await assert_drained(amqp_url, names)

    run(scenario, timeout_s=120.0)


@pytest.mark.rabbitmq
def test_the_leader_on_the_broker_records_a_row_with_no_message_failed(
    amqp_url: str, names: Names
) -> None:
    """The orphan sweep against the real broker: a queued row whose message never reached it
    is recorded failed at the second sweep, while a request recorded as long ago whose message
    waited on the broker for the controller is served, and one the controller holds, waiting,
    is left alone."""
    from qlm.service.upkeep import ORPHAN_ERROR
    from qlm.store import NewRequest
    from tests.unit.service.test_controller_service import drain_all, final, make_service, message

    async def scenario() -> None:
        store = Store.open("sqlite://")
        service = make_service(store, MemoryBroker(), queue=open_queue(amqp_url, names))
        service.orphan_after_s, service.orphan_every_s = 300.0, 3600.0  # swept by hand
        producer = open_queue(amqp_url, names)
        old = store.now() - 1000.0
        store.ensure_requests(
            [
                NewRequest(
                    id="orphan", tenant="acme", model="m", prompt_tokens=8, max_tokens=40,
                    slo_e2e_s=120.0, submitted_at=old, prompt="say something",
                )
            ]
        )  # fmt: skip
        await producer.publish(message(1, old, replay_output_tokens=5))
        store.ensure_requests([NewRequest.from_request(message(1, old).to_request(old))])
        try:
            await service.start()
            await poll(lambda: final(store, ["q0001"]), 30.0, "q0001 to be served")
            await drain_all(service)  # what it takes now waits, held
            await producer.publish(message(2, old))
            store.ensure_requests([NewRequest.from_request(message(2, old).to_request(old))])
            await poll(lambda: service.runtime.holds("q0002"), 30.0, "q0002 to be held")
            assert await service.sweep_once() == []
            assert await service.sweep_once() == ["orphan"]
            waiting = store.get("q0002")
            assert waiting is not None and waiting.status.name == "QUEUED"
            assert await service.cancel("q0002")
            await poll(lambda: final(store, ["q0002"]), 30.0, "q0002 to be cancelled")
            orphan = store.get("orphan")
            assert orphan is not None and orphan.error == ORPHAN_ERROR
            served = store.get("q0001")
            assert served is not None and served.status.name == "FINISHED"
        finally:
            await service.stop()
            await producer.close()
            store.close()
        await assert_drained(amqp_url, names)

    run(scenario, timeout_s=60.0)


@pytest.mark.rabbitmq
def test_reap_dead_hands_dead_letters_with_reasons_and_keeps_them_if_recording_fails(
    amqp_url: str, names: Names
) -> None:
    async def scenario() -> None:
        queue = open_queue(amqp_url, names, delivery_limit=1)
        seen: list[DeadLetter] = []

        async def keep(letters: list[DeadLetter]) -> None:
            seen.extend(letters)

        async def broken(letters: list[DeadLetter]) -> None:
            raise RuntimeError("the store is down")

        assert await queue.reap_dead(keep) == 0

        async def handle(delivery: Delivery) -> None:
            if delivery.message is not None and delivery.message.id == "r0":
                await queue.dead_letter(delivery, "no instance serves it")
            else:
                await queue.requeue(delivery)  # until the broker's delivery limit

        await queue.consume(handle)
        await queue.publish(make_message(0))
        await queue.publish(make_message(1))
        deadline = time.monotonic() + 10.0
        while len(await peek_dead(amqp_url, names)) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="the store is down"):
            await queue.reap_dead(broken)
        assert len(await peek_dead(amqp_url, names)) == 2  # nothing lost when recording fails
        assert await queue.reap_dead(keep) == 2
        reasons = {QueuedRequest.decode(d.raw).id: d.reason for d in seen}
        assert reasons == {"r0": "no instance serves it", "r1": "delivery_limit"}
        assert await queue.reap_dead(keep) == 0  # recorded means gone
        await queue.close()

    run(scenario)


async def peek_dead(url: str, names: Names) -> list[bytes]:
    """The dead-letter queue's bodies, left in place (got and requeued)."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(names["dead_letter_queue"])
        got = []
        while (m := await queue.get(no_ack=False, fail=False)) is not None:
            got.append(m)
        bodies = [m.body for m in got]
        for m in got:
            await m.nack(requeue=True)
        return bodies


@pytest.mark.rabbitmq
def test_a_deleted_queue_is_declared_again_and_consumed(amqp_url: str, names: Names) -> None:
    async def scenario() -> None:
        queue = open_queue(amqp_url, names)
        inbox = Inbox()
        await queue.consume(inbox)
        await queue.publish(make_message(0))
        await inbox.wait_for(1)
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(names["queue"])

        async def publish_until_taken() -> None:
            while True:
                try:
                    await queue.publish(make_message(1))
                    return
                except QueueUnavailable:  # unroutable until a client has declared it again
                    await asyncio.sleep(0.05)

        await asyncio.wait_for(publish_until_taken(), 10.0)
        await poll(lambda: "r1" in inbox.ids(), 10.0, "r1 from the new queue")
        for delivery in inbox.deliveries:
            await queue.ack(delivery)
        await queue.close()

    run(scenario)


@pytest.mark.rabbitmq
def test_a_queue_declared_with_other_arguments_is_refused_naming_the_argument(
    amqp_url: str, names: Names
) -> None:
    async def scenario() -> None:
        first = open_queue(amqp_url, names, delivery_limit=5)
        assert await first.healthy()
        second = open_queue(amqp_url, names, delivery_limit=7)
        with pytest.raises(QueueUnavailable, match="x-delivery-limit"):
            await second.consume(Inbox())
        await first.close()
        await second.close()

    run(scenario)


@pytest.mark.rabbitmq
@pytest.mark.slow
def test_messages_survive_a_broker_restart_and_the_clients_reconnect_by_themselves(
    amqp_url: str, names: Names
) -> None:
    ctl = rabbitmqctl()

    async def scenario() -> None:
        publisher, consumer = open_queue(amqp_url, names), open_queue(amqp_url, names)
        inbox = Inbox()
        await consumer.consume(inbox)
        for i in range(3):
            await publisher.publish(make_message(i))
        before = await inbox.wait_for(3)
        try:
            await asyncio.to_thread(subprocess.run, [*ctl, "-q", "stop_app"], check=True)
            with pytest.raises(QueueUnavailable):
                await publisher.publish(make_message(99))
            assert not await publisher.healthy()
        finally:
            await asyncio.to_thread(subprocess.run, [*ctl, "-q", "start_app"], check=True)
        await inbox.wait_for(6, timeout_s=60.0)
        again = inbox.deliveries[3:]
        assert sorted(inbox.ids()[3:]) == ["r0", "r1", "r2"]
        assert all(d.redelivered and d.delivery_count == 1 for d in again)
        for delivery in before:
            await consumer.ack(delivery)  # from before the restart: a logged no-op

        async def publish_when_back() -> None:
            while True:
                try:
                    await publisher.publish(make_message(3))
                    return
                except QueueUnavailable:
                    await asyncio.sleep(0.2)

        await asyncio.wait_for(publish_when_back(), 30.0)
        await inbox.wait_for(7)
        assert inbox.ids()[6] == "r3"
        for delivery in inbox.deliveries[3:]:
            await consumer.ack(delivery)
        await consumer.close()
        await publisher.close()
        await assert_drained(amqp_url, names)

    run(scenario, timeout_s=150.0)


@pytest.mark.rabbitmq
def test_publish_many_confirms_each_message_and_reports_each_failure(
    amqp_url: str, names: Names
) -> None:
    async def scenario() -> None:
        queue = open_queue(amqp_url, names, shards=2)
        batch = [make_message(i) for i in range(50)]
        assert await queue.publish_many(batch) == [None] * 50
        assert await queue.publish_many([]) == []
        inbox = Inbox()
        await queue.consume(inbox)
        await inbox.wait_for(50)
        assert sorted(inbox.ids()) == sorted(m.id for m in batch)
        for delivery in inbox.deliveries:
            await queue.ack(delivery)
        await queue.close()
        await assert_drained(amqp_url, names, shards=2)
        # Nobody listens: every message of a batch gets its own error, none raises.
        down = RabbitGlobalQueue("amqp://guest:guest@127.0.0.1:1/", connect_timeout_s=2.0)
        errors = await down.publish_many([make_message(i) for i in range(3)])
        assert len(errors) == 3 and all(isinstance(e, QueueUnavailable) for e in errors)
        await down.close()

    run(scenario)


def publish_then(
    queue: RabbitGlobalQueue, messages: list[QueuedRequest]
) -> asyncio.Future[list[QueueUnavailable | None]]:
    """``queue.publish_many_then``, its outcome as a future."""
    outcome: asyncio.Future[list[QueueUnavailable | None]] = (
        asyncio.get_running_loop().create_future()
    )
    queue.publish_many_then(messages, outcome.set_result)
    return outcome


@pytest.mark.rabbitmq
def test_publish_many_then_sends_at_once_answers_from_the_confirms_and_falls_back(
    amqp_url: str, names: Names
) -> None:
    """With the publishing channel open, the batch is on its way when ``publish_many_then``
    returns, and no task is made for it: its outcome comes from the confirms. Before the
    channel is open (and for an empty batch, or a message that cannot be encoded), a task
    runs ``publish_many``, which opens it; an error there is the outcome of every message."""

    async def scenario() -> None:
        queue = open_queue(amqp_url, names)
        assert await publish_then(queue, [make_message(0)]) == [None]  # opened by a task
        assert await publish_then(queue, []) == []
        batch = [make_message(i) for i in range(1, 6)]
        tasks = asyncio.all_tasks()
        outcome = publish_then(queue, batch)
        assert asyncio.all_tasks() == tasks  # sent as it is, answered by the reader
        deadline = time.monotonic() + 30
        while await ready_counts(amqp_url, [names["queue"]]) != [6]:
            assert time.monotonic() < deadline, "the batch did not leave"
            await asyncio.sleep(0.05)
        assert await outcome == [None] * 5
        # A message that cannot be encoded: nothing raised by the call, an error for each.
        broken = make_message(9)
        original = QueuedRequest.encode

        def encode(message: QueuedRequest) -> bytes:
            if message.id == broken.id:
                raise ValueError("cannot encode")
            return original(message)

        QueuedRequest.encode = encode  # type: ignore[method-assign]
        try:
            (error, fine) = await publish_then(queue, [broken, make_message(11)])
        finally:
            QueuedRequest.encode = original  # type: ignore[method-assign]
        assert isinstance(error, QueueUnavailable) and "cannot encode" in str(error)
        assert isinstance(fine, QueueUnavailable)  # the batch failed as one: nothing was sent
        assert await publish_then(queue, [make_message(10)]) == [None]  # nothing left over
        assert await ready_counts(amqp_url, [names["queue"]]) == [7]
        await queue.close()

    run(scenario)


def unanswered(queue: RabbitGlobalQueue) -> Callable[[], None]:
    """From now on the publishing channel reads no confirms (as if the broker sent none),
    until the function returned is called."""
    assert queue._underlay is not None
    channel = queue._underlay[1]
    reading = channel._on_confirm_frame

    async def ignore(frame: Any) -> None:
        return None

    channel._on_confirm_frame = ignore  # type: ignore[method-assign]
    return lambda: setattr(channel, "_on_confirm_frame", reading)


@pytest.mark.rabbitmq
def test_a_batch_not_confirmed_in_time_fails_each_message_and_the_next_one_goes_through(
    amqp_url: str, names: Names
) -> None:
    """Both ways of publishing give every message of a batch its error once
    ``confirm_timeout_s`` passed without its confirm; publishing goes on afterwards."""

    async def scenario() -> None:
        queue = open_queue(amqp_url, names)
        assert await queue.publish_many([make_message(0)]) == [None]
        answer = unanswered(queue)
        queue.confirm_timeout_s = 0.5  # no confirm is read from now on: the timeout ends it
        for outcome in (
            publish_then(queue, [make_message(1), make_message(2)]),
            queue.publish_many([make_message(3), make_message(4)]),
        ):
            errors = await outcome
            assert len(errors) == 2
            for error in errors:
                assert isinstance(error, QueueUnavailable) and "no confirm within 0.5 s" in str(
                    error
                )
        # A caller that stops waiting leaves nothing of its batch on the channel.
        assert queue._underlay is not None
        channel = queue._underlay[1]
        left = make_message(7)
        waiting = asyncio.ensure_future(queue.publish_many([left]))
        await poll(lambda: left.id in channel.message_id_delivery_tag, 10.0, "the publish")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert left.id not in channel.message_id_delivery_tag
        answer()
        queue.confirm_timeout_s = 30.0  # real confirms again, on a host that may be busy
        assert await publish_then(queue, [make_message(5)]) == [None]
        assert await queue.publish_many([make_message(6)]) == [None]
        await queue.close()

    run(scenario)


@pytest.mark.rabbitmq
def test_a_request_id_sent_twice_while_unconfirmed_gets_each_return_and_confirm_right(
    amqp_url: str, names: Names
) -> None:
    """A return is matched to its message by the AMQP message id: two messages of one request
    id waiting on the channel at once (a client's retry republishing it, or the same id twice
    in a batch) each get their own answer. Unroutable, every one of them fails (none is taken
    for confirmed); routable, every one is confirmed and lands."""

    async def scenario() -> None:
        queue = open_queue(amqp_url, names)
        assert await queue.publish_many([make_message(0)]) == [None]  # declares the queue
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(names["queue"])
        twice = [make_message(1), make_message(1), make_message(2)]
        first = publish_then(queue, twice[:2])
        second = publish_then(queue, [make_message(1), twice[2]])
        for errors in (await first, await second):
            assert all(isinstance(e, QueueUnavailable) for e in errors), errors
        # The channel was retired; the next one declares the queue again.
        assert await queue.publish_many(twice) == [None, None, None]
        assert await ready_counts(amqp_url, [names["queue"]]) == [3]
        await queue.close()

    run(scenario)


@pytest.mark.rabbitmq
def test_a_retired_channel_still_open_takes_no_new_batch(amqp_url: str, names: Names) -> None:
    """A channel retired (a message came back unroutable) stays open until its confirms came;
    once another publisher is open (a readiness probe opens one), batches go to the new
    channel, not the old."""

    async def scenario() -> None:
        queue = open_queue(amqp_url, names, confirm_timeout_s=60.0)
        assert await queue.publish_many([make_message(0)]) == [None]
        assert queue._underlay is not None
        old, channel = queue._underlay
        unanswered(queue)
        pending = publish_then(queue, [make_message(1)])  # keeps the old channel open
        queue._publishing.retire(old)
        new = await queue._publishing.open()  # as ``healthy`` does
        for _ in range(10):  # loop passes for the retiring task (it closes an idle channel)
            await asyncio.sleep(0)
        assert new is not old and not channel.is_closed
        batch = [make_message(2), make_message(3)]
        assert await publish_then(queue, batch) == [None, None]
        assert queue._underlay is not None and queue._underlay[0] is new
        assert queue._underlay[1] is not channel
        assert not any(m.id in channel.message_id_delivery_tag for m in batch)
        assert await publish_then(queue, [make_message(4)]) == [None]
        await old.connection.close()
        (error,) = await pending  # the old channel closed: its batch failed at once
        assert isinstance(error, QueueUnavailable)
        await queue.close()  # nothing left to wait for on the retired channel

    run(scenario)


@pytest.mark.rabbitmq
def test_a_multiple_ack_answers_every_message_it_names_as_it_is_read(
    amqp_url: str, names: Names
) -> None:
    """An ack frame for several tags (``multiple``, as a quorum queue sends them under load)
    settles each message it names while the frame is read, not in later loop passes: the
    batch's outcome is there when the channel's reader is done with the frame."""

    async def scenario() -> None:
        queue = open_queue(amqp_url, names)
        assert await queue.publish_many([make_message(0)]) == [None]
        assert queue._underlay is not None
        channel = queue._underlay[1]
        reading = channel._on_confirm_frame
        unanswered(queue)  # the broker's own acks are not read: the test sends its own
        got: list[list[QueueUnavailable | None]] = []
        queue.publish_many_then([make_message(i) for i in (1, 2, 3)], got.append)
        await reading(aiormq.spec.Basic.Ack(delivery_tag=channel.delivery_tag - 1, multiple=True))
        assert got == []  # the last message is not named yet
        await reading(aiormq.spec.Basic.Ack(delivery_tag=channel.delivery_tag, multiple=True))
        assert got == [[None, None, None]]
        await queue.close()

    run(scenario)


@pytest.mark.rabbitmq
def test_a_connection_lost_before_the_confirms_fails_each_message_and_publishing_reconnects(
    amqp_url: str, names: Names
) -> None:
    """When the publishing connection closes with confirms outstanding, every message still
    waiting gets the error at once (not after ``confirm_timeout_s``); the next publish opens a
    new connection."""

    async def scenario() -> None:
        queue = open_queue(amqp_url, names, confirm_timeout_s=600.0)
        assert await queue.publish_many([make_message(0)]) == [None]
        unanswered(queue)
        waiting = publish_then(queue, [make_message(1), make_message(2)])
        third = make_message(3)
        awaited = asyncio.ensure_future(queue.publish_many([third]))
        assert queue._underlay is not None
        publisher, channel = queue._underlay
        await poll(lambda: third.id in channel.message_id_delivery_tag, 10.0, "the second batch")
        await publisher.connection.close()
        for errors in (await waiting, await awaited):
            assert errors and all(isinstance(e, QueueUnavailable) for e in errors)
        assert await publish_then(queue, [make_message(4)]) == [None]
        await queue.close()

    run(scenario)


@pytest.mark.rabbitmq
def test_each_message_of_a_batch_is_answered_by_its_own_confirm(
    amqp_url: str, names: Names
) -> None:
    """A batch goes out as one write; a message no queue takes (its shard was deleted) fails
    alone, and every other message of the batch is confirmed."""

    async def scenario() -> None:
        queue = open_queue(amqp_url, names, shards=2)
        await queue.publish(make_message(0))  # declares both shards
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(shard_names(names["queue"], 2)[1])
        batch = [make_message(i) for i in range(1, 41)]
        lost = {m.id for m in batch if shard_of(m.id, 2) == 1}
        assert lost and len(lost) < len(batch)
        results = await queue.publish_many(batch)
        failed = {m.id for m, error in zip(batch, results, strict=True) if error is not None}
        assert failed == lost
        assert all(isinstance(e, QueueUnavailable) for e in results if e is not None)
        # The channel was retired: the next batch declares the shard again and all get in.
        again = [make_message(i) for i in range(41, 61)]
        assert await queue.publish_many(again) == [None] * len(again)
        inbox = Inbox()
        await queue.consume(inbox)
        kept = {"r0"} if shard_of("r0", 2) == 0 else set()  # the other went with its shard
        expected = kept | {m.id for m in batch if m.id not in lost} | {m.id for m in again}
        await inbox.wait_for(len(expected))
        assert set(inbox.ids()) == expected
        for delivery in inbox.deliveries:
            await queue.ack(delivery)
        await queue.close()

    run(scenario)


@pytest.mark.rabbitmq
def test_a_lock_queue_nobody_owns_is_removed_and_the_consumer_leads(
    amqp_url: str, names: Names
) -> None:
    async def scenario() -> None:
        connection = await aio_pika.connect(amqp_url)
        async with connection:  # a queue of the lock's name, not a connection's exclusive one
            channel = await connection.channel()
            await channel.declare_queue(f"{names['queue']}.leader", durable=False)
        queue = open_queue(amqp_url, names)
        inbox = Inbox()
        await queue.consume(inbox)
        await poll(lambda: queue.leader, 10.0, "the consumer to lead")
        await queue.publish(make_message(0))
        await inbox.wait_for(1)
        await queue.ack(inbox.deliveries[0])
        await queue.close()

    run(scenario)


@pytest.mark.rabbitmq
def test_deleting_the_lock_makes_the_leader_step_down_and_lead_again(
    amqp_url: str, names: Names
) -> None:
    ctl = rabbitmqctl()  # only an administrator can delete another connection's exclusive queue

    async def scenario() -> None:
        queue = open_queue(amqp_url, names)
        inbox = Inbox()
        await queue.consume(inbox)
        await poll(lambda: queue.leader, 10.0, "the consumer to lead")
        await queue.publish(make_message(0))
        (before,) = await inbox.wait_for(1)
        lock = f"{names['queue']}.leader"
        await asyncio.to_thread(subprocess.run, [*ctl, "-q", "delete_queue", lock], check=True)
        (_, after) = await inbox.wait_for(2)  # it reconnected: the message comes again
        assert after.message == before.message and after.redelivered
        assert queue.leader
        await queue.ack(after)
        await queue.close()
        await assert_drained(amqp_url, names)

    run(scenario)


@pytest.mark.rabbitmq
def test_a_user_who_may_not_take_the_lock_fails_at_start_and_does_not_spin(
    amqp_url: str, names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    ctl = rabbitmqctl()
    user, password = f"qlm-test-{names['queue'][-12:]}", "secret"
    base = re.escape(names["queue"])
    subprocess.run([*ctl, "-q", "add_user", user, password], check=True)
    try:
        subprocess.run(
            [
                *ctl,
                "-q",
                "set_permissions",
                "-p",
                "/",
                user,
                f"^{base}(\\.dlx|\\.dead)?$",
                ".*",
                ".*",
            ],
            check=True,
        )
        url = str(URL(amqp_url).with_user(user).with_password(password))
        queue = open_queue(url, names)

        async def scenario() -> None:
            with pytest.raises(QueueUnavailable, match="cannot consume"):
                await queue.consume(Inbox())
            assert not queue.leader

        run(scenario)
        # Allowed now, the same queue object consumes, from another event loop.
        subprocess.run(
            [*ctl, "-q", "set_permissions", "-p", "/", user, ".*", ".*", ".*"], check=True
        )

        async def retry() -> None:
            inbox = Inbox()
            await queue.consume(inbox)
            assert queue.leader
            publisher = open_queue(amqp_url, names)
            await publisher.publish(make_message(0))
            await publisher.close()
            (delivery,) = await inbox.wait_for(1)
            await queue.ack(delivery)
            await queue.close()
            await assert_drained(amqp_url, names)

        run(retry)
        # The failed start left nothing of its loop behind: the second consumer stopped in order
        # (a stale task of the first loop made close abandon it, or raise, by set order).
        stopped_badly = [r.getMessage() for r in caplog.records if "did not stop" in r.getMessage()]
        assert not stopped_badly
    finally:
        subprocess.run([*ctl, "-q", "delete_user", user], check=True)


@pytest.mark.rabbitmq
def test_a_leader_reading_fewer_shards_than_a_publisher_writes_says_so(
    amqp_url: str, names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        publisher = open_queue(amqp_url, names, shards=2)
        (first,), (second,) = ids_by_shard(2, 1)
        await publisher.publish(make_message(id=first))  # declares both shards
        await publisher.publish(make_message(id=second))  # to the shard nobody reads
        consumer = open_queue(amqp_url, names)  # one shard
        inbox = Inbox()
        await consumer.consume(inbox)
        await poll(
            lambda: any("QLM_BROKER__SHARDS > 1" in r.getMessage() for r in caplog.records),
            10.0,
            "the mismatch to be logged",
        )
        await inbox.wait_for(1)
        # The stray shard's message counts as waiting: its request is nobody's yet, no orphan.
        assert await consumer.backlog() == 1
        await consumer.close()
        await publisher.close()

    with caplog.at_level("ERROR", logger="qlm.global_queue.rabbitmq"):
        run(scenario)


@pytest.mark.rabbitmq
def test_a_leader_reading_as_many_shards_as_are_written_says_nothing(
    amqp_url: str, names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        queue = open_queue(amqp_url, names, shards=2)
        await queue.consume(Inbox())
        await poll(
            lambda: any("at most 2 shards" in r.getMessage() for r in caplog.records),
            10.0,
            "the shard check to run",
        )
        await queue.close()

    with caplog.at_level("DEBUG", logger="qlm.global_queue.rabbitmq"):
        run(scenario)
    assert not [r for r in caplog.records if "QLM_BROKER__SHARDS" in r.getMessage()]


@pytest.mark.rabbitmq
def test_a_reconnect_during_a_long_step_hands_the_new_deliveries_over_after_the_stand_by(
    amqp_url: str, names: Names
) -> None:
    """The owner's loop is busy (a planning step) while the consumer's connection drops and
    comes back leading. The owner must be told it stood by (it drops what it took: the broker
    delivers it again) before any delivery of the new connection reaches it, else it would
    throw those away with the old ones."""
    ctl = rabbitmqctl()

    async def scenario() -> None:
        queue = open_queue(amqp_url, names)
        events: list[tuple[str, object]] = []
        taken: list[Delivery] = []

        async def handler(delivery: Delivery) -> None:
            assert delivery.message is not None
            events.append(("delivery", delivery.message.id))
            taken.append(delivery)
            if len(events) == 2:  # the first delivery: a long step, across a reconnect
                (pid,) = consumer_pids(ctl, names["queue"])
                subprocess.run([*ctl, "-q", "close_connection", pid, "test"], check=True)
                deadline = time.monotonic() + 10.0
                while True:  # blocking this loop (no await) until it leads on a new connection
                    pids = consumer_pids(ctl, names["queue"])
                    if pids and pid not in pids and queue.leader and queue.held == 3:
                        break
                    assert time.monotonic() < deadline, "the consumer did not lead again"
                    time.sleep(0.05)

        def on_leader(leading: bool) -> None:
            events.append(("leading", leading))
            if not leading:
                taken.clear()  # as the controller does: the broker delivers them again

        await queue.consume(handler, on_leader=on_leader)
        await queue.publish_many([make_message(i) for i in range(3)])
        await poll(lambda: len(taken) == 3 and events[-1][0] == "delivery", 10.0, "redelivery")
        leads = [i for i, (what, _) in enumerate(events) if what == "leading"]
        assert [events[i] for i in leads] == [
            ("leading", True),
            ("leading", False),
            ("leading", True),
        ]
        # What reached the owner before it was told it stood by (r0, maybe r1 and r2 of the
        # old connection) it dropped; every delivery of the new one came after it led again.
        assert sorted(str(what) for _, what in events[leads[-1] + 1 :]) == ["r0", "r1", "r2"]
        assert sorted(d.message.id for d in taken if d.message) == ["r0", "r1", "r2"]
        assert all(d.redelivered for d in taken)
        await asyncio.gather(*(queue.ack(d) for d in taken))
        await queue.close()
        await assert_drained(amqp_url, names)

    run(scenario)


@pytest.mark.rabbitmq
def test_work_asked_of_the_consumer_while_it_closes_returns(amqp_url: str, names: Names) -> None:
    """Acks, counts and reaping asked for while ``close`` runs neither hang nor raise a
    cancellation their caller did not ask for: an ack is sent or dropped (the broker takes the
    delivery back with the channel), a count or a reap fails with ``QueueUnavailable``. A
    second ``close`` at the same time waits for the first."""

    async def scenario() -> None:
        queue = open_queue(amqp_url, names)
        inbox = Inbox()
        await queue.consume(inbox)
        await queue.publish_many([make_message(i) for i in range(50)])
        deliveries = await inbox.wait_for(50)

        async def record(_letters: list[DeadLetter]) -> None:
            return None

        asked: list[asyncio.Task[Any]] = []
        closing = [asyncio.create_task(queue.close()), asyncio.create_task(queue.close())]
        for d in deliveries:
            asked += [
                asyncio.create_task(queue.ack(d)),
                asyncio.create_task(queue.backlog()),
                asyncio.create_task(queue.reap_dead(record)),
            ]
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*closing), 20.0)
        done, pending = await asyncio.wait(asked, timeout=10.0)
        assert not pending, f"{len(pending)} of {len(asked)} never returned"
        for task in done:
            error = task.exception()
            assert error is None or isinstance(error, QueueUnavailable), repr(error)
        # (What was not acked is the broker's again; whether the broker applied every ack
        # sent just before the close is its business: see broker/README.md.)

    run(scenario)


@pytest.mark.rabbitmq
def test_a_consumer_whose_loop_ended_without_close_lets_go_of_the_lead(
    amqp_url: str, names: Names
) -> None:
    """A program whose event loop ends (an error, say) without closing the queue: the
    consumer's thread notices and closes its connection, so another consumer leads and gets
    what the first held."""
    first = open_queue(amqp_url, names)

    async def lead_then_vanish() -> None:
        await first.consume(Inbox())
        publisher = open_queue(amqp_url, names)  # closed: only the consumer is left behind
        await publisher.publish_many([make_message(i) for i in range(5)])
        await publisher.close()
        await poll(lambda: first.held == 5, 10.0, "5 held")

    run(lead_then_vanish)

    async def take_over() -> None:
        second = open_queue(amqp_url, names)
        inbox = Inbox()
        await second.consume(inbox)
        deliveries = await inbox.wait_for(5, timeout_s=20.0)
        assert second.leader and not first.leader and first.held == 0
        await asyncio.gather(*(second.ack(d) for d in deliveries))
        await second.close()
        await assert_drained(amqp_url, names)

    run(take_over)
