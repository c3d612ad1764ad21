"""The API stops its background work and waits for its store calls before the store is closed:
a store closed under a thread still reading it crashed the process (SQLite freed under a reader).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest

from qlm.api import app as app_module
from qlm.api import create_app
from qlm.api.threads import StoreThreads
from qlm.domain import InstanceSpec
from qlm.global_queue import MemoryGlobalQueue
from qlm.settings import ApiSettings, Settings
from qlm.store import Store, StoreError


class SlowStore:
    """Wraps a store: its next ``final_ids`` blocks until released, and the order of that call
    and ``close`` is recorded (``close`` releases a call it finds running, so nothing hangs)."""

    def __init__(self, store: Store, loop: asyncio.AbstractEventLoop) -> None:
        self.store = store
        self.log: list[str] = []
        self.release = threading.Event()
        self.started = asyncio.Event()
        self.closed = asyncio.Event()
        self._loop = loop
        self._running = 0
        self._final_ids = store.final_ids
        self._close = store.close
        store.final_ids = self.final_ids  # type: ignore[method-assign]
        store.close = self.close  # type: ignore[method-assign]

    def final_ids(self, ids: Any) -> Any:
        self._running += 1
        self.log.append("final_ids starts")
        self._loop.call_soon_threadsafe(self.started.set)
        self.release.wait(60)  # a bound only: the test releases it
        self.log.append("final_ids returns")
        self._running -= 1
        return self._final_ids(ids)

    def close(self) -> None:
        self.log.append("close" if not self._running else "close while final_ids runs")
        self._loop.call_soon_threadsafe(self.closed.set)
        self.release.set()
        self._close()


async def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 60  # only a bound for a condition that never comes
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.005)


def test_the_store_is_closed_only_after_the_results_poller_left_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        store = Store.open("sqlite://")
        store.upsert_instance(InstanceSpec("i0", "G", ("m",)))
        key = store.create_api_key("acme")
        slow = SlowStore(store, asyncio.get_running_loop())
        monkeypatch.setattr(app_module, "open_store", lambda _settings: store)
        app = create_app(Settings(api=ApiSettings(poll_interval_s=0.01)), queue=MemoryGlobalQueue())
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        transport = httpx.ASGITransport(app=app)
        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://qlm") as client:
            r = await client.post(
                "/v1/requests", json={"model": "m", "prompt": "x", "max_tokens": 1}, headers=auth
            )
            rid = r.json()["id"]
            waiting = asyncio.create_task(
                client.get(f"/v1/requests/{rid}", params={"wait": 30}, headers=auth)
            )
            await slow.started.wait()  # the poller reads the store in a thread
            waiting.cancel()  # as the server gives up on requests in flight at shutdown
            stopping = asyncio.create_task(lifespan.__aexit__(None, None, None))
            threads: StoreThreads = app.state.ctx.threads
            await until(lambda: threads.closed or slow.closed.is_set(), "the app stops")
            assert not slow.closed.is_set(), slow.log
            slow.release.set()
            await stopping
        assert slow.log == ["final_ids starts", "final_ids returns", "close"]

    asyncio.run(main())


def test_store_calls_after_the_join_are_refused_as_a_store_outage() -> None:
    async def main() -> None:
        threads = StoreThreads()
        assert await threads.run(lambda x: x + 1, 1) == 2
        await threads.join()
        with pytest.raises(StoreError, match="shutting down"):
            await threads.run(lambda: None)

    asyncio.run(main())


def test_the_join_waits_for_a_call_whose_caller_was_cancelled() -> None:
    async def main() -> None:
        threads = StoreThreads()
        entered, release = threading.Event(), threading.Event()
        done: list[str] = []

        def slow() -> None:
            entered.set()
            release.wait(60)  # a bound only: released below
            done.append("returned")

        caller = asyncio.create_task(threads.run(slow))
        await asyncio.to_thread(entered.wait, 60)
        caller.cancel()
        joining = asyncio.create_task(threads.join())
        await until(lambda: threads.closed, "join begins")
        assert not joining.done() and threads.running == 1
        release.set()
        await joining
        assert done == ["returned"] and threads.running == 0

    asyncio.run(main())
