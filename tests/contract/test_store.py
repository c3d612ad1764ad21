"""The store's contract: what every backend must do, run on in-memory SQLite and on PostgreSQL
(a schema of its own, ``qlm_test_<hex>``, dropped at the end; each test starts from empty tables).
The PostgreSQL runs skip without a server and fail under CI=true.

Backend specifics live with their backend: ``tests/unit/store/test_store.py`` (SQLite, URLs,
batching), ``tests/integration/test_store_postgres.py`` (PostgreSQL)."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from services import postgres_schema
from sqlalchemy import create_engine, event, text

from qlm.domain import InstanceSpec, ModelTier, PlanRecord, RequestStatus, Tier
from qlm.store import InstanceState, InvalidCursor, NewRequest, Store, StoreError
from qlm.store.database import make_engine, parse_url
from qlm.store.models import Base


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def new_request(i: int = 0, **overrides: Any) -> NewRequest:
    fields: dict[str, Any] = {
        "id": f"r{i:04d}",
        "tenant": "acme",
        "model": "m",
        "prompt_tokens": 200,
        "max_tokens": 100,
        "slo_e2e_s": 30.0,
        "submitted_at": 100.0 + i,
    }
    fields.update(overrides)
    return NewRequest(**fields)


def plan_record(at_s: float = 10.0, **overrides: Any) -> PlanRecord:
    fields: dict[str, Any] = {
        "at_s": at_s,
        "trigger": "violation",
        "groups": 3,
        "status": "optimal",
        "method": "milp",
        "objective": 1.5,
        "edf_objective": 2.5,
        "at_risk": ("g1", "g2"),
        "capacity_needed": None,
        "solve_s": 0.25,
        "evaluations": 40,
        "concurrency": {"i0": 64, "i1": 128},
        "deferred": 2,
    }
    fields.update(overrides)
    return PlanRecord(**fields)


def raw_rows(store: Store) -> tuple[dict[str, dict[str, Any]], dict[str, list[tuple[str, str]]]]:
    """Every request row as stored (JSON columns as their text) and every request's labels,
    read past the store's own conversions."""
    columns = [c.name for c in Base.metadata.tables["requests"].columns]
    json_columns = {"messages", "sampling", "labels"}
    listed = ", ".join(f"CAST({c} AS TEXT)" if c in json_columns else c for c in columns)
    with store._engine.connect() as connection:  # white box: the bytes, not the rows
        rows = connection.exec_driver_sql(f"SELECT {listed} FROM requests").all()
        label_rows = connection.exec_driver_sql(
            "SELECT request_id, key, value FROM request_labels ORDER BY request_id, key"
        ).all()
    requests = {row[0]: dict(zip(columns, row, strict=True)) for row in rows}
    labels: dict[str, list[tuple[str, str]]] = {}
    for request_id, key, value in label_rows:
        labels.setdefault(request_id, []).append((key, value))
    return requests, labels


def run_together(n: int, call: Callable[[int], Any]) -> list[Any]:
    """``call(0..n-1)`` from ``n`` threads released at once."""
    barrier = threading.Barrier(n)

    def task(i: int) -> Any:
        barrier.wait()
        return call(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(task, range(n)))


def record_finished(store: Store, id: str, **overrides: Any) -> bool:
    fields: dict[str, Any] = {
        "status": RequestStatus.FINISHED,
        "at": 150.0,
        "output_text": "done",
        "output_tokens": 4,
        "slo_met": True,
        "ttft_met": True,
    }
    fields.update(overrides)
    return store.record_outcome(id, **fields)


def race_outcomes(store: Store, id: str, agents: int = 8) -> list[bool]:
    """Every agent records an outcome of request ``id`` at once (output ``agent <i>``)."""
    return run_together(agents, lambda i: record_finished(store, id, output_text=f"agent {i}"))


@pytest.fixture(scope="module")
def postgres_schema_url(postgres_url: str) -> Iterator[str]:
    """A fresh PostgreSQL schema of the module's own that ``Store.open`` migrated; dropped
    afterwards."""
    with postgres_schema(postgres_url) as url:
        Store.open(url).close()
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest) -> str:
    """Each store backend: in-memory SQLite, and PostgreSQL (skips without a server, fails
    under CI=true)."""
    return str(request.param)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(backend: str, clock: FakeClock, request: pytest.FixtureRequest) -> Iterator[Store]:
    """An empty, migrated store of ``backend``."""
    if backend == "sqlite":
        with Store.open("sqlite://", clock=clock) as store:
            yield store
        return
    url = request.getfixturevalue("postgres_schema_url")
    tables = ", ".join(table.name for table in Base.metadata.sorted_tables)
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    engine.dispose()
    with Store(url, clock=clock) as store:
        yield store


@pytest.fixture
def migrated_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A database of ``backend`` that ``Store.open`` just migrated."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'migrated.db'}"
        Store.open(url).close()
        return url
    return str(request.getfixturevalue("postgres_schema_url"))


class TestStore:
    """What every backend must do, given ``store`` (empty, migrated, on a ``FakeClock`` at
    1000) and ``migrated_url`` (a database ``Store.open`` just migrated) of each backend."""

    # --- requests -------------------------------------------------------------------------

    def test_the_latest_finished_come_by_finish_not_by_submission(self, store: Store) -> None:
        store.add_requests([new_request(i) for i in range(4)])
        for i, at in ((0, 300.0), (1, 200.0), (2, 400.0)):
            store.record_outcome(f"r{i:04d}", status=RequestStatus.FINISHED, at=at)
        store.record_outcome("r0003", status=RequestStatus.FAILED, at=500.0)  # not finished
        assert [r.id for r in store.recently_finished(2)] == ["r0002", "r0000"]
        assert [r.id for r in store.recently_finished(10)] == ["r0002", "r0000", "r0001"]

    def test_the_tool_calls_of_an_answer_read_back_as_recorded(self, store: Store) -> None:
        store.add_requests([new_request(0), new_request(1)])
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        assert record_finished(store, "r0000", output_text="", tool_calls=[call])
        assert record_finished(store, "r0001")
        called, plain = store.get("r0000"), store.get("r0001")
        assert called is not None and called.output_tool_calls == [call]
        assert plain is not None and plain.output_tool_calls is None

    def test_added_request_reads_back_whole(self, store: Store) -> None:
        new = new_request(
            7,
            prompt=None,
            messages=[{"role": "user", "content": "hi"}],
            sampling={"temperature": 0.5, "stop": ["\n"]},
            slo_ttft_s=2.0,
            tier=Tier.INTERACTIVE,
            slo_class="chat",
            labels=(("team", "search"), ("env", "prod")),
            idempotency_key="k-7",
        )
        row, created = store.add_request(new)
        assert created
        assert row == store.get("r0007")
        assert (row.id, row.tenant, row.model, row.slo_class) == ("r0007", "acme", "m", "chat")
        assert row.messages == [{"role": "user", "content": "hi"}]
        assert row.prompt is None
        assert row.sampling == {"temperature": 0.5, "stop": ["\n"]}
        assert (row.prompt_tokens, row.max_tokens, row.slo_e2e_s, row.slo_ttft_s) == (
            200,
            100,
            30.0,
            2.0,
        )
        assert row.tier is Tier.INTERACTIVE
        assert row.labels == (("team", "search"), ("env", "prod"))
        assert row.idempotency_key == "k-7"
        assert row.status is RequestStatus.QUEUED
        assert row.submitted_at == 107.0
        assert row.deadline_at == 137.0
        assert row.updated_at == 1_000.0
        assert (row.dispatched_at, row.first_token_at, row.finished_at) == (None, None, None)
        assert (row.evictions, row.swaps, row.attempts, row.output_tokens) == (0, 0, 0, 0)
        assert (row.partial_text, row.partial_tokens) == ("", 0)
        assert (row.slo_met, row.ttft_met, row.error, row.at_risk) == (None, None, None, False)
        assert not row.cancel_requested

    def test_row_converts_back_to_the_domain_request(self, store: Store) -> None:
        row, _ = store.add_request(new_request(3, slo_ttft_s=1.0, labels=(("a", "b"),)))
        request = row.to_request()
        assert NewRequest.from_request(request) == new_request(
            3, slo_ttft_s=1.0, labels=(("a", "b"),)
        )

    def test_adding_the_same_id_again_returns_the_stored_row(self, store: Store) -> None:
        first, created = store.add_request(new_request(1, prompt="first"))
        again, created_again = store.add_request(new_request(1, prompt="second"))
        assert created and not created_again
        assert again == first
        assert again.prompt == "first"

    def test_same_idempotency_key_returns_the_first_request(self, store: Store) -> None:
        first, _ = store.add_request(new_request(1, idempotency_key="k"))
        again, created = store.add_request(new_request(2, idempotency_key="k"))
        assert not created
        assert again.id == first.id == "r0001"
        assert store.get("r0002") is None

    def test_idempotency_keys_are_per_tenant(self, store: Store) -> None:
        store.add_request(new_request(1, idempotency_key="k"))
        row, created = store.add_request(new_request(2, tenant="other", idempotency_key="k"))
        assert created and row.tenant == "other"

    def test_requests_without_idempotency_key_never_conflict(self, store: Store) -> None:
        assert store.add_request(new_request(1))[1]
        assert store.add_request(new_request(2))[1]

    def test_an_id_of_another_tenant_is_refused(self, store: Store) -> None:
        store.add_request(new_request(1))
        with pytest.raises(StoreError, match="another tenant"):
            store.add_request(new_request(1, tenant="other"))

    def test_a_tenant_sees_only_its_own_requests(self, store: Store) -> None:
        store.add_request(new_request(1, tenant="a"))
        store.add_request(new_request(2, tenant="b"))
        assert store.get("r0001", tenant="a") is not None
        assert store.get("r0001", tenant="b") is None
        assert store.get("r0001") is not None  # admin
        rows, _ = store.list_requests(tenant="b")
        assert [r.id for r in rows] == ["r0002"]
        assert [r.id for r in store.list_requests()[0]] == ["r0002", "r0001"]

    def test_a_request_runs_is_evicted_and_resumes_with_its_partial_output(
        self, store: Store, clock: FakeClock
    ) -> None:
        store.add_request(new_request(1))
        clock.now = 1_001.0
        assert store.mark_dispatched("r0001", instance="i0", at=101.5)
        assert store.mark_first_token("r0001", at=101.7)
        assert store.record_partial("r0001", text="abc", tokens=3)
        assert not store.record_partial("r0001", text="ab", tokens=2)  # late, shorter report
        running = store.get("r0001")
        assert running is not None
        assert (running.status, running.instance, running.attempts) == (
            RequestStatus.RUNNING,
            "i0",
            1,
        )
        assert (running.partial_text, running.partial_tokens) == ("abc", 3)
        assert running.updated_at == 1_001.0

        assert store.record_eviction("r0001", partial_text="abcde", partial_tokens=5)
        evicted = store.get("r0001")
        assert evicted is not None
        assert (evicted.status, evicted.evictions) == (RequestStatus.QUEUED, 1)
        assert (evicted.partial_text, evicted.partial_tokens) == ("abcde", 5)

        assert store.mark_dispatched("r0001", instance="i1", at=110.0)
        assert store.mark_first_token("r0001", at=110.2)
        assert store.record_swap("r0001")
        assert store.record_eviction("r0001", partial_text="abc", partial_tokens=3)
        again = store.get("r0001")
        assert again is not None
        assert (again.partial_text, again.partial_tokens) == ("abcde", 5)  # never lowered
        assert again.dispatched_at == 101.5  # the first dispatch ends the wait
        assert again.first_token_at == 101.7
        assert (again.instance, again.attempts, again.evictions, again.swaps) == ("i1", 2, 2, 1)

    def test_outcome_is_recorded_once(self, store: Store) -> None:
        store.add_request(new_request(1))
        store.mark_dispatched("r0001", instance="i0", at=101.0)
        store.record_prediction("r0001", predicted_at=120.0, at_risk=True)
        assert record_finished(store, "r0001", error=None)
        done = store.get("r0001")
        assert done is not None
        assert done.status is RequestStatus.FINISHED
        assert (done.finished_at, done.output_text, done.output_tokens) == (150.0, "done", 4)
        assert (done.slo_met, done.ttft_met, done.at_risk) == (True, True, False)
        assert store.is_final("r0001")

        assert not store.record_outcome(
            "r0001", status=RequestStatus.FAILED, at=160.0, error="boom"
        )
        assert not store.mark_dispatched("r0001", instance="i1", at=161.0)
        assert not store.record_eviction("r0001", partial_text="x", partial_tokens=99)
        assert not store.record_partial("r0001", text="x", tokens=99)
        assert not store.record_prediction("r0001", predicted_at=200.0, at_risk=True)
        assert store.get("r0001") == done

    def test_a_finished_request_adds_its_latencies_once(self, store: Store) -> None:
        store.add_requests([new_request(i) for i in range(5)])  # submitted at 100 + i
        store.add_request(new_request(5, tier=Tier.BATCH, model="big"))
        store.mark_dispatched("r0000", instance="i0", at=100.3)
        store.mark_first_token("r0000", at=100.7)
        store.mark_dispatched("r0000", instance="i1", at=104.0)  # a second dispatch: no wait
        store.record_eviction("r0000", partial_text="a", partial_tokens=1)
        store.mark_first_token("r0000", at=105.0)  # a resumed run's first token: not the first
        assert record_finished(store, "r0000", at=112.0)
        assert not record_finished(store, "r0000", at=113.0)  # recorded already
        assert record_finished(store, "r0001", at=101.04)  # never dispatched nor a first token
        store.record_outcome("r0002", status=RequestStatus.FAILED, at=150.0, error="x")
        store.record_outcome("r0003", status=RequestStatus.CANCELLED, at=150.0)
        store.mark_dispatched("r0004", instance="i0", at=99.0)  # another host's clock: ahead
        assert record_finished(store, "r0004", at=110.0)
        assert record_finished(store, "r0005", at=105.0 + 86_400)  # beyond every bound
        got = {
            (b.histogram, b.tier, b.model, b.le): (b.count, b.sum) for b in store.latency_buckets()
        }
        assert got == {
            ("e2e", Tier.STANDARD, "m", 0.05): (1, pytest.approx(0.04)),
            ("e2e", Tier.STANDARD, "m", 10.0): (1, pytest.approx(6.0)),
            ("e2e", Tier.STANDARD, "m", 30.0): (1, pytest.approx(12.0)),
            ("queue", Tier.STANDARD, "m", 0.05): (1, 0.0),
            ("queue", Tier.STANDARD, "m", 0.5): (1, pytest.approx(0.3)),
            ("ttft", Tier.STANDARD, "m", 1.0): (1, pytest.approx(0.7)),
            ("e2e", Tier.BATCH, "big", math.inf): (1, pytest.approx(86_400.0)),
        }

    def test_latencies_are_written_with_their_batch_and_lost_with_it(self, store: Store) -> None:
        store.add_requests([new_request(i) for i in range(3)])
        with pytest.raises(RuntimeError), store.batch():
            assert record_finished(store, "r0000", at=101.0)
            raise RuntimeError("the writer's batch failed")
        assert store.latency_buckets() == [] and not store.is_final("r0000")
        with store.batch():  # the writer retries: counted once
            for i in range(3):
                assert record_finished(store, f"r{i:04d}", at=100.0 + i + 1.0)
        [row] = store.latency_buckets()
        assert (row.histogram, row.le, row.count, row.sum) == ("e2e", 1.0, 3, 3.0)

    def test_retention_leaves_the_latency_histograms_alone(self, store: Store) -> None:
        store.add_request(new_request(0))
        assert record_finished(store, "r0000", at=101.0)
        before = store.latency_buckets()
        assert store.prune_requests(1e9) == 1
        assert store.latency_buckets() == before  # counters never go down

    def test_failed_outcome_keeps_its_error(self, store: Store) -> None:
        store.add_request(new_request(1))
        assert store.record_outcome(
            "r0001", status=RequestStatus.FAILED, at=140.0, slo_met=False, error="engine died"
        )
        row = store.get("r0001")
        assert row is not None
        assert (row.status, row.error, row.slo_met) == (RequestStatus.FAILED, "engine died", False)

    def test_a_recorded_outcome_says_what_its_log_line_needs(self, store: Store) -> None:
        """The stored timestamps, as the histograms measure them: a resumed request's first
        dispatch and first token ever, not its last run's."""
        store.add_request(new_request(1, tier=Tier.INTERACTIVE))
        store.mark_dispatched("r0001", instance="i0", at=102.0)
        store.mark_first_token("r0001", at=103.5)
        store.mark_dispatched("r0001", instance="i1", at=110.0)  # resumed elsewhere
        store.mark_first_token("r0001", at=111.0)
        outcome = store.record_outcome_row(
            "r0001", status=RequestStatus.FINISHED, at=121.0, output_tokens=9, slo_met=True
        )
        assert outcome is not None
        assert (outcome.id, outcome.tenant, outcome.model, outcome.tier) == (
            "r0001",
            "acme",
            "m",
            Tier.INTERACTIVE,
        )
        assert (outcome.status, outcome.slo_met, outcome.output_tokens) == (
            RequestStatus.FINISHED,
            True,
            9,
        )
        assert (outcome.e2e_s, outcome.ttft_s, outcome.queue_s) == (20.0, 2.5, 1.0)
        assert outcome.instance == "i1" and outcome.error is None
        again = store.record_outcome_row("r0001", status=RequestStatus.FAILED, at=130.0)
        assert again is None  # written once
        store.add_request(new_request(2))
        failed = store.record_outcome_row(
            "r0002", status=RequestStatus.FAILED, at=140.0, error="engine died"
        )
        assert failed is not None and failed.error == "engine died"
        assert (failed.ttft_s, failed.queue_s, failed.instance) == (None, None, None)

    def test_outcome_needs_a_final_status(self, store: Store) -> None:
        store.add_request(new_request(1))
        with pytest.raises(ValueError, match="final status"):
            store.record_outcome("r0001", status=RequestStatus.RUNNING, at=1.0)

    def test_unknown_requests_change_nothing(self, store: Store) -> None:
        assert store.get("nope") is None
        assert not store.is_final("nope")
        assert not store.mark_dispatched("nope", instance="i0", at=1.0)
        assert not store.record_swap("nope")
        assert not record_finished(store, "nope")
        assert store.cancel("nope") is None

    def test_many_requests_are_read_at_once_in_the_order_asked(self, store: Store) -> None:
        for i in range(3):
            store.add_request(new_request(i))
        rows = store.get_many(["r0002", "nope", "r0000", "r0002"])
        assert [r.id for r in rows] == ["r0002", "r0000"]
        assert store.get_many([]) == []

    def test_predictions_are_recorded_singly_and_in_bulk(self, store: Store) -> None:
        for i in range(3):
            store.add_request(new_request(i))
        record_finished(store, "r0002")
        assert store.record_prediction("r0000", predicted_at=125.0, at_risk=False)
        store.record_predictions(
            {"r0000": (131.0, True), "r0001": (None, False), "r0002": (1.0, True), "x": (1, True)}
        )
        rows = {r.id: r for r in store.list_requests()[0]}
        assert (rows["r0000"].predicted_completion_at, rows["r0000"].at_risk) == (131.0, True)
        assert (rows["r0001"].predicted_completion_at, rows["r0001"].at_risk) == (None, False)
        assert (rows["r0002"].predicted_completion_at, rows["r0002"].at_risk) == (None, False)
        store.record_predictions({})

    def test_cancelling_a_queued_request_ends_it(self, store: Store) -> None:
        store.add_request(new_request(1))
        assert store.cancel("r0001", tenant="acme", at=105.0) is RequestStatus.CANCELLED
        row = store.get("r0001")
        assert row is not None
        assert (row.status, row.finished_at) == (RequestStatus.CANCELLED, 105.0)
        assert not store.mark_dispatched("r0001", instance="i0", at=106.0)
        assert store.final_ids(["r0001"]) == {"r0001"}

    def test_cancelling_a_queued_request_returns_the_outcome_it_recorded(
        self, store: Store
    ) -> None:
        store.add_request(new_request(1, tenant="globex"))
        store.add_request(new_request(2))
        status, outcome = store.cancel_row("r0002", at=110.0)
        assert status is RequestStatus.CANCELLED and outcome is not None
        assert (outcome.id, outcome.tenant, outcome.model, outcome.status) == (
            "r0002", "acme", "m", RequestStatus.CANCELLED,
        )  # fmt: skip
        assert (outcome.submitted_at, outcome.finished_at, outcome.e2e_s) == (102.0, 110.0, 8.0)
        assert (outcome.queue_s, outcome.ttft_s, outcome.instance) == (None, None, None)
        assert (outcome.slo_met, outcome.error, outcome.output_tokens) == (None, None, 0)
        # Run once and evicted back into the queue: its first dispatch and token are kept.
        store.mark_dispatched("r0001", instance="i0", at=101.5)
        store.mark_first_token("r0001", at=102.0)
        store.record_eviction("r0001", partial_text="ab", partial_tokens=2)
        assert store.cancel_row("r0001", tenant="acme") == (None, None)  # another tenant's
        status, outcome = store.cancel_row("r0001", tenant="globex", at=120.0)
        assert status is RequestStatus.CANCELLED and outcome is not None
        assert (outcome.tenant, outcome.queue_s, outcome.ttft_s) == ("globex", 0.5, 1.0)
        assert outcome.instance == "i0"
        # Only the call that ended it has an outcome: final, running or unknown have none.
        assert store.cancel_row("r0002") == (RequestStatus.CANCELLED, None)
        assert store.cancel("r0002") is RequestStatus.CANCELLED
        store.add_request(new_request(3))
        store.mark_dispatched("r0003", instance="i0", at=104.0)
        assert store.cancel_row("r0003") == (RequestStatus.RUNNING, None)
        assert store.cancel_row("unknown") == (None, None)

    def test_cancelling_a_running_request_asks_the_controller(self, store: Store) -> None:
        store.add_request(new_request(1))
        store.add_request(new_request(2))
        store.mark_dispatched("r0001", instance="i0", at=101.0)
        assert store.cancel("r0001") is RequestStatus.RUNNING
        assert store.cancel_requested_ids() == {"r0001"}
        assert store.record_outcome("r0001", status=RequestStatus.CANCELLED, at=102.0)
        assert store.cancel_requested_ids() == set()
        assert store.cancel("r0001") is RequestStatus.CANCELLED

    def test_ensure_requests_records_the_new_and_returns_every_row(self, store: Store) -> None:
        store.add_request(new_request(1))
        store.mark_dispatched("r0001", instance="i0", at=101.0)
        rows = store.ensure_requests([new_request(i) for i in (1, 2, 3)])
        assert set(rows) == {"r0001", "r0002", "r0003"}
        assert rows["r0001"].status is RequestStatus.RUNNING  # existing row unchanged
        assert rows["r0002"].status is RequestStatus.QUEUED
        assert store.ensure_requests([]) == {}
        many = store.ensure_requests([new_request(i) for i in range(10, 1210)])
        assert len(many) == 1200 and store.get("r1209") is not None

    def test_batches_of_any_size_reuse_a_few_statements(self, store: Store) -> None:
        """Each connection keeps the statements it prepared (SQLite 128, psycopg 100): a
        statement per batch length (a multi-row VALUES per insert, a parameter per id in an IN
        list) grew a long-running controller's memory by tens of MB. Batches of 1 to 80
        requests, half of them already stored, use a handful of shapes."""
        statements: set[str] = set()

        def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            statements.add(statement)

        event.listen(store._engine, "before_cursor_execute", seen)
        try:
            for size in range(1, 81):
                news = [new_request(size * 100 + i) for i in range(size)]
                store.add_requests(news[: size // 2])
                rows = store.ensure_requests(news)
                assert set(rows) == {n.id for n in news}
                assert store.final_ids([n.id for n in news]) == set()
        finally:
            event.remove(store._engine, "before_cursor_execute", seen)
        inserts = {s for s in statements if s.lstrip().upper().startswith("INSERT")}
        selects = {s for s in statements if " IN (" in s.upper()}
        assert len(inserts) <= 12, len(inserts)  # runs of 1, 2, 4, ..., 64 rows; labels
        assert len(selects) <= 16, len(selects)  # IN lists of 1, 2, 4, ..., 128 ids

    def test_the_rows_ensure_requests_returns_for_new_requests_are_what_the_store_holds(
        self, store: Store
    ) -> None:
        # Built without reading them back: they must equal a read, field for field.
        news = [
            new_request(1),
            new_request(
                2,
                slo_ttft_s=2.5,
                tier=Tier.INTERACTIVE,
                slo_class="chat",
                messages=[{"role": "user", "content": "hi"}],
                sampling={"temperature": 0.5, "stop": ["\n"]},
                labels=(("team", "search"),),
                idempotency_key="k2",
            ),
        ]
        rows = store.ensure_requests(news)
        for new in news:
            assert rows[new.id] == store.get(new.id)
        again = store.ensure_requests(news)  # recorded now: read back, as plain rows
        for new in news:
            assert again[new.id] == store.get(new.id)

    def test_add_requests_async_writes_exactly_what_add_requests_writes(self, store: Store) -> None:
        # Every kind of value a submission carries, through both paths: the rows (raw, the JSON
        # text included) and the labels must be the same but for the ids and keys.
        def batch(prefix: str) -> list[NewRequest]:
            return [
                new_request(
                    i,
                    id=f"{prefix}{i}",
                    prompt=None if i % 2 else 'héllo 😀 "quoted" \\ back\nslash',
                    messages=[{"role": "user", "content": "hi ü"}] if i % 2 else None,
                    sampling={"temperature": 0.7, "stop": ["\n"], "seed": 2**40} if i else {},
                    slo_ttft_s=2.5 if i == 1 else None,
                    submitted_at=1_767_000_000.123456 + i / 3,
                    tier=Tier.INTERACTIVE if i % 2 else Tier.BATCH,
                    slo_class="chat" if i == 3 else "default",
                    labels=(("team", f"t{i}"), ("zone", "é")) if i != 2 else (),
                    idempotency_key=f"{prefix}-key-{i}" if i in (1, 3) else None,
                )
                for i in range(5)
            ]

        assert store.add_requests(batch("a")) == {f"a{i}" for i in range(5)}
        assert asyncio.run(store.add_requests_async(batch("b"))) == {f"b{i}" for i in range(5)}
        for i in range(5):
            a, b = store.get(f"a{i}"), store.get(f"b{i}")
            assert a is not None and b is not None
            assert b == replace(a, id=b.id, idempotency_key=b.idempotency_key)
        requests, labels = raw_rows(store)
        for i in range(5):
            a, b = requests[f"a{i}"], requests[f"b{i}"]
            assert b == a | {"id": b["id"], "idempotency_key": b["idempotency_key"]}
            assert labels.get(f"b{i}") == labels.get(f"a{i}")
        assert labels["b0"] == [("team", "t0"), ("zone", "é")] and "b2" not in labels

    def test_add_requests_async_skips_what_is_taken(self, store: Store) -> None:
        store.add_request(new_request(0, idempotency_key="k"))
        news = [
            new_request(1, labels=(("a", "1"),)),
            new_request(2, idempotency_key="k", labels=(("a", "2"),)),  # taken before
            new_request(3, idempotency_key="j"),
            new_request(4, idempotency_key="j", labels=(("a", "4"),)),  # taken in the batch
            new_request(0, model="other"),  # an id taken: the row stays as it was
            new_request(5, tenant="globex", idempotency_key="k"),  # keys are per tenant
        ]
        created = asyncio.run(store.add_requests_async(news))
        assert created == {"r0001", "r0003", "r0005"}
        assert store.get("r0002") is None and store.get("r0004") is None
        assert store.get("r0000").model == "m"  # type: ignore[union-attr]
        _, labels = raw_rows(store)
        assert set(labels) == {"r0001"}
        assert asyncio.run(store.add_requests_async([])) == set()

        # Again on the same loop and on a new one: connections are reused or replaced.
        async def twice() -> tuple[set[str], set[str]]:
            one = await store.add_requests_async([new_request(6)])
            return one, await store.add_requests_async([new_request(7)])

        assert asyncio.run(twice()) == ({"r0006"}, {"r0007"})

    def test_controllers_publish_their_state_for_the_api(
        self, store: Store, clock: FakeClock
    ) -> None:
        store.put_controller_state("c0", active=True, snapshot={"queues": [{"instance": "i0"}]})
        clock.now = 1_001.0
        store.put_controller_state("c1", active=False, snapshot={"queues": []})
        clock.now = 1_002.0
        store.put_controller_state("c0", active=False, snapshot={"queues": []})
        states = store.controller_states()
        assert [(s.name, s.active, s.updated_at) for s in states] == [
            ("c0", False, 1_002.0),
            ("c1", False, 1_001.0),
        ]
        assert states[0].snapshot == {"queues": []}

    def test_a_controller_that_stops_says_so_until_it_publishes_again(
        self, store: Store, clock: FakeClock
    ) -> None:
        store.put_controller_state("c0", active=True, snapshot={})
        assert store.controller_states()[0].stopped_at is None
        clock.now = 1_005.0
        store.put_controller_state("c0", active=False, snapshot={}, stopped=True)
        assert store.controller_states()[0].stopped_at == 1_005.0
        clock.now = 1_009.0
        store.put_controller_state("c0", active=False, snapshot={})  # started again, same name
        assert store.controller_states()[0].stopped_at is None

    def test_a_controller_learns_of_recent_cancels_queued_or_running(
        self, store: Store, clock: FakeClock
    ) -> None:
        for i in (1, 2, 3):
            store.add_request(new_request(i))
        store.mark_dispatched("r0002", instance="i0", at=101.0)
        store.cancel("r0003")  # at 1000: before the poll below
        clock.now = 1_010.0
        store.cancel("r0001")
        store.cancel("r0002")
        assert store.cancellations_since(1_005.0) == {"r0001", "r0002"}
        assert store.cancellations_since(2_000.0) == set()

    def test_cancel_leaves_final_and_foreign_requests_alone(self, store: Store) -> None:
        store.add_request(new_request(1))
        record_finished(store, "r0001")
        assert store.cancel("r0001") is RequestStatus.FINISHED
        store.add_request(new_request(2))
        assert store.cancel("r0002", tenant="other") is None
        row = store.get("r0002")
        assert row is not None and row.status is RequestStatus.QUEUED

    def test_final_ids_answers_for_many_ids(self, store: Store) -> None:
        for i in range(4):
            store.add_request(new_request(i))
        record_finished(store, "r0001")
        store.cancel("r0003")
        asked = ["r0000", "r0001", "r0002", "r0003"] + [f"unknown{i}" for i in range(1_200)]
        assert store.final_ids(asked) == {"r0001", "r0003"}
        assert store.final_ids([]) == set()

    def test_pages_cover_every_request_once_newest_first(self, store: Store) -> None:
        # Ties on submitted_at are broken by id, so pages cut through equal timestamps cleanly.
        for i in range(23):
            store.add_request(new_request(i, submitted_at=100.0 + i // 4))
        expected = [r.id for r in store.list_requests(limit=1_000)[0]]
        assert len(expected) == 23
        seen: list[str] = []
        cursor: str | None = None
        while True:
            rows, cursor = store.list_requests(limit=5, cursor=cursor)
            seen += [r.id for r in rows]
            if cursor is None:
                break
            # Newer submissions meanwhile do not shift the pages still to come.
            store.add_request(new_request(100 + len(seen), submitted_at=500.0 + len(seen)))
        assert seen == expected
        keys = [(r.submitted_at, r.id) for r in store.list_requests(limit=1_000)[0]]
        assert keys == sorted(keys, reverse=True)

    def test_a_full_last_page_has_no_next_cursor(self, store: Store) -> None:
        for i in range(4):
            store.add_request(new_request(i))
        rows, cursor = store.list_requests(limit=2)
        rows2, cursor2 = store.list_requests(limit=2, cursor=cursor)
        assert [r.id for r in rows + rows2] == ["r0003", "r0002", "r0001", "r0000"]
        assert cursor is not None and cursor2 is None

    def test_a_forged_cursor_is_refused(self, store: Store) -> None:
        for bad in ("nonsense", "bm9wZQ", "WzEsMl0"):
            with pytest.raises(InvalidCursor):
                store.list_requests(cursor=bad)

    def test_list_filters_by_status_model_label_and_time(self, store: Store) -> None:
        store.add_request(new_request(1, labels=(("team", "search"), ("env", "prod"))))
        store.add_request(new_request(2, model="n", labels=(("team", "ads"),)))
        store.add_request(new_request(3, labels=(("team", "search"), ("env", "dev"))))
        store.mark_dispatched("r0003", instance="i0", at=104.0)

        def ids(**filters: Any) -> list[str]:
            return [r.id for r in store.list_requests(**filters)[0]]

        assert ids(status=RequestStatus.RUNNING) == ["r0003"]
        assert ids(status=RequestStatus.QUEUED) == ["r0002", "r0001"]
        assert ids(model="n") == ["r0002"]
        assert ids(label=("team", "search")) == ["r0003", "r0001"]
        assert ids(label=("env", "prod")) == ["r0001"]
        assert ids(label=("team", "nobody")) == []
        assert ids(since=102.0) == ["r0003", "r0002"]
        assert ids(until=102.0) == ["r0001"]
        assert ids(since=101.0, until=103.0, label=("team", "search"), tenant="acme") == ["r0001"]

    def test_counts_per_tenant_and_status(self, store: Store) -> None:
        store.add_request(new_request(1))
        store.add_request(new_request(2))
        store.add_request(new_request(3, tenant="b"))
        store.mark_dispatched("r0002", instance="i0", at=1.0)
        assert store.counts() == {
            ("acme", RequestStatus.QUEUED): 1,
            ("acme", RequestStatus.RUNNING): 1,
            ("b", RequestStatus.QUEUED): 1,
        }
        assert store.counts(since=102.0) == {
            ("acme", RequestStatus.RUNNING): 1,
            ("b", RequestStatus.QUEUED): 1,
        }
        assert store.queued_count("acme") == 1
        assert store.queued_count("nobody") == 0

    def test_slo_summary_counts_failures_as_misses_and_skips_cancelled(self, store: Store) -> None:
        store.add_request(new_request(1, tier=Tier.INTERACTIVE))
        store.add_request(new_request(2, tier=Tier.INTERACTIVE))
        store.add_request(new_request(3, model="n", tier=Tier.BATCH))
        store.add_request(new_request(4, tenant="b"))
        store.add_request(new_request(5, tenant="b"))
        record_finished(store, "r0001", slo_met=True)
        record_finished(store, "r0002", slo_met=False)
        store.record_outcome("r0003", status=RequestStatus.FAILED, at=1.0, slo_met=False)
        record_finished(store, "r0004", slo_met=True)
        store.cancel("r0005")

        by_tenant = {r.group: r for r in store.slo_summary()}
        acme = by_tenant["acme"]
        assert (acme.requests, acme.finished, acme.failed, acme.slo_met) == (3, 2, 1, 1)
        assert acme.attainment == pytest.approx(1 / 3)
        b = by_tenant["b"]
        assert (b.requests, b.cancelled, b.attainment) == (2, 1, 1.0)

        by_tier = {r.group: r.attainment for r in store.slo_summary(group_by="tier")}
        assert by_tier == {"interactive": 0.5, "standard": 1.0, "batch": 0.0}
        by_model = [r.group for r in store.slo_summary(group_by="model")]
        assert by_model == ["m", "n"]

        window = store.slo_summary(since=102.0, until=104.0)
        assert [(r.group, r.requests) for r in window] == [("acme", 2)]
        store.add_request(new_request(6, tenant="c"))
        pending = {r.group: r for r in store.slo_summary()}["c"]
        assert (pending.pending, pending.attainment) == (1, None)

    def test_slo_series_buckets_requests_by_submission_and_keeps_empty_buckets(
        self, store: Store
    ) -> None:
        # Submitted at 101..107 (new_request(i) is submitted at 100 + i).
        outcomes = {1: True, 2: False, 3: None, 5: True, 6: True, 7: None}
        for i in outcomes:
            store.add_request(new_request(i, tenant="b" if i == 6 else "acme"))
        for i, met in outcomes.items():
            if met is not None:
                record_finished(store, f"r{i:04d}", slo_met=met)
        store.record_outcome("r0003", status=RequestStatus.FAILED, at=1.0, slo_met=False)
        series = store.slo_series(since=100.0, until=109.0, step=3.0)
        assert [(b.start, b.end) for b in series] == [
            (100.0, 103.0),
            (103.0, 106.0),
            (106.0, 109.0),
        ]
        first, second, third = series
        assert (first.requests, first.finished, first.slo_met, first.attainment) == (2, 2, 1, 0.5)
        assert (second.requests, second.failed, second.attainment) == (2, 1, 0.5)
        assert (third.requests, third.pending, third.slo_met) == (2, 1, 1)
        # A span that is no multiple of the step ends its last bucket at ``until``; empty buckets stay.
        empty = store.slo_series(since=0.0, until=25.0, step=10.0)
        assert [(b.start, b.end, b.requests, b.attainment) for b in empty] == [
            (0.0, 10.0, 0, None), (10.0, 20.0, 0, None), (20.0, 25.0, 0, None),
        ]  # fmt: skip
        [one] = store.slo_series(since=100.0, until=200.0, step=100.0, tenant="b")
        assert (one.requests, one.slo_met) == (1, 1)
        with pytest.raises(ValueError, match="at most"):
            store.slo_series(since=0.0, until=1e6, step=1.0)

    # --- instances, plans ----------------------------------------------------------------

    def test_instances_are_upserted_and_keep_their_tiers(
        self, store: Store, clock: FakeClock
    ) -> None:
        spec = InstanceSpec(name="i0", gpu="A100", models=("m", "n"), gpu_count=2, url="http://x")
        tiers = {"m": ModelTier.ACTIVE, "n": ModelTier.WARM}
        row = store.upsert_instance(spec, model_tiers=tiers)
        assert row.spec == spec
        assert (row.state, row.model_tiers, row.updated_at) == (InstanceState.UP, tiers, 1_000.0)

        clock.now = 1_005.0
        moved = InstanceSpec(name="i0", gpu="A100", models=("m",), url="http://y")
        row = store.upsert_instance(moved, state=InstanceState.DRAINING)
        assert row.spec == moved
        assert (row.state, row.model_tiers, row.updated_at) == (
            InstanceState.DRAINING,
            tiers,
            1_005.0,
        )

        store.upsert_instance(InstanceSpec(name="a1", gpu="H100", models=("m",)))
        assert store.set_instance_state("i0", InstanceState.DOWN)
        assert store.set_model_tiers("i0", {"m": ModelTier.COLD})
        assert not store.set_instance_state("zz", InstanceState.DOWN)
        listed = store.instances()
        assert [i.name for i in listed] == ["a1", "i0"]
        assert (listed[1].state, listed[1].model_tiers) == (
            InstanceState.DOWN,
            {"m": ModelTier.COLD},
        )
        assert listed[0].model_tiers == {}
        assert store.remove_instance("a1")
        assert not store.remove_instance("a1")
        assert [i.name for i in store.instances()] == ["i0"]

    def test_a_controller_never_overwrites_an_operators_drain(self, store: Store) -> None:
        spec = InstanceSpec(name="i0", gpu="A100", models=("m",))
        row = store.upsert_instance(spec, state=InstanceState.DOWN, keep_draining=True)
        assert row.state is InstanceState.DOWN  # new instance: the given state
        assert store.set_instance_health("i0", up=True)
        assert store.instances()[0].state is InstanceState.UP

        assert store.set_instance_state("i0", InstanceState.DRAINING)  # the operator
        assert not store.set_instance_health("i0", up=False)  # health flaps, drain stays
        assert not store.set_instance_health("i0", up=True)
        row = store.upsert_instance(spec, state=InstanceState.DOWN, keep_draining=True)
        assert row.state is InstanceState.DRAINING  # a restarted controller keeps it too
        assert store.upsert_instance(spec, state=InstanceState.DOWN).state is InstanceState.DOWN

        assert store.set_instance_state("i0", InstanceState.UP)  # undrained
        assert store.set_instance_health("i0", up=False)
        assert store.instances()[0].state is InstanceState.DOWN
        assert not store.set_instance_health("zz", up=True)

    def test_plans_are_kept_newest_first_and_pruned(self, store: Store) -> None:
        assert store.latest_plan() is None
        ids = [store.record_plan(plan_record(at_s=float(i)), controller="c0") for i in range(5)]
        assert ids == sorted(ids)
        latest = store.latest_plan()
        assert latest is not None
        assert (latest.id, latest.controller) == (ids[-1], "c0")
        assert latest.plan == plan_record(at_s=4.0)  # every field as recorded
        assert [p.plan.at_s for p in store.plans(limit=3)] == [4.0, 3.0, 2.0]

        assert store.prune_plans(keep=2) == 3
        assert [p.id for p in store.plans()] == ids[:-3:-1]
        assert store.prune_plans(keep=2) == 0
        assert store.prune_plans(keep=0) == 2
        assert store.plans() == []

    def test_pruning_deletes_the_oldest_ended_requests_with_their_labels(
        self, store: Store
    ) -> None:
        for i in range(6):
            store.add_request(new_request(i, labels=(("team", "a"),)))
        store.record_outcome("r0000", status=RequestStatus.FINISHED, at=10.0, output_tokens=1)
        store.record_outcome("r0001", status=RequestStatus.FAILED, at=30.0, error="x")
        store.record_outcome("r0002", status=RequestStatus.FINISHED, at=20.0, output_tokens=1)
        assert store.cancel("r0003", at=40.0) is RequestStatus.CANCELLED
        store.mark_dispatched("r0004", instance="i0", at=5.0)  # running: kept however old
        # r0005 waits: kept however old.
        assert store.prune_requests(35.0, limit=2) == 2  # the oldest two: r0000, r0002
        assert store.get("r0000") is None and store.get("r0002") is None
        assert store.prune_requests(35.0) == 1  # r0001; r0003 ended after the cut
        assert store.prune_requests(35.0) == 0
        assert sorted(r.id for r in store.list_requests()[0]) == ["r0003", "r0004", "r0005"]
        assert len(store.list_requests(label=("team", "a"))[0]) == 3
        store.add_request(new_request(0, labels=(("team", "a"),)))  # its labels went with it
        assert store.get("r0000") is not None
        with pytest.raises(ValueError, match="limit"):
            store.prune_requests(35.0, limit=0)

    def test_unsettled_requests_before_a_time_are_listed_oldest_first(self, store: Store) -> None:
        for i in (3, 0, 2, 1, 4, 5):  # submitted at 100 + i
            store.add_request(new_request(i))
        store.mark_dispatched("r0001", instance="i0", at=5.0)  # running: listed
        store.record_outcome("r0002", status=RequestStatus.FAILED, at=6.0, error="x")  # ended
        assert store.cancel("r0003", at=7.0) is RequestStatus.CANCELLED  # ended
        assert store.unsettled_before(104.5) == [
            (100.0, "r0000"),
            (101.0, "r0001"),
            (104.0, "r0004"),
        ]
        first = store.unsettled_before(104.5, limit=2)
        assert first == [(100.0, "r0000"), (101.0, "r0001")]
        assert store.unsettled_before(104.5, after=first[-1]) == [(104.0, "r0004")]
        assert store.unsettled_before(104.5, after=(104.0, "r0004")) == []
        store.add_request(new_request(9, id="r0000b", submitted_at=100.0))  # same time: by id
        assert store.unsettled_before(104.5, after=(100.0, "r0000"), limit=1) == [(100.0, "r0000b")]
        assert store.unsettled_before(100.0) == []  # strictly before
        with pytest.raises(ValueError, match="limit"):
            store.unsettled_before(104.5, limit=0)

    def test_a_plan_with_unbounded_numbers_reads_back(self, store: Store) -> None:
        record = plan_record(capacity_needed=math.inf, objective=math.inf, at_risk=())
        store.record_plan(record, controller="c1")
        row = store.latest_plan()
        assert row is not None
        plan = row.plan
        assert (plan.capacity_needed, plan.objective, plan.at_risk) == (math.inf, math.inf, ())

    # --- API keys --------------------------------------------------------------------------

    def test_api_key_identifies_its_tenant_until_revoked(self, store: Store) -> None:
        key = store.create_api_key("acme", name="ci")
        admin_key = store.create_api_key("ops", admin=True)
        assert key.startswith("qlm_") and key != admin_key
        found = store.lookup_api_key(key)
        assert found is not None
        assert (found.tenant, found.admin, found.name, found.revoked) == (
            "acme",
            False,
            "ci",
            False,
        )
        assert key.startswith(found.prefix) and len(found.prefix) < len(key) // 2
        admin = store.lookup_api_key(admin_key)
        assert admin is not None and admin.admin

        assert store.revoke_api_key(found.id, at=2_000.0)
        assert not store.revoke_api_key(found.id)
        assert store.lookup_api_key(key) is None
        assert store.lookup_api_key(admin_key) is not None
        listed = store.api_keys()
        assert [(k.tenant, k.revoked_at) for k in listed] == [("acme", 2_000.0), ("ops", None)]
        assert [k.tenant for k in store.api_keys(tenant="ops")] == ["ops"]

    def test_unknown_or_malformed_keys_are_not_found(self, store: Store) -> None:
        key = store.create_api_key("acme")
        for wrong in ("", "qlm_", key[:-1] + ("A" if key[-1] != "A" else "B"), key + "x", "x" * 47):
            assert store.lookup_api_key(wrong) is None

    # --- concurrency, schema -------------------------------------------------------------

    def test_racing_outcomes_are_recorded_exactly_once(self, store: Store) -> None:
        for trial in range(3):
            id = f"race{trial}"
            store.add_request(new_request(trial, id=id))
            store.mark_dispatched(id, instance="i0", at=1.0)
            recorded = race_outcomes(store, id)
            assert sum(recorded) == 1
            row = store.get(id)
            assert row is not None
            assert row.output_text == f"agent {recorded.index(True)}"
        e2e = [b for b in store.latency_buckets() if b.histogram == "e2e"]
        assert sum(b.count for b in e2e) == 3  # one observation per request, like its outcome

    def test_racing_submissions_with_one_idempotency_key_create_one_request(
        self, store: Store
    ) -> None:
        results = run_together(
            8, lambda i: store.add_request(new_request(i, idempotency_key="same"))
        )
        assert sum(created for _, created in results) == 1
        assert len({row.id for row, _ in results}) == 1
        assert len(store.list_requests()[0]) == 1

    def test_migrations_create_exactly_the_models_schema(self, migrated_url: str) -> None:
        engine = make_engine(parse_url(migrated_url))
        try:
            with engine.connect() as connection:
                diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
        finally:
            engine.dispose()
        assert diff == []

    def test_migrating_again_changes_nothing(self, store: Store) -> None:
        store.add_request(new_request(1))
        store.migrate()
        assert store.get("r0001") is not None
