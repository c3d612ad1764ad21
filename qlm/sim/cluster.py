"""Replay a workload against simulated instances under a named policy, in virtual time.

The simulator is a heap of ``(time, seq, instance, version)`` engine wake-ups plus the sorted
arrivals. At each arrival or engine event the controller steps with the same view of the instances
production would give it, and its decisions are carried out on the engines with the executor's
rules (``qlm.agents.executor``), the service's too. Nothing here is a policy: the harness only
moves time, performs engine operations and measures.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from qlm.agents.executor import (
    DONE,
    Abort,
    ChangeTier,
    Done,
    Executor,
    Fail,
    Operation,
    Outcome,
    Refused,
    Submit,
    Swap,
)
from qlm.clock import VirtualClock
from qlm.controller import Controller, EngineReading
from qlm.domain import (
    Decision,
    InstanceSpec,
    ModelTier,
    PlanRecord,
    Pull,
    Reject,
    Request,
    RequestRecord,
)
from qlm.engines.base import EventKind
from qlm.engines.perf_model import HardwareCatalog, default_catalog
from qlm.engines.sim import SimEngine, SimEngineConfig
from qlm.errors import ConfigError, EngineError
from qlm.planner.policy import Policy
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


@dataclass(frozen=True, slots=True)
class SimResult:
    """Everything a run measured: one record per request and the summary of them."""

    policy: str
    instances: tuple[InstanceSpec, ...]
    records: tuple[RequestRecord, ...]
    summary: dict[str, Any]
    memory: MemoryTimeline = field(repr=False)
    plans: tuple[PlanRecord, ...] = field(default=(), repr=False)  # the policy's, in order
    overdue_pulls: int = 0  # pulls the policy made ahead of its order for waiting too long


def build_engines(
    instances: Sequence[InstanceSpec],
    *,
    catalog: HardwareCatalog | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> list[SimEngine]:
    """One simulated engine per instance spec, with the catalog's performance models (default:
    the shipped ones)."""
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
        switching = policy.model_switching  # a policy that switches models itself
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
        self.controller = Controller(policy, self.specs)
        self.plans: list[PlanRecord] = []  # every plan the policy made, from the steps' outputs
        self.overdue_pulls = 0  # ``Pull.overdue`` decisions
        self.executor = Executor()
        self._up = [True] * len(self.engines)
        self._weights = [
            tuple((m, pm.model.weights_gb) for m, pm in e.perf_models.items()) for e in self.engines
        ]
        # per engine: its last reading and the state it was made of; ``_touched``: an engine
        # operation or event since (set wherever the simulation calls an engine)
        self._readings: list[tuple[tuple[object, ...], EngineReading] | None] = [None] * len(
            self.engines
        )
        self._touched = [True] * len(self.engines)

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
        dup = [rid for rid, n in Counter(r.id for r in ordered).items() if n > 1]
        if dup:
            raise ConfigError(f"duplicate request id {dup[0]!r}")
        controller = self.controller
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
                controller.arrive(req)
                self._control(t_arrival)
            done = controller.finished
            if progress is not None and (done % step_progress == 0 or ai == total):
                progress(done, total)
        controller.close()  # a request a policy never dispatched, or left swapped out, fails
        records = tuple(controller.track(r.id).copy() for r in ordered)
        self.memory.close(self.clock.now())
        summary = summarize(
            records,
            model_switches={e.name: e.model_switches for e in self.engines},
            memory=self.memory,
        )
        summary["policy"] = self.policy.name
        return SimResult(
            self.policy.name,
            self.specs,
            records,
            summary,
            self.memory,
            tuple(self.plans),
            self.overdue_pulls,
        )

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
        self._touched[idx] = True
        if not up:
            for rid, _, _ in engine.queue_view(now):
                self.controller.returned(rid, engine.abort(rid, now), evicted=False)
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
        self._touched[idx] = True
        events = engine.advance(now)
        finished_any = False
        for ev in events:
            finished = self.controller.on_event(engine.name, ev)
            if finished and self.observer is not None:
                self.observer.on_finish(self.controller.track(ev.request_id).copy())
            finished_any |= finished
        # The utilisation from ``now`` on (the one observed last held until ``now``).
        self.memory.observe(idx, now, engine.gpu_memory_used_fraction())
        self._wake(idx)
        # A model became active with KV caches swapped out to CPU memory: they may come back
        # now (in production the agents step every tick anyway).
        ready = bool(engine.swapped) and any(ev.kind is EventKind.MODEL_READY for ev in events)
        if self.controller.has_arrivals or finished_any or ready:
            self._control(now)

    def _reading(self, i: int) -> EngineReading:
        """What the controller reads off engine ``i``: the same object while nothing in it
        changed (an engine untouched since the last step is not read again)."""
        cached = self._readings[i]
        if cached is not None and not self._touched[i]:
            return cached[1]
        self._touched[i] = False
        engine = self.engines[i]
        state = (
            engine.active_model,
            self._up[i],
            engine.swap_free_gb(),
            engine.preemptions_total,
            tuple(engine.tiers.items()),
        )
        if cached is not None and cached[0] == state:
            return cached[1]
        active_model, up, swap_free_gb, preemptions_total, model_tiers = state
        reading = EngineReading(
            spec=self.specs[i],
            max_running=engine.config.max_num_seqs,
            token_capacity=engine.token_capacity(),
            active_model=active_model,
            up=up,
            host_link_gbs=self._host_link_gbs[i],
            swap_free_gb=swap_free_gb,
            model_tiers=model_tiers,
            model_weights_gb=self._weights[i],
            cpu_cache_gb=engine.config.cpu_model_cache_gb,
            preemptions_total=preemptions_total,
        )
        self._readings[i] = (state, reading)
        return reading

    def _control(self, now: float) -> None:
        views = [self._reading(i) for i in range(len(self.engines))]
        output = self.controller.step(now, views)
        self.plans += output.plans
        for decision in output.decisions:
            if isinstance(decision, Pull) and decision.overdue:
                self.overdue_pulls += 1
            self._apply(decision, now)

    def _apply(self, decision: Decision, now: float) -> None:
        """Carry out one decision with the executor's rules (``qlm.agents.executor``), each of
        its operations a call on a simulated engine at ``now``."""
        execution = self.executor.execute(decision)
        if isinstance(decision, Reject):
            execution.next()  # Forget: the controller ended it failed; no engine holds it
            return
        idx = self._index.get(decision.instance)
        if idx is None:
            raise ConfigError(f"policy {self.policy.name} named unknown instance {decision!r}")
        engine = self.engines[idx]
        if not self._up[idx]:
            raise ConfigError(
                f"policy {self.policy.name} acted on {decision.instance}, which is down"
            )
        self._touched[idx] = True
        op = execution.next()
        while op is not None:
            if isinstance(op, Fail):  # the engine refused the request, unchanged
                self.controller.failed(op.request_id, op.reason)
                return
            op = execution.next(self._perform(op, engine, now))
        self.memory.observe(idx, now, engine.gpu_memory_used_fraction(now))
        self._wake(idx)

    def _perform(self, op: Operation, engine: SimEngine, now: float) -> Outcome:
        """One engine operation, at once."""
        if isinstance(op, Submit):
            try:
                engine.submit(self.controller.engine_request(op.request_id), now)
            except EngineError as exc:
                return Refused(str(exc))
            if self.observer is not None:
                self.observer.on_dispatch(now, self.controller.track(op.request_id).request, engine)
        elif isinstance(op, Abort):
            generated = engine.abort(op.request_id, now)
            self.controller.returned(op.request_id, generated, evicted=True)
        elif isinstance(op, Swap):
            try:
                if op.out:
                    engine.swap_out(op.request_id, now)
                else:
                    engine.swap_in(op.request_id, now)
            except EngineError as exc:  # not running (yet or any more), or no swap space
                return Refused(str(exc))
        elif isinstance(op, ChangeTier):
            switched = op.tier is ModelTier.ACTIVE and op.model != engine.active_model
            try:
                engine.set_model_tier(op.model, op.tier, now)
            except EngineError as exc:  # the CPU model cache full
                return Refused(str(exc))
            return Done(switched)
        return DONE


def simulate(
    requests: Sequence[Request],
    instances: Sequence[InstanceSpec],
    policy: Policy,
    *,
    engine_config: dict[str, Any] | None = None,
    progress: ProgressFn | None = None,
    catalog: HardwareCatalog | None = None,
) -> SimResult:
    """Convenience wrapper: build a cluster, replay ``requests``, return the result
    (``catalog``: the performance models, default the shipped ones)."""
    sim = ClusterSimulation(instances, policy, engine_config=engine_config, catalog=catalog)
    return sim.run(requests, progress=progress)
