"""Server-sent events: the framing, and a keep-alive comment while nothing happens (so that
proxies do not close a stream that waits behind the queue)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

T = TypeVar("T")

KEEPALIVE = b": keep-alive\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: Any, name: str | None = None) -> bytes:
    """One event: ``data`` as compact JSON (a string as is), named when ``name`` is given."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {payload}\n\n".encode()


async def with_keepalive(
    events: AsyncIterator[T], interval_s: float = 15.0
) -> AsyncIterator[T | None]:
    """``events``, with a ``None`` whenever ``interval_s`` passed without one (send a keep-alive
    then). Closes ``events`` when the consumer stops early."""
    iterator = events.__aiter__()
    pending: asyncio.Future[T] = asyncio.ensure_future(iterator.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(iterator.__anext__())
    finally:
        if not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
