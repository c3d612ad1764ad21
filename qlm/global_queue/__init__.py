"""The durable global queue between the API and the controller (ARCHITECTURE.md §2, §4 rule 5).

``open_global_queue(url)`` picks the implementation from ``QLM_BROKER_URL``: none (or
``memory://``) is the in-process default, ``amqp://`` / ``amqps://`` is RabbitMQ. The RabbitMQ
client is imported only when asked for, so the embedded default runs without touching aio-pika.
"""

from __future__ import annotations

from typing import Any

from qlm.errors import ConfigError
from qlm.global_queue.base import (
    DEAD_LETTER_EXCHANGE,
    DEAD_LETTER_QUEUE,
    DELIVERY_LIMIT,
    QUEUE,
    REASON_HEADER,
    DeadLetter,
    Delivery,
    GlobalQueue,
    Handler,
    LeaderHandler,
    QueueUnavailable,
)
from qlm.global_queue.memory import MemoryBroker, MemoryGlobalQueue
from qlm.global_queue.message import SCHEMA_VERSION, MessageError, QueuedRequest

__all__ = [
    "DEAD_LETTER_EXCHANGE",
    "DEAD_LETTER_QUEUE",
    "DELIVERY_LIMIT",
    "QUEUE",
    "REASON_HEADER",
    "SCHEMA_VERSION",
    "DeadLetter",
    "Delivery",
    "GlobalQueue",
    "Handler",
    "LeaderHandler",
    "MemoryBroker",
    "MemoryGlobalQueue",
    "MessageError",
    "QueueUnavailable",
    "QueuedRequest",
    "open_global_queue",
]


def open_global_queue(url: str | None, **options: Any) -> GlobalQueue:
    """The global queue at ``url`` (the value of ``QLM_BROKER_URL``), not yet connected.

    ``options`` go to ``RabbitGlobalQueue``; the in-process queue takes only ``delivery_limit``
    and ignores the rest (queue names, prefetch, timeouts mean nothing in process)."""
    if url is None or url.strip() in ("", "memory://"):
        limit = options.get("delivery_limit", DELIVERY_LIMIT)
        return MemoryGlobalQueue(delivery_limit=limit)
    if url.startswith(("amqp://", "amqps://")):
        from qlm.global_queue.rabbitmq import RabbitGlobalQueue

        try:
            return RabbitGlobalQueue(url, **options)
        except TypeError as exc:  # an option RabbitGlobalQueue does not have
            raise ConfigError(f"global queue options: {exc}") from None
    got = f"scheme {url.split('://', 1)[0]!r}" if "://" in url else "no scheme"
    raise ConfigError(
        f"QLM_BROKER_URL must be empty, memory:// or amqp://user:password@host:port/vhost; "
        f"got {got}"
    )
