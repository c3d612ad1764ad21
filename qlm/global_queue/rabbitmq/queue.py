"""The production global queue: a RabbitMQ quorum queue (broker/README.md explains the topology).

``RabbitGlobalQueue`` is assembled from its parts, a module each: ``publisher`` (confirmed
publishes on the caller's loop), ``consumer`` (the consumer's thread, the hand-over of deliveries
and the settlements), ``leader`` (the leader lock over every shard) and ``dead_letters`` (reaping
the dead-letter queue), over ``base`` (settings, state, connections, topology). Here: the
backlog, health and closing, which concern the whole queue.

Connections are plain (not aio-pika's "robust" ones) so that reconnection is ours to define:
bounded exponential back-off (``reconnect_min_s`` doubling to ``reconnect_max_s``) for both sides.
The publisher reconnects lazily: while it waits out a back-off step, publishes fail fast with
``QueueUnavailable`` instead of piling up. The consumer reconnects in the background and
re-subscribes; the broker has already requeued what the lost channel held, so deliveries of an
older ``epoch`` are dropped and settling them is a logged no-op, and the handler sees those
messages again with ``redelivered=True``. Publisher and consumer use separate connections, as
RabbitMQ advises (flow control on a publishing connection must not stall deliveries).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

from aiormq.exceptions import (
    AuthenticationError,
    ChannelAccessRefused,
    ChannelNotFoundEntity,
    ChannelPreconditionFailed,
    ConnectionNotAllowed,
    InvalidFrameError,
    ProbableAuthenticationError,
)

from qlm.global_queue.base import QueueUnavailable
from qlm.global_queue.rabbitmq.base import BROKER_ERRORS, _close_quietly
from qlm.global_queue.rabbitmq.consumer import Consuming
from qlm.global_queue.rabbitmq.dead_letters import DeadLetters
from qlm.global_queue.rabbitmq.leader import LeaderLock
from qlm.global_queue.rabbitmq.publisher import Publishing


class RabbitGlobalQueue(Publishing, Consuming, LeaderLock, DeadLetters):
    """The ``GlobalQueue`` on a RabbitMQ broker at ``url`` (``amqp://user:pass@host:port/vhost``).

    ``prefetch`` bounds the deliveries held un-acked per shard, and so the requests a controller
    can hold in its virtual queues (``shards × prefetch``). The default is AMQP's maximum, 65,535:
    0 ("unlimited") would be worse, as a RabbitMQ 3.x quorum queue turns it into 2,000. Every
    process using the queue (API replicas, controllers) must agree on ``shards``; raising it later
    is safe (consumers read every shard), lowering it strands the messages of the removed shards
    until they are moved. ``heartbeat_s`` is how soon the broker notices a controller whose host
    died, and so how soon the standby takes over (within ``leader_retry_s`` more).
    """

    async def backlog(self) -> int:
        """Ready messages of every shard and of the dead-letter queue, and of the shards past
        this consumer's that a process with more shards writes (``_check_shard_count``: their
        requests are nobody's yet, not orphans). Passive declares on a short-lived connection
        (the consumer thread's, while consuming: see ``reap_dead``); un-acked deliveries are not
        counted."""
        loop = self._loop
        if loop is None:
            return await self._backlog()
        return await self._on_consumer_loop(self._backlog(), loop)

    async def _backlog(self) -> int:
        try:
            connection = await self._connect("backlog")
        except BROKER_ERRORS as exc:
            raise self._unavailable("cannot count the queue's messages", exc) from exc
        try:
            channel = await connection.channel(publisher_confirms=False)
            total = 0
            for name in (*self.queues, self.dead_letter_queue):
                declared = await channel.declare_queue(name, passive=True)
                total += int(declared.declaration_result.message_count or 0)
            for shard in range(self.shards, 65):  # until one is missing (the channel closes)
                try:
                    stray = await channel.declare_queue(f"{self.queue}.{shard}", passive=True)
                except ChannelNotFoundEntity:
                    break
                total += int(stray.declaration_result.message_count or 0)
            return total
        except BROKER_ERRORS as exc:
            raise self._unavailable("cannot count the queue's messages", exc) from exc
        finally:
            await _close_quietly(connection)

    # --- start-up, health and shutdown ---------------------------------------------------------

    async def reach(self) -> None:
        """A plain TCP connection to the broker's address first, then an AMQP connection that
        declares the topology, closed again (the publisher and the consumer open their own).
        The TCP step says that nothing answers there without the AMQP client's own error log,
        so that a broker that is down is one line."""
        url = self._url
        host = url.host or "localhost"
        port = url.port or (5671 if url.scheme == "amqps" else 5672)
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), self.connect_timeout_s
            )
        except TimeoutError:
            raise self._not_reached(
                TimeoutError(f"no answer within {self.connect_timeout_s:g} s")
            ) from None
        except socket.gaierror as exc:
            raise self._not_reached(exc) from None
        except OSError as exc:  # the system's words ("Connection refused"), whichever loop
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise self._not_reached(OSError(reason)) from None
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        try:
            connection = await self._connect("check")
        except BROKER_ERRORS as exc:
            raise self._not_reached(exc) from exc
        try:
            channel = await connection.channel(publisher_confirms=False)
            await self._declare(channel)
        except BROKER_ERRORS as exc:
            raise self._not_reached(exc) from exc
        finally:
            await _close_quietly(connection)

    def _not_reached(self, exc: BaseException) -> QueueUnavailable:
        """The one line of ``reach``: where (password hidden), why, and what to check."""
        detail = str(exc) or type(exc).__name__
        where = f"the broker at {self._shown_url}"
        if isinstance(exc, ChannelPreconditionFailed):
            return QueueUnavailable(
                f"{where} holds a queue of that name with other arguments than this process "
                f"declares ({detail}); give every API and controller the same QLM_BROKER__* "
                "settings (broker/README.md)"
            )
        if isinstance(exc, socket.gaierror):
            detail = exc.strerror or detail
            hint = "check the host name in the URL"
        elif isinstance(exc, AuthenticationError | ProbableAuthenticationError):
            hint = "check the user and password in the URL"
        elif isinstance(exc, ConnectionNotAllowed | ChannelAccessRefused):
            hint = "check the vhost in the URL (it must exist and the user be allowed on it)"
        elif isinstance(exc, InvalidFrameError) and "Connection.Close" in detail:
            # aiormq's way of saying that the broker closed the connection it asked to open
            # (its reply text is lost): an unknown vhost, or one the user may not use
            detail = "the broker closed the connection as it opened"
            hint = "check the vhost in the URL (it must exist and the user be allowed on it)"
        else:
            hint = "is RabbitMQ running there?"
        return QueueUnavailable(f"cannot reach {where}: {detail}; {hint} (QLM_BROKER_URL)")

    # --- health and shutdown ------------------------------------------------------------------

    async def healthy(self) -> bool:
        if self._closing:
            return False
        try:
            await self._publishing.open()
        except QueueUnavailable:
            return False
        return self._handler is None or self._consumer is not None

    async def close(self) -> None:
        """Stop consuming (what it held goes back to the broker) and publishing. A second call
        waits for the first."""
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        self._closing = True
        task, self._dispatch_task = self._dispatch_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._stop_consumer()
        self.leader = False
        await self._publishing.close()
