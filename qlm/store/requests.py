"""Requests in the store after they are recorded: their life cycle (dispatched, first token,
partial output, evictions, swaps, predictions, outcome, cancel), the queries over them (one
request, pages, counts, SLO attainment, what a controller polls) and their retention.

Every state change is one conditional ``UPDATE`` of a request that is not final (see
``qlm.store.store``); the hot ones are statements built once (``_prepared_update``).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any, Literal

from sqlalchemy import (
    ColumnElement,
    Row,
    Update,
    and_,
    bindparam,
    case,
    delete,
    exists,
    func,
    literal,
    or_,
    select,
    update,
)

from qlm.domain import RequestStatus, Tier
from qlm.store import latency
from qlm.store.base import _CHUNK, StoreBase, StoreError, _in, _rowcount
from qlm.store.models import ACTIVE_STATUSES, FINAL_STATUSES, Base, RequestLabelModel, RequestModel
from qlm.store.rows import LatencyBucketRow, OutcomeRow, RequestRow, SloBucketRow, SloSummaryRow

SummaryKey = Literal["tenant", "model", "tier"]

MAX_SERIES_BUCKETS = 1000
"""The most buckets ``slo_series`` returns: its SQL holds one comparison per bucket."""

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
# An outcome returns what its latencies are measured from (qlm.store.latency) and what else
# the line it is logged with names (OutcomeRow).
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
).returning(
    _REQUESTS.c.tenant,
    _REQUESTS.c.model,
    _REQUESTS.c.tier,
    _REQUESTS.c.submitted_at,
    _REQUESTS.c.dispatched_at,
    _REQUESTS.c.first_token_at,
    _REQUESTS.c.instance,
)
_NOT_FINAL = _R.status.in_(ACTIVE_STATUSES)


class InvalidCursor(StoreError):
    """A pagination cursor that ``list_requests`` did not hand out (a client error)."""


class Requests(StoreBase):
    """The store's requests once recorded (``RequestIngest`` records them)."""

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
        the tool calls its answer made, if any. A finished request's latencies are added to the
        histograms (``qlm.store.latency``) in the same transaction.

        Idempotent by request id: True when this call recorded it; False, changing nothing, when
        the request was already final (a redelivery, a racing agent) or is unknown. Only after it
        returns may the global-queue delivery be acked.
        """
        recorded = self.record_outcome_row(
            id,
            status=status,
            at=at,
            output_text=output_text,
            output_tokens=output_tokens,
            slo_met=slo_met,
            ttft_met=ttft_met,
            error=error,
            tool_calls=tool_calls,
        )
        return recorded is not None

    def record_outcome_row(
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
    ) -> OutcomeRow | None:
        """``record_outcome``, returning the outcome this call recorded (None: none, the
        request was final already or is unknown), for the line it is logged with."""
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
        params = {f"b_{k}": v for k, v in values.items()} | {"b_id": id, "b_now": self._clock()}
        what = f"record outcome {status.name.lower()}"
        with self._tx(f"{what} of request {id!r}", write=True) as session:
            found = session.execute(_RECORD_OUTCOME, params).first()
            if found is None:
                return None
            tenant, model, tier, submitted_at, dispatched_at, first_token_at, instance = found
            if status is RequestStatus.FINISHED:
                latency.tally(session).finished(
                    tier=tier,
                    model=model,
                    submitted_at=submitted_at,
                    dispatched_at=dispatched_at,
                    first_token_at=first_token_at,
                    finished_at=at,
                )
        return OutcomeRow(
            id=id,
            tenant=tenant,
            model=model,
            tier=Tier(tier),
            status=status,
            submitted_at=submitted_at,
            dispatched_at=dispatched_at,
            first_token_at=first_token_at,
            finished_at=at,
            instance=instance,
            output_tokens=output_tokens,
            slo_met=slo_met,
            error=error,
            ttft_met=ttft_met,
        )

    def latency_buckets(self) -> list[LatencyBucketRow]:
        """The latency histograms' stored buckets (``qlm.store.latency``), for metrics."""
        with self._tx("read latency histograms") as session:
            return latency.read(session)

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
        return self.cancel_row(id, tenant=tenant, at=at)[0]

    def cancel_row(
        self, id: str, *, tenant: str | None = None, at: float | None = None
    ) -> tuple[RequestStatus | None, OutcomeRow | None]:
        """``cancel``, with the outcome this call recorded: a queued request's ``cancelled``,
        for the line it is logged with (``qlm.outcomes``); None when it recorded none (the
        request runs, and its controller records the outcome; or it was final already)."""
        now = self._clock()
        ended = now if at is None else at
        with self._tx(f"cancel request {id!r}", write=True) as session:
            # FOR UPDATE keeps a dispatch from slipping between the read and the write
            # (PostgreSQL; SQLite writers are serialised anyway).
            query = select(
                _R.status, _R.tenant, _R.model, _R.tier, _R.submitted_at, _R.dispatched_at,
                _R.first_token_at, _R.instance, _R.output_tokens,
            ).where(_R.id == id).with_for_update()  # fmt: skip
            if tenant is not None:
                query = query.where(_R.tenant == tenant)
            found = session.execute(query).first()
            if found is None:
                return None, None
            status = _status(found.status)
            if status is RequestStatus.QUEUED:
                changes: dict[str, Any] = {
                    "status": _name(RequestStatus.CANCELLED),
                    "cancel_requested": True,
                    "finished_at": ended,
                    "at_risk": False,
                }
                status = RequestStatus.CANCELLED
            elif status is RequestStatus.RUNNING:
                changes = {"cancel_requested": True}
            else:
                return status, None
            session.execute(
                update(RequestModel).where(_R.id == id).values(**changes, updated_at=now)
            )
        if status is not RequestStatus.CANCELLED:
            return status, None
        return status, OutcomeRow(
            id=id,
            tenant=found.tenant,
            model=found.model,
            tier=Tier(found.tier),
            status=status,
            submitted_at=found.submitted_at,
            dispatched_at=found.dispatched_at,
            first_token_at=found.first_token_at,
            finished_at=ended,
            instance=found.instance,
            output_tokens=found.output_tokens or 0,
            slo_met=None,
            error=None,
        )

    def get(self, id: str, *, tenant: str | None = None) -> RequestRow | None:
        """The request ``id``; None when unknown or, with a ``tenant``, another tenant's."""
        with self._tx(f"get request {id!r}") as session:
            model = session.get(RequestModel, id)
            if model is None or (tenant is not None and model.tenant != tenant):
                return None
            return _request_row(model)

    def get_many(self, ids: Iterable[str]) -> list[RequestRow]:
        """The requests among ``ids`` the store knows, in the order of ``ids`` (unknown ones,
        e.g. deleted by retention, left out)."""
        wanted = list(dict.fromkeys(ids))
        found: dict[str, RequestRow] = {}
        with self._tx(f"get {len(wanted)} requests") as session:
            for start in range(0, len(wanted), _CHUNK):
                chunk = wanted[start : start + _CHUNK]
                for model in session.scalars(select(RequestModel).where(_in(_R.id, chunk))):
                    found[model.id] = _request_row(model)
        return [found[id] for id in wanted if id in found]

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

    def slo_series(
        self, *, since: float, until: float, step: float, tenant: str | None = None
    ) -> list[SloBucketRow]:
        """SLO attainment of the requests submitted in ``[since, until)`` (of ``tenant``, or all),
        in consecutive buckets of ``step`` seconds from ``since`` (the last one ends at
        ``until``): every bucket, empty ones too, oldest first. One scan: the bucket of a row
        is a ``CASE`` over the bounds, the same SQL on SQLite and PostgreSQL (whose casts of a
        float to an integer round where SQLite's truncate)."""
        if not until > since:
            raise ValueError(f"until ({until}) must be after since ({since})")
        if not step > 0:
            raise ValueError(f"step must be > 0, got {step}")
        count = math.ceil((until - since) / step)
        if count > MAX_SERIES_BUCKETS:
            raise ValueError(
                f"{count} buckets of {step:g} s in [{since:g}, {until:g}): at most "
                f"{MAX_SERIES_BUCKETS}, take a longer step"
            )
        starts = [since + i * step for i in range(count)]
        whens = [(_R.submitted_at < start + step, i) for i, start in enumerate(starts[:-1])]
        rows = select(
            (case(*whens, else_=count - 1) if whens else literal(count - 1)).label("bucket"),
            _R.status.label("status"),
            _R.slo_met.label("slo_met"),
        ).where(_R.submitted_at >= since, _R.submitted_at < until)
        if tenant is not None:
            rows = rows.where(_R.tenant == tenant)
        # Grouped outside: PostgreSQL cannot tell that a CASE with bound parameters in the
        # select list and the same CASE in GROUP BY are one expression.
        inner = rows.subquery()

        def count_if(condition: ColumnElement[bool]) -> ColumnElement[int]:
            return func.sum(case((condition, 1), else_=0))

        query = select(
            inner.c.bucket,
            func.count(),
            count_if(inner.c.status == _name(RequestStatus.FINISHED)),
            count_if(inner.c.status == _name(RequestStatus.FAILED)),
            count_if(inner.c.status == _name(RequestStatus.CANCELLED)),
            count_if(inner.c.status.in_(ACTIVE_STATUSES)),
            count_if(inner.c.slo_met.is_(True)),
        ).group_by(inner.c.bucket)
        with self._tx("summarise SLO attainment over time") as session:
            found = {int(row[0]): [int(v) for v in row[1:]] for row in session.execute(query)}
        return [
            SloBucketRow(start, min(start + step, until), *found.get(i, [0] * 6))
            for i, start in enumerate(starts)
        ]

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


def _name(status: RequestStatus) -> str:
    return status.name.lower()


def _status(name: str) -> RequestStatus:
    return RequestStatus[name.upper()]


def _has_label(key: str, value: str) -> ColumnElement[bool]:
    label = RequestLabelModel
    return exists().where(label.request_id == _R.id, label.key == key, label.value == value)


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


_ROW_FIELDS = tuple(f.name for f in fields(RequestRow))
ROW_COLUMNS = tuple(RequestModel.__table__.c[name] for name in _ROW_FIELDS)
"""The request table's columns in the order of ``RequestRow``'s fields (``_row_of_values``)."""
_TIER_AT, _LABELS_AT, _STATUS_AT = (_ROW_FIELDS.index(n) for n in ("tier", "labels", "status"))
_TIERS = {int(t): t for t in Tier}


def _row_of_values(values: Sequence[Any]) -> RequestRow:
    """The row of a request from the values of ``ROW_COLUMNS``, in order (a plain ``SELECT``):
    taken by position, not looked up by name on SQLAlchemy's row (36 lookups a row were most of
    what reading a take-over's 100,000 rows cost)."""
    row = list(values)
    row[_TIER_AT] = _TIERS[row[_TIER_AT]]
    row[_LABELS_AT] = tuple(row[_LABELS_AT].items())
    row[_STATUS_AT] = _status(row[_STATUS_AT])
    return RequestRow(*row)


def _request_row(m: RequestModel | Row[Any]) -> RequestRow:
    """The row of a request, from its ORM object or a plain row of the table's columns (their
    names are the object's attributes)."""
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
