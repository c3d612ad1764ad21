"""The durable record of every request, instance, plan and API key (ARCHITECTURE.md §2 step 6).

``Store`` is synchronous and thread-safe: each call opens its own session on a shared engine and
commits before it returns, so the asyncio service calls it through ``asyncio.to_thread`` and the
controller from its own thread. Callers get frozen rows (``qlm.store.rows``), never ORM objects,
and every database failure as a ``StoreError``. One exception: ``add_requests_async``, the API's
ingest hot path, runs on the caller's event loop, on connections of its own.

State changes are single conditional ``UPDATE`` statements (``... WHERE status IN ('queued',
'running')``) rather than read-modify-write, so concurrent callers need no locks: the database
decides which of two racing outcomes lands, on SQLite (one writer at a time) and on PostgreSQL
(the second ``UPDATE`` waits for the first and re-checks its condition) alike.

``Store`` is composed of one part per resource, each in a module of its own: ``ingest``
(recording new requests), ``requests`` (their life cycle, queries and retention), ``instances``,
``plans``, ``controllers`` (the state each controller publishes) and ``keys`` (API keys), all
over ``base`` (engine, sessions, transactions, errors). This module assembles them and adds the
store's life cycle: open, migrate, close.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from alembic import command
from alembic.config import Config
from sqlalchemy.exc import SQLAlchemyError

from qlm.store.base import StoreError, _reason
from qlm.store.controllers import ControllerStates
from qlm.store.database import DEFAULT_PATH, WRITE, unreachable
from qlm.store.ingest import RequestIngest
from qlm.store.instances import Instances
from qlm.store.keys import ApiKeys
from qlm.store.plans import Plans
from qlm.store.requests import Requests

MIGRATIONS = Path(__file__).parent / "migrations"
_MIGRATION_LOCK = 0x514C4D  # PostgreSQL advisory lock: one migrating process at a time


def alembic_config() -> Config:
    """Alembic's configuration for the migrations shipped inside the package (no alembic.ini)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


class Store(RequestIngest, Requests, Instances, Plans, ControllerStates, ApiKeys):
    """The store on one database URL. ``Store(url)`` connects lazily and does not migrate;
    ``Store.open(url)`` migrates to the latest schema first, as a server does at start-up."""

    @classmethod
    def open(
        cls,
        url: str | None = None,
        *,
        default_path: str | Path = DEFAULT_PATH,
        clock: Callable[[], float] = time.time,
    ) -> Store:
        """The migrated store at ``url``, or at the SQLite file ``default_path`` when ``url`` is
        None (the embedded default); the file's directory is created when missing."""
        if url is None:
            path = Path(default_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            url = f"sqlite:///{path}"
        store = cls(url, clock=clock)
        try:
            store._reach()
            store.migrate()
        except BaseException:
            store.close()
            raise
        return store

    def _reach(self) -> None:
        """Connect once before migrating, so that a database that is not there (a server down,
        a wrong host or password, a directory that does not exist) stops start-up with one line
        saying so and naming ``QLM_DATABASE_URL``, not as a failed migration."""
        try:
            with self._engine.connect():
                pass
        except SQLAlchemyError as exc:
            raise StoreError(unreachable(self._url, _reason(exc))) from exc

    def migrate(self) -> None:
        """Upgrade the schema to the latest Alembic revision; a no-op when it is there already.

        Runs in one transaction (both backends have transactional DDL), under an advisory lock on
        PostgreSQL so that an API and a controller starting together do not both create tables.
        """
        config = alembic_config()
        with self._lock:
            try:
                with self._engine.execution_options(**WRITE).begin() as connection:
                    if self._postgres:
                        connection.exec_driver_sql(
                            f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})"
                        )
                    config.attributes["connection"] = connection
                    command.upgrade(config, "head")
            except SQLAlchemyError as exc:
                raise StoreError(f"cannot migrate {self.url}: {_reason(exc)}") from exc

    def close(self) -> None:
        """Close every pooled connection (an in-memory database is gone afterwards), and the
        connections of ``add_requests_async``."""
        self._drop_pg()
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
