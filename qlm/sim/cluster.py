"""Replay a workload against simulated instances under a named policy, in virtual time.

The simulator is a heap of ``(time, seq, instance, version)`` engine wake-ups plus the sorted
arrivals. At each arrival or engine event the policy's ``decide`` is called with the same context
production would give it, and its decisions are applied to the engines by ``_apply``. Nothing here
is a policy: the harness only moves time, routes decisions and measures.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from qlm.clock import VirtualClock
from qlm.domain import (
    Decision,
    Evict,
    InstanceSpec,
    Pull,
    Request,
    RequestRecord,
    RequestStatus,
    SetModelTier,
    SwapIn,
    SwapOut,
)
from qlm.engines.base import EngineEvent, EngineRequest, EventKind
from qlm.engines.perf_model import HardwareCatalog, default_catalog
from qlm.engines.sim import SimEngine, SimEngineConfig
from qlm.errors import ConfigError, EngineError
from qlm.planner.policy import Completion, DispatchContext, InstanceLoad, Policy
from qlm.sim.metrics import MemoryTimeline, summarize

ProgressFn = Callable[[int, int], None]


class SimObserver(Protocol):
    """Watches a run from inside, for experiments that need more than the records (e.g. what an
    estimator would have predicted at each dispatch). Production code never needs it."""

    def on_dispatch(self, now: float, request: Request, engine: SimEngine) -> None: ...

    def on_finish(self, record: RequestRecord) -> None: ...


@dataclass(frozen=True, slots=True)
class Outage:
    """Instance ``instance`` fails at ``fail_s`` and is healthy again at ``recover_s``."""

    instance: str
    fail_s: float
    recover_s: float

    def __post_init__(self) -> None:
        if not self.recover_s > self.fail_s >= 0:
            raise ConfigError(f"outage of {self.instance}: need 0 <= fail_s < recover_s")


@dataclass(slots=True)
class _Track:
    """Mutable measurements of one request during a run."""

    request: Request
    instance: str = ""
    dispatch_s: float | None = None
    scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0  # generated before the current attempt (evictions keep their output)
    preemptions: int = 0
    evictions: int = 0
    swaps: int = 0
    failovers: int = 0  # times the instance running it failed
    status: RequestStatus = RequestStatus.QUEUED
    error: str = ""

    def record(self) -> RequestRecord:
        return RequestRecord(
            request=self.request,
            instance=self.instance,
            dispatch_s=self.dispatch_s,
            scheduled_s=self.scheduled_s,
            first_token_s=self.first_token_s,
            finish_s=self.finish_s,
            output_tokens=self.output_tokens,
            preemptions=self.preemptions,
            evictions=self.evictions,
            swaps=self.swaps,
            status=self.status,
            failovers=self.failovers,
        )


@dataclass(frozen=True, slots=True)
class SimResult:
    """Everything a run measured: one record per request and the summary of them."""

    policy: str
    instances: tuple[InstanceSpec, ...]
    records: tuple[RequestRecord, ...]
    summary: dict[str, Any]
    memory: MemoryTimeline = field(repr=False)


def build_engines(
    instances: Sequence[InstanceSpec],
    *,
    catalog: HardwareCatalog | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> list[SimEngine]:
    """One simulated engine per instance spec, with the shipped performance profiles."""
    catalog = catalog or default_catalog()
    names = [spec.name for spec in instances]
    if len(set(names)) != len(names):
        raise ConfigError(f"instance names must be unique, got {names}")
    engines = []
    for spec in instances:
        perf = {m: catalog.perf_model(m, spec.gpu, spec.gpu_count) for m in spec.models}
        gpu = catalog.gpu(spec.gpu)
        config = SimEngineConfig.for_gpu(gpu.memory_gb, gpu.name, **(config_overrides or {}))
        engines.append(SimEngine(spec.name, perf, config))
    return engines


class ClusterSimulation:
    """A fleet of simulated instances driven by one policy on a virtual clock."""

    def __init__(
        self,
        instances: Sequence[InstanceSpec],
        policy: Policy,
        *,
        catalog: HardwareCatalog | None = None,
        engine_config: dict[str, Any] | None = None,
        memory_bin_s: float = 10.0,
        observer: SimObserver | None = None,
    ) -> None:
        if not instances:
            raise ConfigError("a cluster simulation needs at least one instance")
        self.specs = tuple(instances)
        self.policy = policy
        self.observer = observer
        overrides = dict(engine_config or {})
        switching = getattr(policy, "model_switching", None)  # a policy that switches models itself
        if switching is not None:
            overrides.setdefault("model_switching", switching)
        self.engines = build_engines(instances, catalog=catalog, config_overrides=overrides)
        self._index = {e.name: i for i, e in enumerate(self.engines)}
        cat = catalog or default_catalog()
        self._host_link_gbs = [cat.gpu(spec.gpu).host_link_gbs for spec in self.specs]
        self.clock = VirtualClock()
        self.memory = MemoryTimeline([e.name for e in self.engines], bin_s=memory_bin_s)
        self._heap: list[tuple[float, int, int, int]] = []
        self._version = [0] * len(self.engines)
        self._seq = 0
        self._tracks: dict[str, _Track] = {}
        self._pending: dict[str, Request] = {}  # given to the policy, not pulled yet
        self._arrived: list[Request] = []  # to hand to the policy at the next step
        self._completions: list[Completion] = []
        self._started: list[str] = []
        self._up = [True] * len(self.engines)
        self._outstanding = [0] * len(self.engines)
        self._outstanding_tokens = [0] * len(self.engines)
        self._finished = 0

    def run(
        self,
        requests: Sequence[Request],
        progress: ProgressFn | None = None,
        *,
        outages: Sequence[Outage] = (),
    ) -> SimResult:
        """Replay ``requests`` (any order; sorted by arrival) until every one has finished.
        ``outages``: instances that fail at a time and come back later (fault isolation)."""
        served = {m for spec in self.specs for m in spec.models}
        missing = sorted({r.model for r in requests} - served)
        if missing:
            raise ConfigError(f"no instance serves model(s) {', '.join(missing)}")
        ordered = sorted(requests, key=lambda r: (r.arrival_s, r.id))
        for r in ordered:
            if r.id in self._tracks:
                raise ConfigError(f"duplicate request id {r.id!r}")
            self._tracks[r.id] = _Track(r)
        total = len(ordered)
        ai = 0
        if ordered:
            self.clock.advance_to(ordered[0].arrival_s)
            self.memory.begin(
                ordered[0].arrival_s, [e.gpu_memory_used_fraction() for e in self.engines]
            )
        step_progress = max(1, total // 200)
        events = sorted(
            [(o.fail_s, o.instance, False) for o in outages]
            + [(o.recover_s, o.instance, True) for o in outages]
        )
        for _, name, _ in events:
            if name not in self._index:
                raise ConfigError(f"outage of unknown instance {name!r}")
        while ai < total or self._heap or events:
            t_engine, idx = self._peek_engine()
            if idx < 0 and ai >= total and not events:
                break  # only stale wake-ups were left
            t_arrival = ordered[ai].arrival_s if ai < total else math.inf
            if events and events[0][0] <= min(t_engine, t_arrival):
                t_event, name, recovers = events.pop(0)
                self.clock.advance_to(t_event)
                self._set_up(self._index[name], recovers, t_event)
                self._control(t_event)
            elif t_engine < t_arrival:  # on a tie, arrivals first: they join the next step
                heapq.heappop(self._heap)
                self.clock.advance_to(t_engine)
                self._on_engine(idx, t_engine)
            else:
                self.clock.advance_to(t_arrival)
                req = ordered[ai]
                ai += 1
                self._pending[req.id] = req
                self._arrived.append(req)
                self._control(t_arrival)
            if progress is not None and (self._finished % step_progress == 0 or ai == total):
                progress(self._finished, total)
        for req in self._pending.values():  # only possible if a policy never dispatches them
            track = self._tracks[req.id]
            track.status, track.error = RequestStatus.FAILED, "never dispatched"
        for track in self._tracks.values():  # e.g. left swapped out by a policy: never silent
            if track.status not in (RequestStatus.FINISHED, RequestStatus.FAILED):
                track.status, track.error = RequestStatus.FAILED, "unfinished when the run ended"
        records = tuple(self._tracks[r.id].record() for r in ordered)
        self.memory.close(self.clock.now())
        summary = summarize(
            records,
            model_switches={e.name: e.model_switches for e in self.engines},
            memory=self.memory,
        )
        summary["policy"] = self.policy.name
        return SimResult(self.policy.name, self.specs, records, summary, self.memory)

    # --- event handling --------------------------------------------------------------------------

    def _peek_engine(self) -> tuple[float, int]:
        heap = self._heap
        while heap:
            t, _, idx, version = heap[0]
            if version == self._version[idx]:
                return t, idx
            heapq.heappop(heap)
        return math.inf, -1

    def _set_up(self, idx: int, up: bool, now: float) -> None:
        """An instance fails (every request on it goes back to the policy with the output it had
        streamed, as an agent holding the broken streams would) or comes back empty."""
        engine = self.engines[idx]
        if not up:
            for rid, _, _ in engine.queue_view(now):
                generated = engine.abort(rid, now)
                track = self._tracks[rid]
                self._outstanding[idx] -= 1
                self._outstanding_tokens[idx] -= self._work_tokens(track.request)
                track.output_tokens += generated
                track.failovers += 1
                track.status = RequestStatus.QUEUED
                self._pending[rid] = track.request
                self._arrived.append(track.request)
        self._up[idx] = up
        self._wake(idx)

    def _wake(self, idx: int) -> None:
        """(Re)schedule an engine's next wake-up; older entries become stale."""
        self._version[idx] += 1
        t = self.engines[idx].next_event_time()
        if t is not None:
            self._seq += 1
            heapq.heappush(self._heap, (t, self._seq, idx, self._version[idx]))

    def _on_engine(self, idx: int, now: float) -> None:
        engine = self.engines[idx]
        self.memory.observe(idx, now, engine.gpu_memory_used_fraction())
        events = engine.advance(now)
        finished_any = False
        for ev in events:
            finished_any |= self._on_event(idx, ev)
        self.memory.observe(idx, now, engine.gpu_memory_used_fraction())
        self._wake(idx)
        if self._arrived or finished_any:
            self._control(now)

    def _on_event(self, idx: int, ev: EngineEvent) -> bool:
        track = self._tracks.get(ev.request_id)
        if track is None:
            return False
        kind = ev.kind
        if kind is EventKind.SCHEDULED:
            self._started.append(ev.request_id)
            if track.scheduled_s is None:
                track.scheduled_s = ev.time
            track.status = RequestStatus.RUNNING
        elif kind is EventKind.FIRST_TOKEN:
            if track.first_token_s is None:
                track.first_token_s = ev.time
        elif kind is EventKind.FINISHED:
            track.finish_s = ev.time
            track.output_tokens += ev.tokens
            track.status = RequestStatus.FINISHED
            self._outstanding[idx] -= 1
            self._outstanding_tokens[idx] -= self._work_tokens(track.request)
            self._finished += 1
            self._completions.append(
                Completion(
                    track.request,
                    self.engines[idx].name,
                    track.output_tokens,
                    track.scheduled_s,
                    track.first_token_s,
                    ev.time,
                )
            )
            if self.observer is not None:
                self.observer.on_finish(track.record())
            return True
        elif kind is EventKind.PREEMPTED:
            track.preemptions += 1
        elif kind is EventKind.SWAPPED_OUT:
            track.swaps += 1
        return False

    def _work_tokens(self, req: Request) -> int:
        return req.input_tokens + self._tracks[req.id].output_tokens

    def _control(self, now: float) -> None:
        arrived, self._arrived = self._arrived, []
        finished, self._completions = self._completions, []
        started, self._started = self._started, []
        ctx = DispatchContext(
            now=now,
            arrived=tuple(arrived),
            finished=tuple(finished),
            started=tuple(started),
            generated=tuple(
                (r.id, self._tracks[r.id].output_tokens)
                for r in arrived
                if self._tracks[r.id].output_tokens
            ),
            instances=tuple(
                InstanceLoad(
                    name=spec.name,
                    models=spec.models,
                    outstanding_requests=self._outstanding[i],
                    outstanding_tokens=self._outstanding_tokens[i],
                    max_running=self.engines[i].config.max_num_seqs,
                    token_capacity=self.engines[i].token_capacity(),
                    gpu=spec.gpu,
                    gpu_count=spec.gpu_count,
                    active_model=self.engines[i].active_model,
                    host_link_gbs=self._host_link_gbs[i],
                    swap_free_gb=self.engines[i].swap_free_gb(),
                    model_tiers=tuple(self.engines[i].tiers.items()),
                    model_weights_gb=tuple(
                        (m, pm.model.weights_gb) for m, pm in self.engines[i].perf_models.items()
                    ),
                    cpu_cache_gb=self.engines[i].config.cpu_model_cache_gb,
                    up=self._up[i],
                )
                for i, spec in enumerate(self.specs)
            ),
        )
        for decision in self.policy.decide(ctx):
            self._apply(decision, now)

    def _apply(self, decision: Decision, now: float) -> None:
        """The executor: turn one decision into engine calls."""
        idx = self._index.get(decision.instance)
        if idx is None:
            raise ConfigError(f"policy {self.policy.name} named unknown instance {decision!r}")
        engine = self.engines[idx]
        if not self._up[idx]:
            raise ConfigError(
                f"policy {self.policy.name} acted on {decision.instance}, which is down"
            )
        if isinstance(decision, Pull):
            req = self._pending.pop(decision.request_id)
            track = self._tracks[req.id]
            done = track.output_tokens  # non-zero when an evicted request resumes
            engine_req = EngineRequest(
                request_id=req.id,
                model=req.model,
                prompt_tokens=req.input_tokens + done,
                max_tokens=req.max_tokens - done,
                priority=int(req.tier),
                output_tokens=None
                if req.replay_output_tokens is None
                else req.replay_output_tokens - done,
            )
            try:
                engine.submit(engine_req, now)
            except EngineError as exc:
                track.status, track.error = RequestStatus.FAILED, str(exc)
                return
            track.instance = engine.name
            if track.dispatch_s is None:
                track.dispatch_s = now
            self._outstanding[idx] += 1
            self._outstanding_tokens[idx] += self._work_tokens(req)
            if self.observer is not None:
                self.observer.on_dispatch(now, req, engine)
        elif isinstance(decision, Evict):
            generated = engine.abort(decision.request_id, now)
            track = self._tracks[decision.request_id]
            self._outstanding[idx] -= 1
            self._outstanding_tokens[idx] -= self._work_tokens(track.request)
            track.output_tokens += generated
            track.evictions += 1
            track.status = RequestStatus.QUEUED
            self._pending[track.request.id] = track.request
            self._arrived.append(track.request)
        elif isinstance(decision, SwapOut):
            try:
                engine.swap_out(decision.request_id, now)
            except EngineError:  # not running (yet or any more), or no swap space: evict
                self._apply(Evict(decision.request_id, decision.instance), now)
                return
        elif isinstance(decision, SwapIn):
            engine.swap_in(decision.request_id, now)
        elif isinstance(decision, SetModelTier):
            engine.set_model_tier(decision.model, decision.tier, now)
        self.memory.observe(idx, now, engine.gpu_memory_used_fraction(now))
        self._wake(idx)


def simulate(
    requests: Sequence[Request],
    instances: Sequence[InstanceSpec],
    policy: Policy,
    *,
    engine_config: dict[str, Any] | None = None,
    progress: ProgressFn | None = None,
) -> SimResult:
    """Convenience wrapper: build a cluster, replay ``requests``, return the result."""
    sim = ClusterSimulation(instances, policy, engine_config=engine_config)
    return sim.run(requests, progress=progress)
