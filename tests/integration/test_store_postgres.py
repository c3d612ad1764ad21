"""The store on a real PostgreSQL server, beyond the contract every backend keeps
(``tests/contract/test_store.py``): the run's own schema, many outcomes racing at once, a broken
connection, a migration meeting an index built beforehand.

The run gets a schema of its own, ``qlm_test_<hex>``, selected through the connection's
``search_path`` and dropped at the end, so runs never see each other's tables or an old schema.
Each test starts from empty tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from services import postgres_schema
from sqlalchemy import create_engine, text

from qlm.domain import RequestStatus
from qlm.service.writes import StoreWriter
from qlm.store import Store
from qlm.store.models import Base
from tests.contract.test_store import FakeClock, new_request, run_together

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def schema_url(postgres_url: str) -> Iterator[str]:
    """The URL of a fresh schema that ``Store.open`` migrated; dropped afterwards."""
    with postgres_schema(postgres_url) as url:
        Store.open(url).close()
        yield url


def latest_revision() -> str:
    """The head of the store's migrations (what ``Store.open`` migrates to)."""
    from alembic.script import ScriptDirectory

    from qlm.store.store import alembic_config

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


class TestPostgresStore:
    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    @pytest.fixture
    def store(self, schema_url: str, clock: FakeClock) -> Iterator[Store]:
        tables = ", ".join(table.name for table in Base.metadata.sorted_tables)
        engine = create_engine(schema_url)
        with engine.begin() as connection:
            connection.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
        engine.dispose()
        with Store(schema_url, clock=clock) as store:
            yield store

    def test_the_run_has_its_own_schema(self, store: Store, schema_url: str) -> None:
        engine = create_engine(schema_url)
        with engine.connect() as connection:
            schema = connection.execute(text("SELECT current_schema()")).scalar_one()
            version = connection.execute(text("SELECT version_num FROM alembic_version"))
            assert version.scalar_one() == latest_revision()
        engine.dispose()
        assert schema.startswith("qlm_test_")

    def test_outcomes_race_across_many_requests_at_once(self, store: Store) -> None:
        # Sixteen threads over four requests: each request gets exactly one outcome.
        for i in range(4):
            store.add_request(new_request(i))

        def finish(i: int) -> bool:
            return store.record_outcome(
                f"r{i % 4:04d}", status=RequestStatus.FINISHED, at=1.0, output_text=str(i)
            )

        recorded = run_together(16, finish)
        assert sum(recorded) == 4
        for i in range(4):
            row = store.get(f"r{i:04d}")
            assert row is not None and row.output_text is not None
            assert int(row.output_text) % 4 == i

    def test_two_controllers_flushes_over_the_same_requests_do_not_deadlock(
        self, store: Store, schema_url: str, clock: FakeClock
    ) -> None:
        # One controller takes over requests another still runs: both write to the same rows,
        # each in one transaction per flush, having queued them in opposite orders. Taken in
        # queue order, each would hold one row and wait for the other's (PostgreSQL's
        # "deadlock detected": one flush fails and is retried).
        for i in (1, 2):
            store.add_request(new_request(i))
        meet = threading.Barrier(2)

        def then_meet(on: Store) -> Any:
            def op(request_id: str, *, at: float) -> None:
                on.mark_first_token(request_id, at=at)
                with contextlib.suppress(threading.BrokenBarrierError):
                    meet.wait(timeout=2.0)  # the other holds its first row lock here too

            return op

        with Store(schema_url, clock=clock) as other:
            flushes = []
            for on, (a, b) in ((store, ("r0001", "r0002")), (other, ("r0002", "r0001"))):
                writer = StoreWriter()
                writer.row(a, then_meet(on), at=1.0)
                writer.row(b, on.mark_first_token, at=2.0)
                flushes.append((writer, on))

            async def both() -> None:
                await asyncio.gather(
                    *(w.flush(on, None, 0.0, lambda _settle: []) for w, on in flushes)  # type: ignore[arg-type]
                )

            asyncio.run(both())
            assert not any(writer.pending for writer, _ in flushes)  # both committed at once

    def test_add_requests_async_sends_again_once_when_its_connection_broke(
        self, store: Store, schema_url: str
    ) -> None:
        # Its connections are not pinged before use: the server ending one (a restart, an idle
        # timeout) costs the next statement one more try on a new connection, not an error.
        async def scenario() -> None:
            assert await store.add_requests_async([new_request(1)]) == {"r0001"}
            [idle] = store._pg_idle  # white box: the connection the next call takes
            engine = create_engine(schema_url)
            with engine.begin() as connection:
                connection.execute(
                    text("SELECT pg_terminate_backend(:pid)"), {"pid": idle.info.backend_pid}
                )
            engine.dispose()
            for _ in range(100):  # until the server has closed it
                if idle.pgconn.socket < 0 or not _alive(idle.info.backend_pid, schema_url):
                    break
                await asyncio.sleep(0.01)
            news = [new_request(2, labels=(("k", "v"),)), new_request(3)]
            assert await store.add_requests_async(news) == {"r0002", "r0003"}
            assert idle.closed and store._pg_idle and store._pg_idle[0] is not idle

        asyncio.run(scenario())
        assert store.list_requests(label=("k", "v"))[0][0].id == "r0002"


def _alive(pid: int, url: str) -> bool:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            found = connection.execute(
                text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
            ).scalar_one()
    finally:
        engine.dispose()
    return bool(found)


def test_an_index_built_beforehand_concurrently_is_left_be_by_the_migration(
    postgres_url: str,
) -> None:
    from alembic import command

    from qlm.store.store import alembic_config

    with postgres_schema(postgres_url) as url:
        engine = create_engine(url)
        try:
            config = alembic_config()
            with engine.begin() as connection:
                config.attributes["connection"] = connection
                command.upgrade(config, "0003")
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
                connection.execute(
                    text(
                        "CREATE INDEX CONCURRENTLY ix_requests_finished_at "
                        "ON requests (finished_at)"
                    )
                )
            Store.open(url).close()  # migrates to the latest revision
            with engine.connect() as connection:
                version = connection.execute(text("SELECT version_num FROM alembic_version"))
                assert version.scalar_one() == latest_revision()
                count = connection.execute(
                    text(
                        "SELECT count(*) FROM pg_indexes"
                        " WHERE indexname = :n AND schemaname = current_schema()"
                    ),
                    {"n": "ix_requests_finished_at"},
                )
                assert count.scalar_one() == 1
        finally:
            engine.dispose()
