"""Publishing to the global queue: each message persistently, to the shard its request id
hashes to, confirmed by the broker.

Publishing uses aio-pika's connection on the caller's event loop, not pika. The API publishes from
many concurrent HTTP requests and must answer each only after the broker's confirm; the confirms
are pipelined on one channel (each message has its own delivery tag), and ``publish_many`` and
``publish_many_then`` send a batch as one write on aiormq's channel, without aio-pika's
per-message objects, its confirms collected by ``_Confirms``.
Through ``RabbitGlobalQueue`` that measured 6,100-7,700 confirmed publishes/s, p99 8-9 ms
at concurrency 32 on the 2-core development machine (``benchmarks/global_queue.py``),
against 650-900/s for pika's ``BlockingConnection`` behind a lock; one pika connection per thread
would multiply threads and connections per API process for the same effect, and a pika
``SelectConnection`` in an I/O thread would need a hand-written confirm tracker and a thread
hand-off that aio-pika makes unnecessary.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, cast

import aiormq
from aiormq.exceptions import PublishError

from qlm.global_queue.base import QueueUnavailable, publish_many_later
from qlm.global_queue.message import QueuedRequest
from qlm.global_queue.rabbitmq.base import BROKER_ERRORS, RabbitBase, _Publisher, log, shard_of
from qlm.global_queue.rabbitmq.frames import PublishFrames


class Publishing(RabbitBase):
    """The publishing side of ``RabbitGlobalQueue``, on the caller's event loop."""

    async def publish(self, message: QueuedRequest) -> None:
        """Publish persistently and wait for the broker's confirm (see ``GlobalQueue``)."""
        (error,) = await self.publish_many([message])
        if error is not None:
            raise error

    _underlay: tuple[_Publisher, aiormq.Channel] | None = None
    """The publisher the last ``publish_many`` opened or found, with its aiormq channel."""

    async def publish_many(
        self, messages: Sequence[QueuedRequest]
    ) -> list[QueueUnavailable | None]:
        """Publish each message persistently on the one publishing channel and wait for every
        confirm (see ``GlobalQueue``); each message gets its own outcome: None once the broker
        confirmed that message, else the error.

        The batch goes out as one write (``_send``): every message gets its delivery tag on the
        channel, registered as aiormq's ``basic_publish`` registers it (``_Confirms``), but the
        frames of all of them are packed into one buffer (``PublishFrames``) and queued on the
        connection's writer once. ``basic_publish`` per message costs a task, a lock round, a
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
            if self._underlay is None or self._underlay[1] is not channel:
                _settle_at_once(channel)
            self._underlay = (publisher, channel)
            confirmations = await self._send(channel, messages)
        except (QueueUnavailable, *BROKER_ERRORS) as exc:
            error = (
                exc
                if isinstance(exc, QueueUnavailable)
                else self._unavailable("cannot publish on the publishing channel", exc)
            )
            return [error] * len(messages)
        return await self._outcomes(publisher, channel, messages, confirmations)

    def publish_many_then(
        self,
        messages: Sequence[QueuedRequest],
        then: Callable[[list[QueueUnavailable | None]], None],
    ) -> None:
        """``publish_many`` with the batch queued on the connection's writer before this returns
        when the publishing channel is open and free (the usual case: what ``_send`` does,
        without waiting for anything) and ``then`` called once the batch is settled
        (``_Confirms``: by the reader of its last confirm, or when the channel closed or
        ``confirm_timeout_s`` passed); otherwise, and for an empty batch, ``publish_many`` in a
        task, which opens the channel or waits for it. Only the channel of the publisher in use
        takes the fast way (not one retired, still open until its confirms came)."""
        publisher = self._publishing.publisher
        sending = self._underlay
        channel = sending[1] if sending is not None and sending[0] is publisher else None
        if (
            messages
            and publisher is not None
            and channel is not None
            and not publisher.channel.is_closed
            and not _closing(channel)
            and not _held(channel)
        ):
            try:
                frames, confirms = self._register(channel, messages)
            except Exception:  # a message that cannot be encoded: ``publish_many`` reports it
                publish_many_later(self.publish_many, messages, then)
                return
            try:
                channel.write_queue.put_nowait(frames)
            except asyncio.QueueFull:
                self._unregister(channel, confirms)
            else:
                self._deliver(publisher, channel, messages, confirms, then)
                return
        publish_many_later(self.publish_many, messages, then)

    async def _outcomes(
        self,
        publisher: _Publisher,
        channel: aiormq.Channel,
        messages: Sequence[QueuedRequest],
        confirms: _Confirms,
    ) -> list[QueueUnavailable | None]:
        """Each sent message's outcome, once its confirm came, the channel closed or
        ``confirm_timeout_s`` passed."""
        outcome: asyncio.Future[list[QueueUnavailable | None]] = (
            asyncio.get_running_loop().create_future()
        )

        def answer(outcomes: list[QueueUnavailable | None]) -> None:
            if not outcome.done():  # (cancelled: nobody waits)
                outcome.set_result(outcomes)

        self._deliver(publisher, channel, messages, confirms, answer)
        try:
            return await outcome
        except BaseException:  # cancelled: a confirm that comes later is ignored
            confirms.abandon()
            raise

    def _deliver(
        self,
        publisher: _Publisher,
        channel: aiormq.Channel,
        messages: Sequence[QueuedRequest],
        confirms: _Confirms,
        then: Callable[[list[QueueUnavailable | None]], None],
    ) -> None:
        """Hand ``then`` the messages' outcomes once ``confirms`` is settled (now, if it is):
        called from aiormq's reader, the timer or the close callback, so nothing may escape."""

        def settled() -> None:
            try:
                outcomes = self._outcomes_of(publisher, channel, messages, confirms)
            except Exception as exc:  # a bug: every message gets its error all the same
                log.exception("reading the confirms of %d requests failed", len(messages))
                outcomes = [QueueUnavailable(f"publish failed: {exc!r}")] * len(messages)
            try:
                then(outcomes)
            except Exception:  # ``then`` runs inside aiormq's reader: it must go on
                log.exception("answering %d published requests failed", len(messages))

        if confirms.left:
            confirms.on_settled = settled
        else:  # the channel closed while the batch was being sent
            settled()

    def _outcomes_of(
        self,
        publisher: _Publisher,
        channel: aiormq.Channel,
        messages: Sequence[QueuedRequest],
        confirms: _Confirms,
    ) -> list[QueueUnavailable | None]:
        """Each message's outcome from the settled ``confirms``; the channel forgets the
        messages, and is retired when one came back unroutable."""
        _forget(channel, confirms)
        out: list[QueueUnavailable | None] = []
        returned = False
        for message, answer in zip(messages, confirms.answers, strict=True):
            reason: BaseException
            if answer is _ACK:
                out.append(None)
                continue
            if isinstance(answer, BaseException):
                reason = answer
            else:
                reason = RuntimeError(f"the broker answered {answer!r}, not an ack")
            returned = returned or isinstance(reason, PublishError)
            error = self._unavailable(f"request {message.id!r} not confirmed", reason)
            error.__cause__ = reason
            out.append(error)
        if returned:
            self._publishing.retire(publisher)
        return out

    async def _send(self, channel: aiormq.Channel, messages: Sequence[QueuedRequest]) -> _Confirms:
        """Queue ``messages`` on the connection's writer as one buffer, each registered with its
        delivery tag as aiormq's ``basic_publish`` registers it, so that its reader settles them
        (acks, nacks, returns); see ``_Confirms``. Nothing is left registered when this raises:
        the broker has seen none of them."""
        if channel.is_closed:
            raise QueueUnavailable("the publishing channel is closed")
        async with asyncio.timeout(self.confirm_timeout_s), channel.lock:
            frames, confirms = self._register(channel, messages)
            try:
                await channel.write_queue.put(frames)
            except BaseException:
                self._unregister(channel, confirms)
                raise
        return confirms

    def _register(
        self, channel: aiormq.Channel, messages: Sequence[QueuedRequest]
    ) -> tuple[Any, _Confirms]:
        """The frames of ``messages`` as one buffer, each message with the next delivery tag
        registered on ``channel``, and what settles their confirms.

        A returned message is matched to its tag by its AMQP ``message_id`` (aiormq's
        ``message_id_delivery_tag``), so no two messages waiting on the channel may share one:
        a request id already waiting there (a client's retry republishing a request whose first
        publish is still unconfirmed, or the same id twice in a batch) is sent with the
        ``message_id`` ``<id>~<tag>``. Consumers read the request id from the body."""
        frames = PublishFrames(channel.number, channel.max_content_size)
        confirms = _Confirms(channel, len(messages), self.confirm_timeout_s)
        tags, ids = confirms.tags, confirms.ids
        registered = channel.confirmations
        by_id = channel.message_id_delivery_tag
        try:
            for index, message in enumerate(messages):
                shard = (
                    self.queues[shard_of(message.id, self.shards)]
                    if self.shards > 1
                    else self.queue
                )
                channel.delivery_tag += 1
                tag = channel.delivery_tag
                mid = message.id if message.id not in by_id else f"{message.id}~{tag}"
                registered[tag] = _Confirmation(confirms, index)  # type: ignore[assignment]
                by_id[mid] = tag
                tags.append(tag)
                ids.append(mid)
                frames.add(shard, mid, message.encode())
        except BaseException:
            self._unregister(channel, confirms)
            raise
        return frames.channel_frame(), confirms

    @staticmethod
    def _unregister(channel: aiormq.Channel, confirms: _Confirms) -> None:
        """Not sent: the broker has not seen these tags; the next publish reuses them."""
        for tag in confirms.tags:
            channel.confirmations.pop(tag, None)
        _forget(channel, confirms)
        confirms.abandon()
        if confirms.tags:
            channel.delivery_tag = confirms.tags[0] - 1


_PENDING: Any = object()
"""A message of a batch the broker has not answered yet."""
_ACK: Any = object()
"""A message of a batch the broker confirmed."""


class _Confirms:
    """The broker's answers to one batch of publishes, collected without a future per message.

    aiormq's ``basic_publish`` registers an asyncio future per message on the channel. Each one,
    made by the channel's future store, carries three done callbacks (the channel's and the
    connection's bookkeeping, a retrieval), and waiting for a batch adds one more each: every
    callback is a handle the event loop runs when the confirm comes, and the waiter of the batch
    woke up two loop passes after the last confirm was read. Here each message's entry on the
    channel is a ``_Confirmation``, which aiormq's reader settles as it settles a future
    (``done``, ``cancelled``, ``set_result``, ``set_exception``: acks, nacks and returns), and
    the last one settled calls ``on_settled`` at once. ``answers`` holds each message's answer:
    ``_ACK``, the frame of another answer, or an exception.

    What aiormq does for the futures of its store when the channel or its connection closes —
    fail them with the reason — ``_guard`` does here: one future of the channel's store per
    batch, failed with the others, fails every message not answered yet. Past ``timeout_s`` the
    messages not answered get ``TimeoutError``; ``abandon`` gives up on them (nobody waits)."""

    __slots__ = (
        "_guard",
        "_timeout_s",
        "_timer",
        "answers",
        "given_up",
        "ids",
        "left",
        "on_settled",
        "tags",
    )

    def __init__(self, channel: aiormq.Channel, size: int, timeout_s: float) -> None:
        loop = channel.loop
        self.answers: list[Any] = [_PENDING] * size
        self.left = size
        self.given_up: BaseException | None = None
        self.tags: list[int] = []
        self.ids: list[str] = []  # each message's AMQP message_id (``Publishing._register``)
        self.on_settled: Callable[[], Any] | None = None
        self._timeout_s = timeout_s
        self._timer = loop.call_later(timeout_s, self._expire)
        self._guard = channel.create_future()
        self._guard.add_done_callback(self._closed)

    def settle(self, index: int, answer: Any) -> None:
        if self.answers[index] is not _PENDING:
            return
        self.answers[index] = answer
        self.left -= 1
        if self.left == 0:
            self._end()

    def abandon(self) -> None:
        """Nobody waits any more: the answers still missing are ignored when they come."""
        if self.left:
            self._fill(asyncio.CancelledError())

    def _expire(self) -> None:
        self._fill(TimeoutError(f"no confirm within {self._timeout_s:g} s"))

    def _closed(self, guard: asyncio.Future[Any]) -> None:
        if self.left == 0:
            return
        reason = None if guard.cancelled() else guard.exception()
        self._fill(reason or ConnectionError("the publishing channel closed before the confirm"))

    def _fill(self, reason: BaseException) -> None:
        self.given_up = reason
        answers = self.answers
        for index, answer in enumerate(answers):
            if answer is _PENDING:
                answers[index] = reason
        self.left = 0
        self._end()

    def _end(self) -> None:
        self._timer.cancel()
        if not self._guard.done():
            self._guard.set_result(None)  # leaves the channel's store
        on_settled, self.on_settled = self.on_settled, None
        if on_settled is not None:
            on_settled()


class _Confirmation:
    """One message's entry in aiormq's ``channel.confirmations`` (see ``_Confirms``): what
    aiormq's reader calls on the future it would have put there."""

    __slots__ = ("_confirms", "_index")

    def __init__(self, confirms: _Confirms, index: int) -> None:
        self._confirms = confirms
        self._index = index

    def done(self) -> bool:
        return self._confirms.answers[self._index] is not _PENDING

    def cancelled(self) -> bool:
        """Given up on (timed out, abandoned): aiormq then logs a late confirm at DEBUG."""
        confirms = self._confirms
        return confirms.given_up is not None and confirms.answers[self._index] is confirms.given_up

    def set_result(self, frame: Any) -> None:
        self._confirms.settle(
            self._index, _ACK if isinstance(frame, aiormq.spec.Basic.Ack) else frame
        )

    def set_exception(self, exc: BaseException) -> None:
        self._confirms.settle(self._index, exc)


def _settle_at_once(channel: aiormq.Channel) -> None:
    """Have ``channel``'s reader settle every confirm an ack or nack frame names as it reads
    the frame. aiormq settles the tags a ``multiple`` frame names (nearly every frame of a
    quorum queue under load) in a later pass of the event loop, one handle each, so that it
    does not copy the keys it iterates; copying the few tags that are waiting is cheaper than
    a loop pass. What is settled, and how, is aiormq's ``_confirm_delivery``."""
    confirmations = channel.confirmations

    async def on_confirm_frame(frame: Any) -> None:
        tag = frame.delivery_tag
        if tag not in confirmations:
            log.error("unexpected confirm frame %r from the broker", frame)
            return
        if getattr(frame, "multiple", False):
            for settled in [t for t in confirmations if t <= tag]:
                channel._confirm_delivery(settled, frame)
        else:
            channel._confirm_delivery(tag, frame)

    channel._on_confirm_frame = on_confirm_frame  # type: ignore[method-assign]


def _forget(channel: aiormq.Channel, confirms: _Confirms) -> None:
    """The channel no longer maps these messages' ids to their tags (aiormq's ``basic_publish``
    removes them once a confirm is done; a return is matched to its message by that map)."""
    tags = channel.message_id_delivery_tag
    for tag, mid in zip(confirms.tags, confirms.ids, strict=True):
        if tags.get(mid) == tag:
            del tags[mid]


def _closing(channel: aiormq.Channel) -> bool:
    """Whether ``channel`` is closed or closing: the broker closed it and its reader answered
    (``is_closed`` turns true a few loop passes later; a publish sent meanwhile would be a
    connection error for the broker). Unknown (another aiormq): as ``is_closed`` says."""
    if channel.is_closed:
        return True
    event = getattr(channel, "_Channel__close_event", None)
    return isinstance(event, asyncio.Event) and event.is_set()


def _held(channel: aiormq.Channel) -> bool:
    """Whether a coroutine holds ``channel``'s lock (aiormq's ``basic_publish`` and RPCs take it
    and may wait while they hold it: a delivery tag taken, its frame not queued yet). Unknown
    (another aiormq than the one this was written for): held."""
    lock = getattr(channel, "_Channel__lock", None)
    return not isinstance(lock, asyncio.Lock) or lock.locked()
