"""The store's upkeep by the leading controller: retention of ended requests and old plans
(``prune``), requests the broker gave up on (``reap_dead``: the dead-letter queue's messages
recorded failed) and rows no message stands for (``OrphanSweep``). ``ControllerService`` runs each
on its own period."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from qlm.domain import Request, RequestStatus
from qlm.global_queue import DeadLetter, GlobalQueue, MessageError, QueuedRequest
from qlm.outcomes import log_outcome
from qlm.store import NewRequest, RequestRow, Store, StoreError

log = logging.getLogger(__name__)

RETAIN_BATCH = 5000
"""Ended requests deleted per transaction by retention."""

ORPHAN_PAGE = 1000
"""Rows the orphan sweep reads per query (the oldest first)."""

ORPHAN_PAGES = 20
"""Queries per round of the orphan sweep, at most."""

ORPHAN_ERROR = (
    "lost before it reached the global queue: no message stands for it (the API that recorded "
    "it stopped before the broker confirmed it, so its client was never answered, or an "
    "in-process queue was lost with its process); submit it again, with a new Idempotency-Key"
)


def new_request(msg: QueuedRequest, request: Request | None = None) -> NewRequest:
    """The store's row of a queued request, as the API records it; ``request``: its domain
    request, when the caller has made it already (``msg.to_request(arrival_s=...)``). A chat's
    message carries its rendered text as ``prompt`` (for estimates and for engines without a
    chat template); its row holds the messages only."""
    return NewRequest.from_request(
        request if request is not None else msg.to_request(arrival_s=msg.submitted_at),
        prompt=msg.prompt if msg.messages is None else None,
        messages=msg.messages,
        sampling=dict(msg.sampling),
    )


def prune(store: Store, now: float, retain_s: float, retain_plans: int) -> tuple[int, int]:
    """Delete the requests that ended more than ``retain_s`` ago (in batches, so that no
    transaction holds the table long) and the plans beyond the latest ``retain_plans`` (0: keep
    them). How many requests and plans it deleted."""
    requests = 0
    if retain_s > 0:
        cut = now - retain_s
        while (deleted := store.prune_requests(cut, limit=RETAIN_BATCH)) > 0:
            requests += deleted
            if deleted < RETAIN_BATCH:
                break
    plans = store.prune_plans(keep=retain_plans) if retain_plans > 0 else 0
    return requests, plans


def ensure_each(
    store: Store, news: list[NewRequest]
) -> tuple[dict[str, RequestRow], dict[str, str]]:
    """The rows of ``news``, recorded if need be, and the reasons of those the store refused.

    One transaction for the batch; if the store refuses it, one per request, so that a request
    whose row the store cannot take (a value it refuses) does not hold up the others. A request
    counts as refused only if the store answers a read before and after a second try of it; a
    store that does not is down: ``StoreError`` (nothing is taken as refused)."""
    try:
        return store.ensure_requests(news), {}
    except StoreError as exc:
        if len(news) > 1:
            log.warning("recording %d requests failed (%s); one at a time", len(news), exc)
    rows: dict[str, RequestRow] = {}
    failed: list[NewRequest] = []
    for new in news:
        try:
            rows.update(store.ensure_requests([new]))
        except StoreError:
            failed.append(new)
    if not failed:
        return rows, {}
    store.controller_states()  # StoreError: the store is down
    refused: dict[str, str] = {}
    for new in failed:
        try:
            rows.update(store.ensure_requests([new]))
        except StoreError as exc:
            refused[new.id] = str(exc)
    if refused:
        store.controller_states()
    return rows, refused


async def reap_dead(queue: GlobalQueue, store: Store) -> int:
    """Record the dead-letter queue's requests as failed; a letter leaves the queue only
    once its failure is committed, or once the store refused its row (``ensure_each``: then it
    is logged as an error with its body, which nothing else can hold: kept, it would be read
    again every round, and the orphan sweep waits for an empty dead-letter queue). Returns how
    many requests were recorded."""
    recorded = 0

    async def record(letters: list[DeadLetter]) -> None:
        nonlocal recorded
        failures: list[tuple[NewRequest, DeadLetter]] = []
        for letter in letters:
            try:
                msg = QueuedRequest.decode(letter.raw)
            except MessageError as exc:
                log.warning("dead letter that is no request (%s): %s", letter.reason, exc)
                continue
            failures.append((new_request(msg), letter))
        if failures:
            recorded += await asyncio.to_thread(_record_dead, store, failures)

    await queue.reap_dead(record)
    return recorded


def _record_dead(store: Store, failures: list[tuple[NewRequest, DeadLetter]]) -> int:
    _, refused = ensure_each(store, [new for new, _ in failures])
    now = store.now()
    for new, letter in failures:
        if new.id in refused:
            log.error(
                "dead letter of request %s (tenant %s, %s) dropped: the store refuses its row "
                "(%s); its message: %s",
                new.id,
                new.tenant,
                letter.reason,
                refused[new.id],
                letter.raw[:DEAD_BODY_LOGGED].decode("utf-8", "replace"),
            )
            continue
        row = store.record_outcome_row(
            new.id, status=RequestStatus.FAILED, at=now, error=f"dead-lettered: {letter.reason}"
        )
        if row is not None:
            log.warning("request %s failed: dead-lettered (%s)", new.id, letter.reason)
            log_outcome(row)
    return len(failures) - len(refused)


DEAD_BODY_LOGGED = 65536
"""Bytes of a dropped dead letter's message that its error log line carries, at most."""


class OrphanSweep:
    """The orphan sweep's memory between rounds: the rows the last round found with no
    message, and where the next round reads on (``sweep``)."""

    def __init__(self) -> None:
        self._suspects: set[str] = set()  # rows the last sweep found with no message
        self._sweep_from: tuple[float, str] | None = None  # where the next sweep reads on

    async def sweep(
        self,
        store: Store,
        queue: GlobalQueue,
        after_s: float,
        busy: Callable[[], set[str]],
        leading: Callable[[], bool],
    ) -> tuple[list[str], list[str]]:
        """One round; returns the orphans it found and those of them this round recorded
        failed.

        A row that has not ended, submitted more than ``after_s`` ago, which this
        controller — the leader — does not hold (``busy``) while the broker has nothing left to
        hand out (``GlobalQueue.backlog`` is 0: every message is with the leader) has no
        message. Found so in two rounds in a row — a message on its way, such as a client's
        retry publishing it again, is held by the next round — it is recorded failed with
        ``ORPHAN_ERROR``: it ends, no longer counts against its tenant's queued limit, and a
        client looking it up learns what happened. Each round reads at most ``ORPHAN_PAGES``
        pages of such rows, going on from where the last one stopped (a leader holding many old
        requests is walked over several rounds). Rounds while not ``leading`` find nothing.

        Left open: a message the broker hands over between the last look at what is held and
        the commit (a retry of a real orphan, published again more than ``after_s`` after
        it was recorded, landing in that millisecond) finds its row failed and is acked — its
        client is told it failed, nothing is silently dropped. While the broker holds messages
        the leader has not been handed (a backlog beyond ``shards × prefetch``, a dead letter the
        reaper cannot record) no round finds anything."""
        if not leading():
            self._suspects, self._sweep_from = set(), None
            return [], []
        held = busy()
        # The last round's suspects still neither held nor ended: no message stands for them.
        maybe = self._suspects - held
        ended = await asyncio.to_thread(store.final_ids, maybe) if maybe else set()
        confirmed = maybe - ended
        cut = store.now() - after_s
        suspects: set[str] = set()
        for _ in range(ORPHAN_PAGES):
            page = await asyncio.to_thread(
                store.unsettled_before, cut, after=self._sweep_from, limit=ORPHAN_PAGE
            )
            self._sweep_from = page[-1] if len(page) == ORPHAN_PAGE else None
            suspects.update(rid for _, rid in page if rid not in held and rid not in maybe)
            if self._sweep_from is None or len(suspects) >= ORPHAN_PAGE:
                break
        # Only now the broker (nothing to ask it most of the time), then who holds what again:
        # a message it handed out before saying it has none left is held by then.
        if not (confirmed or suspects) or await queue.backlog() > 0:
            self._suspects = set()
            return [], []
        held = busy()
        if not leading():
            self._suspects, self._sweep_from = set(), None
            return [], []
        orphans = sorted(confirmed - held)
        self._suspects = suspects - held
        recorded = await asyncio.to_thread(_record_orphans, store, orphans) if orphans else []
        return orphans, recorded


def _record_orphans(store: Store, ids: list[str]) -> list[str]:
    """Record them failed (in a worker thread); returns those this call recorded."""
    now, recorded = store.now(), []
    for rid in ids:
        outcome = store.record_outcome_row(
            rid, status=RequestStatus.FAILED, at=now, error=ORPHAN_ERROR
        )
        if outcome is not None:
            log.warning("request %s failed: no message in the global queue stands for it", rid)
            log_outcome(outcome)
            recorded.append(rid)
    return recorded
