"""The controller service: global queue in, agents on live engines, outcomes in the store.

``ControllerService`` consumes the global queue and holds each delivery un-acked while its request
waits (the broker keeps the one replica, ARCHITECTURE.md §4 rule 5). Every delivery is recorded in
the store (idempotently: the API usually did already) and handed to the ``AgentRuntime``, which
runs the one ``Controller`` — groups, estimator, planner, virtual queues, agents — on the wall
clock. What happens to each request is written to the store in order by one writer task
(``qlm.service.writes``); a delivery is acked only after its outcome (finished, failed,
cancelled) is committed. This module takes deliveries in and lets them go when another controller
leads; what the service publishes is in ``qlm.service.publishing``, the store's upkeep
(retention, dead letters, orphans) in ``qlm.service.upkeep``.

**Failover.** A standby controller's consumer waits (the global queue's leader lock). When the
active one dies, the broker redelivers every message it held; the standby records nothing twice:
a request already final in the store is acked at once, the others resume from the partial output
the store holds (kept at each eviction or instance failure) or restart.

**Orphans.** A request row that no message stands for — its API process stopped between the
store commit and the broker's confirm (its client got no answer), or an in-process queue was lost
with its process — would stay queued for ever. The leader sweeps for them (``sweep_once``) and
records them failed.

**Poison.** A message the controller can never serve (no instance serves its model) is recorded
failed with the reason and dead-lettered; the queue dead-letters undecodable bodies itself, and
the broker's delivery limit ends any loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from qlm import tracing
from qlm.clock import work_seconds
from qlm.domain import PlanRecord, Request, RequestRecord, RequestStatus
from qlm.engines.base import TokenChunk, ToolCall
from qlm.errors import check_setting
from qlm.global_queue import Delivery, GlobalQueue, QueuedRequest
from qlm.service.backlog_gc import BacklogGC
from qlm.service.hub import ResultEvent, ResultHub
from qlm.service.jobs import Job, resume_point
from qlm.service.publishing import PredictionWrites, Role, publish_wait, snapshot_dict
from qlm.service.runtime import AgentRuntime, RuntimeListener
from qlm.service.upkeep import OrphanSweep, ensure_each, new_request, prune, reap_dead
from qlm.service.writes import Settle, StoreWriter
from qlm.store import NewRequest, RequestRow, Store, StoreError
from qlm.store.rows import InstanceState
from qlm.virtual_queues import VirtualQueuesSnapshot

log = logging.getLogger(__name__)

STEP_HOLDS_INTAKE_S = 0.5
"""A control step still running after this (the planner's default step budget: grouping and
pulls stay within it; a plan or a recluster of a large backlog may not) holds the global queue's
intake until it ends (``GlobalQueue.hold_intake``)."""


INTAKE_BATCH = 10_000
"""Deliveries recorded in one store transaction and handed to the controller together, at most.
Batches are taken one after the other, each waiting for a worker thread (the store) and then for
the event loop: at 2,000 a take-over of 100,000 requests queued 50 such waits behind each
other, 1.5-11 s each on a loaded host."""


def _span_attributes(msg: QueuedRequest) -> dict[str, Any]:
    return {
        "qlm.tenant": msg.tenant,
        "qlm.model": msg.model,
        "qlm.tier": msg.tier,
        "qlm.attempt": msg.attempt,
    }


def _messages(deliveries: list[Delivery]) -> list[QueuedRequest]:
    """The decoded messages of ``deliveries`` (those the queue hands over all have one)."""
    return [d.message for d in deliveries if d.message is not None]


def default_controller_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(slots=True)
class _Held:
    delivery: Delivery
    message: QueuedRequest
    copies: list[Delivery] = field(default_factory=list)
    """More deliveries of the same request on the same connection (it was published twice: a
    client's resend, an API's retry after a lost confirm): settled with ``delivery``, once the
    outcome is stored."""

    def take(self, delivery: Delivery) -> bool:
        """Another delivery of this request: a copy on the same connection, kept to be settled
        with the first; or, after a reconnect (a new ``epoch``), the one that counts now (the
        broker took the older ones back). True when it is a redelivery."""
        if delivery.epoch == self.delivery.epoch:
            self.copies.append(delivery)
            return False
        self.delivery, self.copies = delivery, []
        return True

    def all(self) -> list[Delivery]:
        return [self.delivery, *self.copies]


class ControllerService(RuntimeListener):
    """Runs one controller (module docstring)."""

    def __init__(
        self,
        queue: GlobalQueue,
        store: Store,
        runtime: AgentRuntime,
        *,
        name: str | None = None,
        flush_s: float = 0.05,
        poll_s: float = 0.5,
        publish_s: float = 1.0,
        prediction_writes: int = 5000,
        reap_s: float = 5.0,
        history_outputs: int = 1000,
        retain_s: float = 0.0,
        retain_plans: int = 0,
        retain_every_s: float = 600.0,
        orphan_after_s: float = 0.0,
        orphan_every_s: float = 60.0,
    ) -> None:
        self.queue = queue
        self.store = store
        self.runtime = runtime
        self.name = name or default_controller_name()
        self.flush_s = flush_s
        self.poll_s = poll_s
        self.publish_s = publish_s
        check_setting(prediction_writes >= 1, "prediction_writes", ">= 1", prediction_writes)
        self.prediction_writes = prediction_writes  # rows per publish, most changed first
        self.reap_s = reap_s
        self.history_outputs = history_outputs
        self.retain_s = retain_s  # 0: keep ended requests forever
        self.retain_plans = retain_plans  # 0: keep every plan
        self.retain_every_s = retain_every_s
        self.orphan_after_s = orphan_after_s  # 0: no orphan sweep
        self.orphan_every_s = orphan_every_s
        self._orphans = OrphanSweep()
        self._taking: set[str] = set()  # deliveries being recorded by ``_take``
        self._leader = False  # the queue says this controller leads
        self._learnt = False  # from the store's recent completions, on becoming active
        self.hub = ResultHub()
        runtime.listener = self
        self._held: dict[str, _Held] = {}
        self.backlog_gc = BacklogGC()  # full collections kept out of the step under a backlog
        self._inbox: list[Delivery] = []
        self._writes = StoreWriter()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._plans = 0  # plans the policy made
        self._latest_plan: PlanRecord | None = None
        self._predictions = PredictionWrites()  # as last written to the store
        self._last_poll = 0.0
        self._stopping = False
        self._standby = False  # another controller leads (told by the queue)
        self._stepping_down: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None  # for another leader, while standing by
        self._lead = 0  # how many times it lost the lead: deliveries taken before are stale
        self.received = 0
        self.settled = 0
        self.redelivered = 0  # deliveries of requests it held already (after a reconnect)
        # The spans of the requests it holds (qlm.tracing), when the process traces.
        self._spans = tracing.RequestSpans() if tracing.enabled() else None

    # --- life cycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Attach to the engines, then start consuming (a standby waits here for its turn)."""
        for spec in self.runtime.controller.specs.values():
            # down until the runtime reaches it; an operator's drain outlives restarts
            row = await asyncio.to_thread(
                self.store.upsert_instance, spec, state=InstanceState.DOWN, keep_draining=True
            )
            if row.state is InstanceState.DRAINING:
                self.runtime.set_draining(spec.name, True)
        await self.runtime.start()
        self._last_poll = self.store.now()
        self._tasks = [
            asyncio.create_task(self._intake(), name="qlm-intake"),
            asyncio.create_task(self._writer(), name="qlm-writer"),
            asyncio.create_task(self._poll(), name="qlm-poll"),
            asyncio.create_task(self._publish(), name="qlm-publish"),
            asyncio.create_task(self._reap(), name="qlm-reap"),
            asyncio.create_task(self._retain(), name="qlm-retain"),
            asyncio.create_task(self._sweep(), name="qlm-sweep"),
        ]
        await self.queue.consume(self._on_delivery, on_leader=self.leader_changed)

    async def stop(self) -> None:
        """Graceful stop: abort what runs (partial outputs are recorded), flush the store,
        publish its state one last time marked stopped (so readers know it is gone, not late),
        then leave the queue, which hands every un-acked message to the next controller."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        await self.runtime.stop(abort=True)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._flush()
        # what the store has is settled before leaving the queue
        await self._writes.wait_settled(SETTLE_ON_STOP_S)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(
                self.store.put_controller_state,
                self.name,
                active=False,
                snapshot=self.snapshot(),
                stopped=True,
            )
        await self.queue.close()
        self.backlog_gc.settled(0)  # what it held is the next controller's now

    @property
    def role(self) -> Role:
        """Where it stands, as the queue told it: ``starting`` until the queue says whether it
        leads (it is taking the leader lock), ``active`` while it leads (with or without
        requests), ``standby`` while another controller leads, ``stopping`` once stopping."""
        if self._stopping:
            return "stopping"
        if self._standby:
            return "standby"
        return "active" if self._leader else "starting"

    @property
    def active(self) -> bool:
        """Leading the global queue (``role``): it serves whatever arrives, from the moment
        the queue says so, not from its first delivery."""
        return self.role == "active"

    @property
    def standby(self) -> bool:
        """Another controller leads the global queue (the queue said so)."""
        return self._standby

    @property
    def watching_leader(self) -> bool:
        """Standing by with requests it held: it looks for the new leader before letting go."""
        return self._watch is not None and not self._watch.done()

    def holds(self, request_id: str) -> bool:
        """It holds the request's delivery, or is recording it (``_take``)."""
        return request_id in self._held or request_id in self._taking

    @property
    def held(self) -> int:
        """Deliveries it holds un-acked (their requests wait or run)."""
        return len(self._held)

    async def crash(self) -> None:
        """Stop as a killed process would: nothing flushed, nothing settled, no request aborted
        (its engines go on running what it sent them); the queue connection closes, so the
        broker hands its un-acked deliveries to the next controller. For fault drills and
        tests."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await self.runtime.stop(abort=False)
        await self.queue.close()

    async def wait_idle(self, poll_s: float = 0.05) -> None:
        """Until every request received has been settled (tests, replays)."""
        while self._inbox or self._held or self._writes.pending:
            await asyncio.sleep(poll_s)

    # --- intake -----------------------------------------------------------------------------------

    async def _on_delivery(self, delivery: Delivery) -> None:
        self._standby = False
        self._inbox.append(delivery)
        self._wake.set()

    def leader_changed(self, leading: bool) -> None:
        """The queue says whether this controller leads. Standing by after it led, with
        requests held (its broker connection dropped: a partition, a broker restart), it
        watches for another controller leading (``_watch_leader``)."""
        self._leader = leading
        if leading:
            self._standby = False
            if self._watch is not None:
                self._watch.cancel()
            return
        self._standby = True
        self._lead += 1  # deliveries taken before are stale: the broker delivers them again
        self._inbox.clear()
        if self._held:
            if self._watch is not None:
                self._watch.cancel()
            self._watch = asyncio.create_task(self._watch_leader(self._lead), name="qlm-watch")

    async def _watch_leader(self, lead: int) -> None:
        """Step down once another controller is seen leading: its state in the store says it
        is active, and it is publishing (its ``updated_at`` moved between two reads: no clock
        is compared, so hosts' clocks may differ). Until then this one goes on serving what it
        holds: the lock may still be its own old connection's (RabbitMQ drops a dead connection
        only after the heartbeat timeout), and leading again it finds its requests running."""
        seen: dict[str, float] = {}
        while self._standby and self._lead == lead and self._held:
            try:
                rows = await asyncio.to_thread(self.store.controller_states)
            except Exception as exc:
                log.warning("cannot read which controller leads (%s); asking again", exc)
                rows = []
            for row in rows:
                if row.name == self.name or not row.active:
                    continue
                if row.name in seen and row.updated_at != seen[row.name]:
                    if self._standby and self._lead == lead:  # still (not leading again)
                        self._step_down()
                    return
            seen = {row.name: row.updated_at for row in rows} or seen
            await asyncio.sleep(self.poll_s)

    def _step_down(self) -> None:
        """Another controller leads: the broker handed it every message this one held, and it
        runs them now. Stop running them here — a request must not run twice on the GPUs — and
        write nothing more for them: their outcome is the leader's to record. What this one had
        recorded stays (an outcome is written once: the first wins)."""
        ids = list(self._held)
        self._held.clear()
        self.backlog_gc.settled(0)
        for rid in ids:
            self._predictions.forget(rid)
            if self._spans is not None:
                self._spans.forget(rid)
        log.warning(
            "controller %s: another controller leads the global queue now; stopping the %d "
            "requests it took over",
            self.name,
            len(ids),
        )
        previous = self._stepping_down
        self._stepping_down = asyncio.create_task(self._release(ids, previous))

    async def _release(self, ids: list[str], previous: asyncio.Task[None] | None) -> None:
        if previous is not None:
            with contextlib.suppress(Exception):
                await previous
        try:
            released = await self.runtime.release(ids)
        except Exception:
            log.exception("could not stop the requests another controller took over")
            return
        log.info("controller %s: stopped %d requests the leader serves now", self.name, released)

    async def _intake(self) -> None:
        """Batches of deliveries: recorded in one store transaction, then planned."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._inbox:
                batch, self._inbox = self._inbox[:INTAKE_BATCH], self._inbox[INTAKE_BATCH:]
                self._taking = {d.message.id for d in batch if d.message is not None}
                try:
                    await self._take(batch)
                    self.backlog_gc.taken(len(self._held))
                except Exception:
                    log.exception("could not take %d deliveries; requeueing them", len(batch))
                    for d in batch:
                        await self.queue.requeue(d)
                    await asyncio.sleep(self.poll_s)
                finally:
                    self._taking = set()

    async def _take(self, batch: list[Delivery]) -> None:
        lead = self._lead  # as the batch was taken from the inbox
        while self._stepping_down is not None:  # leading again: what it let go of goes first
            task = self._stepping_down
            with contextlib.suppress(Exception):
                await task
            if self._stepping_down is task:
                self._stepping_down = None
        if lead != self._lead:
            return  # the lead was lost meanwhile: the broker delivers these again
        fresh: list[Delivery] = []
        first: dict[str, Delivery] = {}  # of each request in this batch
        copies: dict[str, list[Delivery]] = {}  # more of the same request in this batch
        for d in batch:
            msg = d.message
            if msg is None:
                continue
            held = self._held.get(msg.id)
            if held is not None:  # delivered again: settled with its outcome
                self.redelivered += held.take(d)
                continue
            if msg.id in first:
                copies.setdefault(msg.id, []).append(d)
                continue
            first[msg.id] = d
            fresh.append(d)
        if not fresh:
            return
        if not self._learnt:  # in the background: a large store must not hold the intake up
            self._learnt = True
            self._tasks.append(asyncio.create_task(self._learn_history(), name="qlm-history"))
        # Each request's domain form, made once for its row and for the policy.
        requests = [m.to_request(arrival_s=m.submitted_at) for m in _messages(fresh)]
        news = [new_request(m, r) for m, r in zip(_messages(fresh), requests, strict=True)]
        rows, refused = await self._record(news)
        if lead != self._lead:
            return  # the lead was lost meanwhile: the broker handed these to the leader
        served = {m for spec in self.runtime.controller.specs.values() for m in spec.models}
        for d, request in zip(fresh, requests, strict=True):
            if lead != self._lead:
                return  # lost during an ack or dead-letter below: the leader has the rest
            msg = d.message
            assert msg is not None
            self.received += 1
            extra = copies.get(msg.id, [])
            row = rows.get(msg.id)
            if row is None:  # the store refuses this request's row while it takes others'
                reason = refused.get(msg.id, "the store did not record it")
                await self._poison(
                    [d, *extra], f"request {msg.id!r} could not be recorded: {reason}"
                )
                continue
            if row.is_final:
                for each in (d, *extra):
                    await self.queue.ack(each)  # a previous controller finished it
                self.settled += 1
                continue
            if row.tenant != msg.tenant:
                await self._poison([d, *extra], f"request id {msg.id!r} belongs to another tenant")
                continue
            if msg.model not in served:
                reason = f"no instance serves model {msg.model!r}"
                self._writes.row(
                    msg.id,
                    self.store.record_outcome_row,
                    status=RequestStatus.FAILED,
                    at=self.runtime.clock.now(),
                    error=reason,
                )
                self._writes.settle_after(msg.id, reason, RequestStatus.FAILED)
                self._held[msg.id] = _Held(d, msg, list(extra))
                continue
            self._held[msg.id] = _Held(d, msg, list(extra))
            if self._spans is not None:
                self._spans.held(msg.id, msg.trace, _span_attributes(msg))
            self._submit(msg, row, request)

    async def _record(self, news: list[NewRequest]) -> tuple[dict[str, RequestRow], dict[str, str]]:
        """The rows of ``news``, recorded if need be, and the reasons of those the store refused
        (``ensure_each``): a message whose row the store cannot take is dead-lettered with the
        reason instead of holding up every delivery behind it. ``StoreError``: the store is
        down (the batch is requeued)."""
        return await asyncio.to_thread(ensure_each, self.store, news)

    async def _learn_history(self) -> None:
        """On becoming active (its first deliveries): the output lengths of the store's
        ``history_outputs`` most recent completions, oldest first, so that a controller that
        restarts or takes over plans with what the fleet has been answering, not with the
        profile's prior alone (from the moment the store answers, in the background). A store
        that cannot answer only costs that head start."""
        if self.history_outputs <= 0:
            return
        try:
            rows = await asyncio.to_thread(self.store.recently_finished, self.history_outputs)
            learnt = self.runtime.controller.learn_outputs(
                (row.to_request(), row.output_tokens) for row in reversed(rows)
            )
        except StoreError as e:
            log.warning("could not read recent completions to learn output lengths from: %s", e)
            return
        except Exception:
            log.exception("could not learn output lengths from the recent completions")
            return
        if learnt:
            log.info("learnt output lengths from %d recent completions in the store", learnt)

    def _submit(self, msg: QueuedRequest, row: RequestRow, request: Request) -> None:
        """Hand ``request`` (``msg``'s domain form) to the runtime, resumed from the output
        recorded so far (in the message or, if longer, in the row)."""
        partial_text, partial_tokens = msg.partial_text, msg.partial_tokens
        if row.partial_tokens > partial_tokens:
            partial_text, partial_tokens = row.partial_text, row.partial_tokens
        job = Job(prompt=msg.prompt, sampling=dict(msg.sampling), messages=msg.messages)
        if job.resumable and partial_text and partial_tokens >= msg.max_tokens:
            self._complete(msg, row, partial_text)
            return
        partial_text = resume_point(partial_text)
        if job.resumable and partial_text:
            job.partial_text = partial_text
        else:  # a structured answer, or only whitespace so far: it starts over
            partial_tokens = 0
        failovers = 1 if row.status is RequestStatus.RUNNING else 0  # a controller died
        self.runtime.submit(request, job, generated=partial_tokens, failovers=failovers)

    def _complete(self, msg: QueuedRequest, row: RequestRow, text: str) -> None:
        """Its whole output (``max_tokens``) was written before its engine or controller died:
        it is finished with that output, now, and never sent again (asked for even one more
        token, an engine would write past ``max_tokens``)."""
        at = self.runtime.clock.now()
        ttft, first = row.slo_ttft_s, row.first_token_at
        ttft_met = None if ttft is None else first is not None and first - row.submitted_at <= ttft
        self._writes.row(
            msg.id,
            self.store.record_outcome_row,
            status=RequestStatus.FINISHED,
            at=at,
            output_text=text,
            output_tokens=msg.max_tokens,
            slo_met=at <= row.deadline_at and ttft_met is not False,
            ttft_met=ttft_met,
        )
        self._writes.settle_after(msg.id, "ack", RequestStatus.FINISHED)

    async def _poison(self, deliveries: list[Delivery], reason: str) -> None:
        """Dead-letter every delivery of one request with ``reason``."""
        message = deliveries[0].message
        log.warning("dead-lettering %s: %s", message and message.id, reason)
        for delivery in deliveries:
            await self.queue.dead_letter(delivery, reason)
        self.settled += 1

    # --- what the runtime reports (the event loop; never blocks) ----------------------------------

    def dispatched(self, request_id: str, instance: str, at: float) -> None:
        if self._spans is not None:
            self._spans.dispatched(request_id, instance)
        self._writes.row(request_id, self.store.mark_dispatched, instance=instance, at=at)

    def first_token(self, request_id: str, at: float) -> None:
        self._writes.row(request_id, self.store.mark_first_token, at=at)

    def chunk(self, request_id: str, chunk: TokenChunk) -> None:
        if chunk.text and self.hub.watched(request_id):
            self.hub.publish(ResultEvent(request_id, chunk.text, chunk.tokens))

    def returned(
        self, request_id: str, partial_text: str, partial_tokens: int, *, evicted: bool = False
    ) -> None:
        if partial_tokens == 0 and self.hub.watched(request_id):
            self.hub.publish(ResultEvent(request_id, "", 0, restarted=True))
        if self._spans is not None:
            self._spans.returned(request_id, evicted=evicted)
        if evicted:
            self._writes.row(
                request_id,
                self.store.record_eviction,
                partial_text=partial_text,
                partial_tokens=partial_tokens,
            )
        else:
            self._writes.row(
                request_id, self.store.record_partial, text=partial_text, tokens=partial_tokens
            )

    def finished(
        self,
        record: RequestRecord,
        text: str,
        finish_reason: str,
        tool_calls: Sequence[ToolCall] = (),
    ) -> None:
        rid = record.request.id
        ttft = record.request.slo.ttft_s
        if self._spans is not None:
            attrs = {"qlm.slo_met": record.slo_met, "qlm.output_tokens": record.output_tokens}
            self._spans.outcome(rid, "finished", attrs)
        self._writes.row(
            rid,
            self.store.record_outcome_row,
            status=RequestStatus.FINISHED,
            at=record.finish_s if record.finish_s is not None else self.runtime.clock.now(),
            output_text=text,
            output_tokens=record.output_tokens,
            slo_met=record.slo_met,
            ttft_met=None if ttft is None else record.ttft_s is not None and record.ttft_s <= ttft,
            tool_calls=tool_calls,
        )
        self._writes.settle_after(rid, "ack", RequestStatus.FINISHED)

    def failed(self, request_id: str, error: str) -> None:
        if self._spans is not None:
            self._spans.outcome(request_id, "failed", {}, error)
        self._writes.row(
            request_id,
            self.store.record_outcome_row,
            status=RequestStatus.FAILED,
            at=self.runtime.clock.now(),
            error=error,
        )
        self._writes.settle_after(request_id, "ack", RequestStatus.FAILED)

    def rejected(self, request_id: str, reason: str) -> None:
        """Poison: recorded failed with the reason, and its delivery dead-lettered with it."""
        if self._spans is not None:
            self._spans.outcome(request_id, "failed", {}, reason)
        self._writes.row(
            request_id,
            self.store.record_outcome_row,
            status=RequestStatus.FAILED,
            at=self.runtime.clock.now(),
            error=reason,
        )
        self._writes.settle_after(request_id, reason, RequestStatus.FAILED)

    def cancelled(self, request_id: str, partial_text: str, tokens: int) -> None:
        if self._spans is not None:
            self._spans.outcome(request_id, "cancelled", {"qlm.output_tokens": tokens})
        self._writes.row(
            request_id,
            self.store.record_outcome_row,
            status=RequestStatus.CANCELLED,
            at=self.runtime.clock.now(),
            output_text=partial_text or None,
            output_tokens=tokens,
        )
        self._writes.settle_after(request_id, "ack", RequestStatus.CANCELLED)

    def instance_changed(self, name: str, up: bool) -> None:
        self._writes.op(self._instance_changed, name, up)

    def _instance_changed(self, name: str, up: bool) -> None:
        """Record up/down, keeping an operator's drain (a drained instance may go down and up)."""
        self.store.set_instance_health(name, up)

    # --- the writer -------------------------------------------------------------------------------

    async def _writer(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self._flush()

    async def _flush(self) -> None:
        """Apply the queued store operations, then settle what they committed (``StoreWriter``)."""
        await self._writes.flush(self.store, self.queue, self.poll_s, self._committed)

    def _committed(self, settle: list[Settle]) -> list[tuple[Delivery, str]]:
        """Outcomes the store committed: their watchers are told, the controller forgets them,
        and the deliveries held for them are handed back to be settled."""
        batch: list[tuple[Delivery, str]] = []
        settled = self.settled
        for rid, how, status in settle:
            self.hub.publish(ResultEvent(rid, "", 0, done=True, status=status))
            self._predictions.forget(rid)
            self.runtime.controller.forget(rid)  # recorded: the store answers for it now
            if self._spans is not None:
                self._spans.committed(rid)
            held = self._held.pop(rid, None)
            if held is None:
                continue
            batch += [(delivery, how) for delivery in held.all()]
            self.settled += 1
        self.backlog_gc.settled(len(self._held), self.settled - settled)
        return batch

    def stepping(self) -> None:
        """A step that runs longer than a step usually does (a plan or a recluster of a large
        backlog) holds the global queue's intake until it ends (``hold_intake``)."""
        self.queue.hold_intake(STEP_HOLDS_INTAKE_S)

    def stepped(self) -> None:
        """What the step made for a large backlog (its groups, their estimates) is long-lived
        too: out of full collections with what the intake took."""
        self.queue.release_intake()
        self.backlog_gc.taken(len(self._held))

    def planned(self, plans: Sequence[PlanRecord]) -> None:
        """The plans a control step made: counted, the latest shown, each one stored."""
        self._plans += len(plans)
        self._latest_plan = plans[-1]
        for record in plans:
            self._writes.op(self.store.record_plan, record, controller=self.name)

    # --- retention ------------------------------------------------------------------------------

    async def _retain(self) -> None:
        """Retention, by the active controller every ``retain_every_s``: requests that ended
        more than ``retain_s`` ago are deleted (in batches, so that no transaction holds the
        table long), and plans beyond the latest ``retain_plans``. A failure is logged and
        retried at the next round: it never touches a request that has not ended."""
        if self.retain_s <= 0 and self.retain_plans <= 0:
            return
        while True:
            await asyncio.sleep(self.retain_every_s)
            if not self.active:
                continue
            try:
                requests, plans = await asyncio.to_thread(self._prune)
            except Exception:
                log.exception("retention failed; trying again in %.0f s", self.retain_every_s)
                continue
            if requests or plans:
                log.info("retention: deleted %d ended requests and %d plans", requests, plans)

    def _prune(self) -> tuple[int, int]:
        return prune(self.store, self.runtime.clock.now(), self.retain_s, self.retain_plans)

    # --- rows no message stands for ----------------------------------------------------------

    async def _sweep(self) -> None:
        """Every ``orphan_every_s``, while leading: ``sweep_once``."""
        if self.orphan_after_s <= 0:
            return
        while True:
            await asyncio.sleep(self.orphan_every_s)
            try:
                await self.sweep_once()
            except Exception:
                log.exception("orphan sweep failed; trying again in %.0f s", self.orphan_every_s)

    async def sweep_once(self) -> list[str]:
        """One round of the orphan sweep (``OrphanSweep.sweep``, with ``orphan_after_s``);
        returns the requests it found with no message, recorded failed. Rounds of a controller
        that is not leading find nothing."""
        lead = self._lead
        orphans, recorded = await self._orphans.sweep(
            self.store,
            self.queue,
            self.orphan_after_s,
            self._busy,
            lambda: self._leading_now(lead),
        )
        for rid in recorded:
            self.hub.publish(ResultEvent(rid, "", 0, done=True, status=RequestStatus.FAILED))
        return orphans

    def _busy(self) -> set[str]:
        """The requests this controller holds or is taking from the queue."""
        inbox = {d.message.id for d in self._inbox if d.message is not None}
        return set(self._held) | self._taking | inbox

    def _leading_now(self, lead: int) -> bool:
        return self._leader and not self._standby and not self._stopping and lead == self._lead

    # --- messages the broker gave up on ---------------------------------------------------------

    async def _reap(self) -> None:
        """Every ``reap_s``: take the dead-letter queue's messages and record each request as
        failed with the reason (a delivery limit reached after repeated controller deaths, or
        QLM's own reason): nothing accepted is dropped without an outcome."""
        while True:
            await asyncio.sleep(self.reap_s)
            try:
                await self.reap_once()
            except Exception:
                log.exception("could not reap the dead-letter queue")

    async def reap_once(self) -> int:
        """Record the dead-letter queue's requests as failed (``reap_dead``); how many."""
        return await reap_dead(self.queue, self.store)

    # --- what operators and clients do through the store ------------------------------------

    async def cancel(self, request_id: str) -> bool:
        """Cancel a request this controller holds (the API's in-process fast path; otherwise
        the store's cancel reaches it at the next poll). False if it does not hold it."""
        if not self.runtime.holds(request_id):
            return False
        return await self.runtime.cancel(request_id)

    async def _poll(self) -> None:
        """Cancels and drains made through the store by the API or the CLI of any process."""
        while True:
            await asyncio.sleep(self.poll_s)
            since, self._last_poll = self._last_poll - 1.0, self.store.now()
            try:
                ids = await asyncio.to_thread(self.store.cancellations_since, since)
                rows = await asyncio.to_thread(self.store.instances)
            except Exception:
                log.exception("could not poll the store for cancels and drains")
                continue
            for rid in ids:
                if self.runtime.holds(rid):
                    await self.runtime.cancel(rid)
            for row in rows:
                if row.name in self.runtime.controller.specs:
                    self.runtime.set_draining(row.name, row.state is InstanceState.DRAINING)

    # --- what this controller shows of itself -------------------------------------------------

    def snapshot(self, queues: VirtualQueuesSnapshot | None = None) -> dict[str, Any]:
        """Virtual queues (groups, sizes, models, predicted completion, SLO risk), instances and
        counters, as JSON-ready data (published to the store for the API and the CLI).
        ``queues``: the controller's snapshot of them, if just taken (else taken now)."""
        now = self.runtime.clock.now()
        if queues is None:
            queues = self.runtime.controller.snapshot(now)
        else:
            now = queues.at_s
        return snapshot_dict(
            self.name,
            now,
            self.runtime.controller.policy.name,
            queues,
            self.runtime.instance_states(),
            {
                "received": self.received,
                "settled": self.settled,
                "held": len(self._held),
                "evictions": self.runtime.evictions,
                "swaps": self.runtime.swaps,
                "model_switches": self.runtime.model_switches,
                "plans": self._plans,
            },
            self._latest_plan,
            role=self.role,
        )

    def predictions_to_write(
        self, queues: VirtualQueuesSnapshot | None
    ) -> dict[str, tuple[float | None, bool]]:
        """The waiting requests whose stored prediction moved, at most ``prediction_writes`` of
        them (``PredictionWrites.to_write``)."""
        return self._predictions.to_write(queues, self.prediction_writes)

    async def _publish(self) -> None:
        """At once (operators see a controller from its start: ``starting`` while it takes the
        lead), then every ``publish_s``: the snapshot, and each waiting request's predicted
        completion (its group's, from the planner's model) and risk, for ``GET
        /v1/requests/{id}``. Under a backlog, where taking them costs more than a small share
        of the event loop, less often (``publish_wait``)."""
        wait = 0.0
        while True:
            await asyncio.sleep(wait)
            started = work_seconds()
            try:
                queues = self.runtime.controller.snapshot(self.runtime.clock.now())
                snap = self.snapshot(queues)
            except Exception:
                log.exception("could not take a snapshot")
                continue
            predictions = self.predictions_to_write(queues)
            wait = publish_wait(self.publish_s, work_seconds() - started)
            if predictions:
                # Through the writer, in its transaction: run beside it, this batch of updates
                # and the writer's (dispatches, outcomes) took row locks in different orders, and
                # PostgreSQL found them deadlocked (each waits its deadlock_timeout, 1 s, first).
                self._writes.op(self.store.record_predictions, predictions)
            try:
                await asyncio.to_thread(
                    self.store.put_controller_state, self.name, active=self.active, snapshot=snap
                )
            except Exception:
                log.exception("could not publish the controller state")


SETTLE_ON_STOP_S = 10.0
"""How long a stopping controller waits for its last acks before leaving the queue (whatever is
left is delivered again, to a controller that finds it final in the store)."""
