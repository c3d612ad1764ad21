"""The at-risk flag of a request admitted against the plan's advice is recorded even when the
store is away for a while (a PostgreSQL restart): retried with back-off, never dropped, and
never over the controller's own, later prediction."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from qlm.api.risk import AtRiskFlags
from qlm.store import Store, StoreError
from tests.unit.api.test_api import FakeController, Harness, busy_snapshot, run
from tests.unit.api.test_api_parts import new


def fail_first(store: Store, times: int, names: tuple[str, ...]) -> list[str]:
    """Make the first ``times`` calls to ``store``'s methods ``names`` raise ``StoreError`` (a
    database restarting); return the log of calls, ``name`` or ``name!`` for a failed one."""
    calls: list[str] = []

    def wrap(name: str) -> None:
        method = getattr(store, name)

        def flaky(*args: Any, **kwargs: Any) -> Any:
            if sum(c.endswith("!") for c in calls) < times:
                calls.append(name + "!")
                raise StoreError(f"cannot {name}: the database system is starting up")
            calls.append(name)
            return method(*args, **kwargs)

        setattr(store, name, flaky)

    for name in names:
        wrap(name)
    return calls


@pytest.fixture
def store() -> Iterator[Store]:
    s = Store.open("sqlite://")
    yield s
    s.close()


class Naps:
    """A ``sleep`` that records the back-off asked for and returns at once."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)
        await asyncio.sleep(0)


def test_flags_are_retried_with_a_doubling_back_off_until_the_store_takes_them(
    store: Store,
) -> None:
    for i in range(3):
        store.add_request(new(i))
    calls = fail_first(store, 4, ("record_predictions",))
    naps = Naps()

    async def main() -> None:
        flags = AtRiskFlags(store, sleep=naps, first_backoff_s=0.1, max_backoff_s=0.3)
        flags.start()
        for i in range(3):
            flags.add(f"req_{i}", 200.0 + i)
        await flags.flushed()
        assert (flags.pending, flags.failures, flags.recorded, flags.given_up) == (0, 4, 3, 0)
        await flags.close()

    asyncio.run(main())
    assert naps.asked == [0.1, 0.2, 0.3, 0.3]
    assert calls[-1] == "record_predictions"
    for i in range(3):
        row = store.get(f"req_{i}")
        assert row is not None and row.at_risk and row.predicted_completion_at == 200.0 + i


def test_a_retry_leaves_the_controllers_later_prediction_alone(store: Store) -> None:
    store.add_request(new(0))
    store.add_request(new(1))
    fail_first(store, 1, ("record_predictions",))

    async def main() -> None:
        retried = asyncio.Event()

        async def controller_predicts_meanwhile(_seconds: float) -> None:
            # While the API backs off, the controller records its own prediction of req_0.
            Store.record_predictions(store, {"req_0": (150.0, False)})
            retried.set()

        flags = AtRiskFlags(store, sleep=controller_predicts_meanwhile)
        flags.start()
        flags.add("req_0", 300.0)
        flags.add("req_1", 300.0)
        await flags.flushed()
        assert retried.is_set()
        await flags.close()

    asyncio.run(main())
    first, second = store.get("req_0"), store.get("req_1")
    assert first is not None and (first.predicted_completion_at, first.at_risk) == (150.0, False)
    assert second is not None and (second.predicted_completion_at, second.at_risk) == (300.0, True)


def test_flags_waiting_are_bounded_and_the_oldest_given_up_is_logged(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    fail_first(store, 10**9, ("record_predictions",))

    async def main() -> None:
        gate = asyncio.Event()

        async def wait_for_the_test(_seconds: float) -> None:
            await gate.wait()

        flags = AtRiskFlags(store, sleep=wait_for_the_test, max_pending=2)
        flags.start()
        with caplog.at_level(logging.ERROR, logger="qlm.api.risk"):
            for i in range(3):
                flags.add(f"req_{i}", None)
            assert (flags.pending, flags.given_up) == (2, 1)
            await flags.close()
        assert "req_0" in caplog.text and "req_1, req_2" in caplog.text

    asyncio.run(main())


def test_an_at_risk_request_is_flagged_after_the_store_came_back() -> None:
    now = 1000.0

    async def scenario(h: Harness) -> None:
        calls = fail_first(h.store, 3, ("record_prediction", "record_predictions"))
        r = await h.submit(slo_seconds=30)
        assert r.status_code == 202 and r.json()["at_risk"] is True
        rid = r.json()["id"]
        deadline = time.monotonic() + 60  # only a bound: a flag that is never recorded
        while not (row := h.store.get(rid)) or not row.at_risk:
            assert time.monotonic() < deadline, calls
            await asyncio.sleep(0.02)
        assert row.predicted_completion_at == now + 100
        assert sum(c.endswith("!") for c in calls) == 3

    run(scenario, controller=FakeController(busy_snapshot(now)), clock=lambda: now)
