"""What every part of the RabbitMQ global queue shares: its settings and state
(``RabbitBase``), the topology's names and arguments, the connections it opens, and the
publishing link that the publisher and the consumer's dead-letterer each hold.

Every connection declares the topology, with the arguments of ``broker/definitions.json``, so a
bare broker works and a queue declared with different arguments fails loudly (the broker's
PRECONDITION_FAILED names the argument).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractQueue,
)
from aiormq.abc import DeliveredMessage
from aiormq.exceptions import AMQPError
from yarl import URL

from qlm.errors import check_setting
from qlm.global_queue.base import (
    DEAD_LETTER_EXCHANGE,
    DEAD_LETTER_QUEUE,
    DELIVERY_LIMIT,
    QUEUE,
    Delivery,
    Handler,
    LeaderHandler,
    QueueUnavailable,
)

log = logging.getLogger("qlm.global_queue.rabbitmq")
"""One logger for every part of the RabbitMQ queue (its name is what logging is configured by)."""

BROKER_ERRORS = (AMQPError, OSError, asyncio.TimeoutError, RuntimeError)
"""What the AMQP stack raises when the broker is gone or refuses (aiormq's closed-channel error is
a ``RuntimeError``); translated to ``QueueUnavailable`` at this boundary."""

DEAD_QUEUE_ARGUMENTS: dict[str, Any] = {"x-queue-type": "quorum"}

MAX_PREFETCH = 65535
"""AMQP's largest prefetch count (a 16-bit field)."""


def shard_names(queue: str, shards: int) -> list[str]:
    """The queues of a global queue split into ``shards``: the first keeps the plain name, so one
    shard is exactly the unsharded topology of ``broker/definitions.json``."""
    return [queue] + [f"{queue}.{i}" for i in range(1, shards)]


def connection_name(role: str, queue: str) -> str:
    """What a connection calls itself to the broker (``rabbitmqctl list_connections
    client_properties``, the management UI): its role (``publisher``, ``consumer``,
    ``dead-letters``, ``backlog``, ``check``: start-up's, closed at once), the global queue and this process's id, so an operator (or a
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

    def __init__(self, owner: RabbitBase, role: str) -> None:
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
        still pending on it have come (or ``confirm_timeout_s`` passed, or it closed): closing
        it at once would fail other callers' messages that the broker did take."""
        if self.publisher is not publisher:
            return
        self.publisher = None
        timeout_s = self.owner.confirm_timeout_s

        async def close_when_settled() -> None:
            deadline = time.monotonic() + timeout_s
            with contextlib.suppress(*BROKER_ERRORS):
                channel = cast(aiormq.Channel, await publisher.channel.get_underlay_channel())
                while (
                    channel.confirmations and not channel.is_closed and time.monotonic() < deadline
                ):
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


class RabbitBase:
    """The settings and the state of a ``RabbitGlobalQueue`` (see there for the settings), and
    what every part calls: connecting and declaring the topology. The parts (``publisher``,
    ``consumer``, ``leader``, ``dead_letters``) derive from it; ``queue`` assembles them."""

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
        given = URL(url)
        self._shown_url = str(given.with_password("***") if given.password else given)
        """The URL as ``QLM_BROKER_URL`` gave it, password hidden (start-up's errors)."""
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
        # Consumer side: its own event loop in a thread (``consumer``); the dispatcher and
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
        self._intake_open = threading.Event()  # cleared while the caller holds the intake
        self._intake_open.set()
        self._holds = 0  # ``hold_intake`` calls, so that a late stand-still knows its own
        self.standing_still = False
        """Whether the consumer's thread stands still now (``hold_intake``)."""
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
        self._held: dict[int, DeliveredMessage] = {}
        self.leader = False
        """Whether this consumer holds the leader lock (receives); a standby waits for it."""

    def __repr__(self) -> str:
        return f"RabbitGlobalQueue({self._safe_url!r}, queue={self.queue!r})"

    @property
    def held(self) -> int:
        """Deliveries received and not yet settled (the consumer's thread holds them)."""
        return len(self._held)

    async def _connect(self, role: str) -> AbstractConnection:
        """A connection named for ``role``. One that fails to open is closed before the error
        goes on: aio-pika's ``connect`` drops it unclosed, and its finaliser then makes a
        ``close()`` coroutine that nothing awaits (Python warns "never awaited")."""
        connection = aio_pika.Connection(
            self._url, client_properties={"connection_name": connection_name(role, self.queue)}
        )
        try:
            await connection.connect(timeout=self.connect_timeout_s)
        except BaseException:
            await connection.close()
            raise
        return connection

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


async def _close_quietly(connection: AbstractConnection) -> None:
    """Close a connection that may already be dead; there is nothing to do if that fails."""
    try:
        await asyncio.wait_for(connection.close(), 5.0)
    except BROKER_ERRORS as exc:
        log.debug("closing a broker connection: %s", exc)
