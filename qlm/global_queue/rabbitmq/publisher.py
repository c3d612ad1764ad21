"""Publishing to the global queue: each message persistently, to the shard its request id
hashes to, confirmed by the broker.

Publishing uses aio-pika's connection on the caller's event loop, not pika. The API publishes from
many concurrent HTTP requests and must answer each only after the broker's confirm; the confirms
are pipelined on one channel (each publish awaits its own delivery tag), and ``publish_many`` sends
a batch through aiormq's ``basic_publish`` directly, without aio-pika's per-message objects.
Through ``RabbitGlobalQueue`` that measured 6,100-7,700 confirmed publishes/s, p99 8-9 ms
at concurrency 32 on the 2-core development machine (``benchmarks/global_queue.py``),
against 650-900/s for pika's ``BlockingConnection`` behind a lock; one pika connection per thread
would multiply threads and connections per API process for the same effect, and a pika
``SelectConnection`` in an I/O thread would need a hand-written confirm tracker and a thread
hand-off that aio-pika makes unnecessary.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, cast

import aiormq
from aiormq.exceptions import PublishError

from qlm.global_queue.base import QueueUnavailable
from qlm.global_queue.message import QueuedRequest
from qlm.global_queue.rabbitmq.base import BROKER_ERRORS, RabbitBase, _Publisher, shard_of
from qlm.global_queue.rabbitmq.frames import PublishFrames


class Publishing(RabbitBase):
    """The publishing side of ``RabbitGlobalQueue``, on the caller's event loop."""

    async def publish(self, message: QueuedRequest) -> None:
        """Publish persistently and wait for the broker's confirm (see ``GlobalQueue``)."""
        (error,) = await self.publish_many([message])
        if error is not None:
            raise error

    _underlay: aiormq.Channel | None = None
    """The publishing channel's aiormq channel, as the last publish found it."""

    async def publish_many(
        self, messages: Sequence[QueuedRequest]
    ) -> list[QueueUnavailable | None]:
        """Publish each message persistently on the one publishing channel and wait for every
        confirm (see ``GlobalQueue``); each message gets its own outcome: None once the broker
        confirmed that message, else the error.

        The batch goes out as one write (``_send``): every message gets its delivery tag and
        its own confirmation future from the channel, as aiormq's ``basic_publish`` gives them,
        but the frames of all of them are packed into one buffer (``PublishFrames``) and queued
        on the connection's writer once. ``basic_publish`` per message costs a task, a lock round, a
        timeout context and a socket write each: it was the largest part of the API's CPU
        per submission (docs/api.md, "Ingest throughput"). ``mandatory``: a message no queue
        takes (the queue was deleted) comes back as an error instead of being confirmed and
        dropped; the channel is then retired, so the next publish opens a new one, which
        declares the queues again."""
        if not messages:
            return []
        try:
            publisher = await self._publishing.open()
            channel = cast(aiormq.Channel, await publisher.channel.get_underlay_channel())
            self._underlay = channel
            confirmations = await self._send(channel, messages)
        except (QueueUnavailable, *BROKER_ERRORS) as exc:
            error = (
                exc
                if isinstance(exc, QueueUnavailable)
                else self._unavailable("cannot publish on the publishing channel", exc)
            )
            return [error] * len(messages)
        return await self._outcomes(publisher, channel, messages, confirmations)

    def publish_many_now(
        self, messages: Sequence[QueuedRequest]
    ) -> Awaitable[list[QueueUnavailable | None]]:
        """``publish_many`` with the batch queued on the connection's writer before this returns
        when the publishing channel is open and free (the usual case: what ``_send`` does,
        without waiting for anything); otherwise, and for an empty batch, ``publish_many``
        itself, which opens the channel or waits for it when it is awaited."""
        publisher = self._publishing.publisher
        channel = self._underlay
        if (
            messages
            and publisher is not None
            and channel is not None
            and not publisher.channel.is_closed
            and not channel.is_closed
            and not _held(channel)
        ):
            try:
                frames, confirmations = self._register(channel, messages)
            except Exception:  # a message that cannot be encoded: ``publish_many`` reports it
                return self.publish_many(messages)
            try:
                channel.write_queue.put_nowait(frames)
            except asyncio.QueueFull:
                self._unregister(channel, messages, confirmations)
            else:
                return self._outcomes(publisher, channel, messages, confirmations)
        return self.publish_many(messages)

    async def _outcomes(
        self,
        publisher: _Publisher,
        channel: aiormq.Channel,
        messages: Sequence[QueuedRequest],
        confirmations: list[tuple[int, asyncio.Future[Any]]],
    ) -> list[QueueUnavailable | None]:
        """Each sent message's outcome, once its confirm came or ``confirm_timeout_s`` passed."""
        late: set[asyncio.Future[Any]] = set()
        try:
            _, late = await asyncio.wait(
                [c for _, c in confirmations], timeout=self.confirm_timeout_s
            )
        finally:
            for (tag, confirmation), message in zip(confirmations, messages, strict=True):
                if not confirmation.done():
                    confirmation.cancel()  # a confirm that comes later is ignored (aiormq)
                if channel.message_id_delivery_tag.get(message.id) == tag:
                    del channel.message_id_delivery_tag[message.id]
        out: list[QueueUnavailable | None] = []
        returned = False
        for message, (_, confirmation) in zip(messages, confirmations, strict=True):
            reason: BaseException
            if confirmation in late:
                reason = TimeoutError(f"no confirm within {self.confirm_timeout_s:g} s")
            elif confirmation.cancelled():
                reason = ConnectionError("the publishing channel closed before the confirm")
            elif confirmation.exception() is not None:
                reason = cast(BaseException, confirmation.exception())
            elif isinstance(confirmation.result(), aiormq.spec.Basic.Ack):
                out.append(None)
                continue
            else:
                reason = RuntimeError(f"the broker answered {confirmation.result()!r}, not an ack")
            returned = returned or isinstance(reason, PublishError)
            error = self._unavailable(f"request {message.id!r} not confirmed", reason)
            error.__cause__ = reason
            out.append(error)
        if returned:
            self._publishing.retire(publisher)
        return out

    async def _send(
        self, channel: aiormq.Channel, messages: Sequence[QueuedRequest]
    ) -> list[tuple[int, asyncio.Future[Any]]]:
        """Queue ``messages`` on the connection's writer as one buffer, each with its delivery
        tag and confirmation future, registered as aiormq's ``basic_publish`` registers them so
        that its reader settles them (acks, nacks, returns, the channel closing). Nothing is
        left registered when this raises: the broker has seen none of them."""
        if channel.is_closed:
            raise QueueUnavailable("the publishing channel is closed")
        async with asyncio.timeout(self.confirm_timeout_s), channel.lock:
            frames, sent = self._register(channel, messages)
            try:
                await channel.write_queue.put(frames)
            except BaseException:
                self._unregister(channel, messages, sent)
                raise
        return sent

    def _register(
        self, channel: aiormq.Channel, messages: Sequence[QueuedRequest]
    ) -> tuple[Any, list[tuple[int, asyncio.Future[Any]]]]:
        """The frames of ``messages`` as one buffer, each message with the next delivery tag
        and its confirmation future registered on ``channel``."""
        frames = PublishFrames(channel.number, channel.max_content_size)
        sent: list[tuple[int, asyncio.Future[Any]]] = []
        try:
            for message in messages:
                shard = (
                    self.queues[shard_of(message.id, self.shards)]
                    if self.shards > 1
                    else self.queue
                )
                channel.delivery_tag += 1
                tag = channel.delivery_tag
                confirmation = channel.create_future()
                channel.confirmations[tag] = confirmation
                channel.message_id_delivery_tag[message.id] = tag
                sent.append((tag, confirmation))
                frames.add(shard, message.id, message.encode())
        except BaseException:
            self._unregister(channel, messages, sent)
            raise
        return frames.channel_frame(), sent

    @staticmethod
    def _unregister(
        channel: aiormq.Channel,
        messages: Sequence[QueuedRequest],
        sent: list[tuple[int, asyncio.Future[Any]]],
    ) -> None:
        """Not sent: the broker has not seen these tags; the next publish reuses them."""
        for (tag, confirmation), message in zip(sent, messages, strict=False):
            channel.confirmations.pop(tag, None)
            if channel.message_id_delivery_tag.get(message.id) == tag:
                del channel.message_id_delivery_tag[message.id]
            confirmation.cancel()
        if sent:
            channel.delivery_tag = sent[0][0] - 1


def _held(channel: aiormq.Channel) -> bool:
    """Whether a coroutine holds ``channel``'s lock (aiormq's ``basic_publish`` and RPCs take it
    and may wait while they hold it: a delivery tag taken, its frame not queued yet). Unknown
    (another aiormq than the one this was written for): held."""
    lock = getattr(channel, "_Channel__lock", None)
    return not isinstance(lock, asyncio.Lock) or lock.locked()
