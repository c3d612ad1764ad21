"""The leader lock: which controller consumes, decided for every shard at once.

**Shards and the leader lock.** One AMQP consumer holds at most 65,535 un-acked deliveries (the
prefetch count is a 16-bit field, and a RabbitMQ 3.x quorum queue turns "unlimited" into 2,000),
and a controller holds every waiting request un-acked. To hold more, the global queue is split
into ``shards`` quorum queues: ``qlm.requests`` and ``qlm.requests.1`` ... ``qlm.requests.{n-1}``.
A message goes to the shard its request id hashes to (CRC-32), so a republished request lands
where its first copy did; the controller consumes every shard on one channel, each consumer with
its own prefetch, so it can hold ``shards × 65,535``. Which controller is active must then be
decided for all shards at once — single active consumer decides per queue, and two controllers
starting together could each win some shards. So the consumer first takes a leader lock: an
*exclusive* queue ``{queue}.leader``, which only one connection can declare and which the broker
deletes when that connection dies (the same moment it requeues everything the connection held).
A standby keeps its connection and retries the lock every ``leader_retry_s``. Single active
consumer stays on every shard as a second guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aio_pika.abc import AbstractConnection, AbstractIncomingMessage
from aiormq.abc import DeliveredMessage
from aiormq.exceptions import ChannelLockedResource, ChannelNotFoundEntity

from qlm.global_queue.rabbitmq.base import BROKER_ERRORS, RabbitBase, log

LEADER_QUEUE_ARGUMENTS: dict[str, Any] = {"x-queue-type": "classic"}
"""The leader lock is an exclusive queue, which only a classic queue can be."""
SHARD_CHECK_S = 60.0
"""How often the leader looks for a shard beyond its count (a mismatched ``shards`` setting)."""
STANDBY_LOG_S = 300.0
"""A standby says it is still waiting this often (each of its attempts is also a channel error
in the broker's log: one every ``leader_retry_s``)."""


async def _ignore(_message: AbstractIncomingMessage) -> None:
    """Nothing is published to the leader lock; consuming it only watches for its deletion."""


class LeaderLock(RabbitBase):
    """Taking the leader lock and, once held, consuming every shard; waiting as a standby
    otherwise; the leader's check that no process writes to more shards than it reads."""

    if TYPE_CHECKING:  # the consumer's (``consumer.Consuming``)

        def _new_epoch(self) -> None: ...
        def _tell_leader(self, leading: bool) -> None: ...
        async def _on_message(self, epoch: int, incoming: DeliveredMessage) -> None: ...

    async def _lead(
        self, connection: AbstractConnection, lost: asyncio.Event, tried: Callable[[], None]
    ) -> None:
        """Wait for the leader lock, then consume every shard under a new epoch (module
        docstring). ``tried`` is called once the first attempt has told leading from standing
        by. Returns once consuming, or when ``lost`` is set while waiting."""
        waiting_since: float | None = None
        while not lost.is_set():
            channel = await connection.channel(publisher_confirms=False)
            try:
                lock = await channel.declare_queue(
                    self.leader_queue, exclusive=True, arguments=LEADER_QUEUE_ARGUMENTS
                )
                break
            except ChannelLockedResource:  # the broker closed `channel`
                if await self._remove_stale_lock(connection):
                    continue
                tried()
                if waiting_since is None:
                    self._tell_leader(False)
                now = time.monotonic()
                if waiting_since is None or now - waiting_since > STANDBY_LOG_S:
                    log.info("standby: another consumer holds %s; waiting", self.leader_queue)
                    waiting_since = now
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(lost.wait(), self.leader_retry_s)
        else:
            return
        await channel.set_qos(prefetch_count=self.prefetch)
        channel.close_callbacks.add(lambda *_: lost.set())
        # The broker cancels a consumer whose queue is deleted: start over (redeclare). That
        # holds for the lock too: the leader consumes it (nothing is ever published to it), so
        # an operator deleting the lock makes the leader step down and compete again.
        underlay = await channel.get_underlay_channel()
        underlay.on_consumer_cancel_callbacks.add(lambda _: lost.set())
        await lock.consume(_ignore, no_ack=True)
        queues, _ = await self._declare(channel)
        self._new_epoch()
        # Told before any delivery of this epoch is handed over (the dispatcher passes only
        # those of the epoch it last announced as leading).
        self.leader = True
        self._tell_leader(True)
        # The shards are consumed on aiormq's channel, as aio-pika's ``Queue.consume`` does, but
        # without its message object and second task per delivery (``consumer._on_message``).
        on_message = functools.partial(self._on_message, self._epoch)
        for queue in queues:
            await underlay.basic_consume(queue.name, on_message, no_ack=False)
        tried()
        log.info("leading: consuming %s on %s", ", ".join(self.queues), self._safe_url)

    async def _check_shard_count(self, connection: AbstractConnection) -> None:
        """Say so, loudly, when a process publishes to more shards than this consumer reads: it
        declared the next shard's queue, whose requests nobody serves."""
        stray = f"{self.queue}.{self.shards}"
        try:
            channel = await connection.channel(publisher_confirms=False)
        except BROKER_ERRORS:
            return  # the connection is going: the consumer starts over anyway
        try:
            found = await channel.declare_queue(stray, passive=True)
        except BROKER_ERRORS:  # no such queue (the broker closed the channel): the counts agree
            log.debug("no queue %s: every publisher uses at most %d shards", stray, self.shards)
            return
        count = found.declaration_result.message_count or 0
        log.error(
            "queue %s exists (%d messages): some API or controller has QLM_BROKER__SHARDS > %d, "
            "and what it puts there is served by nobody; set the same shard count everywhere",
            stray,
            count,
            self.shards,
        )
        with contextlib.suppress(*BROKER_ERRORS):
            await channel.close()

    async def _remove_stale_lock(self, connection: AbstractConnection) -> bool:
        """After RESOURCE_LOCKED: is the lock a queue no connection owns (left by hand, or
        declared without ``exclusive``)? A passive declaration succeeds only then; such a queue
        would keep every controller standing by forever, so it is deleted (when empty)."""
        channel = await connection.channel(publisher_confirms=False)
        try:
            await channel.declare_queue(self.leader_queue, passive=True)
        except ChannelNotFoundEntity:
            return True  # its leader went meanwhile: try to take it at once
        except BROKER_ERRORS:
            return False  # a live leader holds it (RESOURCE_LOCKED), or we cannot tell: wait
        log.error(
            "%s exists but no connection holds it as its exclusive lock; deleting it",
            self.leader_queue,
        )
        try:
            await channel.queue_delete(self.leader_queue, if_empty=True)
        finally:
            with contextlib.suppress(*BROKER_ERRORS):
                await channel.close()
        return True
