"""The production global queue on RabbitMQ: ``RabbitGlobalQueue`` (``queue``), assembled from a
publisher, a consumer with its thread, the leader lock and dead-letter reaping, a module each.
"""

from __future__ import annotations

from qlm.global_queue.rabbitmq.base import (
    BROKER_ERRORS,
    DEAD_QUEUE_ARGUMENTS,
    MAX_PREFETCH,
    connection_name,
    queue_arguments,
    shard_names,
    shard_of,
)
from qlm.global_queue.rabbitmq.consumer import CALLER_CHECK_S, CONSUMER_STOP_S, SETTLE_GRACE_S
from qlm.global_queue.rabbitmq.dead_letters import dead_letter_reason
from qlm.global_queue.rabbitmq.leader import LEADER_QUEUE_ARGUMENTS, SHARD_CHECK_S, STANDBY_LOG_S
from qlm.global_queue.rabbitmq.queue import RabbitGlobalQueue

__all__ = [
    "BROKER_ERRORS",
    "CALLER_CHECK_S",
    "CONSUMER_STOP_S",
    "DEAD_QUEUE_ARGUMENTS",
    "LEADER_QUEUE_ARGUMENTS",
    "MAX_PREFETCH",
    "SETTLE_GRACE_S",
    "SHARD_CHECK_S",
    "STANDBY_LOG_S",
    "RabbitGlobalQueue",
    "connection_name",
    "dead_letter_reason",
    "queue_arguments",
    "shard_names",
    "shard_of",
]
