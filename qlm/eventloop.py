"""The event loop QLM's services run on: uvloop when installed (a dependency of QLM except on
Windows), else asyncio's own.

Both the API and the controller are bound by Python work on their loops — per request, the
controller's consumer thread reads three AMQP frames and the engines' streams one SSE event per
token — and uvloop's transports, callbacks and tasks cost less of it than asyncio's selector
loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when installed, else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end on a new loop (``new_event_loop``) and return its result."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
