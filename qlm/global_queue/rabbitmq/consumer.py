"""Consuming the global queue: the consumer's thread, its connection and reconnects, the hand-over
of deliveries and lead changes to the caller's loop, and the settlements (ack, requeue, dead letter)
sent back.

**The consumer's thread.** The consumer runs on an event loop of its own, in a daemon thread:
its connection, the leader lock, the held deliveries and every ack, requeue and dead letter live
there. The handler and the leader callback still run on the caller's loop, in order: a change
of lead is a mark in the stream of deliveries (``_Lead``), and only deliveries of the epoch last
announced as leading reach the handler, so a reconnect during a long step cannot slip a new
connection's deliveries in before the owner hears it stood by. Deliveries are handed over in
batches (one wake-up per batch); ``ack``/``requeue``/``dead_letter``, called there, are sent in
rounds (one hand-off each way per round, not per delivery); ``backlog`` and ``reap_dead`` open
their connections on the consumer's loop too. A consumer whose caller's loop closed without
``close`` stops itself (``_watch_caller``). Why: a
controller's loop is busy for 0.2-2 s at a time while it plans a large backlog, and aiormq moves
each frame between its reader, channel and writer tasks through queues of 10, one hand-off per
loop turn. On the controller's loop, deliveries trickled in, the broker's writes to the socket
blocked and it reset the connection (``{inet_error,enotconn}``), redelivering everything: taking
over 100,000 requests took 101-189 s; with the thread, 63-67 s and no reset
(``benchmarks/controller_backlog.py``, 2 shards).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar, cast

import aio_pika
from aio_pika.abc import AbstractConnection
from aiormq.abc import DeliveredMessage

from qlm.eventloop import new_event_loop
from qlm.global_queue.base import REASON_HEADER, Delivery, Handler, LeaderHandler, QueueUnavailable
from qlm.global_queue.message import MessageError, QueuedRequest
from qlm.global_queue.rabbitmq.base import (
    BROKER_ERRORS,
    RabbitBase,
    _Backoff,
    _close_quietly,
    _Lead,
    _PublisherLink,
    _Settlement,
    log,
)
from qlm.global_queue.rabbitmq.leader import SHARD_CHECK_S

T = TypeVar("T")

SETTLE_GRACE_S = 0.5
"""Closing waits until the last ack or requeue is this old (see ``_shut``)."""
CALLER_CHECK_S = 1.0
"""How often the consumer's thread checks that the loop it hands deliveries to is still open."""
CONSUMER_STOP_S = 10.0
"""How long ``close`` waits for the consumer's thread to settle, close and stop."""
INTAKE_HOLD_MAX_S = 2.0
"""The longest the consumer's thread stays still for one ``hold_intake`` (a control step that
runs longer shares the interpreter again after this; the broker's heartbeats allow far more)."""


class Consuming(RabbitBase):
    """The consuming side of ``RabbitGlobalQueue``: ``consume`` on the caller's loop, the
    rest on the consumer's own loop in its thread."""

    if TYPE_CHECKING:  # the leader lock's (``leader.LeaderLock``)

        async def _lead(
            self, connection: AbstractConnection, lost: asyncio.Event, tried: Callable[[], None]
        ) -> None: ...
        async def _check_shard_count(self, connection: AbstractConnection) -> None: ...

    async def consume(self, handler: Handler, *, on_leader: LeaderHandler | None = None) -> None:
        if self._handler is not None:
            raise RuntimeError(f"{self!r} is already consuming")
        if self._closing:
            raise QueueUnavailable(f"{self!r} is closed")
        self._handler = handler
        self._on_leader = on_leader
        self._caller = asyncio.get_running_loop()
        self._wake, self._lead_seen = asyncio.Event(), asyncio.Event()  # of this loop
        self._stopping = False
        self._loop = loop = new_event_loop()
        self._thread = threading.Thread(
            target=_run_forever, args=(loop,), name=f"qlm-consumer {self.queue}", daemon=True
        )
        self._thread.start()
        self._dispatch_task = asyncio.create_task(
            self._dispatch(handler), name=f"qlm-dispatch {self.queue}"
        )
        try:
            sent = await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(self._subscribe(), loop)
            )
            # Return once the owner was told whether it leads (in order with the deliveries).
            while self._leads_seen < sent:
                self._lead_seen.clear()
                await self._lead_seen.wait()
        except BaseException:
            # Leave the queue as it was, so that the caller may try again.
            self._dispatch_task.cancel()
            await self._stop_consumer()
            self._handler = self._dispatch_task = None
            raise

    async def _subscribe(self) -> int:
        """On the consumer's loop: start consuming; return once the lock was first tried, with
        how many ``_Lead`` marks were sent by then."""
        subscribed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._consumer_task = asyncio.create_task(
            self._consume_forever(subscribed), name=f"qlm-consumer {self.queue}"
        )
        watchdog = asyncio.create_task(self._watch_caller(), name=f"qlm-watchdog {self.queue}")
        self._side.add(watchdog)
        await subscribed
        return self._leads_sent

    async def _watch_caller(self) -> None:
        """On the consumer's loop: a caller's loop closed without ``close`` (its program ended
        or moved on) leaves nobody to hand deliveries to; the consumer must not hold them, nor
        the leader lock, for ever. It stops itself."""
        caller = self._caller
        try:
            while caller is not None and not caller.is_closed():
                await asyncio.sleep(CALLER_CHECK_S)
        finally:
            # Cancelled (by ``_shut``) or done: either way no longer a side task; one left
            # behind would belong to a loop that is gone when the queue consumes again.
            self._side.discard(cast("asyncio.Task[Any]", asyncio.current_task()))
        log.warning("the event loop consuming %s closed without closing it; stopping", self.queue)
        await self._shut()
        asyncio.get_running_loop().stop()

    def hold_intake(self, after_s: float = 0.0) -> None:
        """If the caller still computes ``after_s`` later, the consumer's thread stands
        still (blocked, not holding the GIL) until ``release_intake``, ``INTAKE_HOLD_MAX_S`` at
        most. Why: while it takes a large backlog in, it is busy in Python for seconds on end,
        and a thread that gives the GIL up often (the controller's, in every numpy and
        scikit-learn call of a step) waits for it again up to the interpreter's switch interval
        (5 ms) each time, behind the busy one: a step with 0.16 s of CPU took 3.15 s during a
        RabbitMQ take-over. Steps within their usual length should not stop the intake: stopping it
        50 ms into every step starved it (a take-over of 100,000 requests took 226 s, not 23 s).
        Deliveries that come meanwhile wait in the socket's buffers; the step could not handle
        them before it ends anyway."""
        loop = self._loop
        if loop is None or self._stopping or not self._intake_open.is_set():
            return
        self._intake_open.clear()
        self._holds += 1
        with contextlib.suppress(RuntimeError):  # the consumer's loop closed meanwhile
            loop.call_soon_threadsafe(self._stand_still_later, self._holds, after_s)

    def release_intake(self) -> None:
        self._intake_open.set()

    def _stand_still_later(self, hold: int, after_s: float) -> None:
        asyncio.get_running_loop().call_later(after_s, self._stand_still, hold)

    def _stand_still(self, hold: int) -> None:
        """On the consumer's loop: block its thread while this hold lasts."""
        if hold == self._holds:
            self.standing_still = True
            try:
                self._intake_open.wait(INTAKE_HOLD_MAX_S)
            finally:
                self.standing_still = False

    async def _stop_consumer(self) -> None:
        """Close the consumer's connection and stop its thread (what it held goes back to the
        broker); settlements already asked for are sent first."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._stopping = True
        self._intake_open.set()
        try:
            await asyncio.wait_for(
                asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._shut(), loop)),
                CONSUMER_STOP_S,
            )
        except (TimeoutError, RuntimeError):
            log.warning("the consumer of %s did not stop in time; abandoning it", self.queue)
        with contextlib.suppress(RuntimeError):  # closed already
            loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join, CONSUMER_STOP_S)
        self._loop = self._thread = None
        self._fail_settlements()

    async def _shut(self) -> None:
        """On the consumer's loop: the last settlement rounds, then the connections (reaping
        and counting in flight are cancelled: their callers get ``QueueUnavailable``)."""
        while True:
            self._run_settlements()
            if not self._rounds:
                break
            await asyncio.gather(*self._rounds, return_exceptions=True)
        for side in list(self._side):
            if side is not asyncio.current_task():
                side.cancel()
        if self._side:
            await asyncio.gather(*self._side, return_exceptions=True)
            self._side.clear()
        task, self._consumer_task = self._consumer_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.leader = False
        self._new_epoch()
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            # The broker may not have applied the last acks yet: a quorum queue's channel has
            # a few dozen settlements in flight and drops the rest if the connection closes
            # (measured: 15 of 48 acks sent just before a close came back, redelivered, in 5 of
            # 5 runs; none with a pause of 0.2 s).
            await asyncio.sleep(self._last_settled + SETTLE_GRACE_S - time.monotonic())
            await _close_quietly(consumer)
        if self._dead_letters is not None:
            await self._dead_letters.close()
            self._dead_letters = None

    async def _connect_consumer(self, lost: asyncio.Event) -> AbstractConnection:
        """Connect and declare the topology; ``lost`` is set when the connection goes."""
        connection: AbstractConnection | None = None
        try:
            connection = await self._connect("consumer")
            channel = await connection.channel(publisher_confirms=False)
            await self._declare(channel)
            await channel.close()
            connection.close_callbacks.add(lambda *_: lost.set())
        except BROKER_ERRORS as exc:
            if connection is not None:
                await _close_quietly(connection)
            raise self._unavailable(f"cannot consume {self.queue!r}", exc) from exc
        return connection

    def _tell_leader(self, leading: bool) -> None:
        """Tell the consumer's owner whether it leads (in the current epoch): a mark in the
        deliveries' stream, so that the dispatcher tells it in order with them."""
        self._leads_sent += 1
        self._hand_over(_Lead(leading, self._epoch))

    def _hand_over(self, item: Delivery | _Lead) -> None:
        self._arrived.append(item)
        if not self._waking:  # one wake-up for all that arrives before the dispatcher runs
            self._waking = True
            self._to_caller(self._woken)

    def _to_caller(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the caller's loop, after what was handed to it before."""
        if self._caller is not None:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody to tell
                self._caller.call_soon_threadsafe(callback)

    def _new_epoch(self) -> None:
        """Forget every held delivery: its channel is gone and the broker requeued it."""
        self._epoch += 1
        self._held = {}

    async def _consume_forever(self, subscribed: asyncio.Future[None]) -> None:
        """Connect, lead or stand by, and start over whenever the connection goes. ``consume``
        returns once the first attempt at the lock has said which; if the lock cannot even be
        tried (e.g. no permission on it), ``consume`` raises. Every failure waits out a bounded
        exponential back-off, reset only once leading."""
        backoff = _Backoff(self.reconnect_min_s, self.reconnect_max_s)
        while not self._closing:
            lost = asyncio.Event()

            def tried() -> None:
                if not subscribed.done():
                    subscribed.set_result(None)

            try:
                connection = await self._connect_consumer(lost)
            except Exception as exc:
                if not isinstance(exc, QueueUnavailable):
                    log.exception("subscribing to %s failed unexpectedly", self.queue)
                if not subscribed.done():
                    subscribed.set_exception(exc)
                    return
                delay = backoff.next()
                log.warning("%s; retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                continue
            self._consumer = connection
            failed = False
            began = time.monotonic()
            try:
                await self._lead(connection, lost, tried)
            except Exception as exc:
                failed = True
                if isinstance(exc, BROKER_ERRORS):
                    log.warning("consuming %s failed (%s)", self.queue, exc)
                else:
                    log.exception("consuming %s failed unexpectedly", self.queue)
                if not subscribed.done():
                    self._consumer = None
                    await _close_quietly(connection)
                    subscribed.set_exception(
                        self._unavailable(f"cannot consume {self.queue!r}", exc)
                    )
                    return
                lost.set()
            led = self.leader
            if led:
                backoff.reset()
            while self.leader and not lost.is_set():
                try:
                    await self._check_shard_count(connection)
                except Exception:  # a check must never stop the consumer
                    log.exception("checking the shard count of %s failed", self.queue)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(lost.wait(), SHARD_CHECK_S)
            await lost.wait()
            self._consumer = None
            self.leader = False
            self._new_epoch()
            if led:  # what it holds is the broker's again: it stands by until it leads anew
                self._tell_leader(False)
            log.warning(
                "consumer of %s lost its channel; the broker requeues what it held; reconnecting",
                self.queue,
            )
            await _close_quietly(connection)
            if not led and time.monotonic() - began > 2 * self.reconnect_max_s:
                backoff.reset()  # a standby that waited a while: not a failing broker
            if failed or not led:  # a connection that never led and dropped at once backs off
                delay = backoff.next()
                log.warning("retrying %s in %.1f s", self.queue, delay)
                await asyncio.sleep(delay)

    async def _on_message(self, epoch: int, incoming: DeliveredMessage) -> None:
        """aiormq calls this for each delivery, in order, with the frames as it read them (no
        aio-pika message object: building one cost as much as decoding the body); decode,
        hold, hand to the dispatcher."""
        tag = incoming.delivery_tag
        if epoch != self._epoch or tag is None:
            return  # from a channel already given up: the broker redelivers it
        self._held[tag] = incoming
        headers = incoming.header.properties.headers
        count = headers.get("x-delivery-count", 0) if headers else 0
        body = incoming.body
        try:
            message: QueuedRequest | None = QueuedRequest.decode(body)
            error = ""
        except MessageError as exc:
            message, error = None, f"malformed message: {exc}"
        delivery = Delivery(
            message,
            tag,
            bool(incoming.redelivered),
            count if isinstance(count, int) else 0,
            body,
            error,
            epoch,
        )
        if message is None:
            log.warning("dead-lettering delivery %d of %s: %s", tag, self.queue, error)
            await self._dead_letter(delivery, error)
            return
        self._hand_over(delivery)

    def _woken(self) -> None:
        self._waking = False  # first: what arrives from now on schedules another wake-up
        self._wake.set()

    async def _dispatch(self, handler: Handler) -> None:
        """On the caller's loop: call the handler one delivery at a time, in order, and the
        leader callback where the stream says the lead changed (when it did: a standby that
        reconnects and finds the lock taken is not told twice); a failure requeues the
        delivery. Only deliveries of the epoch last announced as leading are handed over: one
        of a later connection comes after its own mark. (``_held`` read from here is a hint:
        settling a delivery no longer held is a logged no-op on the consumer's loop.)"""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._arrived:
                delivery = self._arrived.popleft()
                if isinstance(delivery, _Lead):
                    self._announce(delivery)
                    continue
                if delivery.epoch != self._announced or delivery.delivery_tag not in self._held:
                    continue
                try:
                    await handler(delivery)
                except Exception:
                    log.exception(
                        "global-queue handler failed on delivery %d; requeued",
                        delivery.delivery_tag,
                    )
                    await self.requeue(delivery)

    def _announce(self, mark: _Lead) -> None:
        self._announced = mark.epoch if mark.leading else None
        self._leads_seen += 1
        self._lead_seen.set()
        callback = self._on_leader
        if callback is None or self._told == mark.leading:
            return
        self._told = mark.leading
        try:
            callback(mark.leading)
        except Exception:
            log.exception("the leader callback of %s failed", self.queue)

    def _take(self, delivery: Delivery, what: str) -> DeliveredMessage | None:
        """The held message for ``delivery``, now settled; ``None`` (logged) if not held."""
        incoming = (
            self._held.pop(delivery.delivery_tag, None) if delivery.epoch == self._epoch else None
        )
        if incoming is None:
            log.info(
                "%s of delivery %d (epoch %d) ignored: not held (settled, or requeued by the "
                "broker when its channel closed)",
                what,
                delivery.delivery_tag,
                delivery.epoch,
            )
        return incoming

    async def ack(self, delivery: Delivery) -> None:
        await self._settle(functools.partial(self._ack, delivery))

    async def requeue(self, delivery: Delivery) -> None:
        await self._settle(functools.partial(self._requeue, delivery))

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Publish a copy to the dead-letter exchange with ``reason`` (confirmed), then ack.

        If that publish fails, reject instead: the broker dead-letters the message itself, with
        ``x-death`` reason ``rejected`` and QLM's reason only in the log."""
        await self._settle(functools.partial(self._dead_letter, delivery, reason))

    async def _settle(self, settle: Callable[[], Awaitable[None]]) -> None:
        """Run ``settle`` on the consumer's loop (where the deliveries are held) and wait for it.
        What is asked for while a round is pending joins it: one hand-off between the threads
        each way per round, not per delivery (a controller settles thousands at a time)."""
        loop = self._loop
        if loop is None:  # not consuming: nothing is held (a logged no-op)
            await settle()
            return
        caller = asyncio.get_running_loop()
        if caller is not self._caller:  # its answer would be set from the wrong thread
            raise RuntimeError(f"{self!r}: settle deliveries on the event loop that consumes")
        if self._stopping:  # its channel is closing: the broker takes the delivery back
            log.info("a settlement asked for while the consumer of %s stops: dropped", self.queue)
            return
        done = caller.create_future()
        self._settlements.append((settle, done))
        if not self._settling:
            self._settling = True
            try:
                loop.call_soon_threadsafe(self._run_settlements)
            except RuntimeError:  # the consumer's loop is gone (closing): nothing is held
                self._fail_settlements()
        await done

    def _run_settlements(self) -> None:
        """On the consumer's loop: start a round with every settlement asked for so far."""
        self._settling = False  # first: what is asked for from now on schedules another round
        batch: list[_Settlement] = []
        while self._settlements:
            batch.append(self._settlements.popleft())
        if not batch:
            return
        task = asyncio.create_task(self._settle_round(batch), name="qlm-settle")
        self._rounds.add(task)
        task.add_done_callback(self._rounds.discard)

    async def _settle_round(self, batch: list[_Settlement]) -> None:
        """Every waiter is answered, even if the round is cancelled (the consumer stopping:
        its channel closes and the broker takes the deliveries back)."""
        results: list[BaseException | None] = [None] * len(batch)
        try:
            results = await asyncio.gather(
                *(settle() for settle, _ in batch), return_exceptions=True
            )
        finally:

            def answer() -> None:
                for (_, done), result in zip(batch, results, strict=True):
                    if done.done():
                        continue
                    if isinstance(result, Exception):
                        done.set_exception(result)
                    else:
                        done.set_result(None)

            self._to_caller(answer)

    def _fail_settlements(self) -> None:
        """Answer settlements that no consumer loop will run (it stopped): the channel that held
        their deliveries is closed, so the broker has them back."""
        while self._settlements:
            _, done = self._settlements.popleft()
            if not done.done():
                done.set_result(None)
        self._settling = False

    async def _ack(self, delivery: Delivery) -> None:
        incoming = self._take(delivery, "ack")
        if incoming is not None:
            self._last_settled = time.monotonic()
            await _settle_quietly(
                incoming.channel.basic_ack(delivery.delivery_tag), "ack", delivery
            )

    async def _requeue(self, delivery: Delivery) -> None:
        incoming = self._take(delivery, "requeue")
        if incoming is not None:
            self._last_settled = time.monotonic()
            requeue = incoming.channel.basic_nack(delivery.delivery_tag, requeue=True)
            await _settle_quietly(requeue, "requeue", delivery)

    async def _dead_letter(self, delivery: Delivery, reason: str) -> None:
        incoming = self._take(delivery, "dead-letter")
        if incoming is None:
            return
        self._last_settled = time.monotonic()
        properties = incoming.header.properties
        headers = dict(properties.headers or {})
        headers[REASON_HEADER] = reason
        if self._dead_letters is None:
            self._dead_letters = _PublisherLink(self, "dead-letterer")
        try:
            publisher = await self._dead_letters.open()
            await publisher.dead.publish(
                aio_pika.Message(
                    delivery.raw,
                    headers=headers,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    content_type=properties.content_type,
                    message_id=properties.message_id,
                ),
                self.queue,
                mandatory=True,
                timeout=self.confirm_timeout_s,
            )
        except (QueueUnavailable, *BROKER_ERRORS) as exc:
            log.warning(
                "dead-lettering delivery %d with its reason failed (%s); rejecting it: %s",
                delivery.delivery_tag,
                exc,
                reason,
            )
            reject = incoming.channel.basic_reject(delivery.delivery_tag, requeue=False)
            await _settle_quietly(reject, "reject", delivery)
            return
        await _settle_quietly(incoming.channel.basic_ack(delivery.delivery_tag), "ack", delivery)

    async def _on_consumer_loop(
        self, work: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop
    ) -> T:
        """Run ``work`` on the consumer's loop and wait for it (cancelled with the caller). If
        the consumer stops meanwhile, it is cancelled there: ``QueueUnavailable`` here."""
        if self._stopping:
            work.close()
            raise QueueUnavailable(f"{self!r} is closing")

        async def tracked() -> T:
            task = cast("asyncio.Task[Any]", asyncio.current_task())
            self._side.add(task)
            try:
                return await work
            finally:
                self._side.discard(task)

        try:
            future = asyncio.run_coroutine_threadsafe(tracked(), loop)
        except RuntimeError:  # the loop stopped meanwhile (closing)
            raise QueueUnavailable(f"{self!r} is closed") from None
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if future.cancelled() and not (task is not None and task.cancelling()):
                raise QueueUnavailable(f"{self!r} closed meanwhile") from None
            raise


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    """The consumer thread: its loop until ``close`` stops it."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        with contextlib.suppress(Exception):  # what the AMQP stack left running
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _settle_quietly(settle: Awaitable[None], what: str, delivery: Delivery) -> None:
    """Send an ack/nack; if the channel died meanwhile, the broker requeued the message anyway."""
    try:
        await settle
    except BROKER_ERRORS as exc:
        log.info(
            "%s of delivery %d lost with its channel (%s); it will be redelivered",
            what,
            delivery.delivery_tag,
            exc,
        )
