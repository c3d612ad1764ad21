"""The production global queue: a RabbitMQ quorum queue (broker/README.md explains the topology).

Publishing uses aio-pika's connection on the caller's event loop, not pika. The API publishes from
many concurrent HTTP requests and must answer each only after the broker's confirm; the confirms are
pipelined on one channel (each publish awaits its own delivery tag), and ``publish_many`` sends a
batch through aiormq's ``basic_publish`` directly, without aio-pika's per-message objects. Through this class that
measured 6,100-7,700 confirmed publishes/s, p99 8-9 ms (2026-11-25), at concurrency 32 on the 2-core
development machine (``benchmarks/global_queue.py``), against 650-900/s for pika's
``BlockingConnection`` behind a lock; one pika connection per thread would multiply threads and
connections per API process for the same effect, and a pika ``SelectConnection`` in an I/O thread
would need a hand-written confirm tracker and a thread hand-off that aio-pika makes unnecessary.

Connections are plain (not aio-pika's "robust" ones) so that reconnection is ours to define:
bounded exponential back-off (``reconnect_min_s`` doubling to ``reconnect_max_s``) for both sides.
The publisher reconnects lazily: while it waits out a back-off step, publishes fail fast with
``QueueUnavailable`` instead of piling up. The consumer reconnects in the background and
re-subscribes; the broker has already requeued what the lost channel held, so deliveries of an
older ``epoch`` are dropped and settling them is a logged no-op, and the handler sees those
messages again with ``redelivered=True``. Publisher and consumer use separate connections, as
RabbitMQ advises (flow control on a publishing connection must not stall deliveries).

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

Every connection declares the topology, with the arguments of ``broker/definitions.json``, so a
bare broker works and a queue declared with different arguments fails loudly (the broker's
PRECONDITION_FAILED names the argument).

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
import collections
import contextlib
import functools
import logging
import os
import threading
import time
import zlib
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
)
from aiormq.exceptions import (
    AMQPError,
    ChannelLockedResource,
    ChannelNotFoundEntity,
    PublishError,
)
from yarl import URL

from qlm.errors import check_setting
from qlm.global_queue.base import (
    DEAD_LETTER_EXCHANGE,
    DEAD_LETTER_QUEUE,
    DELIVERY_LIMIT,
    QUEUE,
    REASON_HEADER,
    DeadHandler,
    DeadLetter,
    Delivery,
    Handler,
    LeaderHandler,
    QueueUnavailable,
)
from qlm.global_queue.message import MessageError, QueuedRequest

log = logging.getLogger(__name__)

T = TypeVar("T")

BROKER_ERRORS = (AMQPError, OSError, asyncio.TimeoutError, RuntimeError)
"""What the AMQP stack raises when the broker is gone or refuses (aiormq's closed-channel error is
a ``RuntimeError``); translated to ``QueueUnavailable`` at this boundary."""

DEAD_QUEUE_ARGUMENTS: dict[str, Any] = {"x-queue-type": "quorum"}

SETTLE_GRACE_S = 0.5
"""Closing waits until the last ack or requeue is this old (see ``_shut``)."""
CALLER_CHECK_S = 1.0
"""How often the consumer's thread checks that the loop it hands deliveries to is still open."""
CONSUMER_STOP_S = 10.0
"""How long ``close`` waits for the consumer's thread to settle, close and stop."""

MAX_PREFETCH = 65535
"""AMQP's largest prefetch count (a 16-bit field)."""

LEADER_QUEUE_ARGUMENTS: dict[str, Any] = {"x-queue-type": "classic"}
SHARD_CHECK_S = 60.0
"""How often the leader looks for a shard beyond its count (a mismatched ``shards`` setting)."""
STANDBY_LOG_S = 300.0
"""A standby says it is still waiting this often (each of its attempts is also a channel error
in the broker's log: one every ``leader_retry_s``)."""
"""The leader lock is an exclusive queue, which only a classic queue can be."""


def shard_names(queue: str, shards: int) -> list[str]:
    """The queues of a global queue split into ``shards``: the first keeps the plain name, so one
    shard is exactly the unsharded topology of ``broker/definitions.json``."""
    return [queue] + [f"{queue}.{i}" for i in range(1, shards)]


async def _ignore(_message: AbstractIncomingMessage) -> None:
    """Nothing is published to the leader lock; consuming it only watches for its deletion."""


def connection_name(role: str, queue: str) -> str:
    """What a connection calls itself to the broker (``rabbitmqctl list_connections
    client_properties``, the management UI): its role (``publisher``, ``consumer``,
    ``dead-letters``, ``backlog``), the global queue and this process's id, so an operator (or a
    test) can tell which process holds it and close exactly that one."""
    return f"qlm-{role} {queue} (pid {os.getpid()})"


def shard_of(request_id: str, shards: int) -> int:
    """The shard a request's messages go to: stable across processes and restarts."""
    return zlib.crc32(request_id.encode()) % shards


def queue_arguments(dead_letter_exchange: str, delivery_limit: int) -> dict[str, Any]:
    """Arguments of the global queue; ``broker/definitions.json`` must match them exactly.

    Quorum: replicated and durable. Single active consumer: one controller receives, standbys
    wait. Delivery limit and dead-letter exchange: a message returned too often is parked, never
    looping. At-least-once dead-lettering keeps it in the queue until the dead-letter queue has
    confirmed it (RabbitMQ requires ``reject-publish`` overflow for that; no length limit is set,
    so it never rejects).
    """
    return {
        "x-queue-type": "quorum",
        "x-single-active-consumer": True,
        "x-delivery-limit": delivery_limit,
        "x-dead-letter-exchange": dead_letter_exchange,
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }


def dead_letter_reason(headers: Mapping[str, Any]) -> str:
    """Why a message in the dead-letter queue is there: QLM's reason, else the broker's."""
    reason = headers.get(REASON_HEADER) or headers.get("x-first-death-reason") or "unknown"
    return reason.decode() if isinstance(reason, bytes) else str(reason)


@dataclass(slots=True)
class _Backoff:
    """Exponential back-off: ``first_s``, doubling, capped at ``max_s``."""

    first_s: float
    max_s: float
    current_s: float = 0.0

    def next(self) -> float:
        self.current_s = min(self.max_s, self.current_s * 2 if self.current_s else self.first_s)
        return self.current_s

    def reset(self) -> None:
        self.current_s = 0.0


@dataclass(frozen=True, slots=True)
class _Lead:
    """A mark in the stream of deliveries: from here on, the consumer leads in ``epoch`` (or
    stands by)."""

    leading: bool
    epoch: int


_Settlement = tuple[Callable[[], Awaitable[None]], "asyncio.Future[None]"]
"""An ack, requeue or dead-letter asked for on the caller's loop, and its answer there."""


@dataclass(slots=True)
class _Publisher:
    connection: AbstractConnection
    channel: AbstractChannel
    exchange: AbstractExchange  # the default exchange: routing key = queue name
    dead: AbstractExchange


class _PublisherLink:
    """A publishing connection of ``owner``, opened lazily on the event loop that uses it (one
    per loop: the API's publishes, the consumer thread's dead letters), reopened after a bounded
    exponential back-off. While it waits out a step, ``open`` fails fast with
    ``QueueUnavailable`` instead of letting publishes pile up."""

    def __init__(self, owner: RabbitGlobalQueue, role: str) -> None:
        self.owner = owner
        self.role = role
        self.publisher: _Publisher | None = None
        self._lock = asyncio.Lock()
        self._backoff = _Backoff(owner.reconnect_min_s, owner.reconnect_max_s)
        self._retry_at = 0.0
        self._error = ""
        self._retiring: set[asyncio.Task[None]] = set()

    async def open(self) -> _Publisher:
        """The open publishing channel, (re)connecting when the back-off allows it."""
        publisher = self.publisher
        if publisher is not None and not publisher.channel.is_closed:
            return publisher
        owner = self.owner
        async with self._lock:
            publisher = self.publisher
            if publisher is not None and not publisher.channel.is_closed:
                return publisher
            if owner._closing:
                raise QueueUnavailable(f"{owner!r} is closed")
            self.publisher = None
            if publisher is not None:
                await _close_quietly(publisher.connection)
            wait_s = self._retry_at - time.monotonic()
            if wait_s > 0:
                raise QueueUnavailable(
                    f"RabbitMQ at {owner._safe_url} unavailable ({self._error}); "
                    f"next connection attempt in {wait_s:.1f} s"
                )
            connection: AbstractConnection | None = None
            try:
                connection = await owner._connect(self.role)
                channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
                _, dead = await owner._declare(channel)
            except BROKER_ERRORS as exc:
                if connection is not None:
                    await _close_quietly(connection)
                self._retry_at = time.monotonic() + self._backoff.next()
                self._error = str(exc) or type(exc).__name__
                raise owner._unavailable("cannot open a publishing channel", exc) from exc
            self._backoff.reset()
            self._retry_at = 0.0
            self.publisher = _Publisher(connection, channel, channel.default_exchange, dead)
            log.info("%s: publishing to %s on %s", self.role, owner.queue, owner._safe_url)
            return self.publisher

    def retire(self, publisher: _Publisher) -> None:
        """A message came back unroutable (its queue was deleted): the next publish opens a new
        channel, which declares the queues again. The old one is closed only once the confirms
        still pending on it have come (or ``confirm_timeout_s`` passed): closing it at once
        would fail other callers' messages that the broker did take."""
        if self.publisher is not publisher:
            return
        self.publisher = None
        timeout_s = self.owner.confirm_timeout_s

        async def close_when_settled() -> None:
            deadline = time.monotonic() + timeout_s
            with contextlib.suppress(*BROKER_ERRORS):
                channel = cast(aiormq.Channel, await publisher.channel.get_underlay_channel())
                while channel.confirmations and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            await _close_quietly(publisher.connection)

        task = asyncio.create_task(close_when_settled(), name="qlm-retire-publisher")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def close(self) -> None:
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            await _close_quietly(publisher.connection)
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)


class RabbitGlobalQueue:
    """The ``GlobalQueue`` on a RabbitMQ broker at ``url`` (``amqp://user:pass@host:port/vhost``).

    ``prefetch`` bounds the deliveries held un-acked per shard, and so the requests a controller
    can hold in its virtual queues (``shards × prefetch``). The default is AMQP's maximum, 65,535:
    0 ("unlimited") would be worse, as a RabbitMQ 3.x quorum queue turns it into 2,000. Every
    process using the queue (API replicas, controllers) must agree on ``shards``; raising it later
    is safe (consumers read every shard), lowering it strands the messages of the removed shards
    until they are moved. ``heartbeat_s`` is how soon the broker notices a controller whose host
    died, and so how soon the standby takes over (within ``leader_retry_s`` more).
    """

    def __init__(
        self,
        url: str,
        *,
        queue: str = QUEUE,
        dead_letter_exchange: str = DEAD_LETTER_EXCHANGE,
        dead_letter_queue: str = DEAD_LETTER_QUEUE,
        delivery_limit: int = DELIVERY_LIMIT,
        prefetch: int = MAX_PREFETCH,
        shards: int = 1,
        leader_retry_s: float = 2.0,
        confirm_timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        heartbeat_s: int = 10,
        reconnect_min_s: float = 0.1,
        reconnect_max_s: float = 5.0,
    ) -> None:
        check_setting(
            0 <= prefetch <= MAX_PREFETCH, "prefetch", f"in [0, {MAX_PREFETCH}]", prefetch
        )
        check_setting(1 <= shards <= 64, "shards", "in [1, 64]", shards)
        check_setting(leader_retry_s > 0, "leader_retry_s", "> 0", leader_retry_s)
        check_setting(delivery_limit >= 1, "delivery_limit", ">= 1", delivery_limit)
        check_setting(confirm_timeout_s > 0, "confirm_timeout_s", "> 0", confirm_timeout_s)
        check_setting(connect_timeout_s > 0, "connect_timeout_s", "> 0", connect_timeout_s)
        check_setting(heartbeat_s >= 0, "heartbeat_s", ">= 0", heartbeat_s)
        check_setting(
            0 < reconnect_min_s <= reconnect_max_s,
            "reconnect_min_s",
            f"in (0, reconnect_max_s={reconnect_max_s}]",
            reconnect_min_s,
        )
        parsed = URL(url)
        if "heartbeat" not in parsed.query:
            parsed = parsed.update_query(heartbeat=heartbeat_s)
        self._url = parsed
        self._safe_url = str(parsed.with_password("***") if parsed.password else parsed)
        self.queue = queue
        self.shards = shards
        self.queues = shard_names(queue, shards)
        self.leader_queue = f"{queue}.leader"
        self.leader_retry_s = leader_retry_s
        self.dead_letter_exchange = dead_letter_exchange
        self.dead_letter_queue = dead_letter_queue
        self.delivery_limit = delivery_limit
        self.prefetch = prefetch
        self.confirm_timeout_s = confirm_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.reconnect_min_s = reconnect_min_s
        self.reconnect_max_s = reconnect_max_s
        self._closing = False
        # Publisher side (the caller's event loop).
        self._publishing = _PublisherLink(self, "publisher")
        # Consumer side: its own event loop in a thread (module docstring); the dispatcher and
        # the handler run on the caller's loop.
        self._handler: Handler | None = None
        self._on_leader: LeaderHandler | None = None
        self._caller: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dispatch_task: asyncio.Task[None] | None = None
        self._arrived: collections.deque[Delivery | _Lead] = collections.deque()
        self._waking = False  # a wake-up of the dispatcher is scheduled (consumer thread)
        self._wake = asyncio.Event()
        self._settlements: collections.deque[_Settlement] = collections.deque()
        self._settling = False  # a settlement round is scheduled (caller's loop)
        self._stopping = False  # the consumer is being stopped: nothing more goes to its loop
        self._close_task: asyncio.Future[None] | None = None
        # Touched only on the caller's loop, by the dispatcher:
        self._told: bool | None = None  # what ``_on_leader`` was last told
        self._announced: int | None = None  # the epoch it was last told it leads in
        self._leads_seen = 0  # ``_Lead`` marks dispatched ...
        self._lead_seen = asyncio.Event()
        # Touched only on the consumer's loop:
        self._leads_sent = 0  # ... and sent
        self._side: set[asyncio.Task[Any]] = set()  # reaping, counting (``_on_consumer_loop``)
        self._last_settled = 0.0  # monotonic time of the last ack or requeue sent
        self._consumer: AbstractConnection | None = None
        self._consumer_task: asyncio.Task[None] | None = None
        self._dead_letters: _PublisherLink | None = None
        self._rounds: set[asyncio.Task[None]] = set()
        self._epoch = 0
        self._held: dict[int, AbstractIncomingMessage] = {}
        self.leader = False
        """Whether this consumer holds the leader lock (receives); a standby waits for it."""

    def __repr__(self) -> str:
        return f"RabbitGlobalQueue({self._safe_url!r}, queue={self.queue!r})"

    @property
    def held(self) -> int:
        """Deliveries received and not yet settled (the consumer's thread holds them)."""
        return len(self._held)

    # --- connections and topology ----------------------------------------------------------

    async def _connect(self, role: str) -> AbstractConnection:
        return await aio_pika.connect(
            self._url,
            timeout=self.connect_timeout_s,
            client_properties={"connection_name": connection_name(role, self.queue)},
        )

    async def _declare(
        self, channel: AbstractChannel
    ) -> tuple[list[AbstractQueue], AbstractExchange]:
        """Declare the shards, the dead-letter exchange and queue (idempotent)."""
        dead_exchange = await channel.declare_exchange(
            self.dead_letter_exchange, aio_pika.ExchangeType.FANOUT, durable=True
        )
        dead = await channel.declare_queue(
            self.dead_letter_queue, durable=True, arguments=DEAD_QUEUE_ARGUMENTS
        )
        await dead.bind(dead_exchange)
        arguments = queue_arguments(self.dead_letter_exchange, self.delivery_limit)
        queues = [
            await channel.declare_queue(name, durable=True, arguments=arguments)
            for name in self.queues
        ]
        return queues, dead_exchange

    def _unavailable(self, what: str, exc: BaseException) -> QueueUnavailable:
        detail = str(exc) or type(exc).__name__
        return QueueUnavailable(f"RabbitMQ at {self._safe_url}: {what}: {detail}")

    # --- publishing ---------------------------------------------------------------------------

    async def publish(self, message: QueuedRequest) -> None:
        """Publish persistently and wait for the broker's confirm (see ``GlobalQueue``)."""
        (error,) = await self.publish_many([message])
        if error is not None:
            raise error

    async def publish_many(
        self, messages: Sequence[QueuedRequest]
    ) -> list[QueueUnavailable | None]:
        """Publish each message persistently on the one publishing channel, confirms pipelined,
        and wait for every confirm (see ``GlobalQueue``).

        Straight through aiormq's ``basic_publish`` with ``wait=False``: no aio-pika ``Message``
        per request and no wait for the socket to drain after each frame (the confirm is what
        counts). ``mandatory``: a message no queue takes (the queue was deleted) comes back as
        an error instead of being confirmed and dropped; the channel is then closed, so the next
        publish opens a new one, which declares the queue again."""
        if not messages:
            return []
        try:
            publisher = await self._publishing.open()
            channel = cast(aiormq.Channel, await publisher.channel.get_underlay_channel())
        except (QueueUnavailable, *BROKER_ERRORS) as exc:
            error = (
                exc
                if isinstance(exc, QueueUnavailable)
                else self._unavailable("cannot open a publishing channel", exc)
            )
            return [error] * len(messages)
        results = await asyncio.gather(
            *(self._publish_one(channel, m) for m in messages), return_exceptions=True
        )
        out: list[QueueUnavailable | None] = []
        returned = False
        for message, result in zip(messages, results, strict=True):
            if result is None:
                out.append(None)
                continue
            if isinstance(result, asyncio.CancelledError):
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise result  # this call was cancelled, not one message's publish
            elif not isinstance(result, Exception):
                raise result
            returned = returned or isinstance(result, PublishError)
            error = self._unavailable(f"request {message.id!r} not confirmed", result)
            error.__cause__ = result
            out.append(error)
        if returned:
            self._publishing.retire(publisher)
        return out

    async def _publish_one(self, channel: aiormq.Channel, message: QueuedRequest) -> None:
        shard = self.queues[shard_of(message.id, self.shards)] if self.shards > 1 else self.queue
        confirmation = await channel.basic_publish(
            message.encode(),
            exchange="",
            routing_key=shard,
            properties=aiormq.spec.Basic.Properties(
                delivery_mode=2,  # persistent
                content_type="application/json",
                message_id=message.id,
            ),
            mandatory=True,
            timeout=self.confirm_timeout_s,
            wait=False,
        )
        if not isinstance(confirmation, aiormq.spec.Basic.Ack):  # aiormq raises for the others
            raise RuntimeError(f"the broker answered {confirmation!r}, not an ack")

    # --- consuming ----------------------------------------------------------------------------

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
        self._loop = loop = asyncio.new_event_loop()
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

    async def _stop_consumer(self) -> None:
        """Close the consumer's connection and stop its thread (what it held goes back to the
        broker); settlements already asked for are sent first."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._stopping = True
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
        on_message = functools.partial(self._on_message, self._epoch)
        for queue in queues:
            await queue.consume(on_message, no_ack=False)
        tried()
        log.info("leading: consuming %s on %s", ", ".join(self.queues), self._safe_url)

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

    async def _on_message(self, epoch: int, incoming: AbstractIncomingMessage) -> None:
        """aiormq calls this for each delivery, in order; decode, hold, hand to the dispatcher."""
        tag = incoming.delivery_tag
        if epoch != self._epoch or tag is None:
            return  # from a channel already given up: the broker redelivers it
        self._held[tag] = incoming
        count = incoming.headers.get("x-delivery-count", 0)
        try:
            message: QueuedRequest | None = QueuedRequest.decode(incoming.body)
            error = ""
        except MessageError as exc:
            message, error = None, f"malformed message: {exc}"
        delivery = Delivery(
            message,
            tag,
            bool(incoming.redelivered),
            count if isinstance(count, int) else 0,
            incoming.body,
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

    def _take(self, delivery: Delivery, what: str) -> AbstractIncomingMessage | None:
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
            await _settle_quietly(incoming.ack(), "ack", delivery)

    async def _requeue(self, delivery: Delivery) -> None:
        incoming = self._take(delivery, "requeue")
        if incoming is not None:
            self._last_settled = time.monotonic()
            await _settle_quietly(incoming.nack(requeue=True), "requeue", delivery)

    async def _dead_letter(self, delivery: Delivery, reason: str) -> None:
        incoming = self._take(delivery, "dead-letter")
        if incoming is None:
            return
        self._last_settled = time.monotonic()
        headers = dict(incoming.headers)
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
                    content_type=incoming.content_type,
                    message_id=incoming.message_id,
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
            await _settle_quietly(incoming.reject(requeue=False), "reject", delivery)
            return
        await _settle_quietly(incoming.ack(), "ack", delivery)

    async def reap_dead(self, record: DeadHandler, limit: int = 1000) -> int:
        """``basic.get`` from the dead-letter queue on a short-lived connection, holding the
        messages un-acked while ``record`` runs: acked once it returned, returned to the
        dead-letter queue if it raised (or if this process dies meanwhile). While consuming,
        the connection is the consumer thread's (``record`` still runs on the caller's loop):
        a controller's loop busy planning a backlog made its handshakes time out."""
        caller, loop = asyncio.get_running_loop(), self._loop
        if loop is None:
            return await self._reap_dead(record, limit)

        async def record_there(letters: list[DeadLetter]) -> None:
            await record(letters)

        async def record_on_caller(letters: list[DeadLetter]) -> None:
            done = asyncio.run_coroutine_threadsafe(record_there(letters), caller)
            await asyncio.wrap_future(done)

        return await self._on_consumer_loop(self._reap_dead(record_on_caller, limit), loop)

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

    async def _reap_dead(self, record: DeadHandler, limit: int) -> int:
        try:
            connection = await self._connect("dead-letters")
        except BROKER_ERRORS as exc:
            raise self._unavailable("cannot read the dead-letter queue", exc) from exc
        try:
            held: list[AbstractIncomingMessage] = []
            try:
                channel = await connection.channel(publisher_confirms=False)
                await self._declare(channel)
                dead = await channel.get_queue(self.dead_letter_queue, ensure=False)
                while len(held) < limit:
                    incoming = await dead.get(no_ack=False, fail=False)
                    if incoming is None:
                        break
                    held.append(incoming)
            except BROKER_ERRORS as exc:
                raise self._unavailable("cannot read the dead-letter queue", exc) from exc
            if not held:
                return 0
            try:
                await record([DeadLetter(m.body, _dead_reason(m.headers)) for m in held])
            except BaseException:
                for m in held:  # a lost channel returns them anyway
                    with contextlib.suppress(*BROKER_ERRORS):
                        await m.nack(requeue=True)
                raise
            try:
                for m in held:
                    await m.ack()
            except BROKER_ERRORS as exc:  # unacked ones come back: recorded again, idempotently
                raise self._unavailable("cannot ack dead letters", exc) from exc
            return len(held)
        finally:
            await _close_quietly(connection)

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


async def _close_quietly(connection: AbstractConnection) -> None:
    """Close a connection that may already be dead; there is nothing to do if that fails."""
    try:
        await asyncio.wait_for(connection.close(), 5.0)
    except BROKER_ERRORS as exc:
        log.debug("closing a broker connection: %s", exc)


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


def _dead_reason(headers: Mapping[str, Any]) -> str:
    """QLM's own reason if it dead-lettered the message, else the broker's (``x-death``)."""
    reason = headers.get(REASON_HEADER)
    if isinstance(reason, (str, bytes)):
        return reason.decode() if isinstance(reason, bytes) else reason
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
        why = deaths[0].get("reason")
        if isinstance(why, (str, bytes)):
            return why.decode() if isinstance(why, bytes) else why
    return "dead-lettered"
