"""The in-process global queue beyond the contract every global queue keeps
(``tests/contract/test_global_queue.py``): a dropped connection hands over to the leader, and the
factory picks the queue from the broker URL."""

from __future__ import annotations

import pytest

from qlm.errors import ConfigError
from qlm.global_queue import MemoryBroker, MemoryGlobalQueue, open_global_queue
from tests.contract.test_global_queue import Inbox, make_message, run


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
