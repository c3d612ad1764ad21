"""The global queue's contract: what the in-process queue and the RabbitMQ queue both do — held
deliveries acked for good, requeue, the delivery limit, dead letters with reasons, a handler's
failure, single-active-consumer takeover, settling twice, a closed queue. The RabbitMQ runs
declare a ``qlm.test.<uuid>`` queue of their own (deleted afterwards); they skip without a broker
and fail under CI=true.

Implementation specifics live with their implementation: ``tests/unit/global_queue/
test_memory.py`` (the in-process broker, the factory) and ``tests/integration/
test_global_queue_rabbitmq.py`` (confirms, shards, the leader lock, reconnection, reaping)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from queue_helpers import Inbox, make_message, poll
from services import broker_names

from qlm.global_queue import (
    DeadLetter,
    Delivery,
    GlobalQueue,
    MemoryBroker,
    MemoryGlobalQueue,
    QueuedRequest,
    QueueUnavailable,
)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


async def settle() -> None:
    """Let the consumers run (the in-process ones in this loop, RabbitMQ's on their thread)."""
    for _ in range(10):
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)


# --- the implementations ----------------------------------------------------------------------


class MemoryBackend:
    """Clients of one ``MemoryBroker``; the first ``open`` sets its delivery limit."""

    def __init__(self) -> None:
        self.broker: MemoryBroker | None = None

    def open(self, **options: Any) -> GlobalQueue:
        if self.broker is None:
            self.broker = MemoryGlobalQueue(**options).broker
        return MemoryGlobalQueue(broker=self.broker)

    async def put_raw(self, body: bytes) -> None:
        assert self.broker is not None
        self.broker.put_raw(body)

    async def dead(self, count: int) -> list[DeadLetter]:
        await poll(lambda: self.broker is not None and len(self.broker.dead) >= count, 10.0, "dead")
        assert self.broker is not None
        return list(self.broker.dead)


class RabbitBackend:
    """Clients of one test queue on the broker at ``url`` (named by ``names``)."""

    def __init__(self, url: str, names: dict[str, str]) -> None:
        self.url, self.names = url, names

    def open(self, **options: Any) -> GlobalQueue:
        from qlm.global_queue.rabbitmq import RabbitGlobalQueue

        return RabbitGlobalQueue(self.url, reconnect_max_s=1.0, **self.names, **options)

    async def put_raw(self, body: bytes) -> None:
        """Publish ``body`` as is (a foreign producer), past QLM's publisher."""
        import aio_pika

        connection = await aio_pika.connect(self.url)
        async with connection:
            channel = await connection.channel()
            await channel.default_exchange.publish(aio_pika.Message(body), self.names["queue"])

    async def dead(self, count: int) -> list[DeadLetter]:
        """Wait for ``count`` messages in the dead-letter queue and take them (acked), each with
        the reason ``reap_dead`` would record."""
        import aio_pika

        from qlm.global_queue.rabbitmq import dead_letter_reason

        connection = await aio_pika.connect(self.url)
        async with connection:
            channel = await connection.channel()
            queue = await channel.get_queue(self.names["dead_letter_queue"])
            got: list[aio_pika.abc.AbstractIncomingMessage] = []

            async def keep(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                got.append(message)
                await message.ack()

            await queue.consume(keep)
            await poll(lambda: len(got) >= count, 10.0, f"{count} dead letters")
            return [DeadLetter(m.body, dead_letter_reason(m.headers)) for m in got]


Backend = MemoryBackend | RabbitBackend


@pytest.fixture(params=["memory", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """Each global queue: in process, and RabbitMQ (skips without a broker, fails under
    CI=true)."""
    if request.param == "memory":
        yield MemoryBackend()
        return
    url = request.getfixturevalue("amqp_url")
    with broker_names(url) as names:
        yield RabbitBackend(url, names)


async def left_in_queue(backend: Backend) -> list[str]:
    """The ids still queued, oldest first: a fresh consumer gets them before a sentinel
    published now (they are older)."""
    queue = backend.open()
    inbox = Inbox()
    await queue.consume(inbox)
    await queue.publish(make_message(id="sentinel"))
    await poll(lambda: "sentinel" in inbox.ids(), 10.0, "the sentinel")
    for delivery in inbox.deliveries:
        await queue.ack(delivery)
    await queue.close()
    ids = inbox.ids()
    return ids[: ids.index("sentinel")]


# --- the contract -----------------------------------------------------------------------------


def test_published_messages_are_delivered_in_order_and_acked_for_good(backend: Backend) -> None:
    async def scenario() -> None:
        queue = backend.open()
        inbox = Inbox()
        await queue.publish(make_message(0))
        await queue.consume(inbox)
        await asyncio.gather(*(queue.publish(make_message(i)) for i in range(1, 20)))
        await inbox.wait_for(20)
        assert inbox.ids() == [f"r{i}" for i in range(20)]  # one publisher, one queue: in order
        first = inbox.deliveries[0]
        assert first.message == make_message(0)
        assert (first.redelivered, first.delivery_count, first.error) == (False, 0, "")
        assert await queue.healthy()
        for delivery in inbox.deliveries:
            await queue.ack(delivery)
        assert await queue.backlog() == 0  # nothing ready, nothing dead
        await queue.close()
        assert await left_in_queue(backend) == []

    run(scenario)


def test_a_requeued_delivery_comes_back_marked_redelivered_with_its_count(
    backend: Backend,
) -> None:
    async def scenario() -> None:
        queue = backend.open()
        inbox = Inbox()
        await queue.consume(inbox)
        await queue.publish(make_message(0))
        (first,) = await inbox.wait_for(1)
        await queue.requeue(first)
        _, again = await inbox.wait_for(2)
        assert again.message == first.message
        assert (again.redelivered, again.delivery_count) == (True, 1)
        await queue.ack(again)
        await queue.close()

    run(scenario)


@pytest.mark.parametrize("from_handler", [False, True], ids=["after", "in-handler"])
def test_a_message_returned_past_the_delivery_limit_is_dead_lettered(
    backend: Backend, from_handler: bool
) -> None:
    async def scenario() -> None:
        queue = backend.open(delivery_limit=2)
        inbox = Inbox()

        async def give_back(delivery: Delivery) -> None:
            await inbox(delivery)
            await queue.requeue(delivery)

        await queue.consume(give_back if from_handler else inbox)
        await queue.publish(make_message(0))
        for n in range(1, 4):  # delivered with counts 0, 1, 2; the third return is one too many
            await inbox.wait_for(n)
            if not from_handler:
                await queue.requeue(inbox.deliveries[-1])
        (dead,) = await backend.dead(1)
        await settle()
        assert [d.delivery_count for d in inbox.deliveries] == [0, 1, 2]
        assert dead.reason == "delivery_limit"
        assert QueuedRequest.decode(dead.raw) == make_message(0)
        await queue.close()

    run(scenario)


@pytest.mark.parametrize(
    ("body", "missing"),
    [
        (b'{"schema": 1, "id": "x"}', "'model'"),
        (b'{"schema": 1, "id": "x", "model": "m"}', "'prompt_tokens'"),
    ],
    ids=["no-model", "no-prompt-tokens"],
)
def test_a_malformed_body_is_dead_lettered_with_its_reason_and_never_handled(
    backend: Backend, body: bytes, missing: str
) -> None:
    async def scenario() -> None:
        queue = backend.open()
        inbox = Inbox()
        await queue.consume(inbox)
        await backend.put_raw(body)
        await queue.publish(make_message(1))
        await inbox.wait_for(1)
        (dead,) = await backend.dead(1)
        await settle()
        assert inbox.ids() == ["r1"]  # the handler never saw the bad one
        assert dead.raw == body
        assert "malformed" in dead.reason and missing in dead.reason
        await queue.close()

    run(scenario)


def test_dead_letter_parks_the_message_with_the_callers_reason(backend: Backend) -> None:
    async def scenario() -> None:
        queue = backend.open()
        inbox = Inbox()
        await queue.consume(inbox)
        await queue.publish(make_message(0, model="no-such-model"))
        (delivery,) = await inbox.wait_for(1)
        await queue.dead_letter(delivery, "unknown model 'no-such-model'")
        for _ in range(100):  # dead-lettering may be the broker's routing, after the reject
            if await queue.backlog() == 1:
                break
            await asyncio.sleep(0.05)
        assert await queue.backlog() == 1  # a dead letter not yet reaped counts
        (dead,) = await backend.dead(1)
        assert QueuedRequest.decode(dead.raw) == delivery.message
        assert dead.reason == "unknown model 'no-such-model'"
        await queue.close()
        assert await left_in_queue(backend) == []

    run(scenario)


def test_the_standby_consumer_takes_over_every_unacked_message_when_the_active_one_closes(
    backend: Backend,
) -> None:
    async def scenario() -> None:
        active, standby = backend.open(), backend.open()
        first, second = Inbox(), Inbox()
        told: list[tuple[str, bool]] = []
        await active.consume(first, on_leader=lambda leads: told.append(("active", leads)))
        await poll(lambda: ("active", True) in told, 10.0, "the first consumer to lead")
        await standby.consume(second, on_leader=lambda leads: told.append(("standby", leads)))
        assert told == [("active", True), ("standby", False)]
        for i in range(3):
            await active.publish(make_message(i))
        await first.wait_for(3)
        await active.ack(first.deliveries[1])
        await settle()
        assert second.deliveries == []  # single active consumer: the standby waits
        await active.close()
        await second.wait_for(2)
        assert told[-1] == ("standby", True)
        assert second.ids() == ["r0", "r2"]
        assert all(d.redelivered and d.delivery_count == 1 for d in second.deliveries)
        # The old consumer's deliveries are settled by the broker now: acking them is a no-op.
        await active.ack(first.deliveries[0])
        await standby.ack(second.deliveries[0])
        await standby.close()
        assert await left_in_queue(backend) == ["r2"]  # back for whoever consumes next

    run(scenario)


def test_settling_a_delivery_twice_is_a_harmless_no_op(backend: Backend) -> None:
    async def scenario() -> None:
        queue = backend.open()
        inbox = Inbox()
        await queue.consume(inbox)
        await queue.publish(make_message(0))
        (delivery,) = await inbox.wait_for(1)
        await queue.ack(delivery)
        await queue.ack(delivery)
        await queue.requeue(delivery)
        await settle()
        assert len(inbox.deliveries) == 1
        assert await queue.healthy()
        await queue.close()
        assert await left_in_queue(backend) == []

    run(scenario)


def test_a_handler_that_raises_gets_the_delivery_back_until_the_limit(backend: Backend) -> None:
    async def scenario() -> None:
        queue = backend.open(delivery_limit=1)
        seen: list[int] = []

        async def failing(delivery: Delivery) -> None:
            seen.append(delivery.delivery_count)
            raise ValueError("boom")

        await queue.consume(failing)
        await queue.publish(make_message(0))
        dead = await backend.dead(1)
        assert seen == [0, 1]
        assert [d.reason for d in dead] == ["delivery_limit"]
        await queue.close()

    run(scenario)


def test_a_closed_queue_refuses_to_publish_and_reports_unhealthy(backend: Backend) -> None:
    async def scenario() -> None:
        queue = backend.open()
        assert await queue.healthy()
        await queue.close()
        assert not await queue.healthy()
        with pytest.raises(QueueUnavailable):
            await queue.publish(make_message(0))

    run(scenario)
