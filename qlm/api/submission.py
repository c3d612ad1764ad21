"""Accepting a request: record it in the store, publish it with a confirm, and only then say 202.

**Order.** The row goes in first (idempotently: by id and by ``(tenant, Idempotency-Key)``), the
message second. A publish that fails removes the row again (``Store.delete_requests``) and the
client gets 503: a request is either both stored and confirmed by the broker, or neither.

**Group commit.** One store transaction per request would cap ingest at what the database does in
single-row commits (a few hundred per second with fsync, plus a statement's CPU each). Instead
the writer takes every submission waiting whenever one of its ``writers`` slots is free — at
most ``max_batch`` — and records them in one transaction (``Store.add_requests_async``: one
statement on the event loop, no worker thread), then publishes the batch at once
(``GlobalQueue.publish_many``: confirms pipelined on one channel) while it records the next
batches. There is no timer: an idle server records a lone request at once, a busy one in
batches as large as the load makes them. Several batches in flight (``writers``: 3 on PostgreSQL, 1 on SQLite, which
writes one transaction at a time anyway) spare a request the wait for the commit before its
own. Each caller still gets its answer only after its own row is committed and its own message
confirmed.

**What can still go wrong** (docs/api.md, "Guarantees"): if the process dies between the commit
and the confirm, the row stays ``queued`` without a message. A client that retries with the same
``Idempotency-Key`` repairs it: a replay of a request that is still queued and was never
dispatched is published again (the controller keys requests by id, so a duplicate message is
harmless). A publish that timed out may still have reached the broker; the row is removed and the
client told 503, but the controller then records the request from the message and serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from qlm.api.prompts import render_chat
from qlm.api.threads import StoreThreads
from qlm.domain import RequestStatus
from qlm.global_queue import GlobalQueue, QueuedRequest, QueueUnavailable
from qlm.store import NewRequest, RequestRow, Store, StoreError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Accepted:
    """A stored, broker-confirmed request: the caller's ``new`` as recorded just now, or, when
    ``replayed``, the earlier request that holds its Idempotency-Key. ``stored``: the row read
    from the store (a replay's, or one recorded by a retry); None when ``new`` was recorded
    as it is, whose row ``row`` builds only when asked for — the native 202 needs a few of its
    fields (``id``, ``model``, ...), and a row is 35 fields to set on the hot path."""

    new: NewRequest
    replayed: bool
    stored: RequestRow | None = None

    @property
    def row(self) -> RequestRow:
        """The request's row as the store holds it now."""
        if self.stored is not None:
            return self.stored
        return self.new.queued_row(self.new.submitted_at)


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before for a different request (``existing``)."""

    def __init__(self, existing: RequestRow) -> None:
        super().__init__(existing.id)
        self.existing = existing


@dataclass(slots=True)
class _Pending:
    new: NewRequest
    message: QueuedRequest
    future: asyncio.Future[Accepted]


def message_of(row: RequestRow) -> QueuedRequest:
    """The queue message of a stored request (to publish a replay again)."""
    return QueuedRequest(
        id=row.id,
        model=row.model,
        prompt_tokens=row.prompt_tokens,
        max_tokens=row.max_tokens,
        slo_e2e_s=row.slo_e2e_s,
        slo_ttft_s=row.slo_ttft_s,
        submitted_at=row.submitted_at,
        tenant=row.tenant,
        prompt=row.prompt if row.messages is None else render_chat(row.messages),
        messages=row.messages,
        sampling=dict(row.sampling),
        tier=int(row.tier),
        labels=dict(row.labels),
    )


def same_request(row: RequestRow, new: NewRequest) -> bool:
    """Whether a replayed Idempotency-Key names the same request (what it asks for, not when)."""
    return (
        row.model == new.model
        and row.prompt == new.prompt
        and row.messages == new.messages
        and row.max_tokens == new.max_tokens
    )


class Submitter:
    """The group-committing writer (module docstring). ``start`` before use, ``close`` after."""

    def __init__(
        self,
        store: Store,
        queue: GlobalQueue,
        *,
        max_batch: int = 512,
        writers: int = 1,
        threads: StoreThreads | None = None,
    ) -> None:
        self._store = store
        self._threads = threads if threads is not None else StoreThreads()
        self._queue = queue
        self._max_batch = max_batch
        self._pending: list[_Pending] = []
        self._wake = asyncio.Event()
        self._inflight: dict[str, asyncio.Future[Accepted]] = {}
        self._writer: asyncio.Task[None] | None = None
        self._free = asyncio.Semaphore(writers)
        self._writing: set[asyncio.Task[None]] = set()
        self._publishes: set[asyncio.Task[None]] = set()
        self._closed = False
        self.batches = 0
        self.recorded = 0

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write_forever(), name="qlm-api-submitter")

    async def close(self) -> None:
        """Finish the batches in flight, refuse what still waits."""
        self._closed = True
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        if self._writing:
            await asyncio.gather(*self._writing, return_exceptions=True)
        if self._publishes:
            await asyncio.gather(*self._publishes, return_exceptions=True)
        for pending in self._pending:
            if not pending.future.done():
                pending.future.set_exception(QueueUnavailable("the API is shutting down"))
        self._pending.clear()

    async def submit(self, new: NewRequest, message: QueuedRequest) -> Accepted:
        """Record and publish one request; raise ``QueueUnavailable`` or ``StoreError`` (nothing
        accepted) or ``IdempotencyConflict``."""
        if self._closed or self._writer is None:
            raise QueueUnavailable("the API is not accepting requests (shutting down)")
        future: asyncio.Future[Accepted] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)  # a caller that went away leaves no loose error
        self._pending.append(_Pending(new, message, future))
        self._inflight[new.id] = future
        self._wake.set()
        try:
            return await asyncio.shield(future)
        finally:
            self._inflight.pop(new.id, None)

    # --- the writer ---------------------------------------------------------------------------

    async def _write_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._free.acquire()  # one of ``writers`` batches in flight at most
                if not self._pending:
                    self._free.release()
                    break
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                task = asyncio.create_task(self._write_one(batch), name="qlm-api-record")
                self._writing.add(task)
                task.add_done_callback(self._writing.discard)

    async def _write_one(self, batch: list[_Pending]) -> None:
        try:
            await self._write(batch)
        except Exception as exc:  # one batch failing must not stop the others
            log.exception("recording %d submissions failed", len(batch))
            _fail(batch, exc)
        finally:
            self._free.release()

    async def _write(self, batch: list[_Pending]) -> None:
        try:
            created = await self._store.add_requests_async([p.new for p in batch])
        except StoreError as exc:
            _fail(batch, exc)
            return
        self.batches += 1
        fresh: list[tuple[_Pending, RequestRow | None]] = [
            (p, None) for p in batch if p.new.id in created
        ]
        taken = [p for p in batch if p.new.id not in created]
        self._publish_soon(fresh)
        if not taken:
            return
        # Rare: an Idempotency-Key used before. Look up the request that holds it.
        try:
            found = await self._threads.run(self._lookup, [p.new for p in taken])
        except Exception as exc:  # not the batch's: its new requests are being published
            log.exception("looking up %d taken Idempotency-Keys failed", len(taken))
            _fail(taken, exc)
            return
        made: list[tuple[_Pending, RequestRow | None]] = []
        for pending, result in zip(taken, found, strict=True):
            if isinstance(result, StoreError):
                _settle(pending.future, exc=result)
            elif result[1]:
                made.append((pending, result[0]))  # the holder went away meanwhile
            else:
                self._replay(pending, result[0])
        self._publish_soon(made)

    def _publish_soon(self, created: list[tuple[_Pending, RequestRow | None]]) -> None:
        if created:
            self.recorded += len(created)
            task = asyncio.create_task(self._publish(created), name="qlm-api-publish")
            self._publishes.add(task)
            task.add_done_callback(self._publishes.discard)

    def _lookup(self, news: Sequence[NewRequest]) -> list[tuple[RequestRow, bool] | StoreError]:
        """In a worker thread: the request holding each taken Idempotency-Key (or id), as
        ``add_request`` finds it; ``(row, True)`` when that recorded the request after all (the
        holder was removed in between)."""
        out: list[tuple[RequestRow, bool] | StoreError] = []
        for new in news:
            try:
                out.append(self._store.add_request(new))
            except StoreError as exc:
                out.append(exc)
        return out

    def _replay(self, pending: _Pending, row: RequestRow) -> None:
        """An earlier request holds the Idempotency-Key: answer with it once it is confirmed."""
        if not same_request(row, pending.new):
            _settle(pending.future, exc=IdempotencyConflict(row))
            return
        earlier = self._inflight.get(row.id)
        if earlier is not None and earlier is not pending.future:
            # Still being published by a call in this process: share its outcome.
            def follow(done: asyncio.Future[Accepted]) -> None:
                if done.cancelled() or done.exception() is not None:
                    _settle(pending.future, exc=done.exception() or QueueUnavailable("cancelled"))
                else:
                    first = done.result()
                    _settle(pending.future, Accepted(pending.new, True, first.row))

            earlier.add_done_callback(follow)
            return
        if row.status is RequestStatus.QUEUED and row.attempts == 0:
            # Maybe never published (its API died between commit and confirm): publish again.
            task = asyncio.create_task(self._republish(pending, row), name="qlm-api-republish")
            self._publishes.add(task)
            task.add_done_callback(self._publishes.discard)
            return
        _settle(pending.future, Accepted(pending.new, True, row))

    async def _republish(self, pending: _Pending, row: RequestRow) -> None:
        try:
            await self._queue.publish(message_of(row))
        except QueueUnavailable as exc:
            _settle(pending.future, exc=exc)
        else:
            _settle(pending.future, Accepted(pending.new, True, row))

    async def _publish(self, created: list[tuple[_Pending, RequestRow | None]]) -> None:
        try:
            results: Sequence[BaseException | None] = await self._queue.publish_many(
                [p.message for p, _ in created]
            )
        except Exception as exc:  # a bug, not the broker: answer every caller all the same
            log.exception("publishing %d requests failed", len(created))
            results = [exc] * len(created)
        except BaseException:  # cancelled (shutting down): nobody may be left waiting
            _fail([p for p, _ in created], QueueUnavailable("the API is shutting down"))
            raise
        failed: list[tuple[_Pending, BaseException]] = []
        for (pending, row), result in zip(created, results, strict=True):
            if result is not None:
                failed.append((pending, result))
            else:
                _settle(pending.future, Accepted(pending.new, False, row))
        if not failed:
            return
        # Remove the rows before answering, so that a retry cannot find one that is going away.
        ids = [pending.new.id for pending, _ in failed]
        try:
            await self._threads.run(self._store.delete_requests, ids)
        except StoreError:
            log.exception(
                "could not remove %d requests whose publish failed; they stay queued without "
                "a message until retried with their Idempotency-Key: %s",
                len(ids),
                ", ".join(ids[:20]),
            )
        for pending, error in failed:
            if not isinstance(error, QueueUnavailable):
                error = QueueUnavailable(f"publish failed: {error!r}")
            _settle(pending.future, exc=error)


def _settle(
    future: asyncio.Future[Accepted],
    result: Accepted | None = None,
    *,
    exc: BaseException | None = None,
) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        assert result is not None
        future.set_result(result)


def _retrieve(future: asyncio.Future[Accepted]) -> None:
    if not future.cancelled():
        future.exception()


def _fail(batch: list[_Pending], exc: BaseException) -> None:
    for pending in batch:
        _settle(pending.future, exc=exc)
