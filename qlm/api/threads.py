"""The API's blocking store calls, each in a worker thread, counted so that the store is closed
only once none runs.

``asyncio.to_thread`` cannot stop a thread: cancelling the task that awaits it (a poller stopped
at shutdown, a request handler uvicorn gave up on) leaves the thread running, and a store closed
under it crashed the process (SQLite's C code freed under a reader). So every call the API makes
in a thread goes through ``StoreThreads.run``; at shutdown ``join`` refuses new calls (a
``StoreError``: the caller answers 503 as for any store outage) and waits for the running ones
to return, and only then is the store closed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from qlm.store import StoreError

P = ParamSpec("P")
T = TypeVar("T")


class StoreThreads:
    """Runs blocking calls in worker threads until ``join`` (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._closed = False
        self._idle: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def closed(self) -> bool:
        """``join`` began: no new call starts."""
        return self._closed

    @property
    def running(self) -> int:
        """Calls in a thread now."""
        with self._lock:
            return self._running

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` in a worker thread; ``StoreError`` once joined. A caller
        cancelled meanwhile stops waiting; the call itself runs to its end, counted."""
        if self._closed:
            raise StoreError("the API is shutting down")
        return await asyncio.to_thread(self._counted, fn, *args, **kwargs)

    def _counted(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        with self._lock:
            # Checked again in the thread: a call queued before ``join`` may start after it.
            if self._closed:
                raise StoreError("the API is shutting down")
            self._running += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                self._running -= 1
                wake = self._running == 0 and self._idle is not None
            if wake:
                assert self._loop is not None and self._idle is not None
                self._loop.call_soon_threadsafe(self._idle.set)

    async def join(self) -> None:
        """Refuse new calls, and return once no call runs in a thread."""
        idle = asyncio.Event()
        with self._lock:
            self._closed = True
            if self._running == 0:
                return
            self._loop = asyncio.get_running_loop()
            self._idle = idle
        await idle.wait()
