"""The embedded default global queue: RabbitMQ's semantics, in process (ARCHITECTURE.md §4 rule 6).

It lets ``qlm`` run with no broker and lets tests check the controller's failover logic without
one. A ``MemoryBroker`` plays the server; each ``MemoryGlobalQueue`` is one client of it (an API or
a controller), so two handles on one broker behave like two controllers on one RabbitMQ queue:

* a publish is "confirmed" once the body is stored (it is encoded, as on the wire);
* deliveries stay held until settled; ``requeue`` and the close of the consumer holding them
  return them with ``redelivered=True`` and ``delivery_count + 1``, in publish order;
* past ``delivery_limit`` returns, or when the body does not decode, a message goes to
  ``MemoryBroker.dead`` with its reason;
* single active consumer: only the first registered consumer receives; the next one takes over,
  with every un-acked message, when it closes. ``drop_connection`` plays a consumer's lost
  connection (a network partition): what it held goes to whoever leads then, and it comes back
  behind the others — a standby, told so by ``on_leader(False)``, unless it was alone.

Nothing survives the process, which is why production uses RabbitMQ.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from qlm.global_queue.base import (
    DELIVERY_LIMIT,
    DeadHandler,
    DeadLetter,
    Delivery,
    Handler,
    LeaderHandler,
    QueueUnavailable,
    publish_many_later,
)
from qlm.global_queue.message import MessageError, QueuedRequest

log = logging.getLogger(__name__)


@dataclass(order=True, slots=True)
class _Stored:
    seq: int
    raw: bytes = field(compare=False)
    delivery_count: int = field(default=0, compare=False)
    delivered: bool = field(default=False, compare=False)


@dataclass(slots=True)
class _Consumer:
    epoch: int
    handler: Handler
    inbox: asyncio.Queue[Delivery] = field(default_factory=asyncio.Queue)
    held: dict[int, _Stored] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    on_leader: LeaderHandler | None = None


class MemoryBroker:
    """The shared state: stored messages, consumers in registration order, dead letters.

    ``dead`` keeps the most recent ``dead_limit`` dead letters, so a long run stays bounded.
    """

    def __init__(self, *, delivery_limit: int = DELIVERY_LIMIT, dead_limit: int = 10_000) -> None:
        self.delivery_limit = delivery_limit
        self.dead: deque[DeadLetter] = deque(maxlen=dead_limit)
        self._ready: list[_Stored] = []  # heap by publish order
        self._consumers: list[_Consumer] = []
        self._seq = itertools.count()
        self._tags = itertools.count(1)  # unique across consumers: a stale tag never matches
        self._epochs = itertools.count(1)

    @property
    def ready(self) -> int:
        """Messages waiting for a consumer (not delivered, or returned)."""
        return len(self._ready)

    @property
    def unacked(self) -> int:
        """Messages delivered and not settled yet."""
        return sum(len(consumer.held) for consumer in self._consumers)

    def put_raw(self, body: bytes) -> None:
        """Store a body as is, valid or not (what a foreign producer could put on the queue)."""
        heapq.heappush(self._ready, _Stored(next(self._seq), body))
        self._pump()

    def _register(self, handler: Handler, on_leader: LeaderHandler | None = None) -> _Consumer:
        consumer = _Consumer(next(self._epochs), handler, on_leader=on_leader)
        self._consumers.append(consumer)
        if on_leader is not None:
            on_leader(self._consumers[0] is consumer)
        self._pump()
        return consumer

    def _unregister(self, consumer: _Consumer) -> None:
        led = self._consumers[0] is consumer
        self._consumers.remove(consumer)
        if led and self._consumers and self._consumers[0].on_leader is not None:
            self._consumers[0].on_leader(True)  # the next one takes over
        held, consumer.held = consumer.held, {}
        for tag in sorted(held):
            self._return(held[tag])
        self._pump()

    def _return(self, stored: _Stored) -> None:
        stored.delivery_count += 1
        if stored.delivery_count > self.delivery_limit:
            self.dead.append(DeadLetter(stored.raw, "delivery_limit"))
        else:
            heapq.heappush(self._ready, stored)

    def _pump(self) -> None:
        """Hand every ready message to the active consumer (unlimited prefetch)."""
        if not self._consumers:
            return
        active = self._consumers[0]
        while self._ready:
            stored = heapq.heappop(self._ready)
            try:
                message = QueuedRequest.decode(stored.raw)
            except MessageError as exc:
                log.warning("dead-lettering a malformed message: %s", exc)
                self.dead.append(DeadLetter(stored.raw, f"malformed message: {exc}"))
                continue
            tag = next(self._tags)
            active.held[tag] = stored
            delivery = Delivery(
                message, tag, stored.delivered, stored.delivery_count, stored.raw, "", active.epoch
            )
            stored.delivered = True
            active.inbox.put_nowait(delivery)


class MemoryGlobalQueue:
    """One client of a ``MemoryBroker`` (a fresh one unless ``broker`` is given)."""

    def __init__(
        self, *, broker: MemoryBroker | None = None, delivery_limit: int = DELIVERY_LIMIT
    ) -> None:
        self.broker = broker if broker is not None else MemoryBroker(delivery_limit=delivery_limit)
        self._consumer: _Consumer | None = None
        self._on_leader: LeaderHandler | None = None
        self._closed = False

    async def publish(self, message: QueuedRequest) -> None:
        if self._closed:
            raise QueueUnavailable("the in-process global queue is closed")
        self.broker.put_raw(message.encode())

    def publish_many_then(
        self,
        messages: Sequence[QueuedRequest],
        then: Callable[[list[QueueUnavailable | None]], None],
    ) -> None:
        publish_many_later(self.publish_many, messages, then)  # in memory: nothing to start early

    async def publish_many(
        self, messages: Sequence[QueuedRequest]
    ) -> list[QueueUnavailable | None]:
        results: list[QueueUnavailable | None] = []
        for message in messages:
            try:
                await self.publish(message)
            except QueueUnavailable as exc:
                results.append(exc)
            else:
                results.append(None)
        return results

    async def consume(self, handler: Handler, *, on_leader: LeaderHandler | None = None) -> None:
        if self._closed:
            raise QueueUnavailable("the in-process global queue is closed")
        if self._consumer is not None:
            raise RuntimeError("this queue client is already consuming")
        self._on_leader = on_leader
        self._subscribe(handler)

    def _subscribe(self, handler: Handler) -> None:
        consumer = self.broker._register(handler, self._on_leader)
        consumer.task = asyncio.create_task(self._dispatch(consumer), name="qlm-memory-consumer")
        self._consumer = consumer

    def drop_connection(self) -> None:
        """What a lost connection does to this consumer (failover tests): the broker takes back
        every message it held and hands them to whoever leads, and the client subscribes again
        at once, behind any other consumer — it leads again only if it was alone."""
        consumer = self._consumer
        if consumer is None:
            raise RuntimeError("this queue client is not consuming")
        if consumer.task is not None:
            consumer.task.cancel()
        self.broker._unregister(consumer)
        self._subscribe(consumer.handler)

    async def _dispatch(self, consumer: _Consumer) -> None:
        while True:
            delivery = await consumer.inbox.get()
            if delivery.delivery_tag not in consumer.held:
                continue  # settled before the handler saw it
            try:
                await consumer.handler(delivery)
            except Exception:
                log.exception("global-queue handler failed on %s; requeued", delivery.delivery_tag)
                await self.requeue(delivery)

    def _settle(self, delivery: Delivery, what: str) -> _Stored | None:
        held = self._consumer.held if self._consumer is not None else {}
        stored = held.pop(delivery.delivery_tag, None)
        if stored is None:
            log.info("%s of delivery %s ignored: no longer held", what, delivery.delivery_tag)
        return stored

    async def ack(self, delivery: Delivery) -> None:
        self._settle(delivery, "ack")

    async def requeue(self, delivery: Delivery) -> None:
        stored = self._settle(delivery, "requeue")
        if stored is not None:
            self.broker._return(stored)
            self.broker._pump()

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        stored = self._settle(delivery, "dead-letter")
        if stored is not None:
            self.broker.dead.append(DeadLetter(stored.raw, reason))

    async def reap_dead(self, record: DeadHandler, limit: int = 1000) -> int:
        letters = list(itertools.islice(self.broker.dead, limit))
        if letters:
            await record(letters)
            for letter in letters:
                with contextlib.suppress(ValueError):  # another reaper took it meanwhile
                    self.broker.dead.remove(letter)
        return len(letters)

    async def backlog(self) -> int:
        return self.broker.ready + len(self.broker.dead)

    def hold_intake(self, after_s: float = 0.0) -> None:
        """Nothing to hold: deliveries are handed over on the caller's loop."""

    def release_intake(self) -> None:
        """Nothing was held."""

    async def reach(self) -> None:
        """Nothing to reach: the queue is in this process."""

    async def healthy(self) -> bool:
        return not self._closed

    async def close(self) -> None:
        self._closed = True
        consumer, self._consumer = self._consumer, None
        if consumer is None:
            return
        self.broker._unregister(consumer)
        if consumer.task is not None and consumer.task is not asyncio.current_task():
            consumer.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer.task
