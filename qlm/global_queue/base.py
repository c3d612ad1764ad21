"""The global-queue seam: the ``GlobalQueue`` protocol the API publishes to and the controller
consumes from, and the ``Delivery`` it hands over.

The broker holds the one replica of every accepted request (ARCHITECTURE.md §4 rule 5):

* ``publish`` returns only once the broker has the message (publisher confirm, persistent), so the
  API answers 202 only for requests that cannot be lost;
* the controller holds each delivery un-acked while its request waits in a virtual queue and acks
  it only once the outcome is durable. If the controller dies, the broker redelivers everything it
  held (``redelivered=True``) to the standby controller, which waited until then (RabbitMQ: a
  leader lock on the broker; in process: single active consumer);
* every redelivery counts: past the delivery limit the broker dead-letters the message, so a
  request that crashes every controller cannot loop forever. A body that does not decode is
  dead-lettered with its reason at once and never reaches the handler.

Delivery is at least once. A publish that timed out or lost its connection mid-flight may still
have been stored, and a controller may die after recording an outcome but before its ack: the
request id is the key that makes both harmless.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from qlm.errors import QLMError
from qlm.global_queue.message import QueuedRequest

log = logging.getLogger(__name__)

QUEUE = "qlm.requests"
DEAD_LETTER_EXCHANGE = "qlm.dlx"
DEAD_LETTER_QUEUE = "qlm.dead"
DELIVERY_LIMIT = 5
"""Redeliveries a message gets before the broker dead-letters it. Every return counts: a requeue,
and, on RabbitMQ 3.10, the death of the consumer that held it (a controller failover)."""

REASON_HEADER = "x-qlm-reason"
"""Header naming why QLM dead-lettered a message (the broker's own reasons are in ``x-death``)."""


class QueueUnavailable(QLMError):
    """The global queue did not take the message (broker down, refused, no confirm in time) or
    cannot be reached; the API answers 503 and the client may retry with the same request id."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """One delivery of a queued request to the active consumer.

    ``delivery_count`` is how many earlier deliveries of this message were returned (0 the first
    time; RabbitMQ's ``x-delivery-count``). ``epoch`` numbers the consumer's connection: after a
    reconnect the broker has already requeued older deliveries, so settling one is a no-op.
    The handler only ever sees deliveries whose body decoded (``message`` set, ``error`` empty);
    the queue dead-letters the others itself, with ``error`` as the reason.
    """

    message: QueuedRequest | None
    delivery_tag: int
    redelivered: bool
    delivery_count: int
    raw: bytes
    error: str = ""
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message the queue gave up on, with why (``delivery_limit``, ``rejected``, or QLM's
    reason)."""

    raw: bytes
    reason: str


Handler = Callable[[Delivery], Awaitable[None]]
LeaderHandler = Callable[[bool], None]
DeadHandler = Callable[[list[DeadLetter]], Awaitable[None]]
"""Called once per delivery, one at a time, in delivery order. It should return quickly (put the
request into a virtual queue) and settle the delivery later. If it raises, the error is logged and
the delivery is requeued, so a handler that always fails ends in the dead-letter queue."""


class GlobalQueue(Protocol):
    """The durable queue in front of the controller (RabbitMQ, or in-process by default).

    Settling a delivery the queue no longer holds (already settled, or from before a reconnect,
    when the broker has requeued it) is a logged no-op, never an error: the broker redelivers it.
    So after a reconnect a consumer may be handed a request it still holds or runs (now
    ``redelivered=True``): key requests by ``message.id`` and settle the newest delivery.
    """

    async def publish(self, message: QueuedRequest) -> None:
        """Store ``message`` durably; return once stored, else raise ``QueueUnavailable``.

        Safe to call from many tasks at once: confirms are pipelined."""
        ...

    async def publish_many(
        self, messages: Sequence[QueuedRequest]
    ) -> list[QueueUnavailable | None]:
        """``publish`` for a batch (the API's group commit), cheaper per message: one result per
        message, in order — ``None`` once the broker confirmed it, else why it was not taken.
        Never raises for a message's failure: each caller answers its own client."""
        ...

    def publish_many_then(
        self,
        messages: Sequence[QueuedRequest],
        then: Callable[[list[QueueUnavailable | None]], None],
    ) -> None:
        """``publish_many`` started now, its result handed to ``then`` (once, on the caller's
        event loop) instead of being awaited. Where the queue can, the messages are on their
        way before this returns and ``then`` is called straight from the broker's confirms, with
        no task and no pass of the event loop in between (the API's group commit: the batch
        leaves in the same pass as the commit it overlaps, and its callers are answered in the
        pass that reads the last confirm). Never raises; ``then`` must not raise."""
        ...

    async def consume(self, handler: Handler, *, on_leader: LeaderHandler | None = None) -> None:
        """Become a consumer: return once subscribed (raise ``QueueUnavailable`` if the queue
        cannot be reached at all), then call ``handler`` for each delivery in the background,
        reconnecting by itself. Only one consumer in the cluster receives (the leader); the others
        wait, and one takes over with every un-acked message when it goes.

        ``on_leader`` is called (in the event loop) with True when this consumer starts leading,
        and with False when it finds the lead taken: at the start, or after its connection
        dropped — by another consumer, which was then handed every message this one held, or
        (RabbitMQ) by its own old connection, until the broker notices that it is gone."""
        ...

    async def ack(self, delivery: Delivery) -> None:
        """The request's outcome is durable: remove the message for good."""
        ...

    async def requeue(self, delivery: Delivery) -> None:
        """Give the message back for redelivery (counts towards the delivery limit)."""
        ...

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """The message can never be processed (e.g. unknown model): park it in the dead-letter
        queue with ``reason`` and remove it from the queue."""
        ...

    async def reap_dead(self, record: DeadHandler, limit: int = 1000) -> int:
        """Hand up to ``limit`` messages of the dead-letter queue, with their reasons, to
        ``record`` (the controller records each as a failed request: the store is the audit
        trail); they leave the dead-letter queue only once ``record`` returned, and stay if it
        raises. Returns how many were handed."""
        ...

    async def backlog(self) -> int:
        """Messages the broker holds that no consumer has been handed: ready in the queue (every
        shard) or in the dead-letter queue, not yet reaped. 0 means every request the queue
        holds is with the leader (the controller's orphan sweep relies on it); raises
        ``QueueUnavailable`` when the broker cannot be asked."""
        ...

    async def reach(self) -> None:
        """Connect to the broker now, declare the topology and let go; raise
        ``QueueUnavailable`` naming why and what to check when that fails (a broker that is down,
        a wrong host, user, password or vhost). A process calls it at start-up, before it writes
        anything, so that a wrong ``QLM_BROKER_URL`` stops it with one line; once running, the
        queue reconnects by itself. A no-op where there is no broker."""
        ...

    async def healthy(self) -> bool:
        """Whether the queue can take messages now (``/readyz``); never raises."""
        ...

    def hold_intake(self, after_s: float = 0.0) -> None:
        """The caller is about to compute on its thread (a control step): if it still does
        ``after_s`` later, the queue may stop taking deliveries in until ``release_intake`` (a
        bounded time at most), so that its own work does not compete with the caller's. Never
        blocks; a no-op where the queue does no work of its own."""
        ...

    def release_intake(self) -> None:
        """End ``hold_intake``: deliveries are taken in again. Never blocks."""
        ...

    async def close(self) -> None:
        """Stop consuming and disconnect. Un-acked deliveries go back to the queue."""
        ...


def publish_many_later(
    publish_many: Callable[[Sequence[QueuedRequest]], Awaitable[list[QueueUnavailable | None]]],
    messages: Sequence[QueuedRequest],
    then: Callable[[list[QueueUnavailable | None]], None],
) -> None:
    """``publish_many_then`` by a task that awaits a queue's ``publish_many`` (where nothing
    quicker is possible); a task that fails or is cancelled gives every message its error."""

    def ended(task: asyncio.Future[list[QueueUnavailable | None]]) -> None:
        _running.discard(task)
        outcomes: list[QueueUnavailable | None]
        if task.cancelled():
            outcomes = [QueueUnavailable("the publish was cancelled")] * len(messages)
        elif (exc := task.exception()) is not None:
            log.error("publishing %d requests failed", len(messages), exc_info=exc)
            outcomes = [QueueUnavailable(f"publish failed: {exc!r}")] * len(messages)
        else:
            outcomes = task.result()
        try:
            then(outcomes)
        except Exception:  # a bug in ``then``: logged, as the fast way logs it
            log.exception("answering %d published requests failed", len(messages))

    task = asyncio.ensure_future(publish_many(messages))
    _running.add(task)
    task.add_done_callback(ended)


_running: set[asyncio.Future[list[QueueUnavailable | None]]] = set()
"""``publish_many_later``'s tasks, held until they end (the loop keeps only weak references)."""
