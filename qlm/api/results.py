"""Waiting for a request's result: from the controller's result hub when it runs in this process
(``qlm serve``), else by polling the store.

* **Hub.** Subscribe first, then read the store (the request may have ended before the
  subscription), then wait for the hub's final event, which comes only after the outcome is
  committed; stream the text chunks as they arrive. The store poller below watches these
  requests too: another controller may serve them (this process's stands by, or lost the lead),
  and then only the store says when they end.
* **Store.** One poller task asks the store every ``QLM_API__POLL_INTERVAL_S`` which of *all*
  the awaited requests are final (``Store.final_ids``: one query however many clients wait), and
  wakes their waiters. A stream then gets the whole text at once, when it is final.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from qlm.api.ports import ResultHubLike
from qlm.api.threads import StoreThreads
from qlm.store import RequestRow, Store

log = logging.getLogger(__name__)

FIRST = asyncio.FIRST_COMPLETED


@dataclass(frozen=True, slots=True)
class Chunk:
    """New output text of a running request."""

    text: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Restart:
    """The request's output starts over: the text of earlier chunks is not part of its answer
    (a structured answer evicted or lost with its instance; ``qlm.service.hub.ResultEvent``)."""


@dataclass(frozen=True, slots=True)
class Final:
    """The request's stored row: final, or (on timeout) as it stands."""

    row: RequestRow
    timed_out: bool = False


Event = Chunk | Restart | Final


class Results:
    def __init__(
        self,
        store: Store,
        *,
        hub: ResultHubLike | None = None,
        poll_interval_s: float = 0.25,
        threads: StoreThreads | None = None,
    ) -> None:
        self._store = store
        self._threads = threads if threads is not None else StoreThreads()
        self._hub = hub
        self._poll_interval_s = poll_interval_s
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._poller: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    @property
    def streams_tokens(self) -> bool:
        """Whether text arrives as it is generated (a controller in process)."""
        return self._hub is not None

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    async def get(self, request_id: str) -> RequestRow | None:
        return await self._threads.run(self._store.get, request_id)

    async def wait(self, row: RequestRow, timeout_s: float) -> Final:
        """The request's row once final, or as it stands after ``timeout_s``."""
        final: Final | None = None
        async for event in self.events(row, timeout_s):
            if isinstance(event, Final):
                final = event
        assert final is not None
        return final

    async def events(self, row: RequestRow, timeout_s: float) -> AsyncIterator[Event]:
        """Text chunks and restarts (hub only), then one ``Final``. ``row`` is the caller's fresh read (it
        checked the tenant): nothing is awaited when it is final already."""
        if row.is_final:
            yield Final(row)
            return
        deadline = time.monotonic() + timeout_s
        if self._hub is not None:
            async for event in self._hub_events(self._hub, row, deadline):
                yield event
            return
        fresh = await self._poll_until_final(row.id, deadline)
        yield Final(fresh or row, timed_out=fresh is None or not fresh.is_final)

    async def _hub_events(
        self, hub: ResultHubLike, row: RequestRow, deadline: float
    ) -> AsyncIterator[Event]:
        queue = hub.subscribe(row.id)
        stored = self._watch(row.id)  # done once the store says it is final
        getter: asyncio.Future[Any] | None = None
        try:
            current = await self.get(row.id) or row
            if current.is_final:
                yield Final(current)
                return
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    yield Final(await self.get(row.id) or current, timed_out=True)
                    return
                if getter is None:
                    getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, stored}, timeout=remaining, return_when=FIRST)
                if getter.done():
                    event, getter = getter.result(), None
                    if event.restarted:
                        yield Restart()
                    if event.text:
                        yield Chunk(event.text, event.tokens)
                    if not event.done:
                        continue
                elif not stored.done():
                    continue
                final = await self.get(row.id) or current
                yield Final(final, timed_out=not final.is_final)
                return
        finally:
            if getter is not None:
                getter.cancel()
            self._unwatch(row.id, stored)
            hub.unsubscribe(row.id, queue)

    async def _poll_until_final(self, request_id: str, deadline: float) -> RequestRow | None:
        future = self._watch(request_id)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
        finally:
            self._unwatch(request_id, future)
        return await self.get(request_id)

    def _watch(self, request_id: str) -> asyncio.Future[None]:
        """A future the poller completes once the store says ``request_id`` is final."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(request_id, []).append(future)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_forever(), name="qlm-api-results")
        self._wake.set()
        return future

    def _unwatch(self, request_id: str, future: asyncio.Future[None]) -> None:
        future.cancel()
        waiters = self._waiters.get(request_id, [])
        if future in waiters:
            waiters.remove(future)
        if not waiters:
            self._waiters.pop(request_id, None)

    async def _poll_forever(self) -> None:
        while True:
            if not self._waiters:
                await self._wake.wait()
            self._wake.clear()
            ids = list(self._waiters)
            try:
                final = await self._threads.run(self._store.final_ids, ids) if ids else set()
            except Exception:
                log.exception("polling the store for %d results failed", len(ids))
                final = set()
            for rid in final:
                for future in self._waiters.pop(rid, []):
                    if not future.done():
                        future.set_result(None)
            await asyncio.sleep(self._poll_interval_s)
