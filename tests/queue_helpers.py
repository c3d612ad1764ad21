"""What tests of the global queue share: a message with overrides, a handler that keeps what it
is given, and a bounded wait on a condition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from qlm.global_queue import Delivery, QueuedRequest


def make_message(i: int = 0, **overrides: Any) -> QueuedRequest:
    fields: dict[str, Any] = {
        "id": f"r{i}",
        "model": "m",
        "prompt": "hello",
        "prompt_tokens": 10,
        "max_tokens": 20,
        "slo_e2e_s": 30.0,
        "submitted_at": 1_700_000_000.0 + i,
    }
    fields.update(overrides)
    return QueuedRequest(**fields)


class Inbox:
    """A handler that keeps what it is given, and a bounded wait for it."""

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []

    async def __call__(self, delivery: Delivery) -> None:
        self.deliveries.append(delivery)

    async def wait_for(self, count: int, timeout_s: float = 10.0) -> list[Delivery]:
        await poll(lambda: len(self.deliveries) >= count, timeout_s, f"{count} deliveries")
        return list(self.deliveries)

    def ids(self) -> list[str]:
        return [d.message.id for d in self.deliveries if d.message is not None]


async def poll(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait until ``done()``, failing after ``timeout_s`` with what was awaited."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)
