"""Virtual queues (paper §4): one per instance, an ordered sequence of request-group references.

See ``docs/groups.md``. Pure: no I/O, no clock.
"""

from __future__ import annotations

from qlm.virtual_queues.virtual_queue import (
    UNASSIGNED,
    GroupPrediction,
    GroupSnapshot,
    QueueSnapshot,
    VirtualQueueSet,
    VirtualQueuesSnapshot,
)

__all__ = [
    "UNASSIGNED",
    "GroupPrediction",
    "GroupSnapshot",
    "QueueSnapshot",
    "VirtualQueueSet",
    "VirtualQueuesSnapshot",
]
