"""Accepting a request: record it in the store, publish it with a confirm, and only then say 202.

**Order.** A request with an ``Idempotency-Key`` is recorded first (idempotently: by id and by
``(tenant, Idempotency-Key)``; the commit says whether the key was taken) and published second.
A request without one has a fresh random id and needs nothing from the store before it is
published: its message goes out while its row is written, and its caller is answered once both
ended (the confirm and the commit overlap: the two round trips are most of a submission's
latency). Either way, a publish that fails removes the row again (``Store.delete_requests``) and
the client gets 503, and 202 means the broker confirmed the message and the row is written.
When the store fails to write a batch whose messages the broker confirmed, those requests are
accepted all the same (the broker holds them; the controller records each from its message,
as it does for any message whose row is missing) and the failure is logged; from then on
batches are committed before they are published until the store takes one again, so while the
store is down submissions get 503 ``store_unavailable`` and nothing is published.

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

**What can still go wrong** (docs/api.md, "Guarantees"): if the process dies between a
confirm and its commit, the message is in the broker without a row, and the controller records
it from the message. If it dies between a commit and its confirm, the row stays ``queued``
without a message. A client that retries with the same
``Idempotency-Key`` repairs it: a replay of a request that is still queued and was never
dispatched is published again (the controller keys requests by id, so a duplicate message is
harmless). A publish that timed out may still have reached the broker; the row is removed and the
client told 503, but the controller then records the request from the message and serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

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
    """A submission waiting for its outcome: ``future`` is its caller's (cancelled when the
    caller goes away); ``followers`` are told the outcome all the same (replays of the same
    Idempotency-Key in this process)."""

    new: NewRequest
    message: QueuedRequest
    future: asyncio.Future[Accepted]
    followers: list[Callable[[Accepted | None, BaseException | None], None]] | None = None
    outcome: tuple[Accepted | None, BaseException | None] | None = None
    handed: bool = False  # to what gives it its outcome (``_Answering``, a replay's task)


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
        self._inflight: dict[str, _Pending] = {}
        self._writer: asyncio.Task[None] | None = None
        self._free = asyncio.Semaphore(writers)
        self._writing: set[asyncio.Task[None]] = set()
        self._publishes: set[asyncio.Task[None]] = set()
        self._answering: set[_Answering] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self._overlap = False  # see _write
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
        await self._idle.wait()  # the queue answers every publish (its confirm timeout at most)
        if self._publishes:
            await asyncio.gather(*self._publishes, return_exceptions=True)
        for pending in self._pending:
            _resolve(pending, exc=QueueUnavailable("the API is shutting down"))
        self._pending.clear()

    async def submit(self, new: NewRequest, message: QueuedRequest) -> Accepted:
        """Record and publish one request; raise ``QueueUnavailable`` or ``StoreError`` (nothing
        accepted) or ``IdempotencyConflict``."""
        if self._closed or self._writer is None:
            raise QueueUnavailable("the API is not accepting requests (shutting down)")
        future: asyncio.Future[Accepted] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)  # a caller that went away leaves no loose error
        pending = _Pending(new, message, future)
        self._pending.append(pending)
        self._inflight[new.id] = pending
        self._wake.set()
        try:
            return await future  # cancelled with its caller; the batch goes on without it
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
        except StoreError as exc:
            self._overlap = False  # committed first until the store takes a batch again
            _fail(batch, exc)
        except Exception as exc:  # one batch failing must not stop the others
            log.exception("recording %d submissions failed", len(batch))
            _fail(batch, exc)
        except BaseException:  # cancelled mid-batch: nobody may be left waiting
            _fail([p for p in batch if not p.handed], QueueUnavailable("the API is shutting down"))
            raise
        finally:
            self._free.release()

    async def _write(self, batch: list[_Pending]) -> None:
        # Requests without an Idempotency-Key need nothing from the store before they are
        # published (ids are fresh): unless the store failed the last batch, their messages go
        # out now and the commit and the confirm overlap (module docstring, "Order").
        early = [p for p in batch if p.new.idempotency_key is None] if self._overlap else []
        answering: _Answering | None = None
        if early:
            answering = self._publish([(p, None) for p in early], committed=False)
        try:
            created = await self._store.add_requests_async([p.new for p in batch])
        except BaseException as exc:
            if answering is None:
                raise
            answering.commit_ended(exc)  # the broker may hold them: ``_Answering`` decides
            if isinstance(exc, StoreError):
                self._overlap = False  # committed first until the store takes a batch again
            elif not isinstance(exc, Exception):
                raise  # cancelled: ``_write_one`` answers the others
            else:
                log.exception("recording %d submissions failed", len(batch))
            _fail([p for p in batch if p.new.idempotency_key is not None], exc)
            return
        self._overlap = True
        self.batches += 1
        if answering is not None:
            # A fresh id the store already holds was recorded from its message by a controller
            # (the broker confirmed it first): the same request.
            answering.commit_ended(None)
            self.recorded += len(early)
            batch = [p for p in batch if p.new.idempotency_key is not None]
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
                _resolve(pending, exc=result)
            elif result[1]:
                made.append((pending, result[0]))  # the holder went away meanwhile
            else:
                self._replay(pending, result[0])
        self._publish_soon(made)

    def _publish_soon(self, created: list[tuple[_Pending, RequestRow | None]]) -> None:
        if created:
            self.recorded += len(created)
            self._publish(created, committed=True)

    def _publish(
        self, created: list[tuple[_Pending, RequestRow | None]], *, committed: bool
    ) -> _Answering:
        """Publish the messages of ``created`` now; ``_Answering`` answers their callers."""
        answering = _Answering(self, created, committed)
        for pending, _ in created:
            pending.handed = True
        self._answering.add(answering)
        self._idle.clear()
        self._queue.publish_many_then([p.message for p, _ in created], answering.confirmed)
        return answering

    def _answered(self, answering: _Answering) -> None:
        self._answering.discard(answering)
        if not self._answering:
            self._idle.set()

    def _track(self, work: Coroutine[Any, Any, None], *handed: _Pending) -> None:
        for pending in handed:
            pending.handed = True
        task = asyncio.create_task(work, name="qlm-api-publish")
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
            _resolve(pending, exc=IdempotencyConflict(row))
            return
        earlier = self._inflight.get(row.id)
        if earlier is not None and earlier is not pending:
            # Still being published by a call in this process: share its outcome.
            def follow(first: Accepted | None, exc: BaseException | None) -> None:
                if first is None:
                    _resolve(pending, exc=exc or QueueUnavailable("cancelled"))
                else:
                    _resolve(pending, Accepted(pending.new, True, first.row))

            pending.handed = True
            if earlier.outcome is not None:
                follow(*earlier.outcome)
            elif earlier.followers is None:
                earlier.followers = [follow]
            else:
                earlier.followers.append(follow)
            return
        if row.status is RequestStatus.QUEUED and row.attempts == 0:
            # Maybe never published (its API died between commit and confirm): publish again.
            self._track(self._republish(pending, row), pending)
            return
        _resolve(pending, Accepted(pending.new, True, row))

    async def _republish(self, pending: _Pending, row: RequestRow) -> None:
        try:
            await self._queue.publish(message_of(row))
        except QueueUnavailable as exc:
            _resolve(pending, exc=exc)
        else:
            _resolve(pending, Accepted(pending.new, True, row))

    async def _remove(self, failed: list[tuple[_Pending, QueueUnavailable]]) -> None:
        """Remove the rows of requests whose publish failed, then answer their callers 503:
        so that a retry cannot find a row going away."""
        ids = [pending.new.id for pending, _ in failed]
        try:
            await self._threads.run(self._store.delete_requests, ids)
        except StoreError:
            log.exception(
                "could not remove %d requests whose publish failed; they stay queued "
                "without a message until retried with their Idempotency-Key: %s",
                len(ids),
                ", ".join(ids[:20]),
            )
        finally:
            for pending, error in failed:
                _resolve(pending, exc=error)


class _Answering:
    """The callers of one published batch (``created``), answered once the publish ended
    (``confirmed``, called by the queue, straight from the broker's last confirm where it can)
    and the commit it overlaps ended (``commit_ended``; ``committed``: it ended before): each
    caller whose message the broker confirmed is accepted at once, in the same pass of the
    event loop; the rows of the others are removed (unless the commit failed and left none)
    and they get 503."""

    __slots__ = ("_commit", "_created", "_results", "_submitter")

    def __init__(
        self,
        submitter: Submitter,
        created: list[tuple[_Pending, RequestRow | None]],
        committed: bool,
    ) -> None:
        self._submitter = submitter
        self._created = created
        self._results: list[QueueUnavailable | None] | None = None
        self._commit: BaseException | bool | None = None if committed else False
        """False while the commit runs; then None (it succeeded) or its error."""

    def confirmed(self, results: list[QueueUnavailable | None]) -> None:
        self._results = results
        if self._commit is not False:
            self._end()

    def commit_ended(self, error: BaseException | None) -> None:
        self._commit = error
        if self._results is not None:
            self._end()

    def _end(self) -> None:
        try:
            self._answer()
        finally:  # even after a bug: ``close`` waits for every batch to be answered
            self._submitter._answered(self)

    def _answer(self) -> None:
        submitter = self._submitter
        results = self._results
        assert results is not None and self._commit is not False
        unrecorded = self._commit
        failed: list[tuple[_Pending, QueueUnavailable]] = []
        confirmed = 0
        for (pending, row), result in zip(self._created, results, strict=True):
            if result is not None:
                failed.append((pending, result))
            else:
                confirmed += 1
                _resolve(pending, Accepted(pending.new, False, row))
        if unrecorded is not None and confirmed:
            log.warning(
                "%d requests were confirmed by the broker while the store failed to record them "
                "(%s): accepted; the controller records each from its message",
                confirmed,
                unrecorded,
            )
        if failed and unrecorded is None:
            submitter._track(submitter._remove(failed))
        else:
            for pending, error in failed:
                _resolve(pending, exc=error)


def _resolve(
    pending: _Pending, result: Accepted | None = None, *, exc: BaseException | None = None
) -> None:
    """Give ``pending`` its outcome (the first one it gets), its followers too."""
    if pending.outcome is not None:
        return
    pending.outcome = (result, exc)
    if not pending.future.done():  # else its caller went away
        if exc is not None:
            pending.future.set_exception(exc)
        else:
            assert result is not None
            pending.future.set_result(result)
    for follow in pending.followers or ():
        follow(result, exc)
    pending.followers = None


def _retrieve(future: asyncio.Future[Accepted]) -> None:
    if not future.cancelled():
        future.exception()


def _fail(batch: list[_Pending], exc: BaseException) -> None:
    for pending in batch:
        _resolve(pending, exc=exc)
