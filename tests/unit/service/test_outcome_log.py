"""The line each recorded outcome is logged with (``qlm.outcomes``): one per request,
after its commit, with the fields docs/operations.md lists, in the text and the JSON format."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from qlm.cli.logs import JsonFormatter
from qlm.domain import RequestStatus
from qlm.global_queue import DeadLetter, MemoryBroker, MemoryGlobalQueue
from qlm.store import Store, StoreError
from tests.unit.service.test_controller_service import (
    eventually,
    final,
    make_service,
    message,
    run,
)

FIELDS = {
    "request_id",
    "tenant",
    "model",
    "tier",
    "status",
    "slo_met",
    "ttft_met",
    "e2e_s",
    "ttft_s",
    "queue_s",
    "instance",
    "output_tokens",
    "error",
}


def outcome_lines(caplog: pytest.LogCaptureFixture) -> dict[str, list[logging.LogRecord]]:
    by_id: dict[str, list[logging.LogRecord]] = {}
    for record in caplog.records:
        if record.name == "qlm.outcomes":
            by_id.setdefault(record.request_id, []).append(record)  # type: ignore[attr-defined]
    return by_id


def test_every_recorded_outcome_is_logged_once_after_its_commit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A flush whose transaction fails is written again, and logged only then: once."""
    caplog.set_level(logging.INFO, logger="qlm.outcomes")

    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker)
        real = store.record_outcome_row
        failures: list[str] = []

        def down_once(id: str, **kwargs: Any) -> Any:
            if not failures:
                failures.append(id)
                raise StoreError("the store is down")
            return real(id, **kwargs)

        store.record_outcome_row = down_once  # type: ignore[method-assign]
        producer = MemoryGlobalQueue(broker=broker)
        now = service.runtime.clock.now()
        ids = [f"q{i:04d}" for i in range(5)]
        for i in range(5):  # the first with a first-token deadline as long as its SLO: met
            await producer.publish(message(i, now, slo_ttft_s=120.0 if i == 0 else None))
        await producer.publish(message(5, now, model="unknown-model"))
        await service.start()
        await eventually(lambda: final(store, [*ids, "q0005"]), "every request is final")
        await service.wait_idle()
        await service.stop()
        assert failures  # one flush failed and was written again

        lines = outcome_lines(caplog)
        assert sorted(lines) == [*ids, "q0005"]
        assert all(len(records) == 1 for records in lines.values())
        for rid in ids:
            [record] = lines[rid]
            row = store.get(rid)
            assert row is not None and row.finished_at is not None
            assert row.dispatched_at is not None and row.first_token_at is not None
            fields = {k: getattr(record, k) for k in FIELDS}
            assert fields == {
                "request_id": rid,
                "tenant": "acme",
                "model": "m",
                "tier": "standard",
                "status": "finished",
                "slo_met": True,
                "ttft_met": True if rid == "q0000" else None,
                "e2e_s": round(row.finished_at - row.submitted_at, 3),
                "ttft_s": round(row.first_token_at - row.submitted_at, 3),
                "queue_s": round(row.dispatched_at - row.submitted_at, 3),
                "instance": row.instance,
                "output_tokens": row.output_tokens,
                "error": None,
            }
            text = record.getMessage()
            assert text.startswith(f"request {rid} finished: tenant=acme model=m tier=standard ")
            assert "slo_met=true" in text and f"instance={row.instance}" in text
            assert "error=" not in text  # null fields are left out of the text
        [poison] = lines["q0005"]
        assert (poison.status, poison.slo_met, poison.queue_s) == ("failed", False, None)  # type: ignore[attr-defined]
        assert poison.error == "no instance serves model 'unknown-model'"  # type: ignore[attr-defined]
        assert "error=\"no instance serves model 'unknown-model'\"" in poison.getMessage()
        doc = json.loads(JsonFormatter().format(poison))
        assert set(doc) >= FIELDS and doc["logger"] == "qlm.outcomes"
        assert doc["ttft_s"] is None and doc["slo_met"] is False

    run(scenario)


def test_a_dead_letter_recorded_failed_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="qlm.outcomes")

    async def scenario(store: Store) -> None:
        broker = MemoryBroker()
        service = make_service(store, broker)
        broker.dead.append(DeadLetter(message(7, 100.0).encode(), "delivery_limit"))
        assert await service.reap_once() == 1
        assert await service.reap_once() == 0
        [record] = outcome_lines(caplog)["q0007"]
        assert record.status == "failed" and record.error == "dead-lettered: delivery_limit"  # type: ignore[attr-defined]
        row = store.get("q0007")
        assert row is not None and row.status is RequestStatus.FAILED

    run(scenario)


def test_a_request_cancelled_in_the_queue_or_while_it_runs_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The API ends a queued request itself and logs its line; a running one is ended, and
    logged, by the controller. Neither twice."""
    from tests.unit.service.test_api_service import run as run_api
    from tests.unit.service.test_api_service import two_running_one_waiting

    caplog.set_level(logging.INFO, logger="qlm.outcomes")

    async def scenario(h: Any, _service: Any) -> None:
        running, waiting = await two_running_one_waiting(h)
        r = await h.client.delete(f"/v1/requests/{waiting}", headers=h.auth())
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        for rid in running:
            assert (await h.client.delete(f"/v1/requests/{rid}", headers=h.auth())).status_code in (200, 202)  # fmt: skip
        await eventually(lambda: final(h.store, running), "the running ones are aborted")
        await h.client.delete(f"/v1/requests/{waiting}", headers=h.auth())  # again: 409
        lines = outcome_lines(caplog)
        assert {rid: len(lines.get(rid, [])) for rid in [*running, waiting]} == dict.fromkeys(
            [*running, waiting], 1
        )
        [queued] = lines[waiting]
        fields = json.loads(JsonFormatter().format(queued))
        assert (fields["status"], fields["slo_met"], fields["queue_s"]) == ("cancelled", None, None)
        assert fields["tenant"] == "acme" and fields["instance"] is None and fields["e2e_s"] >= 0
        assert queued.getMessage().startswith(f"request {waiting} cancelled: tenant=acme ")
        for rid in running:
            [line] = lines[rid]
            assert line.status == "cancelled" and line.queue_s is not None  # type: ignore[attr-defined]

    run_api(scenario, max_running=1)
