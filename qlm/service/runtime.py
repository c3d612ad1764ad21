"""The agents on the wall clock: apply the controller's decisions to ``Engine``s with asyncio.

``AgentRuntime`` is the production driver of ``qlm.controller.Controller``, as
``qlm.sim.cluster.ClusterSimulation`` is its virtual-time driver. A step runs whenever something
changed (an arrival, a first token, a completion, an instance going up or down, a cancel) and at
least every ``tick_s`` (the planner's period and violation triggers need the time to move), then
each decision is carried out with the executor's rules (``qlm.agents.executor``, the simulator's
too: what each decision becomes, the fallbacks, the counts), its engine operations awaited in a
task of its own:

- ``Submit`` (a ``Pull``): stream the request (``Engine.submit``); its first chunk marks it
  started, its end finishes it. A resumed request is sent as prompt + partial output (a chat: its
  messages and the partial output as the assistant's message to continue) with ``max_tokens``
  reduced (``Controller.engine_request``), so the client still receives one whole answer.
- ``Abort`` (an ``Evict``): ``Engine.abort``; the partial output is kept and the request goes back
  to the policy.
- ``Swap`` (``SwapOut`` / ``SwapIn``): the engine's KV swap.
- ``ChangeTier`` (``SetModelTier``): sleep / wake-up, one change at a time per instance; the
  instance's tiers, as the policy reads them, are those the engine says its models are in after
  it (a model vLLM cannot warm stays cold, and the change counts as refused).

**Fault isolation.** An instance is marked down on evidence that it is dead: its health check
answers that it is not serving, or cannot reach it (connection refused or reset: its process is
gone), or ``down_after_health_timeouts`` health checks in a row go unanswered within
``HEALTH_TIMEOUT_S`` (a host that stays silent). Every request sent to it returns to the policy
with the output streamed so far (nothing is lost: the agent holds the streams), and the planner
re-plans its groups onto the others. A health check every ``health_interval_s`` brings it back.
A timeout alone (a connect, a health check) says the instance is slow or starved, not dead: a
request whose stream timed out goes back alone, and the instance stays up. A health check that
timed out more than ``LATE_S`` late waited on this controller's own event loop, not on the
instance: it is not counted either way.

What happens to requests is reported to a ``RuntimeListener`` (the controller service records it in
the store and acks the broker delivery; tests collect it).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from qlm.agents.executor import (
    DONE,
    Abort,
    ChangeTier,
    Done,
    Execution,
    Executor,
    Fail,
    Forget,
    Operation,
    Outcome,
    Refused,
    Submit,
    Swap,
)
from qlm.clock import Clock
from qlm.controller import Controller, EngineReading
from qlm.domain import Decision, InstanceSpec, ModelTier, PlanRecord, Request, RequestRecord
from qlm.engines.base import (
    Engine,
    EngineCapabilities,
    EngineEvent,
    EngineOutput,
    EventKind,
    TokenChunk,
    ToolCall,
)
from qlm.errors import EngineError, EngineTimeout, QLMError, RequestRejected, check_setting
from qlm.service.jobs import Job, resume_point

log = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING = 256
"""vLLM's default ``max_num_seqs``, for a server that does not tell (its API does not export it)."""
MAX_STREAM_FAILURES = 3  # a request's streams an answering instance may fail before it is failed
HEALTH_TIMEOUT_S = 5.0  # how long an instance has to answer a health check
DOWN_AFTER_HEALTH_TIMEOUTS = 3
"""Health checks in a row an up instance may leave unanswered (each within ``HEALTH_TIMEOUT_S``)
before it is marked down: a slow or starved instance is not a dead one, a silent one is."""
LATE_S = 1.0
"""How much later than ``HEALTH_TIMEOUT_S`` a health check may time out and still count as
unanswered: one that timed out later waited on this controller's own event loop (held by a long
step, or starved of CPU), and the answer may have been there, unread."""


class Health(enum.Enum):
    """What one health check says of an instance."""

    SERVING = "serving"
    DEAD = "dead"  # it answered that it is not serving, it cannot be reached, or the check broke
    SILENT = "silent"  # no answer within HEALTH_TIMEOUT_S
    UNKNOWN = "unknown"  # it timed out while this controller's event loop was held: no evidence


DEFAULT_TOKEN_CAPACITY = 1 << 30


class RuntimeListener:
    """Hooks for what happens to requests; every method is a no-op here. Called on the event
    loop, in order for each request; they must not block."""

    def dispatched(self, request_id: str, instance: str, at: float) -> None: ...

    def first_token(self, request_id: str, at: float) -> None: ...

    def chunk(self, request_id: str, chunk: TokenChunk) -> None: ...

    def returned(
        self, request_id: str, partial_text: str, partial_tokens: int, *, evicted: bool = False
    ) -> None:
        """Back from an engine unfinished: evicted, or (``evicted`` False) its instance failed."""

    def finished(
        self,
        record: RequestRecord,
        text: str,
        finish_reason: str,
        tool_calls: Sequence[ToolCall] = (),
    ) -> None: ...

    def failed(self, request_id: str, error: str) -> None: ...

    def rejected(self, request_id: str, reason: str) -> None:
        """The controller could not handle the request (poison): it ends failed, never retried."""
        self.failed(request_id, reason)

    def cancelled(self, request_id: str, partial_text: str, tokens: int) -> None: ...

    def instance_changed(self, name: str, up: bool) -> None: ...

    def planned(self, plans: Sequence[PlanRecord]) -> None:
        """The plans a control step made, oldest first (each is told once)."""

    def stepping(self) -> None:
        """A control step starts: it holds the event loop and a core until ``stepped``."""

    def stepped(self) -> None:
        """A control step ended, or raised (its decisions are set in motion next)."""


@dataclass(slots=True)
class _Instance:
    spec: InstanceSpec
    engine: Engine
    up: bool = False
    caps: EngineCapabilities | None = None
    active_model: str | None = None
    tiers: dict[str, ModelTier] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    host_link_gbs: float = 0.0
    weights_gb: tuple[tuple[str, float], ...] = ()
    cpu_cache_gb: float = 0.0
    reading: EngineReading | None = None  # the last step's (``_view``)
    max_running: int | None = None  # configured; overrides what the engine says
    preemptions_total: int | None = None  # the engine's counter, read with each health check
    swap_free_gb: float = 0.0  # CPU memory for parked KV caches, read with each health check
    silent_checks: int = 0  # health checks in a row it left unanswered (``HEALTH_TIMEOUT_S``)
    probe: asyncio.Task[Health] | None = None  # the health check under way (``_probe``)


@dataclass(slots=True)
class _Flight:
    instance: str
    task: asyncio.Task[None] | None = None
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    started: bool = False
    leaving: bool = False  # evicted, cancelled or failed over: its end is not a completion
    prompt_counted: bool = False  # the engine's count of its prompt was passed on
    held: str = ""  # trailing whitespace not passed on yet (``resume_point``)
    ids: list[int] | None = field(default_factory=list)  # its tokens' ids (None: not all known)


class AgentRuntime:
    """Runs ``controller`` against live engines on the wall clock (module docstring)."""

    def __init__(
        self,
        controller: Controller,
        engines: Sequence[Engine],
        *,
        clock: Clock,
        listener: RuntimeListener | None = None,
        tick_s: float = 0.25,
        health_interval_s: float = 1.0,
        down_after_health_timeouts: int = DOWN_AFTER_HEALTH_TIMEOUTS,
        max_running: Mapping[str, int] | None = None,
        host_link_gbs: Mapping[str, float] | None = None,
        weights_gb: Mapping[str, Sequence[tuple[str, float]]] | None = None,
        cpu_cache_gb: Mapping[str, float] | None = None,
    ) -> None:
        self.controller = controller
        self.clock = clock
        self.listener = listener or RuntimeListener()
        self.tick_s = tick_s
        self.health_interval_s = health_interval_s
        check_setting(
            down_after_health_timeouts >= 1,
            "down_after_health_timeouts",
            ">= 1",
            down_after_health_timeouts,
        )
        self.down_after_health_timeouts = down_after_health_timeouts
        by_name = {e.name: e for e in engines}
        missing = sorted(set(controller.specs) - set(by_name))
        if missing:
            raise QLMError(f"no engine for instance(s) {', '.join(missing)}")
        self._instances = {
            name: _Instance(
                spec,
                by_name[name],
                max_running=(max_running or {}).get(name),
                host_link_gbs=(host_link_gbs or {}).get(name, 0.0),
                weights_gb=tuple((weights_gb or {}).get(name, ())),
                cpu_cache_gb=(cpu_cache_gb or {}).get(name, 0.0),
            )
            for name, spec in controller.specs.items()
        }
        self._jobs: dict[str, Job] = {}
        self._flights: dict[str, _Flight] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._kick = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._draining: set[str] = set()
        self._cancelling: set[str] = set()
        self.steps = 0
        self.executor = Executor()

    @property
    def evictions(self) -> int:
        return self.executor.evictions

    @property
    def swaps(self) -> int:
        return self.executor.swaps

    @property
    def model_switches(self) -> int:
        return self.executor.model_switches

    # --- life cycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Attach to every engine (an engine that does not answer starts down) and run."""
        await asyncio.gather(*(self._attach(i) for i in self._instances.values()))
        self._loop_task = asyncio.create_task(self._loop(), name="qlm-control-loop")
        self._health_task = asyncio.create_task(self._health(), name="qlm-health")

    async def stop(self, *, abort: bool = True) -> None:
        """Stop stepping. ``abort``: abort what runs, reporting each as ``returned`` with its
        partial output (a standby controller resumes it from there)."""
        self._stopping = True
        probes = [i.probe for i in self._instances.values()]
        for task in (self._loop_task, self._health_task, *probes):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if abort:
            for rid in list(self._flights):
                await self._take_back(rid, evicted=False)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- input ------------------------------------------------------------------------------------

    def submit(
        self, request: Request, job: Job | None = None, *, generated: int = 0, failovers: int = 0
    ) -> bool:
        """Hand a request to the controller (``generated`` output tokens already in
        ``job.partial_text``, for one recovered from an earlier controller). False when it is
        already held."""
        text = job is not None and job.has_text
        if not self.controller.arrive(
            request, generated=generated, failovers=failovers, estimated_prompt=text
        ):
            return False
        self._jobs[request.id] = job or Job()
        self._kick.set()
        return True

    async def cancel(self, request_id: str) -> bool:
        """Cancel a request: forgotten if it waits, aborted if it runs. False if unknown or over."""
        if request_id in self._cancelling:
            return False  # a cancel of it is under way
        flight = self._flights.get(request_id)
        instance = self.controller.cancel(request_id)
        if instance is None and request_id not in self._jobs:
            return False
        self._cancelling.add(request_id)
        try:
            await self._cancel(request_id, instance, flight)
        finally:
            self._cancelling.discard(request_id)
        return True

    async def _cancel(self, request_id: str, instance: str | None, flight: _Flight | None) -> None:
        partial = self._jobs.get(request_id, Job()).partial_text
        tokens = self.controller.track(request_id).output_tokens
        if instance is not None and flight is not None:
            flight.leaving = True
            out = await self._abort(instance, request_id)
            if self._flights.get(request_id) is flight:
                partial += out.text if out is not None else "".join(flight.text)
                tokens += out.tokens if out is not None else flight.tokens
                self._flights.pop(request_id, None)
            elif request_id not in self._jobs:
                return  # an eviction under way found it finished, and reported it so
            else:  # an eviction under way gave it back: it waits again, with its output
                self.controller.cancel(request_id)
                partial = self._jobs[request_id].partial_text
                tokens = self.controller.track(request_id).output_tokens
        self._jobs.pop(request_id, None)
        self.listener.cancelled(request_id, partial, tokens)
        self._kick.set()

    async def release(self, request_ids: Iterable[str]) -> int:
        """Let go of requests another controller serves now (this one lost the global queue's
        lead, and the broker handed them over): each is stopped where it runs and forgotten, and
        nothing is reported to the listener — their outcome is the other controller's to record.
        Returns how many were held, once the policy has forgotten them (a step ran: so none can
        arrive again before) and their engines were told to abort them."""
        aborts = []
        released = 0
        for rid in request_ids:
            job = self._jobs.pop(rid, None)
            flight = self._flights.get(rid)
            on = self.controller.cancel(rid)
            self.controller.forget(rid)
            if job is None and flight is None and on is None:
                continue
            released += 1
            if flight is not None:  # also one an eviction is aborting: stopped before the end
                flight.leaving = True
                aborts.append((rid, flight))
        try:
            self.step()
        except Exception:  # the loop's next step hands the policy the same news
            log.exception("control step failed while releasing requests")
        await asyncio.gather(*(self._abort(flight.instance, rid) for rid, flight in aborts))
        for rid, flight in aborts:
            if self._flights.get(rid) is flight:
                del self._flights[rid]
        self._kick.set()
        return released

    def holds(self, request_id: str) -> bool:
        return request_id in self._jobs

    @property
    def idle(self) -> bool:
        """Nothing held: every request given has finished, failed or been cancelled."""
        return not self._jobs

    def running(self, request_id: str) -> bool:
        """An engine runs the request now (its stream is open)."""
        return request_id in self._flights

    @property
    def operations(self) -> int:
        """Engine operations under way (pulls, aborts, swaps, tier changes)."""
        return len(self._tasks)

    def engines(self) -> list[Engine]:
        """The engine of every instance, in the instances' order."""
        return [inst.engine for inst in self._instances.values()]

    def instances_up(self) -> dict[str, bool]:
        return {name: inst.up for name, inst in self._instances.items()}

    def set_draining(self, name: str, draining: bool) -> None:
        """Drain an instance (the policy sees it as unavailable: nothing new is pulled onto it,
        its groups are planned elsewhere, what runs there finishes) or take it back."""
        if name not in self._instances:
            raise QLMError(f"unknown instance {name!r}")
        if draining != (name in self._draining):
            self._draining.symmetric_difference_update({name})
            self._kick.set()

    def instance_states(self) -> list[dict[str, Any]]:
        """Each instance as operators see it (the controller's snapshot), with the ids of the
        requests it runs (sent to it and not back: at most its concurrency limit) and the
        output tokens each has so far (before an eviction and in its stream now); the store
        counts a request's tokens only once it ends or is evicted."""
        running: dict[str, list[str]] = {name: [] for name in self._instances}
        tokens: dict[str, dict[str, int]] = {name: {} for name in self._instances}
        for rid, name in self.controller.running_on().items():
            running.setdefault(name, []).append(rid)
            flight = self._flights.get(rid)
            so_far = self.controller.track(rid).output_tokens
            tokens.setdefault(name, {})[rid] = so_far + (flight.tokens if flight else 0)
        out = []
        for name, inst in self._instances.items():
            view = self._view(inst)
            out.append(
                {
                    "name": name,
                    "url": inst.spec.url,
                    "gpu": inst.spec.gpu,
                    "models": list(inst.spec.models),
                    "up": inst.up,
                    "draining": name in self._draining,
                    "active_model": inst.active_model,
                    "tiers": {m: t.name.lower() for m, t in inst.tiers.items()},
                    "outstanding": self.controller.outstanding(name),
                    "max_running": view.max_running,
                    "running": running[name],
                    "tokens": tokens[name],
                }
            )
        return out

    # --- the loop ---------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), timeout=self.tick_s)
            self._kick.clear()
            try:
                self.step()
            except Exception:  # never let the loop die: every request would hang
                log.exception("control step failed; retrying at the next tick")
                await asyncio.sleep(self.tick_s)

    def step(self) -> None:
        """One control step now, and its decisions set in motion."""
        now = self.clock.now()
        self.listener.stepping()
        try:
            output = self.controller.step(now, [self._view(i) for i in self._instances.values()])
        finally:
            self.listener.stepped()
        self.steps += 1
        if output.plans:
            self.listener.planned(output.plans)
        for decision in output.decisions:
            self._apply(decision, now)

    def _view(self, inst: _Instance) -> EngineReading:
        """The instance as its engine reads now: the same object as at the last step while
        nothing in it changed (the controller keeps what it built of a reading while it is the
        same object, as the simulator's driver does)."""
        reading = self._read(inst)
        if reading != inst.reading:
            inst.reading = reading
        return inst.reading

    def _read(self, inst: _Instance) -> EngineReading:
        caps = inst.caps
        max_running = inst.max_running or (caps.max_num_seqs if caps else None)
        capacity = caps.kv_capacity_tokens if caps else None
        return EngineReading(
            spec=inst.spec,
            max_running=max_running or DEFAULT_MAX_RUNNING,
            token_capacity=capacity or DEFAULT_TOKEN_CAPACITY,
            active_model=inst.active_model,
            up=inst.up and inst.spec.name not in self._draining,
            host_link_gbs=inst.host_link_gbs if caps and caps.supports_swap else 0.0,
            swap_free_gb=inst.swap_free_gb if caps and caps.supports_swap else 0.0,
            model_tiers=tuple(inst.tiers.items()),
            model_weights_gb=inst.weights_gb,
            cpu_cache_gb=inst.cpu_cache_gb,
            preemptions_total=inst.preemptions_total,
        )

    def _apply(self, decision: Decision, now: float) -> None:
        """Carry out one decision: a rejection at once, engine operations in a task."""
        execution = self.executor.execute(decision)
        op = execution.next()
        if isinstance(op, Forget):
            self._jobs.pop(op.request_id, None)
            self.listener.rejected(op.request_id, op.reason)
            self._kick.set()
        elif op is not None:
            self._spawn(self._carry_out(execution, op, now))

    async def _carry_out(self, execution: Execution, op: Operation | None, now: float) -> None:
        while op is not None:
            op = execution.next(await self._perform(op, now))

    async def _perform(self, op: Operation, now: float) -> Outcome:
        """One engine operation, awaited."""
        if isinstance(op, Submit):
            return await self._run(op.request_id, op.instance, now)
        if isinstance(op, Abort):
            await self._take_back(op.request_id, evicted=True)
        elif isinstance(op, Swap):
            return await self._swap(op)
        elif isinstance(op, ChangeTier):
            return await self._set_tier(op)
        elif isinstance(op, Fail):
            self._fail(op.request_id, op.reason)
        return DONE

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("agent operation failed", exc_info=task.exception())

    # --- operations -------------------------------------------------------------------------------

    async def _run(self, rid: str, instance: str, now: float) -> Outcome:
        """Submit: stream the request on its instance until it ends. ``Refused`` when the engine
        rejects the request (it cannot serve it); a stream that breaks is handled here."""
        job = self._jobs.get(rid)
        if job is None:
            return DONE  # cancelled between the decision and now
        inst = self._instances[instance]
        flight = _Flight(instance)
        flight.task = asyncio.current_task()
        self._flights[rid] = flight
        fresh = self.controller.track(rid).output_tokens == 0  # (not resumed: its own prompt)
        request = job.fill(self.controller.engine_request(rid))
        if job.exact:
            flight.held, job.held = job.held, ""
        self.listener.dispatched(rid, instance, now)
        if request.tokens_to_generate <= 0:  # all its output came back with it: nothing to run
            self._finish(rid, flight, EngineOutput(rid, "", 0, "length"))
            return DONE

        def on_chunk(chunk: TokenChunk) -> None:
            if flight.leaving:
                return
            if chunk.prompt_token_ids is not None and fresh:
                job.prompt_ids = chunk.prompt_token_ids
            if chunk.token_ids is None:
                flight.ids = None
            elif flight.ids is not None:
                flight.ids.extend(chunk.token_ids)
            if not (chunk.text or chunk.calls or chunk.finish_reason):
                flight.tokens = chunk.tokens
                return  # (a token that decoded to nothing yet: its id is kept)
            flight.text.append(chunk.text)
            if chunk.text:  # trailing whitespace waits for the text that follows it
                text = flight.held + chunk.text
                shown = text.rstrip()
                flight.held = text[len(shown) :]
                if shown != chunk.text:
                    chunk = replace(chunk, text=shown)
            flight.tokens = chunk.tokens
            if chunk.prompt_tokens is not None and not flight.prompt_counted:
                flight.prompt_counted = True
                if job.has_text and not job.exact:
                    self.controller.observe_prompt(rid, request.prompt_tokens, chunk.prompt_tokens)
            if not flight.started:
                flight.started = True
                at = self.clock.now()
                self.controller.on_event(instance, EngineEvent(EventKind.SCHEDULED, at, rid))
                self.controller.on_event(instance, EngineEvent(EventKind.FIRST_TOKEN, at, rid))
                self.listener.first_token(rid, at)
                self._kick.set()
            self.listener.chunk(rid, chunk)

        try:
            out = await inst.engine.submit(request, on_chunk)
        except asyncio.CancelledError:
            raise
        except RequestRejected as exc:
            if flight.leaving:
                return DONE
            log.warning("%s rejected %s: %s", instance, rid, exc)
            return Refused(str(exc))
        except EngineError as exc:
            if not flight.leaving:
                await self._stream_failed(inst, rid, flight, job, exc)
            return DONE
        if flight.leaving or self._flights.get(rid) is not flight:
            return DONE  # evicted or cancelled: handled where that was decided
        if out.aborted:  # aborted by someone else (an operator, a restart of the server)
            await self._take_back(rid, evicted=False)
        else:
            self._finish(rid, flight, out)
        return DONE

    async def _stream_failed(
        self, inst: _Instance, rid: str, flight: _Flight, job: Job, exc: EngineError
    ) -> None:
        """A request's stream broke. A timeout says the instance is slow, not dead: the request
        goes back alone, and the health checks decide about the instance. Otherwise its health
        is asked: an instance that answers it is not serving, or cannot be reached, is down (all
        it ran goes back). One that answers (or is slow to) leaves the failure this request's (a
        500 for it, a proxy cutting one connection): it alone goes back, with its output so far
        — and after ``MAX_STREAM_FAILURES`` such failures it is reported failed, so that one
        request an engine cannot serve does not fail over for ever, nor take its instance down
        with it. A connect that timed out never reached the engine and is not counted."""
        name = inst.spec.name
        health = Health.UNKNOWN if isinstance(exc, EngineTimeout) else await self._probe(inst)
        if flight.leaving or self._flights.get(rid) is not flight:
            return  # handled meanwhile (the instance went down, an eviction, a cancel)
        if health is Health.DEAD:
            log.warning("%s failed %s: %s", name, rid, exc)
            self._mark_down(inst, str(exc))  # returns this request and the others there
            return
        flight.leaving = True
        self._flights.pop(rid, None)
        if isinstance(exc, EngineTimeout) and not exc.reached:
            log.info("%s is slow: %s goes back (it never reached the engine): %s", name, rid, exc)
        else:
            job.stream_failures += 1
            if job.stream_failures >= MAX_STREAM_FAILURES:
                reason = f"{name} failed it {job.stream_failures} times, last: {exc}"
                log.warning("%s: giving up on %s: %s", name, rid, reason)
                self._fail(rid, reason)
                return
            log.warning(
                "%s failed %s (%d of %d; the instance %s): %s",
                name,
                rid,
                job.stream_failures,
                MAX_STREAM_FAILURES,
                "answers" if health is Health.SERVING else "is slow",
                exc,
            )
        self._give_back(rid, flight, "".join(flight.text), flight.tokens, evicted=False)

    def _fail(self, rid: str, reason: str) -> None:
        """The request is over, failed for ``reason`` (not returned to its group)."""
        self._flights.pop(rid, None)
        self.controller.failed(rid, reason)
        self._jobs.pop(rid, None)
        self.listener.failed(rid, reason)
        self._kick.set()

    def _finish(self, rid: str, flight: _Flight, out: EngineOutput) -> None:
        at = self.clock.now()
        if not flight.started:  # one chunk only, or an engine that does not stream
            self.controller.on_event(flight.instance, EngineEvent(EventKind.SCHEDULED, at, rid))
            self.controller.on_event(flight.instance, EngineEvent(EventKind.FIRST_TOKEN, at, rid))
            self.listener.first_token(rid, at)
        self.controller.on_event(
            flight.instance, EngineEvent(EventKind.FINISHED, at, rid, tokens=out.tokens)
        )
        self._flights.pop(rid, None)
        job = self._jobs.pop(rid, Job())
        record = self.controller.track(rid).copy()
        self.listener.finished(
            record, job.partial_text + out.text, out.finish_reason, out.tool_calls
        )
        self._kick.set()

    async def _take_back(self, rid: str, *, evicted: bool) -> None:
        """Stop a request on its engine and give it back to the policy with its output so far."""
        flight = self._flights.get(rid)
        if flight is None or flight.leaving:
            return
        flight.leaving = True
        out = await self._abort(flight.instance, rid)
        if self._flights.get(rid) is not flight or rid in self._cancelling:
            return  # a cancel or a release took it meanwhile: it reports (or drops) it
        if out is not None and not out.aborted:  # it finished before the abort reached it
            self._finish(rid, flight, out)
            return
        text = out.text if out is not None else "".join(flight.text)
        tokens = out.tokens if out is not None else flight.tokens
        self._flights.pop(rid, None)
        self._give_back(rid, flight, text, tokens, evicted=evicted)

    def _give_back(
        self, rid: str, flight: _Flight, text: str, tokens: int, *, evicted: bool
    ) -> None:
        """Back to the policy with its output so far: by its token ids where every one is known
        (``Job.exact``: nothing is dropped, the whitespace the stream held back included; the
        tokens the stream had shown, where an engine's abort counts a few more it never sent),
        else as text from ``resume_point``, or from the start when nothing can be continued."""
        job = self._jobs.get(rid)
        if job is None:
            return
        before = self.controller.track(rid).output_tokens
        ids = flight.ids
        if (
            job.resumable
            and job.prompt_ids is not None
            and ids is not None
            and len(ids) <= tokens
            and len(job.partial_ids) == before
            and before + len(ids) > 0
        ):
            job.partial_ids += tuple(ids)
            job.partial_text += "".join(flight.text)
            job.held = flight.held
            self.controller.returned(rid, len(ids), evicted=evicted, restart=False)
            self.listener.returned(rid, job.partial_text, before + len(ids), evicted=evicted)
            self._kick.set()
            return
        job.partial_ids, job.held = (), ""
        kept = resume_point(job.partial_text + text)
        # Nothing to continue (a structured answer; or only whitespace, which resuming drops):
        # it starts over, with its whole max_tokens.
        restart = not job.resumable or not kept
        job.partial_text = "" if restart else kept
        self.controller.returned(rid, tokens, evicted=evicted, restart=restart)
        track = self.controller.track(rid)
        self.listener.returned(rid, job.partial_text, track.output_tokens, evicted=evicted)
        self._kick.set()

    async def _abort(self, instance: str, rid: str) -> EngineOutput | None:
        """The engine's partial output, or None when it cannot say (down, or already gone)."""
        inst = self._instances[instance]
        if not inst.up:
            flight = self._flights.get(rid)
            if flight is not None and flight.task is not None:
                flight.task.cancel()
            return None
        try:
            return await inst.engine.abort(rid)
        except EngineError as exc:
            log.info("abort of %s on %s: %s", rid, instance, exc)
            return None

    async def _swap(self, op: Swap) -> Outcome:
        inst = self._instances[op.instance]
        try:
            if op.out:
                await inst.engine.swap_out(op.request_id)
            else:
                await inst.engine.swap_in(op.request_id)
        except EngineError as exc:
            log.info(
                "swap of %s on %s refused (%s): evicting instead", op.request_id, op.instance, exc
            )
            return Refused(str(exc))
        if op.out:  # an engine over HTTP says nothing of it otherwise
            self.controller.on_event(
                op.instance, EngineEvent(EventKind.SWAPPED_OUT, self.clock.now(), op.request_id)
            )
        return DONE

    async def _set_tier(self, op: ChangeTier) -> Outcome:
        """Change a model's tier; this instance's record of its tiers follows what the engine
        says it did, which may be less than asked (vLLM: a model asleep at level 2 asked warm
        stays cold): the policy then plans with the tier the model is really in — its load
        time, and no CPU memory taken for weights that are not there. A change the engine did
        not make is refused (the next step plans with the tiers as they are) and wakes no step
        of its own: the policy, seeing the model where it was, may ask again, and a step woken
        by each refusal would ask again at once, without end."""
        inst = self._instances[op.instance]
        async with inst.lock:
            try:
                tier = await inst.engine.set_model_tier(op.model, op.tier)
            except EngineError as exc:
                log.warning("%s: %s -> %s failed: %s", inst.spec.name, op.model, op.tier, exc)
                return Refused(str(exc))
            before = (dict(inst.tiers), inst.active_model)
            switched = tier is ModelTier.ACTIVE and op.model != inst.active_model
            if tier is ModelTier.ACTIVE:
                for model, was in inst.tiers.items():
                    if was is ModelTier.ACTIVE and model != op.model:
                        inst.tiers[model] = ModelTier.WARM
                inst.active_model = op.model
            elif inst.active_model == op.model:
                inst.active_model = None
            inst.tiers[op.model] = tier
            changed = before != (inst.tiers, inst.active_model)
        if changed or tier is op.tier:
            self._kick.set()
        if tier is not op.tier:
            log.debug("%s: %s asked %s stays %s", inst.spec.name, op.model, op.tier, tier)
            return Refused(f"{op.model} stays {tier.name.lower()} on {inst.spec.name}")
        return Done(switched)

    # --- health -----------------------------------------------------------------------------------

    async def _attach(self, inst: _Instance) -> None:
        try:
            inst.caps = await inst.engine.capabilities()
            stats = await inst.engine.stats()
        except EngineError as exc:
            log.warning("%s does not answer (%s): down until it does", inst.spec.name, exc)
            return
        inst.preemptions_total = stats.preemptions_total
        inst.swap_free_gb = stats.swap_free_gb or 0.0
        inst.tiers = dict(stats.model_tiers) or {
            m: ModelTier.ACTIVE if i == 0 else ModelTier.COLD
            for i, m in enumerate(inst.spec.models)
        }
        inst.active_model = stats.active_model or next(
            (m for m, t in inst.tiers.items() if t is ModelTier.ACTIVE), None
        )
        if not inst.up:
            log.info("%s is up", inst.spec.name)
            inst.up = True
            self.listener.instance_changed(inst.spec.name, True)
            self._kick.set()

    async def _health(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.health_interval_s)
            try:
                await asyncio.gather(*(self._check(i) for i in self._instances.values()))
            except Exception:  # never let the checks stop: no instance would come back
                log.exception("health checks failed")

    async def _check(self, inst: _Instance) -> None:
        """One health check at the interval: an instance that is not serving, or cannot be
        reached, is down at once; one that leaves ``down_after_health_timeouts`` checks in a row
        unanswered is down too; one that answers is (back) up."""
        health = await self._probe(inst)
        if health is Health.UNKNOWN:
            log.info(
                "%s: health check late (this controller was busy): not counted", inst.spec.name
            )
            return
        if health is Health.SILENT:
            inst.silent_checks += 1
            if not inst.up:
                return
            if inst.silent_checks >= self.down_after_health_timeouts:
                self._mark_down(
                    inst,
                    f"{inst.silent_checks} health checks in a row unanswered within "
                    f"{HEALTH_TIMEOUT_S:g} s",
                )
            else:
                log.warning(
                    "%s is slow: its health check was not answered within %g s (%d in a row; "
                    "down at %d)",
                    inst.spec.name,
                    HEALTH_TIMEOUT_S,
                    inst.silent_checks,
                    self.down_after_health_timeouts,
                )
            return
        inst.silent_checks = 0
        ok = health is Health.SERVING
        if ok and not inst.up:
            await self._attach(inst)
        elif not ok and inst.up:
            self._mark_down(inst, "health check failed")
        elif ok:
            await self._read_counters(inst)

    async def _probe(self, inst: _Instance) -> Health:
        """The instance's health (``Health``). One check at a time per instance: whoever asks
        meanwhile (a burst of broken streams, the interval's check) shares its answer."""
        if inst.probe is None:
            probe = asyncio.create_task(self._ask_health(inst), name=f"qlm-health-{inst.spec.name}")

            def clear(task: asyncio.Task[Health]) -> None:
                if inst.probe is task:
                    inst.probe = None

            probe.add_done_callback(clear)
            inst.probe = probe
        return await asyncio.shield(inst.probe)

    @staticmethod
    async def _ask_health(inst: _Instance) -> Health:
        started = time.monotonic()
        try:
            ok = await asyncio.wait_for(inst.engine.health(), HEALTH_TIMEOUT_S)
        except (TimeoutError, EngineTimeout):
            if time.monotonic() - started > HEALTH_TIMEOUT_S + LATE_S:
                return Health.UNKNOWN
            return Health.SILENT
        except Exception:  # health() raises nothing else; a broken one means down
            log.exception("health check of %s failed", inst.spec.name)
            return Health.DEAD
        return Health.SERVING if ok else Health.DEAD

    async def _read_counters(self, inst: _Instance) -> None:
        """The engine's preemption counter, for the estimator (vLLM preempts when its KV cache
        is full, and recomputes what it threw away: work the estimator must count), and the
        CPU memory it can still park KV caches in (what KV swap may use)."""
        try:
            stats = await inst.engine.stats()
            inst.preemptions_total = stats.preemptions_total
            inst.swap_free_gb = stats.swap_free_gb or 0.0
        except EngineError as exc:  # the next health check decides whether it is down
            log.debug("%s: stats not read (%s)", inst.spec.name, exc)

    def _mark_down(self, inst: _Instance, reason: str) -> None:
        """Fault isolation: everything sent to ``inst`` returns to the policy with its output."""
        if inst.up:
            log.warning("%s is down: %s", inst.spec.name, reason)
            inst.up = False
            self.listener.instance_changed(inst.spec.name, False)
        for rid, flight in list(self._flights.items()):
            if flight.instance != inst.spec.name or flight.leaving:
                continue
            flight.leaving = True
            if flight.task is not None and flight.task is not asyncio.current_task():
                flight.task.cancel()
            self._flights.pop(rid, None)
            self._give_back(rid, flight, "".join(flight.text), flight.tokens, evicted=False)
        self._kick.set()
