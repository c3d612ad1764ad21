"""One control step: observe -> group -> estimate -> plan -> act -> record.

``Controller`` is the part of QLM that both the simulator and the service run, unchanged: it
keeps what happened to every request it was given (a ``RequestRecord`` each, filled in as it
runs), counts what each instance holds (the agents' own count: engines' gauges lag), and runs
one step as named stages (``Controller.step``): *observe* — the news since the last step (arrivals, requests back from
an engine, completions, starts, cancellations) and each instance's load, as one
``DispatchContext``; *group, estimate, plan, act* — the policy's ``decide`` (``qlm.planner``:
groups, RCT estimator, planner, virtual queues and agent decisions for ``qlm``; a baseline
otherwise), checked; *record* — each pull counted against its instance, and the plans the
policy made taken over. The step returns a ``StepOutput``: the decisions, which the executor
(``qlm.agents.executor``) maps to engine operations on both clocks, and the plans made in it.
What the policy predicts of its virtual queues is asked for on demand (``Controller.snapshot``):
under a large backlog it is too costly for every step.

What differs between the two clocks lives outside: the driver that calls ``step`` and performs
those operations (the discrete-event loop of ``qlm.sim.cluster`` with ``SimEngine`` calls, or
the asyncio runtime of ``qlm.service.runtime`` with ``Engine`` coroutines over HTTP). The driver
reports back through ``on_event`` (what the engine did), ``returned`` (a request came back from
an engine with the output it had generated: evicted, or its instance failed) and ``failed`` (the
engine refused it).

**Prompt lengths.** The API estimates a prompt's tokens without the model's tokenizer (about four
characters per token: ``qlm.api.prompts``); code or non-Latin text runs denser. An engine that
says how many tokens it counted (vLLM's ``usage``) teaches the controller the ratio per model
(``observe_prompt``; a ratio of sums, forgetting, shrunk toward 1 by ``PROMPT_PRIOR_TOKENS``),
and every request that arrives after is planned with its estimate scaled by it.

**Poison.** A request whose handling raises inside a step (an input no validation foresaw, a
corner of the policy's arithmetic) must not stop the step for everyone, tick after tick. A
policy that knows which request broke (``RequestFailed``) has it rejected and the step taken
again without it. Otherwise the controller asks the policy to step without the suspects — the step's arrivals, then every
waiting request — and hands them back in halves, so each request that fails a step alone ends
with a ``Reject`` (failed, with the error as its reason: the service dead-letters it), in
O(k log n) extra policy calls for k such requests among n. A step that fails even with no
request waiting raises, as before, and its news waits for the next step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from qlm.domain import (
    Decision,
    InstanceSpec,
    ModelTier,
    PlanRecord,
    Pull,
    Reject,
    Request,
    RequestRecord,
    RequestStatus,
)
from qlm.engines.base import EngineEvent, EngineRequest, EventKind
from qlm.errors import ConfigError, RequestFailed
from qlm.planner.policy import Completion, DispatchContext, InstanceLoad, Policy

if TYPE_CHECKING:
    from qlm.virtual_queues import VirtualQueuesSnapshot

log = logging.getLogger(__name__)

FINAL = frozenset({RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED})
PROMPT_PRIOR_TOKENS = 2000.0  # weight of "the estimate is right", in estimated tokens
PROMPT_FORGETTING = 0.99  # per observed prompt: the ratio follows the last ~100
PROMPT_SCALE_LIMITS = (0.25, 4.0)


@dataclass(frozen=True, slots=True)
class EngineReading:
    """What the driver reads off one instance's engine before a step; the controller adds what
    it counts itself (requests and tokens it sent there)."""

    spec: InstanceSpec
    max_running: int
    token_capacity: int
    active_model: str | None
    up: bool = True
    host_link_gbs: float = 0.0
    swap_free_gb: float = 0.0
    model_tiers: tuple[tuple[str, ModelTier], ...] = ()
    model_weights_gb: tuple[tuple[str, float], ...] = ()
    cpu_cache_gb: float = 0.0
    preemptions_total: int | None = None  # the engine's own preemptions so far (None: unread)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one control step produced: the decisions for an executor to apply, in order, and
    the plans the policy made in the step (each handed over once: a plan appears in the output
    of the step that made it and in no other)."""

    decisions: tuple[Decision, ...]
    plans: tuple[PlanRecord, ...] = ()


class Controller:
    """The control plane's state between steps, around one policy (module docstring)."""

    def __init__(self, policy: Policy, instances: Sequence[InstanceSpec]) -> None:
        names = [spec.name for spec in instances]
        if len(set(names)) != len(names):
            raise ConfigError(f"instance names must be unique, got {names}")
        self.policy = policy
        self.specs = {spec.name: spec for spec in instances}
        self._served = {m for spec in instances for m in spec.models}
        self._tracks: dict[str, RequestRecord] = {}
        self._pending: dict[str, Request] = {}  # given to the policy, not pulled yet
        self._arrived: list[Request] = []  # to hand to the policy at the next step
        self._completions: list[Completion] = []
        self._started: list[str] = []
        self._cancelled: list[str] = []
        self._outstanding = dict.fromkeys(names, 0)
        self._outstanding_tokens = dict.fromkeys(names, 0)
        self._on: dict[str, str] = {}  # request -> instance it was sent to, while there
        self._prompts: dict[str, tuple[float, float]] = {}  # model -> (counted, estimated)
        # instance -> (reading, the load built of it and the counts): ``_load``; dropped when
        # the counts change
        self._loads: dict[str, tuple[EngineReading, InstanceLoad]] = {}
        self.finished = 0

    # --- input ------------------------------------------------------------------------------------

    def add_instance(self, spec: InstanceSpec) -> None:
        """An instance joins the fleet (the policy sees it at the next step)."""
        if spec.name in self.specs:
            raise ConfigError(f"instance {spec.name!r} already exists")
        self.specs[spec.name] = spec
        self._served.update(spec.models)
        self._outstanding[spec.name] = 0
        self._loads.pop(spec.name, None)
        self._outstanding_tokens[spec.name] = 0

    def learn_outputs(self, history: Iterable[tuple[Request, int]]) -> int:
        """Completions this controller did not see — the store's most recent, when it starts or
        takes over from another: the policy learns their output lengths
        (``Policy.learn_output``), of the models the fleet serves. Returns how many it learnt
        from (0 if it learns none)."""
        learnt = 0
        for request, output_tokens in history:
            if request.model in self._served and output_tokens > 0:
                if not self.policy.learn_output(request, output_tokens):
                    return 0
                learnt += 1
        return learnt

    def observe_prompt(self, request_id: str, sent: int, counted: int) -> None:
        """The engine counted ``counted`` tokens in the prompt of ``request_id`` sent as
        ``sent`` (``engine_request``: its scaled input and any output it resumes from, which
        the engine counted itself): the ratio learns the input's part against the API's own
        estimate (module docstring, "Prompt lengths")."""
        track = self._tracks.get(request_id)
        if track is None:
            return
        resumed = sent - track.request.input_tokens
        estimated = track.estimated_input_tokens or track.request.input_tokens
        counted -= resumed
        if estimated < 1 or counted < 1:
            return
        model = track.request.model
        seen_counted, seen_estimated = self._prompts.get(model, (0.0, 0.0))
        self._prompts[model] = (
            PROMPT_FORGETTING * seen_counted + counted,
            PROMPT_FORGETTING * seen_estimated + estimated,
        )

    def prompt_scale(self, model: str) -> float:
        """Tokens the engines count per estimated token of ``model``'s prompts (1 until told)."""
        counted, estimated = self._prompts.get(model, (0.0, 0.0))
        ratio = (counted + PROMPT_PRIOR_TOKENS) / (estimated + PROMPT_PRIOR_TOKENS)
        low, high = PROMPT_SCALE_LIMITS
        return min(high, max(low, ratio))

    def arrive(
        self,
        request: Request,
        *,
        generated: int = 0,
        failovers: int = 0,
        estimated_prompt: bool = False,
    ) -> bool:
        """Hand a request to the policy at the next step. ``generated``: output it already has
        (a request recovered from an earlier controller resumes from it). ``estimated_prompt``:
        its prompt is text whose length the API estimated, scaled by what the engines have
        counted (``prompt_scale``; a replay's filler prompt is counted exactly). Returns False,
        and changes nothing, when the request is already held (a redelivered message)."""
        if request.id in self._tracks:
            return False
        if request.model not in self._served:
            raise ConfigError(f"request {request.id}: no instance serves model {request.model!r}")
        estimated, scale = request.input_tokens, self.prompt_scale(request.model)
        if scale != 1.0 and estimated_prompt:
            request = replace(request, input_tokens=max(1, round(estimated * scale)))
        track = RequestRecord(
            request, output_tokens=generated, failovers=failovers, estimated_input_tokens=estimated
        )
        self._tracks[request.id] = track
        self._pending[request.id] = request
        self._arrived.append(request)
        return True

    def on_event(self, instance: str, event: EngineEvent) -> bool:
        """What an engine did to a request; True when the request finished."""
        track = self._tracks.get(event.request_id)
        if track is None or self._on.get(event.request_id) != instance:
            return False  # an event of an attempt that was already given up (evicted, failed)
        kind = event.kind
        if kind is EventKind.SCHEDULED:
            self._started.append(event.request_id)
            if track.scheduled_s is None:
                track.scheduled_s = event.time
            track.status = RequestStatus.RUNNING
        elif kind is EventKind.FIRST_TOKEN:
            if track.first_token_s is None:
                track.first_token_s = event.time
        elif kind is EventKind.FINISHED:
            self._release(track)  # before the output grows: release what was counted at dispatch
            track.finish_s = event.time
            track.output_tokens += event.tokens
            track.status = RequestStatus.FINISHED
            self.finished += 1
            self._completions.append(
                Completion(
                    track.request,
                    instance,
                    track.output_tokens,
                    track.scheduled_s,
                    track.first_token_s,
                    event.time,
                )
            )
            return True
        elif kind is EventKind.PREEMPTED:
            track.preemptions += 1
        elif kind is EventKind.SWAPPED_OUT:
            track.swaps += 1
        return False

    def returned(
        self, request_id: str, generated: int, *, evicted: bool, restart: bool = False
    ) -> None:
        """A request left its engine unfinished with ``generated`` new output tokens: evicted by
        a decision (``evicted``) or lost with its instance. It goes back to the policy, which
        resumes it as prompt + partial output (in its group, not at the tail) — or, with
        ``restart`` (an answer that cannot be continued), runs it again from its first token."""
        track = self._tracks[request_id]
        if self._on.get(request_id) is None:
            return  # already back (an abort and a failure of the same attempt)
        self._release(track)
        track.output_tokens = 0 if restart else track.output_tokens + generated
        if evicted:
            track.evictions += 1
        else:
            track.failovers += 1
        track.status = RequestStatus.QUEUED
        self._pending[request_id] = track.request
        self._arrived.append(track.request)

    def failed(self, request_id: str, error: str) -> None:
        """The engine refused the request (or it cannot be served): it ends failed."""
        track = self._tracks[request_id]
        if self._on.get(request_id) is not None:
            self._release(track)
        self._pending.pop(request_id, None)
        self._cancelled.append(request_id)  # the policy forgets it: it will never finish
        track.status, track.error = RequestStatus.FAILED, error

    def cancel(self, request_id: str) -> str | None:
        """Stop a request wherever it is: the policy forgets it at the next step. Returns the
        instance it was sent to (the executor aborts it there), else None."""
        track = self._tracks.get(request_id)
        if track is None or track.status in FINAL:
            return None
        track.status = RequestStatus.CANCELLED
        self._pending.pop(request_id, None)
        self._cancelled.append(request_id)
        instance = self._on.get(request_id)
        if instance is not None:
            self._release(track)
        return instance

    def forget(self, request_id: str) -> bool:
        """Drop a finished, failed or cancelled request's track once its outcome is recorded
        elsewhere (the service's store): a long-running controller must not keep every request
        it ever served. A request still held is kept. Returns whether one was dropped. A
        redelivery of a forgotten request is answered by the store, which knows it is final."""
        track = self._tracks.get(request_id)
        if track is None or track.status not in FINAL or request_id in self._on:
            return False
        del self._tracks[request_id]
        return True

    # --- the step ---------------------------------------------------------------------------------

    @property
    def has_arrivals(self) -> bool:
        """Requests (new, or back from an engine) wait to be handed to the policy."""
        return bool(self._arrived)

    @property
    def has_news(self) -> bool:
        """Something arrived, started or finished since the last step."""
        return bool(self._arrived or self._completions or self._started or self._cancelled)

    def step(self, now: float, readings: Iterable[EngineReading]) -> StepOutput:
        """One control step (module docstring): observe the news, let the policy group,
        estimate, plan and act on it, record what it decided. Pulls are counted against their
        instance here, before the executor applies them. A step the policy cannot take is
        narrowed down to the waiting requests that make it fail (module docstring, "Poison"):
        each of them ends with a ``Reject``, and the step goes on for everyone else."""
        readings = tuple(readings)
        arrived, finished, started, cancelled = self._observe()
        decisions = self._run_policy(now, readings, arrived, finished, started, cancelled)
        return StepOutput(tuple(decisions), tuple(self.policy.take_plans()))

    def snapshot(self, now: float) -> VirtualQueuesSnapshot | None:
        """The policy's virtual queues now, with what its model predicts of each group (None
        for a policy without virtual queues). Costly under a large backlog: for operators and
        clients, asked for when they need it, never by a step."""
        return self.policy.snapshot(now)

    def _observe(self) -> tuple[list[Request], list[Completion], list[str], list[str]]:
        """The news since the last step, taken: requests to hand to the policy (not cancelled
        meanwhile), completions, requests started, requests cancelled."""
        arrived = [r for r in self._arrived if r.id in self._pending]  # not cancelled meanwhile
        self._arrived = []
        finished, self._completions = self._completions, []
        started, self._started = self._started, []
        cancelled, self._cancelled = self._cancelled, []
        return arrived, finished, started, cancelled

    def _run_policy(
        self,
        now: float,
        readings: Sequence[EngineReading],
        arrived: list[Request],
        finished: list[Completion],
        started: list[str],
        cancelled: list[str],
    ) -> list[Decision]:
        """The policy's decisions on the news (``_decide``), the step taken again without a
        request the policy names as failing it, or narrowed down to the requests that do
        (``_isolate``). A step that fails for no waiting request puts its news back for the
        next step and raises."""
        rejects: list[Decision] = []
        try:
            while True:
                try:
                    return rejects + self._decide(
                        now, readings, arrived, finished, started, cancelled
                    )
                except RequestFailed as exc:
                    if exc.request_id not in self._pending:
                        raise
                    # the policy took everything before that request: again without it
                    rejects.append(self._reject(exc.request_id, exc.cause))
                    arrived = [r for r in arrived if r.id != exc.request_id]
                    finished, started, cancelled = [], [], [exc.request_id]
        except Exception as exc:
            decisions = self._isolate(now, readings, arrived, finished, started, cancelled, exc)
            if decisions is None:
                # Not a waiting request's fault: nothing of this step happened, and its inputs
                # wait for the next one (policies take a request they already hold again
                # without harm).
                self._arrived[:0] = arrived
                self._completions[:0] = finished
                self._started[:0] = started
                self._cancelled[:0] = cancelled
                raise
            return rejects + decisions

    def _decide(
        self,
        now: float,
        readings: Sequence[EngineReading],
        arrived: Sequence[Request],
        finished: Sequence[Completion] = (),
        started: Sequence[str] = (),
        cancelled: Sequence[str] = (),
    ) -> list[Decision]:
        """The policy's decisions on this news (it groups, estimates, plans and acts), checked,
        and recorded: their pulls counted against their instances."""
        tracks = self._tracks
        ctx = DispatchContext(
            now=now,
            arrived=tuple(arrived),
            finished=tuple(finished),
            started=tuple(started),
            cancelled=tuple(cancelled),
            generated=tuple(
                (r.id, tokens) for r in arrived if (tokens := tracks[r.id].output_tokens)
            ),
            instances=tuple([self._load(r) for r in readings]),
        )
        decisions = self.policy.decide(ctx)
        if not decisions:
            return decisions
        specs, pending = self.specs, self._pending
        for d in decisions:
            if isinstance(d, Reject) or d.instance not in specs:
                raise ConfigError(f"policy {self.policy.name} named unknown instance {d!r}")
            if isinstance(d, Pull) and d.request_id not in pending:
                raise ConfigError(f"policy {self.policy.name} pulled {d.request_id!r} twice")
        for d in decisions:
            if isinstance(d, Pull):
                self._dispatch(d, now)
        return decisions

    def _isolate(
        self,
        now: float,
        readings: Sequence[EngineReading],
        arrived: list[Request],
        finished: list[Completion],
        started: list[str],
        cancelled: list[str],
        error: Exception,
    ) -> list[Decision] | None:
        """The step failed with ``error``. Suspect the arrivals first, then every waiting
        request: if the policy can step without the suspects (told to forget them), they are
        handed back in halves, and each one that makes a step fail alone is rejected. None when
        the step fails even without any waiting request (the fault is elsewhere)."""
        log.warning("control step failed (%r); looking for the requests that cause it", error)
        narrow = [r.id for r in arrived]
        for suspects in (narrow, list(self._pending)):
            try:
                decisions = self._decide(
                    now, readings, (), finished, started, (*cancelled, *suspects)
                )
            except Exception:
                if suspects is narrow and len(suspects) == len(self._pending):
                    break  # the wider suspicion is the same
                continue
            back = [self._pending[rid] for rid in suspects if rid in self._pending]
            return decisions + self._readmit(now, readings, back, error)
        return None

    def _readmit(
        self,
        now: float,
        readings: Sequence[EngineReading],
        requests: list[Request],
        error: Exception,
    ) -> list[Decision]:
        """Hand ``requests`` back to the policy, halving any part that fails a step (the policy
        forgets that part again) until each one that fails alone is rejected."""
        decisions: list[Decision] = []
        parts = [requests]
        while parts:
            part = parts.pop()
            if not part:
                continue
            try:
                decisions += self._decide(now, readings, part)
                continue
            except Exception as exc:
                error = exc
            try:
                decisions += self._decide(now, readings, (), cancelled=[r.id for r in part])
            except Exception:  # the policy cannot even forget them: none of them can run
                decisions += [self._reject(r.id, error) for r in part]
                continue
            if len(part) == 1:
                decisions.append(self._reject(part[0].id, error))
            else:
                half = len(part) // 2
                parts += [part[half:], part[:half]]
        return decisions

    def _reject(self, request_id: str, error: Exception) -> Reject:
        if isinstance(error, RequestFailed):
            error = error.cause
        track = self._tracks[request_id]
        self._pending.pop(request_id, None)
        reason = f"could not be planned ({type(error).__name__}: {error})"
        track.status, track.error = RequestStatus.FAILED, reason
        log.error("request %s fails alone: %s", request_id, reason)
        return Reject(request_id, reason)

    def engine_request(self, request_id: str) -> EngineRequest:
        """What to submit for a pulled request: a resumed one carries its earlier output as
        prompt and asks for the rest."""
        track = self._tracks[request_id]
        req, done = track.request, track.output_tokens
        return EngineRequest(
            request_id=req.id,
            model=req.model,
            prompt_tokens=req.input_tokens + done,
            max_tokens=req.max_tokens - done,
            priority=int(req.tier),
            resumed_tokens=done,
            output_tokens=None
            if req.replay_output_tokens is None
            else req.replay_output_tokens - done,
        )

    # --- reading --------------------------------------------------------------------------------

    def track(self, request_id: str) -> RequestRecord:
        return self._tracks[request_id]

    def tracks(self) -> Iterable[RequestRecord]:
        return self._tracks.values()

    def instance_of(self, request_id: str) -> str | None:
        """The instance running (or holding) the request now."""
        return self._on.get(request_id)

    def on_instance(self, instance: str) -> list[str]:
        """Requests sent to ``instance`` that have not come back."""
        return [rid for rid, name in self._on.items() if name == instance]

    def running_on(self) -> dict[str, str]:
        """Every request sent to an instance that has not come back, with that instance."""
        return dict(self._on)

    def pending(self) -> list[Request]:
        """Requests the policy holds and has not pulled."""
        return list(self._pending.values())

    def outstanding(self, instance: str) -> int:
        return self._outstanding[instance]

    def outstanding_tokens(self, instance: str) -> int:
        """Prompt tokens (with the output a resumed request re-reads) sent to ``instance`` and
        not back yet: what the agent holds against the instance's KV cache."""
        return self._outstanding_tokens[instance]

    def close(self) -> None:
        """End of a run: anything still held ends failed with the reason, never silently."""
        for track in self._tracks.values():
            if track.request.id in self._pending and track.status is RequestStatus.QUEUED:
                track.status, track.error = RequestStatus.FAILED, "never dispatched"
            elif track.status not in FINAL:
                track.status, track.error = RequestStatus.FAILED, "unfinished when the run ended"

    # --- internals --------------------------------------------------------------------------------

    def _dispatch(self, pull: Pull, now: float) -> None:
        req = self._pending.pop(pull.request_id)
        track = self._tracks[req.id]
        track.instance = pull.instance
        if track.dispatch_s is None:
            track.dispatch_s = now
        self._on[req.id] = pull.instance
        self._loads.pop(pull.instance, None)
        self._outstanding[pull.instance] += 1
        self._outstanding_tokens[pull.instance] += req.input_tokens + track.output_tokens

    def _release(self, track: RequestRecord) -> None:
        name = self._on.pop(track.request.id)
        self._loads.pop(name, None)
        self._outstanding[name] -= 1
        self._outstanding_tokens[name] -= track.request.input_tokens + track.output_tokens

    def _load(self, reading: EngineReading) -> InstanceLoad:
        """What the policy knows of the instance: the same object as at the last step while its
        reading and counts are unchanged (a step changes one or two instances at most)."""
        spec = reading.spec
        cached = self._loads.get(spec.name)
        if cached is not None and cached[0] is reading:
            return cached[1]
        load = InstanceLoad(
            name=spec.name,
            models=spec.models,
            outstanding_requests=self._outstanding[spec.name],
            outstanding_tokens=self._outstanding_tokens[spec.name],
            max_running=reading.max_running,
            token_capacity=reading.token_capacity,
            gpu=spec.gpu,
            gpu_count=spec.gpu_count,
            active_model=reading.active_model,
            host_link_gbs=reading.host_link_gbs,
            swap_free_gb=reading.swap_free_gb,
            model_tiers=reading.model_tiers,
            model_weights_gb=reading.model_weights_gb,
            cpu_cache_gb=reading.cpu_cache_gb,
            up=reading.up,
            preemptions_total=reading.preemptions_total,
        )
        self._loads[spec.name] = (reading, load)
        return load
