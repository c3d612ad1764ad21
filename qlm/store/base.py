"""What every part of the store shares: the engine and its sessions, one transaction per call
(``_tx``) or per ``batch()``, database errors translated into ``StoreError``, the dialect's
``INSERT`` for ``ON CONFLICT`` clauses, and the PostgreSQL connections ``add_requests_async``
keeps for its event loop.

``StoreBase`` holds that state; the per-resource parts of ``qlm.store.store.Store`` derive from
it and call it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from sqlalchemy import event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import CursorResult
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from qlm.errors import QLMError
from qlm.store.database import CONNECT_S, WRITE, display, is_memory, make_engine, parse_url
from qlm.store.latency import write_tally

if TYPE_CHECKING:
    import psycopg

T = TypeVar("T")
_CHUNK = 512  # ids per IN (...) list: well under SQLite's bound-parameter limit (32,766)
_PG_IDLE = 4  # connections add_requests_async keeps open between calls


def _in(column: Any, ids: Sequence[str]) -> Any:
    """``column IN (ids)`` with the list padded to a power of two (the last id repeated).

    SQLAlchemy renders an ``IN`` list with one parameter per value, so every list length is a
    statement of its own, and each database connection keeps the statements it prepared (SQLite:
    128 per connection; psycopg: 100) — with lengths from 1 to 512 a long-running controller's
    memory grew by tens of MB that way. Padded, a query has at most ten shapes."""
    padded = list(ids)
    if padded:
        padded += [padded[-1]] * ((1 << (len(padded) - 1).bit_length()) - len(padded))
    return column.in_(padded)


def _pieces(items: Sequence[T]) -> Iterator[Sequence[T]]:
    """``items`` in runs of power-of-two lengths, longest first (37 → 32, 4, 1): an
    executemany with ``RETURNING`` is sent as one multi-row statement per run (SQLAlchemy's
    "insertmanyvalues"), and a statement per length would fill the connections' caches of
    prepared statements (see ``_in``)."""
    start = 0
    for bit in reversed(range(len(items).bit_length())):
        if len(items) & (1 << bit):
            yield items[start : start + (1 << bit)]
            start += 1 << bit


class StoreError(QLMError):
    """The database refused or failed an operation; the message says which and why."""


class StoreBase:
    """The engine, sessions and transactions of one database URL, shared by the parts of
    ``Store``. ``StoreBase(url)`` connects lazily."""

    def __init__(self, url: str, *, clock: Callable[[], float] = time.time) -> None:
        self._url = parse_url(url)
        self._engine = make_engine(self._url)
        self._postgres = self._url.get_backend_name() == "postgresql"
        self._clock = clock
        self._read = sessionmaker(self._engine)
        self._write = sessionmaker(self._engine.execution_options(**WRITE))
        # Latency observations gathered in a transaction are written as it commits.
        event.listen(self._write, "before_commit", write_tally)
        # A shared in-memory connection runs one transaction at a time (qlm.store.database).
        self._batch = threading.local()
        self._lock: AbstractContextManager[Any] = (
            threading.RLock() if is_memory(self._url) else nullcontext()
        )
        # add_requests_async's own PostgreSQL connections (idle ones), for one event loop.
        self._pg_idle: list[psycopg.AsyncConnection[Any]] = []
        self._pg_loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        """The database URL, password hidden."""
        return display(self._url)

    @property
    def backend(self) -> Literal["postgresql", "sqlite"]:
        """Which database: PostgreSQL takes concurrent writers, SQLite one at a time."""
        return "postgresql" if self._postgres else "sqlite"

    def now(self) -> float:
        """The store's clock (unix time unless a test gave another): what ``updated_at`` and
        the other bookkeeping times are on."""
        return self._clock()

    @contextmanager
    def _tx(self, what: str, *, write: bool = False) -> Iterator[Session]:
        """One session and transaction, committed on exit; database errors become StoreError.
        Inside ``batch()`` on the same thread, the batch's transaction is used instead."""
        shared = getattr(self._batch, "session", None)
        if shared is not None:
            yield shared
            return
        with self._lock:
            try:
                with (self._write if write else self._read).begin() as session:
                    yield session
            except OperationalError as exc:
                raise StoreError(f"cannot {what} ({self.url}): {_reason(exc)}") from exc
            except SQLAlchemyError as exc:
                raise StoreError(f"cannot {what}: {_reason(exc)}") from exc

    @property
    def in_batch(self) -> bool:
        """This thread is inside ``batch()``: its calls share one transaction."""
        return getattr(self._batch, "session", None) is not None

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Run the store calls made inside, on this thread, in one write transaction: one commit
        for many small updates (the controller's writer). All or nothing: on an error nothing
        of the batch is kept."""
        if getattr(self._batch, "session", None) is not None:
            yield  # already in a batch
            return
        with self._tx("write a batch", write=True) as session:
            self._batch.session = session
            try:
                yield
            finally:
                self._batch.session = None

    def _insert(self, model: type[Any]) -> postgresql.Insert | sqlite.Insert:
        """The dialect's INSERT, for its ON CONFLICT clauses (same syntax on both)."""
        return postgresql.insert(model) if self._postgres else sqlite.insert(model)

    async def _pg_take(self, what: str, *, fresh: bool) -> psycopg.AsyncConnection[Any]:
        """An idle connection of this event loop, or a new one (``fresh``: always new)."""
        import psycopg

        loop = asyncio.get_running_loop()
        if self._pg_loop is not loop:
            self._drop_pg()
            self._pg_loop = loop
        while self._pg_idle and not fresh:
            connection = self._pg_idle.pop()
            if not connection.closed:
                return connection
        cargs, cparams = self._engine.dialect.create_connect_args(self._url)
        cparams.pop("context", None)  # SQLAlchemy's adapters: plain psycopg here
        cparams.setdefault("connect_timeout", CONNECT_S)
        try:
            return await psycopg.AsyncConnection.connect(*cargs, autocommit=True, **cparams)
        except psycopg.Error as exc:
            raise StoreError(f"cannot {what} ({self.url}): {_pg_reason(exc)}") from exc

    def _pg_give_back(self, connection: psycopg.AsyncConnection[Any]) -> None:
        if len(self._pg_idle) < _PG_IDLE and not connection.closed:
            self._pg_idle.append(connection)
        else:
            connection.pgconn.finish()

    def _drop_pg(self) -> None:
        """Close ``add_requests_async``'s idle connections (libpq's close is synchronous)."""
        idle, self._pg_idle = self._pg_idle, []
        for connection in idle:
            if not connection.closed:
                connection.pgconn.finish()


def _rowcount(result: Any) -> int:
    # Session.execute is typed as returning Result; DML statements return a CursorResult.
    assert isinstance(result, CursorResult)
    return result.rowcount


def _reason(exc: SQLAlchemyError) -> str:
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip().splitlines()[0]
    if "no such table" in text or ("relation" in text and "does not exist" in text):
        text += " (is the database migrated? Store.migrate())"
    return text


def _pg_reason(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
