"""Engines for the two supported databases, set up for many threads.

The store is synchronous and the asyncio service calls it through ``asyncio.to_thread``, so every
engine here is shared by threads, each call taking its own session:

- **PostgreSQL** (``postgresql+psycopg://``): a connection pool with pre-ping, so a restarted
  server costs one retried checkout, not an error. The ping is a round trip per transaction;
  the API's submissions do not pay it: ``Store.add_requests_async`` writes on connections of its
  own, not pinged, and sends a statement again once when its connection turns out broken.
- **SQLite file** (``sqlite:///qlm.db``): one connection per thread from a pool, WAL journal so
  readers never block the writer, and writes that start with ``BEGIN IMMEDIATE``. A deferred
  transaction that reads and then writes fails at once with "database is locked" when another
  writer got in between (the busy timeout does not apply to that upgrade); taking the write lock
  up front makes writers queue instead. ``synchronous`` stays FULL: an outcome must be durable
  before the broker delivery is acked.
- **SQLite in memory** (``sqlite://``, for tests): one connection shared by every thread
  (``StaticPool``), or each thread would see its own empty database. A shared connection has one
  transaction at a time, so the store serialises its calls with a lock (``shared_connection``).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.pool import StaticPool

from qlm.errors import ConfigError

SETTING = "QLM_DATABASE_URL"
DEFAULT_PATH = "qlm.db"
WRITE = {"qlm_sqlite_begin": "BEGIN IMMEDIATE"}
"""Execution options of a writing session's engine; only SQLite reads them."""

_EXAMPLES = "sqlite:///qlm.db or postgresql+psycopg://user:password@host:5432/qlm"
_BUSY_TIMEOUT_S = 30.0


def parse_url(url: str) -> URL:
    """The SQLAlchemy URL of ``url``; plain ``postgresql://`` and ``postgres://`` get psycopg 3.

    Raises ``ConfigError`` naming ``QLM_DATABASE_URL`` for anything else than SQLite or
    PostgreSQL through psycopg (the backends the migrations are tested on).
    """
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ConfigError(
            f"{SETTING} must be a URL like {_EXAMPLES}, got {_masked(url)!r}"
        ) from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername not in ("sqlite", "sqlite+pysqlite", "postgresql+psycopg"):
        raise ConfigError(
            f"{SETTING} must use sqlite or postgresql+psycopg, got {parsed.drivername!r} "
            f"(e.g. {_EXAMPLES})"
        )
    return parsed


def is_memory(url: URL) -> bool:
    """Whether ``url`` is an in-memory SQLite database (gone when its connection closes)."""
    if url.get_backend_name() != "sqlite":
        return False
    return url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"


CONNECT_S = 10
"""Seconds a PostgreSQL connection attempt may take (``connect_timeout`` in the URL overrides)."""


def make_engine(url: URL) -> Engine:
    """An engine for ``url`` (from ``parse_url``) set up as the module docstring says."""
    try:
        if url.get_backend_name() == "postgresql":
            # A server that drops packets fails a connect in seconds, not at the OS's TCP
            # timeout (the API's own connections use the same bound); the URL may set another.
            timeout = {} if "connect_timeout" in url.query else {"connect_timeout": CONNECT_S}
            return create_engine(url, pool_pre_ping=True, connect_args=timeout)
        return _sqlite_engine(url)
    except (NoSuchModuleError, ImportError) as exc:
        raise ConfigError(
            f"{SETTING} is a PostgreSQL URL but its driver, psycopg 3, is not installed ({exc}): "
            "install QLM with its postgres extra, pip install 'qlm[postgres]'"
        ) from None
    except ArgumentError as exc:
        raise ConfigError(f"{SETTING}: {exc}") from None


def display(url: URL) -> str:
    """``url`` fit for a log line or an error message: its password hidden."""
    return url.render_as_string(hide_password=True)


def unreachable(url: URL, reason: str) -> str:
    """The one line a store that cannot be connected to gets at start-up: where (password
    hidden), the driver's reason, what to check, and the setting that chose it."""
    if url.get_backend_name() == "sqlite":
        hint = "does its directory exist, and may this user write there?"
    else:
        hint = _postgres_hint(reason)
    return f"cannot reach the store at {display(url)}: {reason}; {hint} ({SETTING})"


def _postgres_hint(reason: str) -> str:
    """What to check for libpq's reason: a login it refuses, a database that does not exist, a
    host name that does not resolve, else a server that is not there."""
    text = reason.lower()
    if "authentication" in text or "password" in text or ("role" in text and "not exist" in text):
        return "check the user and password in the URL"
    if "database" in text and "does not exist" in text:
        return "create the database first (createdb), or name an existing one"
    if "resolve" in text or "translate host name" in text:
        return "check the host name in the URL"
    return "is PostgreSQL running there?"


def _sqlite_engine(url: URL) -> Engine:
    memory = is_memory(url)
    connect_args: dict[str, Any] = {"check_same_thread": False, "timeout": _BUSY_TIMEOUT_S}
    if memory:
        engine = create_engine(url, connect_args=connect_args, poolclass=StaticPool)
    else:
        engine = create_engine(url, connect_args=connect_args)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transactions out of pysqlite's hands (it would not BEGIN before DDL, nor
        # IMMEDIATE); ``_on_begin`` emits them instead.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys = ON")
        if not memory:
            cursor.execute("PRAGMA journal_mode = WAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql(
            connection.get_execution_options().get("qlm_sqlite_begin", "BEGIN")
        )

    return engine


@contextmanager
def scratch_schema(postgres_url: str, prefix: str = "qlm_scratch") -> Iterator[str]:
    """The URL of a fresh PostgreSQL schema (``<prefix>_<hex>``, selected through the
    connection's ``search_path``) for one test or benchmark run, dropped with everything in it
    afterwards: runs never see each other's tables."""
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_url)
    try:
        with admin.begin() as connection:
            connection.execute(text(f'CREATE SCHEMA "{schema}"'))
        url = make_url(postgres_url).update_query_dict({"options": f"-csearch_path={schema}"})
        try:
            yield url.render_as_string(hide_password=False)
        finally:
            with admin.begin() as connection:
                connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    finally:
        admin.dispose()


def _masked(url: str) -> str:
    return re.sub(r"//[^/@]*@", "//***@", url)
