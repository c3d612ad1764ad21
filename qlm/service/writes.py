"""The controller service's store writer: what the event loop reports (dispatches, first tokens,
partial outputs, outcomes, plans, predictions) is queued as store operations and applied in
one transaction per flush: those on one request in order, the requests in id order (two
controllers' flushes over the same rows, as when one takes over what the other still runs, take
their row locks in one order and cannot deadlock), then the rest in order; the outcomes a flush committed are then logged
(``qlm.outcomes``) and their deliveries settled with the broker — acked, or
dead-lettered with their reason — and never before."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qlm.domain import RequestStatus
from qlm.global_queue import Delivery, GlobalQueue
from qlm.outcomes import log_outcome
from qlm.store import OutcomeRow, Store

log = logging.getLogger(__name__)

Settle = tuple[str, str, RequestStatus]
"""(request id, "ack" or the reason to dead-letter it, its final status)"""


@dataclass(slots=True)
class _Writes:
    """Store operations queued by the runtime's callbacks, applied in order by the writer."""

    rows: list[tuple[str, Callable[[], Any]]] = field(default_factory=list)  # by request id
    ops: list[Callable[[], Any]] = field(default_factory=list)
    settle: list[Settle] = field(default_factory=list)


class StoreWriter:
    """Queued store operations and the settlement of what they commit (module docstring)."""

    def __init__(self) -> None:
        self._writes = _Writes()
        self._settling: set[asyncio.Task[None]] = set()  # acks of committed outcomes
        self._unsettled = 0  # deliveries they are settling

    def op(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue ``fn(*args, **kwargs)`` for the next flush, after its operations on requests."""
        self._writes.ops.append(lambda: fn(*args, **kwargs))

    def row(self, request_id: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue ``fn(request_id, *args, **kwargs)``, an operation on that request's row."""
        self._writes.rows.append((request_id, lambda: fn(request_id, *args, **kwargs)))

    def settle_after(self, request_id: str, how: str, status: RequestStatus) -> None:
        """Settle the request's deliveries (``how``: "ack" or the reason to dead-letter them)
        once the operations queued so far are committed; ``status``: its final status."""
        self._writes.settle.append((request_id, how, status))

    @property
    def pending(self) -> bool:
        """Operations or settlements not done yet."""
        writes = self._writes
        return bool(writes.rows or writes.ops or writes.settle or self._unsettled)

    async def flush(
        self,
        store: Store,
        queue: GlobalQueue,
        retry_s: float,
        committed: Callable[[list[Settle]], list[tuple[Delivery, str]]],
    ) -> None:
        """Apply the queued store operations in order, then settle the deliveries whose outcome
        they committed (``committed`` names them). A failed write is retried at the next flush
        (nothing is acked before), after ``retry_s``."""
        writes, self._writes = self._writes, _Writes()
        if writes.rows or writes.ops:
            try:
                outcomes = await asyncio.to_thread(_run_all, store, writes.rows, writes.ops)
            except Exception:
                log.exception("store write failed; retrying")
                self._writes.rows[:0] = writes.rows
                self._writes.ops[:0] = writes.ops
                self._writes.settle[:0] = writes.settle
                await asyncio.sleep(retry_s)  # the store may be down: do not spin
                return
            for outcome in outcomes:
                log_outcome(outcome)
        batch = committed(writes.settle)
        if batch:
            self._unsettled += len(batch)
            task = asyncio.create_task(self._settle(queue, batch), name="qlm-settle")
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def _settle(self, queue: GlobalQueue, batch: list[tuple[Delivery, str]]) -> None:
        """Ack (or dead-letter) deliveries whose outcome a flush committed: in a task of their
        own, beside the writer. Awaited in the writer, each settlement waited for the event
        loop's turn (a control step under a backlog), and a flush settling thousands held the
        next flushes — and the store writes piling up behind them — for tens of seconds
        (measured with RabbitMQ); nor does a slow one hold the next batches back."""
        try:
            results = await asyncio.gather(
                *(queue.ack(d) if how == "ack" else queue.dead_letter(d, how) for d, how in batch),
                return_exceptions=True,
            )
        finally:
            self._unsettled -= len(batch)
        for failed in results:
            if isinstance(failed, BaseException):
                log.error(
                    "could not settle a delivery (its outcome is stored; the broker delivers "
                    "it again when its channel closes): %r",
                    failed,
                )

    async def wait_settled(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the settlements under way; cancel those still going
        (the broker delivers their deliveries again)."""
        if self._settling:
            _, late = await asyncio.wait(set(self._settling), timeout=timeout_s)
            if late:
                log.warning("stopping with deliveries unsettled: the broker delivers them again")
                for task in late:
                    task.cancel()


def _run_all(
    store: Store, rows: list[tuple[str, Callable[[], Any]]], ops: list[Callable[[], Any]]
) -> list[OutcomeRow]:
    """In one transaction (one commit for a whole flush): the operations on requests in id
    order (a stable sort: each request's in the order queued), then the others in order;
    returns the outcomes it recorded (``Store.record_outcome_row``'s answers)."""
    by_id = sorted(rows, key=lambda row: row[0])
    with store.batch():
        results = [op() for _, op in by_id] + [op() for op in ops]
    return [r for r in results if isinstance(r, OutcomeRow)]
