"""Recording new requests: one at a time and idempotently (``add_request``), a controller's
batch of deliveries (``ensure_requests``), and the API's group commit (``add_requests``,
``add_requests_async``), with the undo of a batch the global queue did not take
(``delete_requests``).

``add_requests_async`` bypasses SQLAlchemy for its statements: one JSON document per batch on
PostgreSQL, the raw ``sqlite3`` connection on SQLite.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from qlm import jsontext
from qlm.domain import RequestStatus, Tier
from qlm.store.base import _CHUNK, StoreBase, StoreError, _in, _pg_reason, _pieces, _rowcount
from qlm.store.models import Base, RequestLabelModel, RequestModel
from qlm.store.requests import _R, ROW_COLUMNS, _name, _request_row, _row_of_values
from qlm.store.rows import NewRequest, RequestRow


class RequestIngest(StoreBase):
    """How requests get into the store."""

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
        them already stored by the API, some published directly (replays) or redelivered.

        The rows already there are read first and only the others are inserted: sending every
        request's values again, to be dropped by ``ON CONFLICT``, cost most of a take-over's
        store time (psycopg parses each multi-row statement anew)."""
        now = self._clock()
        rows: dict[str, RequestRow] = {}
        with self._tx(f"record {len(news)} requests", write=True) as session:
            for start in range(0, len(news), _CHUNK):
                chunk = news[start : start + _CHUNK]
                rows.update(_read_rows(session, [n.id for n in chunk]))
                missing = [n for n in chunk if n.id not in rows]
                if not missing:
                    continue
                # executemany with RETURNING: SQLAlchemy sends a multi-row VALUES statement per
                # run ("insertmanyvalues"), so runs of a few lengths only (``_pieces``).
                stmt = self._insert(RequestModel).on_conflict_do_nothing().returning(_R.id)
                connection = session.connection()
                created: set[str] = set()
                for piece in _pieces(missing):
                    params = [_request_values(n, now) for n in piece]
                    created.update(connection.execute(stmt, params).scalars())
                labels = [
                    {"request_id": n.id, "key": k, "value": v}
                    for n in missing
                    if n.id in created
                    for k, v in n.labels
                ]
                if labels:
                    session.execute(insert(RequestLabelModel), labels)
                for n in missing:
                    if n.id in created:
                        rows[n.id] = n.queued_row(now)
                # recorded meanwhile by another writer, or kept out by an idempotency key
                rows.update(_read_rows(session, [n.id for n in missing if n.id not in created]))
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
          document (``json_populate_recordset``), so the client writes one JSON text instead
          of adapting every parameter: 15-30 µs of CPU per row, of which the document
          (``_rows_document``: ``json.dumps``'s text, written from a template) ~3.5 µs. Each row
          carries only the columns its request gives; the columns every new row starts with the
          same values in, and the label rows, are made by the statement (``_PG_ADD_REQUESTS``).
          Connections are in autocommit mode (one statement is one transaction), one per call
          in flight, kept for the next calls (at most ``_PG_IDLE``), and not pinged before use:
          a statement that fails because its connection broke (a restarted server) is sent once
          more on a new one.
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

        initial = json.dumps(_initial_values(self._clock()))
        rows = _rows_document(news)
        what = f"record {len(news)} requests"
        for attempt in (1, 2):
            connection = await self._pg_take(what, fresh=attempt > 1)
            try:
                cursor = await connection.execute(_PG_ADD_REQUESTS, (initial, rows))
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


def _read_rows(session: Session, ids: Sequence[str]) -> dict[str, RequestRow]:
    """The rows of those of ``ids`` that are recorded, by id. Read as plain rows of the table's
    columns, not as ORM objects (nothing here changes them), taken by position
    (``_row_of_values``): the ORM's loading and identity map were most of what a take-over's
    100,000 reads cost."""
    if not ids:
        return {}
    values = session.execute(select(*ROW_COLUMNS).where(_in(_R.id, ids)))
    rows = (_row_of_values(v) for v in values)
    return {row.id: row for row in rows}


def _request_values(new: NewRequest, now: float) -> dict[str, Any]:
    """The column values of a new request's row."""
    return _given_values(new) | _initial_values(now)


def _given_values(new: NewRequest) -> dict[str, Any]:
    """The columns of a new request's row that the request gives."""
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
        "submitted_at": new.submitted_at,
    }


def _rows_document(news: Sequence[NewRequest]) -> str:
    """``json.dumps([_given_values(n) for n in news])``, row by row (``_row_document``)."""
    return "[" + ", ".join(map(_row_document, news)) + "]"


def _row_document(new: NewRequest) -> str:
    """``json.dumps(_given_values(new))``: the text it writes, its constant parts written once
    and each value by the function ``json`` writes it with (``qlm.jsontext``). Values of other
    types than the usual ones take ``json.dumps`` itself; a test compares both."""
    prompt = new.prompt
    ttft = new.slo_ttft_s
    key = new.idempotency_key
    tier = new.tier
    if not (
        type(new.id) is str
        and type(new.tenant) is str
        and type(new.model) is str
        and type(new.slo_class) is str
        and (prompt is None or type(prompt) is str)
        and (key is None or type(key) is str)
        and type(new.prompt_tokens) is int
        and type(new.max_tokens) is int
        and (type(tier) is Tier or type(tier) is int)
        and type(new.slo_e2e_s) is float
        and -_INF < new.slo_e2e_s < _INF
        and type(new.submitted_at) is float
        and -_INF < new.submitted_at < _INF
        and (ttft is None or (type(ttft) is float and -_INF < ttft < _INF))
    ):
        return json.dumps(_given_values(new))
    sampling = new.sampling
    if type(sampling) is not dict:
        sampling = dict(sampling)
    labels = dict(new.labels)
    return (
        f'{{"id": {_ASCII(new.id)}, "tenant": {_ASCII(new.tenant)}, '
        f'"model": {_ASCII(new.model)}, "slo_class": {_ASCII(new.slo_class)}, '
        f'"prompt": {"null" if prompt is None else _ASCII(prompt)}, '
        f'"messages": {"null" if new.messages is None else json.dumps(new.messages)}, '
        f'"prompt_tokens": {new.prompt_tokens}, "max_tokens": {new.max_tokens}, '
        f'"sampling": {_FLAT(sampling, _ASCII, ", ", ": ") or json.dumps(sampling)}, '
        f'"slo_e2e_s": {new.slo_e2e_s!r}, '
        f'"slo_ttft_s": {"null" if ttft is None else _FLOAT(ttft)}, "tier": {_INT(tier)}, '
        f'"labels": {_FLAT(labels, _ASCII, ", ", ": ") or json.dumps(labels)}, '
        f'"idempotency_key": {"null" if key is None else _ASCII(key)}, '
        f'"submitted_at": {new.submitted_at!r}}}'
    )


_FLAT = jsontext.flat_object
_ASCII = jsontext.ASCII
_FLOAT = jsontext.FLOAT
_INT = jsontext.INT
_INF = jsontext.INF


def _initial_values(now: float) -> dict[str, Any]:
    """The columns every new row starts with the same values in (recorded at ``now``)."""
    return {
        "status": _name(RequestStatus.QUEUED),
        "cancel_requested": False,
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
_PG_ADD_REQUESTS = f"""
WITH new AS (
    INSERT INTO requests ({", ".join(_NEW_COLUMNS)})
    SELECT {", ".join(_NEW_COLUMNS)}
    FROM json_populate_recordset(json_populate_record(NULL::requests, %s::json), %s::json)
    ON CONFLICT DO NOTHING
    RETURNING id, labels
), labelled AS (
    INSERT INTO request_labels (request_id, key, value)
    SELECT new.id, l.key, l.value FROM new CROSS JOIN LATERAL json_each_text(new.labels) AS l
)
SELECT id FROM new
"""
"""``add_requests_async`` on PostgreSQL: one statement, one implicit transaction. The rows
travel as one JSON document of the columns each request gives (``_given_values``); the columns
every new row starts with the same values in come once per batch, as the record the rows are
populated over (``_initial_values``). The label rows are those of the requests actually
inserted, read from their ``labels`` column. A JSON ``null`` is SQL NULL (``messages``), and a
nested JSON value keeps its text (``json.dumps``'s, as SQLAlchemy writes it)."""
_PG_PRESENT = "SELECT id FROM requests WHERE id = ANY(%s)"
_SQLITE_ADD_REQUEST = (
    f"INSERT INTO requests ({', '.join(_NEW_COLUMNS)}) "
    f"VALUES ({', '.join(':' + c for c in _NEW_COLUMNS)}) ON CONFLICT DO NOTHING"
)
_SQLITE_ADD_LABEL = "INSERT INTO request_labels (request_id, key, value) VALUES (?, ?, ?)"
