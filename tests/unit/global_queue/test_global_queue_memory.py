"""The in-process global queue keeps RabbitMQ's semantics: held deliveries, requeue, the delivery
limit, dead letters with reasons, and single-active-consumer takeover."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from qlm.errors import ConfigError
from qlm.global_queue import (
    Delivery,
    MemoryBroker,
    MemoryGlobalQueue,
    QueuedRequest,
    QueueUnavailable,
    open_global_queue,
)


def make_message(i: int = 0, **overrides: Any) -> QueuedRequest:
    fields: dict[str, Any] = {
        "id": f"r{i}",
        "model": "m",
        "prompt_tokens": 10,
        "max_tokens": 20,
        "slo_e2e_s": 30.0,
        "submitted_at": 1_700_000_000.0 + i,
    }
    fields.update(overrides)
    return QueuedRequest(**fields)


class Inbox:
    """A handler that keeps what it is given, and a bounded wait for it."""

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []

    async def __call__(self, delivery: Delivery) -> None:
        self.deliveries.append(delivery)

    async def wait_for(self, count: int, timeout_s: float = 5.0) -> list[Delivery]:
        async def enough() -> None:
            while len(self.deliveries) < count:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(enough(), timeout_s)
        return list(self.deliveries)

    def ids(self) -> list[str]:
        return [d.message.id for d in self.deliveries if d.message is not None]


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 10))


async def settle() -> None:
    """Let the consumer tasks run."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_published_messages_are_delivered_in_order_and_acked_for_good() -> None:
    async def scenario() -> None:
        queue = MemoryGlobalQueue()
        inbox = Inbox()
        await queue.publish(make_message(0))
        await queue.consume(inbox)
        await queue.publish(make_message(1))
        first, second = await inbox.wait_for(2)
        assert inbox.ids() == ["r0", "r1"]
        assert (first.redelivered, first.delivery_count) == (False, 0)
        assert first.message == make_message(0)
        await queue.ack(first)
        await queue.ack(second)
        await queue.close()
        assert queue.broker.ready == 0
        assert list(queue.broker.dead) == []

    run(scenario)


def test_a_requeued_delivery_comes_back_marked_redelivered_with_its_count() -> None:
    async def scenario() -> None:
        queue = MemoryGlobalQueue()
        inbox = Inbox()
        await queue.consume(inbox)
        await queue.publish(make_message(0))
        (first,) = await inbox.wait_for(1)
        await queue.requeue(first)
        _, again = await inbox.wait_for(2)
        assert again.message == first.message
        assert (again.redelivered, again.delivery_count) == (True, 1)
        await queue.close()

    run(scenario)


def test_a_message_returned_past_the_delivery_limit_is_dead_lettered() -> None:
    async def scenario() -> None:
        queue = MemoryGlobalQueue(delivery_limit=2)
        inbox = Inbox()
        await queue.consume(inbox)
        await queue.publish(make_message(0))
        for n in range(1, 4):  # delivered with counts 0, 1, 2; the third return is one too many
            await inbox.wait_for(n)
            await queue.requeue(inbox.deliveries[-1])
        await settle()
        assert [d.delivery_count for d in inbox.deliveries] == [0, 1, 2]
        (dead,) = queue.broker.dead
        assert dead.reason == "delivery_limit"
        assert QueuedRequest.decode(dead.raw) == make_message(0)
        await queue.close()

    run(scenario)


def test_a_malformed_body_is_dead_lettered_with_its_reason_and_never_handled() -> None:
    async def scenario() -> None:
        queue = MemoryGlobalQueue()
        inbox = Inbox()
        await queue.consume(inbox)
        queue.broker.put_raw(b'{"schema": 1, "id": "x"}')
        await queue.publish(make_message(1))
        await inbox.wait_for(1)
        await settle()
        assert inbox.ids() == ["r1"]
        (dead,) = queue.broker.dead
        assert dead.raw == b'{"schema": 1, "id": "x"}'
        assert "malformed" in dead.reason and "'model'" in dead.reason
        await queue.close()

    run(scenario)


def test_dead_letter_parks_the_message_with_the_callers_reason() -> None:
    async def scenario() -> None:
        queue = MemoryGlobalQueue()
        inbox = Inbox()
        await queue.consume(inbox)
        await queue.publish(make_message(0, model="no-such-model"))
        (delivery,) = await inbox.wait_for(1)
        await queue.dead_letter(delivery, "unknown model 'no-such-model'")
        (dead,) = queue.broker.dead
        assert dead.reason == "unknown model 'no-such-model'"
        assert queue.broker.ready == 0
        await queue.close()

    run(scenario)


def test_the_standby_consumer_takes_over_every_unacked_message_when_the_active_one_closes() -> None:
    async def scenario() -> None:
        broker = MemoryBroker()
        active, standby = MemoryGlobalQueue(broker=broker), MemoryGlobalQueue(broker=broker)
        first, second = Inbox(), Inbox()
        await active.consume(first)
        await standby.consume(second)
        for i in range(3):
            await active.publish(make_message(i))
        await first.wait_for(3)
        await active.ack(first.deliveries[1])
        await settle()
        assert second.deliveries == []  # single active consumer: the standby waits
        await active.close()
        await second.wait_for(2)
        assert second.ids() == ["r0", "r2"]
        assert all(d.redelivered and d.delivery_count == 1 for d in second.deliveries)
        # The old consumer's deliveries are settled by the broker now: acking them is a no-op.
        await active.ack(first.deliveries[0])
        await standby.ack(second.deliveries[0])
        await standby.close()
        assert broker.ready == 1  # r2, back in the queue for whoever consumes next

    run(scenario)


def test_a_dropped_connection_hands_what_it_held_to_the_leader_and_comes_back_behind_it() -> None:
    async def scenario() -> None:
        broker = MemoryBroker()
        first, second = MemoryGlobalQueue(broker=broker), MemoryGlobalQueue(broker=broker)
        told: list[tuple[str, bool]] = []
        one, two = Inbox(), Inbox()
        await first.consume(one, on_leader=lambda leads: told.append(("first", leads)))
        await second.consume(two, on_leader=lambda leads: told.append(("second", leads)))
        assert told == [("first", True), ("second", False)]
        await first.publish(make_message(0))
        (held,) = await one.wait_for(1)
        told.clear()
        first.drop_connection()
        assert told == [("second", True), ("first", False)]  # back behind the second
        (taken,) = await two.wait_for(1)
        assert taken.message == held.message and taken.redelivered
        await first.ack(held)  # from the lost connection: a no-op, the second holds it
        await second.ack(taken)
        told.clear()
        second.drop_connection()  # the first, behind it, leads again
        assert told == [("first", True), ("second", False)] and broker.ready == 0
        await first.publish(make_message(1))
        assert [d.message.id for d in await one.wait_for(2) if d.message] == ["r0", "r1"]

    run(scenario)


def test_settling_a_delivery_twice_is_a_harmless_no_op() -> None:
    async def scenario() -> None:
        queue = MemoryGlobalQueue()
        inbox = Inbox()
        await queue.consume(inbox)
        await queue.publish(make_message(0))
        (delivery,) = await inbox.wait_for(1)
        await queue.ack(delivery)
        await queue.ack(delivery)
        await queue.requeue(delivery)
        await settle()
        assert len(inbox.deliveries) == 1
        await queue.close()

    run(scenario)


def test_a_handler_that_raises_gets_the_delivery_back_until_the_limit() -> None:
    async def scenario() -> None:
        queue = MemoryGlobalQueue(delivery_limit=1)
        seen: list[int] = []

        async def failing(delivery: Delivery) -> None:
            seen.append(delivery.delivery_count)
            raise ValueError("boom")

        await queue.consume(failing)
        await queue.publish(make_message(0))
        for _ in range(100):
            if queue.broker.dead:
                break
            await asyncio.sleep(0.001)
        assert seen == [0, 1]
        assert [d.reason for d in queue.broker.dead] == ["delivery_limit"]
        await queue.close()

    run(scenario)


def test_a_closed_queue_refuses_to_publish_and_reports_unhealthy() -> None:
    async def scenario() -> None:
        queue = MemoryGlobalQueue()
        assert await queue.healthy()
        await queue.close()
        assert not await queue.healthy()
        with pytest.raises(QueueUnavailable):
            await queue.publish(make_message(0))

    run(scenario)


def test_the_factory_picks_the_queue_from_the_broker_url() -> None:
    assert isinstance(open_global_queue(None), MemoryGlobalQueue)
    assert isinstance(open_global_queue("memory://", delivery_limit=3), MemoryGlobalQueue)
    rabbit = open_global_queue("amqp://guest:secret@127.0.0.1:5672/%2F", queue="q")
    assert type(rabbit).__name__ == "RabbitGlobalQueue"
    assert "secret" not in repr(rabbit)
    with pytest.raises(ConfigError, match="QLM_BROKER_URL"):
        open_global_queue("redis://127.0.0.1:6379")
    with pytest.raises(ConfigError, match="prefetch"):
        open_global_queue("amqp://127.0.0.1", prefetch=70_000)
