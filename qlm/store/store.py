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
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import (
    ColumnElement,
    Update,
    and_,
    bindparam,
    case,
    delete,
    exists,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import CursorResult
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from qlm.domain import InstanceSpec, ModelTier, RequestStatus, Tier
from qlm.errors import QLMError
from qlm.store import keys
from qlm.store.database import (
    DEFAULT_PATH,
    WRITE,
    display,
    is_memory,
    make_engine,
    parse_url,
)
from qlm.store.models import (
    ACTIVE_STATUSES,
    FINAL_STATUSES,
    ApiKeyModel,
    Base,
    ControllerStateModel,
    InstanceModel,
    PlanModel,
    RequestLabelModel,
    RequestModel,
)
from qlm.store.rows import (
    ApiKey,
    ControllerStateRow,
    InstanceRow,
    InstanceState,
    NewRequest,
    PlanRow,
    RequestRow,
    SloSummaryRow,
)

if TYPE_CHECKING:
    import psycopg

MIGRATIONS = Path(__file__).parent / "migrations"
SummaryKey = Literal["tenant", "model", "tier"]

_R = RequestModel
_REQUESTS = Base.metadata.tables[RequestModel.__tablename__]


def _prepared_update(**values: Any) -> Update:
    """``UPDATE requests SET values, updated_at = :b_now WHERE id = :b_id AND not final``, built
    once; plain values given as ``None`` become the bound parameter ``b_<column>``."""
    c = _REQUESTS.c
    sets = {k: bindparam(f"b_{k}") if v is None else v for k, v in values.items()}
    return (
        update(_REQUESTS)
        .where(c.id == bindparam("b_id"), c.status.in_(ACTIVE_STATUSES))
        .values(**sets, updated_at=bindparam("b_now"))
    )


_MARK_DISPATCHED = _prepared_update(
    status=literal(RequestStatus.RUNNING.name.lower()),
    instance=bindparam("b_instance"),
    dispatched_at=func.coalesce(_REQUESTS.c.dispatched_at, bindparam("b_at")),
    attempts=_REQUESTS.c.attempts + 1,
)
_MARK_FIRST_TOKEN = _prepared_update(
    first_token_at=func.coalesce(_REQUESTS.c.first_token_at, bindparam("b_at"))
)
_RECORD_OUTCOME = _prepared_update(
    status=None,
    finished_at=None,
    output_text=None,
    output_tokens=None,
    output_tool_calls=None,
    slo_met=None,
    ttft_met=None,
    error=None,
    at_risk=literal(False),
)
_NOT_FINAL = _R.status.in_(ACTIVE_STATUSES)
T = TypeVar("T")
_CHUNK = 512  # ids per IN (...) list: well under SQLite's bound-parameter limit (32,766)
_MIGRATION_LOCK = 0x514C4D  # PostgreSQL advisory lock: one migrating process at a time


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


class InvalidCursor(StoreError):
    """A pagination cursor that ``list_requests`` did not hand out (a client error)."""


class PlanLike(Protocol):
    """The fields of ``qlm.planner.qlm_policy.PlanRecord`` the store keeps. A protocol, so that
    importing the store does not import the planner (numpy, scikit-learn, PuLP)."""

    @property
    def at_s(self) -> float: ...
    @property
    def trigger(self) -> str: ...
    @property
    def groups(self) -> int: ...
    @property
    def status(self) -> str: ...
    @property
    def method(self) -> str: ...
    @property
    def objective(self) -> float: ...
    @property
    def edf_objective(self) -> float: ...
    @property
    def at_risk(self) -> tuple[str, ...]: ...
    @property
    def capacity_needed(self) -> float | None: ...
    @property
    def solve_s(self) -> float: ...
    @property
    def evaluations(self) -> int: ...
    @property
    def concurrency(self) -> Mapping[str, int]: ...
    @property
    def deferred(self) -> int: ...


def alembic_config() -> Config:
    """Alembic's configuration for the migrations shipped inside the package (no alembic.ini)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


class Store:
    """The store on one database URL. ``Store(url)`` connects lazily and does not migrate;
    ``Store.open(url)`` migrates to the latest schema first, as a server does at start-up."""

    def __init__(self, url: str, *, clock: Callable[[], float] = time.time) -> None:
        self._url = parse_url(url)
        self._engine = make_engine(self._url)
        self._postgres = self._url.get_backend_name() == "postgresql"
        self._clock = clock
        self._read = sessionmaker(self._engine)
        self._write = sessionmaker(self._engine.execution_options(**WRITE))
        # A shared in-memory connection runs one transaction at a time (qlm.store.database).
        self._batch = threading.local()
        self._lock: AbstractContextManager[Any] = (
            threading.RLock() if is_memory(self._url) else nullcontext()
        )
        # add_requests_async's own PostgreSQL connections (idle ones), for one event loop.
        self._pg_idle: list[psycopg.AsyncConnection[Any]] = []
        self._pg_loop: asyncio.AbstractEventLoop | None = None

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
            store.migrate()
        except BaseException:
            store.close()
            raise
        return store

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

    # --- requests: recording ---------------------------------------------------------------

    def add_request(self, new: NewRequest) -> tuple[RequestRow, bool]:
        """Record an accepted request; ``(row, True)`` when it is new.

        Idempotent: the same id again, or the same ``(tenant, idempotency_key)``, returns the row
        already there with ``False`` and changes nothing, also when two calls race. An id already
        taken by another tenant raises ``StoreError`` (ids are meant to be unique across tenants).
        """
        labels = dict(new.labels)
        values = _request_values(new, self._clock())
        with self._tx(f"add request {new.id!r}", write=True) as session:
            # ON CONFLICT DO NOTHING without a target covers both the id and the idempotency key.
            stmt = self._insert(RequestModel).values(values).on_conflict_do_nothing()
            created = session.execute(stmt.returning(_R.id)).scalar_one_or_none() is not None
            if created and labels:
                session.execute(
                    insert(RequestLabelModel),
                    [{"request_id": new.id, "key": k, "value": v} for k, v in labels.items()],
                )
            model = session.get(RequestModel, new.id, populate_existing=True)
            if model is not None and model.tenant == new.tenant:
                return _request_row(model), created
            if new.idempotency_key is not None:
                model = session.scalars(
                    select(RequestModel).where(
                        _R.tenant == new.tenant, _R.idempotency_key == new.idempotency_key
                    )
                ).one_or_none()
                if model is not None:
                    return _request_row(model), False
        raise StoreError(f"request id {new.id!r} is already used by another tenant")

    def ensure_requests(self, news: Sequence[NewRequest]) -> dict[str, RequestRow]:
        """Record every request not recorded yet, in one transaction, and return the row of each
        id (existing rows unchanged): what a controller does with a batch of deliveries, most of
        them already stored by the API, some published directly (replays) or redelivered."""
        now = self._clock()
        rows: dict[str, RequestRow] = {}
        with self._tx(f"record {len(news)} requests", write=True) as session:
            for start in range(0, len(news), _CHUNK):
                chunk = news[start : start + _CHUNK]
                # executemany with RETURNING: SQLAlchemy sends a multi-row VALUES statement per
                # run ("insertmanyvalues"), so runs of a few lengths only (``_pieces``).
                stmt = self._insert(RequestModel).on_conflict_do_nothing().returning(_R.id)
                connection = session.connection()
                created: set[str] = set()
                for piece in _pieces(chunk):
                    params = [_request_values(n, now) for n in piece]
                    created.update(connection.execute(stmt, params).scalars())
                labels = [
                    {"request_id": n.id, "key": k, "value": v}
                    for n in chunk
                    if n.id in created
                    for k, v in n.labels
                ]
                if labels:
                    session.execute(insert(RequestLabelModel), labels)
                for n in chunk:
                    if n.id in created:
                        rows[n.id] = n.queued_row(now)
                ids = [n.id for n in chunk if n.id not in created]
                if ids:
                    for model in session.scalars(select(RequestModel).where(_in(_R.id, ids))):
                        rows[model.id] = _request_row(model)
        return rows

    def add_requests(self, news: Sequence[NewRequest]) -> set[str]:
        """Record freshly accepted requests in one transaction, as cheaply as the database
        allows: the API's group commit, thousands per second. One batched ``INSERT ... ON
        CONFLICT DO NOTHING`` (an executemany, nothing read back but the ids of the requests
        that carry an idempotency key). Returns the ids recorded: all of them except those
        whose ``(tenant, idempotency_key)`` was taken (``add_request`` finds that request).
        The ids must be new (the API makes them at random); unlike ``ensure_requests`` this
        does not check them against existing rows."""
        if not news:
            return set()
        now = self._clock()
        table = Base.metadata.tables[RequestModel.__tablename__]
        labels = Base.metadata.tables[RequestLabelModel.__tablename__]
        keyed = [n.id for n in news if n.idempotency_key is not None]
        with self._tx(f"record {len(news)} requests", write=True) as session:
            connection = session.connection()
            stmt = postgresql.insert(table) if self._postgres else sqlite.insert(table)
            connection.execute(
                stmt.on_conflict_do_nothing(),
                [_request_values(n, now) for n in news],
            )
            lost: set[str] = set()
            if keyed:
                present = set(
                    connection.execute(select(table.c.id).where(_in(table.c.id, keyed))).scalars()
                )
                lost = set(keyed) - present
            rows = [
                {"request_id": n.id, "key": k, "value": v}
                for n in news
                if n.id not in lost
                for k, v in n.labels
            ]
            if rows:
                connection.execute(insert(labels), rows)
        return {n.id for n in news} - lost

    async def add_requests_async(self, news: Sequence[NewRequest]) -> set[str]:
        """``add_requests`` for an event loop, as cheap for its process as the database allows:
        the API's group commit at thousands of requests per second.

        The same rows as ``add_requests`` (requests and their labels, ``INSERT ... ON CONFLICT
        DO NOTHING``), written without SQLAlchemy, whose compiling and parameter processing cost
        70-90 µs of CPU per row, and without a worker thread, which would hold the GIL against
        the event loop while it does. Returns the ids inserted: a request whose
        ``(tenant, idempotency_key)`` or id was taken is not (``add_request`` finds the request
        that holds it).

        - **PostgreSQL**: one statement on a psycopg ``AsyncConnection`` on the caller's event
          loop (libpq's I/O waits in the loop, not in a thread). The rows travel as one JSON
          document (``json_populate_recordset``), so the client does one ``json.dumps`` instead
          of adapting every parameter: 15-30 µs of CPU per row. Connections are in autocommit
          mode (one statement is one transaction), one per call in flight, kept for the next
          calls (at most ``_PG_IDLE``), and not pinged before use: a statement that fails
          because its connection broke (a restarted server) is sent once more on a new one.
          Rows the first attempt may have committed before the break count as inserted (their
          ids are fresh).
        - **SQLite**: the raw ``sqlite3`` connection in a worker thread (SQLite releases the GIL
          while it works), in one ``BEGIN IMMEDIATE`` transaction.

        Not part of a ``batch()``: it always commits on its own. Its PostgreSQL connections
        belong to the event loop that made them (a call from another loop replaces them).
        """
        if not news:
            return set()
        if not self._postgres:
            return await asyncio.to_thread(self._add_requests_sqlite, news)
        import psycopg

        now = self._clock()
        rows = json.dumps([_request_values(n, now) for n in news])
        labels = json.dumps(
            [{"request_id": n.id, "key": k, "value": v} for n in news for k, v in n.labels]
        )
        what = f"record {len(news)} requests"
        for attempt in (1, 2):
            connection = await self._pg_take(what, fresh=attempt > 1)
            try:
                cursor = await connection.execute(_PG_ADD_REQUESTS, (rows, labels))
                created = {str(row[0]) for row in await cursor.fetchall()}
                if attempt > 1:
                    ids = [n.id for n in news]
                    cursor = await connection.execute(_PG_PRESENT, (ids,))
                    created = {str(row[0]) for row in await cursor.fetchall()}
            except psycopg.OperationalError as exc:
                broken = connection.broken or connection.closed
                if not broken:
                    self._pg_give_back(connection)
                else:
                    await connection.close()
                if not broken or attempt > 1:
                    raise StoreError(f"cannot {what} ({self.url}): {_pg_reason(exc)}") from exc
                self._drop_pg()  # the others were idle on the same server: likely broken too
            except psycopg.Error as exc:
                self._pg_give_back(connection)  # autocommit: no transaction left open
                raise StoreError(f"cannot {what}: {_pg_reason(exc)}") from exc
            except BaseException:
                # Cancelled mid-statement: the connection's state is unknown; not reused.
                connection.pgconn.finish()
                raise
            else:
                self._pg_give_back(connection)
                return created
        raise AssertionError("unreachable")

    def _add_requests_sqlite(self, news: Sequence[NewRequest]) -> set[str]:
        now = self._clock()
        created: set[str] = set()
        what = f"record {len(news)} requests"
        with self._tx(what, write=True) as session:
            raw = session.connection().connection.driver_connection
            assert isinstance(raw, sqlite3.Connection)
            try:
                cursor = raw.cursor()
                try:
                    for new in news:
                        values = _request_values(new, now)
                        for column in _JSON_COLUMNS:
                            if values[column] is not None:
                                values[column] = json.dumps(values[column])
                        cursor.execute(_SQLITE_ADD_REQUEST, values)
                        if cursor.rowcount == 1:
                            created.add(new.id)
                    labels = [(n.id, k, v) for n in news if n.id in created for k, v in n.labels]
                    if labels:
                        cursor.executemany(_SQLITE_ADD_LABEL, labels)
                finally:
                    cursor.close()
            except sqlite3.Error as exc:
                raise StoreError(f"cannot {what} ({self.url}): {exc}") from exc
        return created

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
        cparams.setdefault("connect_timeout", 10)
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

    def delete_requests(self, ids: Sequence[str]) -> int:
        """Remove requests the API recorded but could not hand to the global queue (the publish
        failed, so the client is told nothing was accepted). Only rows still queued and never
        dispatched go, with their labels: nothing a controller touched is lost. Returns how many
        were removed."""
        removed = 0
        with self._tx(f"delete {len(ids)} unpublished requests", write=True) as session:
            for start in range(0, len(ids), _CHUNK):
                chunk = list(ids[start : start + _CHUNK])
                doomed = select(_R.id).where(
                    _in(_R.id, chunk), _R.status == _name(RequestStatus.QUEUED), _R.attempts == 0
                )
                session.execute(
                    delete(RequestLabelModel).where(RequestLabelModel.request_id.in_(doomed))
                )
                result = session.execute(delete(RequestModel).where(_R.id.in_(doomed)))
                removed += _rowcount(result)
        return removed

    def mark_dispatched(self, id: str, *, instance: str, at: float) -> bool:
        """The request was sent to ``instance``: it is running there. ``dispatched_at`` keeps the
        first dispatch (the end of the wait); ``attempts`` counts them all. False when the request
        is unknown or final (e.g. cancelled while queued: the caller must not run it)."""
        return self._run_update(
            _MARK_DISPATCHED, "mark dispatched", id, {"b_instance": instance, "b_at": at}
        )

    def mark_first_token(self, id: str, *, at: float) -> bool:
        """The first output token arrived; only the first ever counts (a resumed request does
        not reset it). False when the request is unknown or final."""
        return self._run_update(_MARK_FIRST_TOKEN, "mark first token", id, {"b_at": at})

    def record_partial(self, id: str, *, text: str, tokens: int) -> bool:
        """Keep the output generated so far, to resume from if the run is interrupted.
        Monotonic: a report with fewer tokens than already kept changes nothing (False)."""
        return self._update(
            id,
            "record partial output",
            _R.partial_tokens < tokens,
            partial_text=text,
            partial_tokens=tokens,
        )

    def record_eviction(self, id: str, *, partial_text: str, partial_tokens: int) -> bool:
        """The request was evicted and is queued again, keeping its output to resume from (the
        longer of ``partial_*`` and what was kept before). False when unknown or final."""
        longer = _R.partial_tokens <= partial_tokens
        return self._update(
            id,
            "record eviction",
            status=_name(RequestStatus.QUEUED),
            evictions=_R.evictions + 1,
            partial_text=case((longer, partial_text), else_=_R.partial_text),
            partial_tokens=case((longer, partial_tokens), else_=_R.partial_tokens),
        )

    def record_swap(self, id: str) -> bool:
        """The request's KV cache was swapped out to CPU memory once more."""
        return self._update(id, "record swap", swaps=_R.swaps + 1)

    def record_prediction(self, id: str, *, predicted_at: float | None, at_risk: bool) -> bool:
        """The estimator's latest predicted completion time of a waiting or running request."""
        return self._update(
            id, "record prediction", predicted_completion_at=predicted_at, at_risk=at_risk
        )

    def record_predictions(self, predictions: Mapping[str, tuple[float | None, bool]]) -> None:
        """``record_prediction`` for many requests (``id -> (predicted_at, at_risk)``) in one
        transaction and one batched statement; final and unknown ids are skipped."""
        if not predictions:
            return
        table = Base.metadata.tables[RequestModel.__tablename__]
        stmt = (
            update(table)
            # ``or`` of equalities: an ``IN`` list cannot be bound in an executemany.
            .where(
                table.c.id == bindparam("b_id"),
                or_(*(table.c.status == status for status in ACTIVE_STATUSES)),
            )
            .values(
                predicted_completion_at=bindparam("b_at"),
                at_risk=bindparam("b_risk"),
                updated_at=self._clock(),
            )
        )
        params = [  # in id order, as any other batch over these rows should take their locks
            {"b_id": id, "b_at": at, "b_risk": risk}
            for id, (at, risk) in sorted(predictions.items())
        ]
        with self._tx(f"record {len(params)} predictions", write=True) as session:
            session.execute(stmt, params)

    def record_outcome(
        self,
        id: str,
        *,
        status: RequestStatus,
        at: float,
        output_text: str | None = None,
        output_tokens: int = 0,
        slo_met: bool | None = None,
        ttft_met: bool | None = None,
        error: str | None = None,
        tool_calls: Sequence[Mapping[str, Any]] = (),
    ) -> bool:
        """Record how a request ended (``status`` finished, failed or cancelled at ``at``), with
        the tool calls its answer made, if any.

        Idempotent by request id: True when this call recorded it; False, changing nothing, when
        the request was already final (a redelivery, a racing agent) or is unknown. Only after it
        returns may the global-queue delivery be acked.
        """
        if not status.is_final:
            raise ValueError(f"record_outcome needs a final status, got {status.name}")
        values = {
            "status": _name(status),
            "finished_at": at,
            "output_text": output_text,
            "output_tokens": output_tokens,
            "output_tool_calls": [dict(c) for c in tool_calls] or None,
            "slo_met": slo_met,
            "ttft_met": ttft_met,
            "error": error,
        }
        params = {f"b_{k}": v for k, v in values.items()}
        return self._run_update(
            _RECORD_OUTCOME, f"record outcome {status.name.lower()}", id, params
        )

    def cancel(
        self, id: str, *, tenant: str | None = None, at: float | None = None
    ) -> RequestStatus | None:
        """Cancel a request for ``tenant`` (None: an admin, any tenant's). Returns its status
        afterwards, None when there is no such request for that tenant:

        - queued: cancelled at once (``CANCELLED``);
        - running: ``cancel_requested`` is set and ``RUNNING`` returned; the controller aborts it
          and records the outcome ``cancelled`` (``cancel_requested_ids``);
        - final: unchanged.
        """
        now = self._clock()
        with self._tx(f"cancel request {id!r}", write=True) as session:
            # FOR UPDATE keeps a dispatch from slipping between the read and the write
            # (PostgreSQL; SQLite writers are serialised anyway).
            query = select(_R.status).where(_R.id == id).with_for_update()
            if tenant is not None:
                query = query.where(_R.tenant == tenant)
            found = session.execute(query).scalar_one_or_none()
            if found is None:
                return None
            status = _status(found)
            if status is RequestStatus.QUEUED:
                changes: dict[str, Any] = {
                    "status": _name(RequestStatus.CANCELLED),
                    "cancel_requested": True,
                    "finished_at": now if at is None else at,
                    "at_risk": False,
                }
                status = RequestStatus.CANCELLED
            elif status is RequestStatus.RUNNING:
                changes = {"cancel_requested": True}
            else:
                return status
            session.execute(
                update(RequestModel).where(_R.id == id).values(**changes, updated_at=now)
            )
            return status

    # --- requests: reading ------------------------------------------------------------------

    def get(self, id: str, *, tenant: str | None = None) -> RequestRow | None:
        """The request ``id``; None when unknown or, with a ``tenant``, another tenant's."""
        with self._tx(f"get request {id!r}") as session:
            model = session.get(RequestModel, id)
            if model is None or (tenant is not None and model.tenant != tenant):
                return None
            return _request_row(model)

    def is_final(self, id: str) -> bool:
        """Whether the request's outcome is recorded (False for an unknown id)."""
        return bool(self.final_ids([id]))

    def final_ids(self, ids: Iterable[str]) -> set[str]:
        """Which of ``ids`` have a recorded outcome: a recovering controller acks those
        redelivered messages without running them again."""
        wanted = list(dict.fromkeys(ids))
        final: set[str] = set()
        with self._tx(f"check {len(wanted)} requests for outcomes") as session:
            for start in range(0, len(wanted), _CHUNK):
                chunk = wanted[start : start + _CHUNK]
                final.update(
                    session.scalars(
                        select(_R.id).where(_in(_R.id, chunk), _R.status.in_(FINAL_STATUSES))
                    )
                )
        return final

    def list_requests(
        self,
        *,
        tenant: str | None = None,
        status: RequestStatus | None = None,
        model: str | None = None,
        label: tuple[str, str] | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> tuple[list[RequestRow], str | None]:
        """One page of requests, newest first, and the cursor of the next page (None at the end).

        Keyset pagination on ``(submitted_at, id)``: a page starts strictly after the previous
        one's last row, so rows submitted meanwhile never shift, repeat or hide older pages.
        ``since <= submitted_at < until``; ``label`` is one ``(key, value)`` the request carries.
        """
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        query = select(RequestModel)
        if tenant is not None:
            query = query.where(_R.tenant == tenant)
        if status is not None:
            query = query.where(_R.status == _name(status))
        if model is not None:
            query = query.where(_R.model == model)
        if label is not None:
            query = query.where(_has_label(*label))
        if since is not None:
            query = query.where(_R.submitted_at >= since)
        if until is not None:
            query = query.where(_R.submitted_at < until)
        if cursor is not None:
            at, last = _decode_cursor(cursor)
            query = query.where(
                or_(_R.submitted_at < at, and_(_R.submitted_at == at, _R.id < last))
            )
        query = query.order_by(_R.submitted_at.desc(), _R.id.desc()).limit(limit + 1)
        with self._tx("list requests") as session:
            rows = [_request_row(m) for m in session.scalars(query)]
        if len(rows) <= limit:
            return rows, None
        rows = rows[:limit]
        return rows, _encode_cursor(rows[-1].submitted_at, rows[-1].id)

    def counts(self, *, since: float | None = None) -> dict[tuple[str, RequestStatus], int]:
        """Requests per ``(tenant, status)``, submitted at or after ``since`` (for metrics)."""
        query = select(_R.tenant, _R.status, func.count()).group_by(_R.tenant, _R.status)
        if since is not None:
            query = query.where(_R.submitted_at >= since)
        with self._tx("count requests") as session:
            return {(t, _status(s)): int(n) for t, s, n in session.execute(query)}

    def queued_count(self, tenant: str) -> int:
        """How many of ``tenant``'s requests are queued (for its queued-requests limit)."""
        query = select(func.count()).where(
            _R.tenant == tenant, _R.status == _name(RequestStatus.QUEUED)
        )
        with self._tx(f"count queued requests of {tenant!r}") as session:
            return int(session.execute(query).scalar_one())

    def recently_finished(self, limit: int) -> list[RequestRow]:
        """The ``limit`` requests that finished last, latest first (by ``finished_at``: the
        latest *submitted* ones that finished are, under load, the short ones)."""
        query = (
            select(RequestModel)
            .where(_R.status == _name(RequestStatus.FINISHED))
            .order_by(_R.finished_at.desc(), _R.id.desc())
            .limit(limit)
        )
        with self._tx("list recently finished requests") as session:
            return [_request_row(m) for m in session.scalars(query)]

    def cancel_requested_ids(self) -> set[str]:
        """Requests a client cancelled that still await the controller's abort."""
        query = select(_R.id).where(_R.cancel_requested.is_(True), _NOT_FINAL)
        with self._tx("list requests to cancel") as session:
            return set(session.scalars(query))

    def cancellations_since(self, since: float) -> set[str]:
        """Requests a client asked to cancel whose row changed at or after ``since``: what a
        controller polls to learn of cancels made through another process (queued ones are
        already ``cancelled`` in the store; running ones await its abort)."""
        query = select(_R.id).where(_R.cancel_requested.is_(True), _R.updated_at >= since)
        with self._tx("list recent cancellations") as session:
            return set(session.scalars(query))

    def slo_summary(
        self,
        *,
        since: float | None = None,
        until: float | None = None,
        group_by: SummaryKey = "tenant",
    ) -> list[SloSummaryRow]:
        """SLO attainment per tenant, model or tier of the requests submitted in
        ``[since, until)``, ordered by group (see ``SloSummaryRow`` for what counts)."""
        key = {"tenant": _R.tenant, "model": _R.model, "tier": _R.tier}[group_by]

        def count_if(condition: ColumnElement[bool]) -> ColumnElement[int]:
            return func.sum(case((condition, 1), else_=0))

        query = select(
            key,
            func.count(),
            count_if(_R.status == _name(RequestStatus.FINISHED)),
            count_if(_R.status == _name(RequestStatus.FAILED)),
            count_if(_R.status == _name(RequestStatus.CANCELLED)),
            count_if(_NOT_FINAL),
            count_if(_R.slo_met.is_(True)),
        )
        if since is not None:
            query = query.where(_R.submitted_at >= since)
        if until is not None:
            query = query.where(_R.submitted_at < until)
        query = query.group_by(key).order_by(key)
        with self._tx("summarise SLO attainment") as session:
            result = session.execute(query).all()
        return [
            SloSummaryRow(
                group=Tier(group).name.lower() if isinstance(group, int) else str(group),
                requests=int(n),
                finished=int(finished),
                failed=int(failed),
                cancelled=int(cancelled),
                pending=int(pending),
                slo_met=int(met),
            )
            for group, n, finished, failed, cancelled, pending, met in result
        ]

    # --- instances ---------------------------------------------------------------------------

    def upsert_instance(
        self,
        spec: InstanceSpec,
        *,
        state: InstanceState = InstanceState.UP,
        model_tiers: Mapping[str, ModelTier] | None = None,
        keep_draining: bool = False,
    ) -> InstanceRow:
        """Record an instance or update it in place; ``model_tiers`` None keeps the known tiers;
        ``keep_draining`` keeps an operator's drain of a known instance (in the same statement,
        so a drain made concurrently is never lost)."""
        now = self._clock()
        values: dict[str, Any] = {
            "url": spec.url,
            "gpu": spec.gpu,
            "gpu_count": spec.gpu_count,
            "models": list(spec.models),
            "state": state.value,
            "updated_at": now,
        }
        if model_tiers is not None:
            values["model_tiers"] = _tier_names(model_tiers)
        upsert = self._insert(InstanceModel).values(name=spec.name, **{"model_tiers": {}, **values})
        on_conflict = dict(values)
        if keep_draining:
            draining = InstanceState.DRAINING.value
            on_conflict["state"] = case(
                (InstanceModel.state == draining, draining), else_=upsert.excluded.state
            )
        stmt = upsert.on_conflict_do_update(index_elements=[InstanceModel.name], set_=on_conflict)
        with self._tx(f"record instance {spec.name!r}", write=True) as session:
            session.execute(stmt)
            model = session.get(InstanceModel, spec.name, populate_existing=True)
            assert model is not None  # just written in this transaction
            return _instance_row(model)

    def set_instance_state(self, name: str, state: InstanceState) -> bool:
        """Mark an instance up, down or draining; False when it is unknown."""
        return self._update_instance(name, state=state.value)

    def set_instance_health(self, name: str, up: bool) -> bool:
        """Record that a controller found an instance up or down, in one statement that keeps
        an operator's drain (a read-then-write would lose a drain made in between); False when
        the instance is unknown or draining."""
        stmt = (
            update(InstanceModel)
            .where(InstanceModel.name == name)
            .where(InstanceModel.state != InstanceState.DRAINING.value)
            .values(
                state=(InstanceState.UP if up else InstanceState.DOWN).value,
                updated_at=self._clock(),
            )
        )
        with self._tx(f"update instance {name!r}", write=True) as session:
            return _rowcount(session.execute(stmt)) > 0

    def set_model_tiers(self, name: str, model_tiers: Mapping[str, ModelTier]) -> bool:
        """Where each model's weights are on the instance now; False when it is unknown."""
        return self._update_instance(name, model_tiers=_tier_names(model_tiers))

    def remove_instance(self, name: str) -> bool:
        """Forget an instance (its requests keep its name); False when it was unknown."""
        with self._tx(f"remove instance {name!r}", write=True) as session:
            result = session.execute(delete(InstanceModel).where(InstanceModel.name == name))
            return _rowcount(result) > 0

    def instances(self) -> list[InstanceRow]:
        """Every known instance, by name."""
        with self._tx("list instances") as session:
            models = session.scalars(select(InstanceModel).order_by(InstanceModel.name))
            return [_instance_row(m) for m in models]

    # --- plans -------------------------------------------------------------------------------

    def put_controller_state(self, name: str, *, active: bool, snapshot: Mapping[str, Any]) -> None:
        """Publish controller ``name``'s state (replacing what it published before)."""
        values = {"active": active, "updated_at": self._clock(), "snapshot": dict(snapshot)}
        stmt = (
            self._insert(ControllerStateModel)
            .values(name=name, **values)
            .on_conflict_do_update(index_elements=[ControllerStateModel.name], set_=values)
        )
        with self._tx(f"publish the state of controller {name!r}", write=True) as session:
            session.execute(stmt)

    def controller_states(self) -> list[ControllerStateRow]:
        """Every controller's last published state, the most recent first."""
        query = select(ControllerStateModel).order_by(ControllerStateModel.updated_at.desc())
        with self._tx("read controller states") as session:
            return [
                ControllerStateRow(m.name, m.active, m.updated_at, dict(m.snapshot))
                for m in session.scalars(query)
            ]

    def record_plan(self, record: PlanLike, *, controller: str) -> int:
        """Keep one planning event made by ``controller``; returns its id (increasing)."""
        plan = PlanModel(
            controller=controller,
            at=record.at_s,
            trigger=record.trigger,
            groups=record.groups,
            status=record.status,
            method=record.method,
            objective=record.objective,
            edf_objective=record.edf_objective,
            at_risk=list(record.at_risk),
            capacity_needed=record.capacity_needed,
            solve_s=record.solve_s,
            evaluations=record.evaluations,
            concurrency=dict(record.concurrency),
            deferred=record.deferred,
        )
        with self._tx("record plan", write=True) as session:
            session.add(plan)
            session.flush()
            return plan.id

    def latest_plan(self) -> PlanRow | None:
        plans = self.plans(limit=1)
        return plans[0] if plans else None

    def plans(self, *, limit: int = 50) -> list[PlanRow]:
        """The latest ``limit`` plans, newest first."""
        query = select(PlanModel).order_by(PlanModel.id.desc()).limit(limit)
        with self._tx("list plans") as session:
            return [_plan_row(m) for m in session.scalars(query)]

    def unsettled_before(
        self, before: float, *, after: tuple[float, str] | None = None, limit: int = 1000
    ) -> list[tuple[float, str]]:
        """Up to ``limit`` requests submitted before ``before`` that have not ended (queued or
        running), as ``(submitted_at, id)``, oldest first, starting strictly after ``after`` (the
        last pair of the previous page): what the controller's orphan sweep checks against the
        requests it holds."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        query = select(_R.submitted_at, _R.id).where(_NOT_FINAL, _R.submitted_at < before)
        if after is not None:
            at, last = after
            query = query.where(
                or_(_R.submitted_at > at, and_(_R.submitted_at == at, _R.id > last))
            )
        query = query.order_by(_R.submitted_at, _R.id).limit(limit)
        with self._tx("list unsettled requests") as session:
            return [(float(at), str(rid)) for at, rid in session.execute(query)]

    def prune_requests(self, before: float, *, limit: int = 5000) -> int:
        """Delete up to ``limit`` requests that ended (finished, failed or cancelled) before
        ``before``, oldest first, with their labels; returns how many. Retention calls it in
        batches (``QLM_CONTROLLER__RETAIN_DAYS``), so that no transaction holds the table long."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        oldest = (
            select(_R.id)
            .where(_R.finished_at < before, _R.status.in_(FINAL_STATUSES))
            .order_by(_R.finished_at)
            .limit(limit)
        )
        with self._tx("prune requests", write=True) as session:
            deleted = delete(RequestModel).where(_R.id.in_(oldest.scalar_subquery()))
            return _rowcount(session.execute(deleted))

    def prune_plans(self, *, keep: int) -> int:
        """Delete all but the latest ``keep`` plans; returns how many were deleted."""
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        with self._tx("prune plans", write=True) as session:
            oldest_kept = session.scalars(
                select(PlanModel.id).order_by(PlanModel.id.desc()).offset(max(keep - 1, 0))
            ).first()
            if oldest_kept is None:
                return 0
            cut = PlanModel.id < oldest_kept if keep else PlanModel.id <= oldest_kept
            return _rowcount(session.execute(delete(PlanModel).where(cut)))

    # --- API keys ----------------------------------------------------------------------------

    def create_api_key(self, tenant: str, *, admin: bool = False, name: str = "") -> str:
        """A new key for ``tenant``, returned in clear this once; only its digest is stored."""
        key = keys.new_key()
        model = ApiKeyModel(
            tenant=tenant,
            name=name,
            prefix=key[: keys.SHOWN_CHARS],
            key_hash=keys.key_digest(key),
            admin=admin,
            created_at=self._clock(),
            revoked_at=None,
        )
        with self._tx(f"create an API key for {tenant!r}", write=True) as session:
            session.add(model)
        return key

    def lookup_api_key(self, key: str) -> ApiKey | None:
        """Who ``key`` belongs to; None when it is unknown, malformed or revoked."""
        if not keys.looks_like_key(key):
            return None
        query = select(ApiKeyModel).where(
            ApiKeyModel.key_hash == keys.key_digest(key), ApiKeyModel.revoked_at.is_(None)
        )
        with self._tx("look up an API key") as session:
            model = session.scalars(query).one_or_none()
            return None if model is None else _api_key(model)

    def revoke_api_key(self, key_id: int, *, at: float | None = None) -> bool:
        """Revoke key ``key_id`` (see ``api_keys``); False when unknown or already revoked."""
        stmt = (
            update(ApiKeyModel)
            .where(ApiKeyModel.id == key_id, ApiKeyModel.revoked_at.is_(None))
            .values(revoked_at=self._clock() if at is None else at)
        )
        with self._tx(f"revoke API key {key_id}", write=True) as session:
            return _rowcount(session.execute(stmt)) > 0

    def api_keys(self, *, tenant: str | None = None) -> list[ApiKey]:
        """Every key (revoked ones too), without secrets, oldest first."""
        query = select(ApiKeyModel).order_by(ApiKeyModel.id)
        if tenant is not None:
            query = query.where(ApiKeyModel.tenant == tenant)
        with self._tx("list API keys") as session:
            return [_api_key(m) for m in session.scalars(query)]

    # --- plumbing ----------------------------------------------------------------------------

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

    def _update(self, id: str, what: str, *where: ColumnElement[bool], **values: Any) -> bool:
        """One conditional UPDATE of a request that is not final; True when it matched. A Core
        statement on the table: the ORM's bulk-update path costs twice the CPU for nothing here
        (no objects are loaded)."""
        stmt = (
            update(_REQUESTS)
            .where(_R.id == id, _NOT_FINAL, *where)
            .values(**values, updated_at=self._clock())
        )
        with self._tx(f"{what} of request {id!r}", write=True) as session:
            return _rowcount(session.execute(stmt)) > 0

    def _run_update(self, stmt: Update, what: str, id: str, params: dict[str, Any]) -> bool:
        """A prepared conditional UPDATE (``_prepared_update``) of request ``id``: the hot
        per-request writes skip building and cache-keying a statement on every call."""
        params = {**params, "b_id": id, "b_now": self._clock()}
        with self._tx(f"{what} of request {id!r}", write=True) as session:
            return _rowcount(session.execute(stmt, params)) > 0

    def _update_instance(self, name: str, **values: Any) -> bool:
        stmt = (
            update(InstanceModel)
            .where(InstanceModel.name == name)
            .values(**values, updated_at=self._clock())
        )
        with self._tx(f"update instance {name!r}", write=True) as session:
            return _rowcount(session.execute(stmt)) > 0

    def _insert(self, model: type[Any]) -> postgresql.Insert | sqlite.Insert:
        """The dialect's INSERT, for its ON CONFLICT clauses (same syntax on both)."""
        return postgresql.insert(model) if self._postgres else sqlite.insert(model)


# --- conversions --------------------------------------------------------------------------


def _name(status: RequestStatus) -> str:
    return status.name.lower()


def _status(name: str) -> RequestStatus:
    return RequestStatus[name.upper()]


def _has_label(key: str, value: str) -> ColumnElement[bool]:
    label = RequestLabelModel
    return exists().where(label.request_id == _R.id, label.key == key, label.value == value)


def _tier_names(tiers: Mapping[str, ModelTier]) -> dict[str, str]:
    return {model: tier.name.lower() for model, tier in tiers.items()}


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


def _encode_cursor(at: float, id: str) -> str:
    raw = json.dumps([at, id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        at, id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if (
            isinstance(at, int | float)
            and not isinstance(at, bool)
            and isinstance(id, str)
            and "\x00" not in id  # no request has it (PostgreSQL text cannot hold NUL)
        ):
            return float(at), id
    except (binascii.Error, ValueError, TypeError):
        pass
    raise InvalidCursor(f"invalid cursor {cursor!r}: pass back the one list_requests returned")


def _request_row(m: RequestModel) -> RequestRow:
    return RequestRow(
        id=m.id,
        tenant=m.tenant,
        model=m.model,
        slo_class=m.slo_class,
        prompt=m.prompt,
        messages=m.messages,
        prompt_tokens=m.prompt_tokens,
        max_tokens=m.max_tokens,
        sampling=m.sampling,
        slo_e2e_s=m.slo_e2e_s,
        slo_ttft_s=m.slo_ttft_s,
        tier=Tier(m.tier),
        labels=tuple(m.labels.items()),
        idempotency_key=m.idempotency_key,
        status=_status(m.status),
        cancel_requested=m.cancel_requested,
        submitted_at=m.submitted_at,
        dispatched_at=m.dispatched_at,
        first_token_at=m.first_token_at,
        finished_at=m.finished_at,
        instance=m.instance,
        output_text=m.output_text,
        output_tokens=m.output_tokens,
        output_tool_calls=m.output_tool_calls,
        partial_text=m.partial_text,
        partial_tokens=m.partial_tokens,
        evictions=m.evictions,
        swaps=m.swaps,
        attempts=m.attempts,
        slo_met=m.slo_met,
        ttft_met=m.ttft_met,
        error=m.error,
        predicted_completion_at=m.predicted_completion_at,
        at_risk=m.at_risk,
        updated_at=m.updated_at,
    )


def _instance_row(m: InstanceModel) -> InstanceRow:
    return InstanceRow(
        name=m.name,
        url=m.url,
        gpu=m.gpu,
        gpu_count=m.gpu_count,
        models=tuple(m.models),
        state=InstanceState(m.state),
        model_tiers={model: ModelTier[tier.upper()] for model, tier in m.model_tiers.items()},
        updated_at=m.updated_at,
    )


def _plan_row(m: PlanModel) -> PlanRow:
    return PlanRow(
        id=m.id,
        controller=m.controller,
        at=m.at,
        trigger=m.trigger,
        groups=m.groups,
        status=m.status,
        method=m.method,
        objective=m.objective,
        edf_objective=m.edf_objective,
        at_risk=tuple(m.at_risk),
        capacity_needed=m.capacity_needed,
        solve_s=m.solve_s,
        evaluations=m.evaluations,
        concurrency=m.concurrency,
        deferred=m.deferred,
    )


def _api_key(m: ApiKeyModel) -> ApiKey:
    return ApiKey(
        id=m.id,
        tenant=m.tenant,
        name=m.name,
        prefix=m.prefix,
        admin=m.admin,
        created_at=m.created_at,
        revoked_at=m.revoked_at,
    )


def _pg_reason(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _request_values(new: NewRequest, now: float) -> dict[str, Any]:
    """The column values of a new request's row."""
    return {
        "id": new.id,
        "tenant": new.tenant,
        "model": new.model,
        "slo_class": new.slo_class,
        "prompt": new.prompt,
        "messages": new.messages,
        "prompt_tokens": new.prompt_tokens,
        "max_tokens": new.max_tokens,
        "sampling": dict(new.sampling),
        "slo_e2e_s": new.slo_e2e_s,
        "slo_ttft_s": new.slo_ttft_s,
        "tier": int(new.tier),
        "labels": dict(new.labels),
        "idempotency_key": new.idempotency_key,
        "status": _name(RequestStatus.QUEUED),
        "cancel_requested": False,
        "submitted_at": new.submitted_at,
        "output_tokens": 0,
        "partial_text": "",
        "partial_tokens": 0,
        "evictions": 0,
        "swaps": 0,
        "attempts": 0,
        "at_risk": False,
        "updated_at": now,
    }


_NEW_COLUMNS = tuple(
    _request_values(NewRequest("", "", "", 0, 0, 0.0, 0.0), 0.0)  # the columns a new row sets
)
_JSON_COLUMNS = ("messages", "sampling", "labels")
_PG_IDLE = 4  # connections add_requests_async keeps open between calls
_PG_ADD_REQUESTS = f"""
WITH new AS (
    INSERT INTO requests ({", ".join(_NEW_COLUMNS)})
    SELECT {", ".join(_NEW_COLUMNS)} FROM json_populate_recordset(NULL::requests, %s::json)
    ON CONFLICT DO NOTHING
    RETURNING id
), labelled AS (
    INSERT INTO request_labels (request_id, key, value)
    SELECT l.request_id, l.key, l.value
    FROM json_to_recordset(%s::json) AS l(request_id text, key text, value text)
    JOIN new ON new.id = l.request_id
)
SELECT id FROM new
"""
"""``add_requests_async`` on PostgreSQL: one statement, one implicit transaction. The label rows
join the requests actually inserted; a JSON ``null`` is SQL NULL (``messages``), and a nested JSON
value keeps its text (``json.dumps``'s, as SQLAlchemy writes it)."""
_PG_PRESENT = "SELECT id FROM requests WHERE id = ANY(%s)"
_SQLITE_ADD_REQUEST = (
    f"INSERT INTO requests ({', '.join(_NEW_COLUMNS)}) "
    f"VALUES ({', '.join(':' + c for c in _NEW_COLUMNS)}) ON CONFLICT DO NOTHING"
)
_SQLITE_ADD_LABEL = "INSERT INTO request_labels (request_id, key, value) VALUES (?, ?, ?)"
