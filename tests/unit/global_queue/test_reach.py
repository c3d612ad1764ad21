"""Reaching the broker before anything is written: a broker that is not there is one line naming
``QLM_BROKER_URL`` (its password hidden), and a connection that failed to open leaves nothing
behind, not even a coroutine that is never awaited. Nothing here needs a broker: the address is
a port where nothing listens."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest

from qlm.global_queue import MemoryGlobalQueue, QueueUnavailable
from qlm.global_queue.rabbitmq import RabbitGlobalQueue

NOWHERE = "amqp://guest:secret@127.0.0.1:1/"


def test_a_broker_that_is_not_there_is_one_line_naming_the_setting() -> None:
    async def scenario() -> str:
        queue = RabbitGlobalQueue(NOWHERE, connect_timeout_s=2.0)
        try:
            with pytest.raises(QueueUnavailable) as err:
                await queue.reach()
        finally:
            await queue.close()
        return str(err.value)

    message = asyncio.run(scenario())
    assert message.startswith("cannot reach the broker at amqp://guest:***@127.0.0.1:1/: ")
    assert "refused" in message.lower() and "is RabbitMQ running there?" in message
    assert message.endswith("(QLM_BROKER_URL)") and "\n" not in message
    assert "secret" not in message and "heartbeat" not in message


def test_the_in_process_queue_has_nothing_to_reach() -> None:
    asyncio.run(MemoryGlobalQueue().reach())


def test_a_failed_connection_leaves_no_coroutine_never_awaited() -> None:
    """aio-pika drops a connection that failed to open without closing it; collected where no
    event loop runs (here: the collector in a worker thread, as a store call's thread may), its
    finaliser made a ``close()`` coroutine that nothing awaited, and Python warned."""

    async def scenario() -> None:
        queue = RabbitGlobalQueue(NOWHERE, reconnect_min_s=0.01, reconnect_max_s=0.01)
        assert not await queue.healthy()  # the publisher's connection fails to open
        await asyncio.to_thread(gc.collect)
        await queue.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(scenario())
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
