"""Baseline policies, as the systems QLM is compared with behave.

``FcfsDispatch`` is a fleet of vLLM servers behind an ordinary load balancer: every request is sent
to an instance the moment it arrives (round-robin, or to the instance with the fewest outstanding
requests), and each instance serves its own queue first-come-first-served. Nothing is held back,
reordered or evicted: head-of-line blocking is left to happen, which is what QLM is measured against.

The others hold requests in their own queues and let instances pull (``qlm.planner.queued``), each
ordering and placing them as its paper does: ``EdfPolicy`` (QLM §8), ``SlackEdfPolicy`` (FlowPrefill
§5.2), ``PriorityPolicy`` (QLLM §3.2), ``ProservePolicy`` (PROSERVE §4.2–4.3) and ``ShepherdPolicy``
(as QLM §8 describes SHEPHERD). Where a paper acts inside the engine (prefill chunks, expert layers)
only its request-level part is reproduced: the engine stays vLLM. Output lengths come from the RCT
estimator (a policy never sees a request's true length); ``create_baseline`` builds one by name.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import pulp

from qlm.domain import Decision, Pull, Request, Tier
from qlm.errors import check_setting
from qlm.planner.policy import (
    Completion,
    DispatchContext,
    InstanceLoad,
    Policy,
    PolicyBase,
    has_room,
)
from qlm.planner.queued import QueuedPolicy, Step, instance_queue, model_queue
from qlm.rct.estimator import RCTEstimator
from qlm.rct.profile import HardwareProfile, RctProfile, default_profile
from qlm.solvers import make_solver


class FcfsDispatch(PolicyBase):
    """vLLM's default: dispatch on arrival, FCFS inside each engine."""

    def __init__(self, dispatch: Literal["least-loaded", "round-robin"] = "least-loaded") -> None:
        self.dispatch = dispatch
        self.name = "fcfs" if dispatch == "least-loaded" else "fcfs-rr"
        self._next: dict[str, int] = {}
        self._held: list[Request] = []  # no instance up serves them yet

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        decisions: list[Decision] = []
        added: dict[str, int] = {}
        gone = set(ctx.cancelled)
        waiting, self._held = [r for r in (*self._held, *ctx.arrived) if r.id not in gone], []
        for req in waiting:
            able = [i for i in ctx.instances if req.model in i.models and i.up]
            if not able:
                self._held.append(req)  # retried when an instance serving it is up
                continue
            if self.dispatch == "round-robin":
                k = self._next.get(req.model, 0)
                target = able[k % len(able)]
                self._next[req.model] = k + 1
            else:
                target = min(
                    able, key=lambda i: (i.outstanding_requests + added.get(i.name, 0), i.name)
                )
            added[target.name] = added.get(target.name, 0) + 1
            decisions.append(Pull(req.id, target.name))
        return decisions


@dataclass
class ServiceEstimates:
    """Service times from the RCT profile and the estimator's output-length posterior, which
    learns from every completion: what the baselines know of a request's cost."""

    profile: RctProfile
    estimator: RCTEstimator = field(init=False)
    _hardware: dict[tuple[str, str, int], HardwareProfile] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.estimator = RCTEstimator(self.profile)

    def hardware(self, model: str, load: InstanceLoad) -> HardwareProfile:
        key = (model, load.gpu, load.gpu_count)
        hw = self._hardware.get(key)
        if hw is None:
            hw = self._hardware[key] = self.profile.hardware_for(*key)
        return hw

    def output(self, request: Request, generated: int = 0) -> float:
        """Expected output tokens still to generate."""
        return self.estimator.output_moments(request, generated)[0]

    def decode_s(self, request: Request, generated: int, load: InstanceLoad) -> float:
        """Time to decode the expected output at a full batch's pace (``d`` of paper §6)."""
        return (
            self.output(request, generated) * self.hardware(request.model, load).decode_per_token_s
        )

    def service_s(self, request: Request, generated: int, load: InstanceLoad) -> float:
        """Prefill plus decode of the request on ``load``, once it runs: its latency with no wait."""
        hw = self.hardware(request.model, load)
        return hw.prefill_s(request.input_tokens + generated) + self.decode_s(
            request, generated, load
        )

    def work_s(self, request: Request, generated: int, load: InstanceLoad) -> float:
        """Seconds of a saturated instance the request takes (prompt work and its share of the
        decode throughput): what admitting it costs the others."""
        hw = self.hardware(request.model, load)
        prompt = (request.input_tokens + generated) * hw.input_token_work_s
        return prompt + self.output(request, generated) / hw.throughput_tps

    def observe(self, completion: Completion) -> None:
        self.estimator.observe(completion.request, output_tokens=completion.output_tokens)


class _Learns:
    """``Policy.learn_output`` for the policies that estimate service times."""

    estimates: ServiceEstimates

    def learn_output(self, request: Request, output_tokens: int) -> bool:
        self.estimates.estimator.observe(request, output_tokens=output_tokens)
        return True


def _serving(ctx: DispatchContext, model: str) -> list[InstanceLoad]:
    """Instances up and serving ``model`` (all serving it if none is up)."""
    able = [i for i in ctx.instances if model in i.models]
    return [i for i in able if i.up] or able


class EdfPolicy(QueuedPolicy):
    """Earliest deadline first: QLM's EDF baseline (QLM §8, "requests are sorted by their SLO
    values"), on the absolute end-to-end deadline so that an old request with a loose SLO is not
    overtaken forever. One global queue per model; any instance serving the model with room pulls
    its head. No eviction or KV swap (QLM §8.2 credits its gain over EDF to choosing between them)."""

    name = "edf"

    def key(self, request: Request, ctx: DispatchContext) -> tuple[float, ...]:
        return (request.deadline_s,)


class SlackEdfPolicy(_Learns, QueuedPolicy):
    """FlowPrefill's slack-aware EDF (FlowPrefill §5.2, Eq. 3): ``priority = sgn(slack) /
    deadline``, ``slack = deadline − now − T̂``, highest priority first.

    Read literally, requests with non-negative slack go first, earliest deadline first; a request
    whose slack went negative (it can no longer make its deadline) drops behind all of them, and
    among those late requests a larger deadline means a larger ``−1/deadline``, so the *latest*
    deadline goes first. Both are kept. FlowPrefill schedules TTFT deadlines with ``T̂`` its
    predicted prefill time; QLM's SLO is end to end, so ``deadline`` is the end-to-end deadline and
    ``T̂`` the predicted prefill plus the expected decode (profile and output posterior), estimated
    when the request is queued, on the fastest instance serving its model. The slack turns negative
    at a known time, so a heap of those times re-keys each request once.

    Not reproduced: FlowPrefill's operator-level preemption of a running prefill and its SLO-aware
    prefill batching (Alg. 1, 2) act inside the engine, which stays vLLM; here S-EDF orders the
    global queue per model that instances pull from, at every arrival and completion (its
    event-driven trigger).
    """

    name = "sedf"

    def __init__(self, profile: RctProfile) -> None:
        super().__init__()
        self.estimates = ServiceEstimates(profile)
        self._turns: list[tuple[float, str]] = []  # (time the slack turns negative, request)
        self._turn_at: dict[str, float] = {}

    def key(self, request: Request, ctx: DispatchContext) -> tuple[float, ...]:
        generated = self.generated.get(request.id, 0)
        able = _serving(ctx, request.model)
        service = min((self.estimates.service_s(request, generated, i) for i in able), default=0.0)
        turn = request.deadline_s - service
        if ctx.now > turn:
            return (1.0, -request.deadline_s)
        self._turn_at[request.id] = turn
        heapq.heappush(self._turns, (turn, request.id))
        return (0.0, request.deadline_s)

    def refresh(self, ctx: DispatchContext) -> None:
        while self._turns and self._turns[0][0] < ctx.now:
            turn, request_id = heapq.heappop(self._turns)
            if self._turn_at.get(request_id) != turn:
                continue  # an entry of an earlier stay in the queue
            del self._turn_at[request_id]
            if self.waiting(request_id):
                self.requeue(request_id, (1.0, -self.requests[request_id].deadline_s))

    def on_pull(self, request: Request, instance: str, ctx: DispatchContext) -> None:
        self._turn_at.pop(request.id, None)

    def on_finish(self, completion: Completion) -> None:
        self.estimates.observe(completion)


class PriorityPolicy(QueuedPolicy):
    """Strict priority tiers, first-come-first-served inside a tier, preemptive: QLLM's scheduler
    (QLLM §3.2, Alg. 1) with our three tiers in place of its latency-sensitive / best-effort pair.

    QLLM keeps FCFS queues per class and fills every batch with latency-sensitive jobs first,
    preempting best-effort jobs at expert granularity to make room for a newly arrived
    latency-sensitive one; the preempted jobs keep their state and resume later. Here one global
    queue per model is ordered by (tier, arrival) and, when the head cannot be placed on any
    instance serving its model, running requests of a strictly lower tier are evicted (``Evict``:
    least urgent tier first, the most recently pulled first) on one instance until the head fits.
    An evicted request keeps its output and rejoins its tier at its arrival position. Differences:
    eviction happens at request level and the engine recomputes the evicted KV cache on resumption
    (QLLM keeps it); QLLM's preference for decode over prefill jobs within a class is the engine's.
    Like QLLM (§6, "Limitations"), lower tiers may starve under sustained higher-tier load.
    """

    name = "priority"

    def __init__(self, *, preempt: bool = True) -> None:
        super().__init__()
        self.preempt = preempt
        # instance -> tier -> running requests of that tier, in pull order
        self._tiers: dict[str, dict[int, dict[str, None]]] = {}

    def key(self, request: Request, ctx: DispatchContext) -> tuple[float, ...]:
        return (float(request.tier), request.arrival_s)

    def on_pull(self, request: Request, instance: str, ctx: DispatchContext) -> None:
        self._tiers.setdefault(instance, {}).setdefault(int(request.tier), {})[request.id] = None

    def on_finish(self, completion: Completion) -> None:
        tiers = self._tiers.get(completion.instance, {})
        tiers.get(int(completion.request.tier), {}).pop(completion.request.id, None)

    def on_return(self, request: Request) -> None:
        for tiers in self._tiers.values():  # its instance failed: it runs nowhere now
            tiers.get(int(request.tier), {}).pop(request.id, None)

    def pull(self, ctx: DispatchContext, step: Step) -> None:
        super().pull(ctx, step)
        if not self.preempt:
            return
        for queue in self.queues():
            while (head := self.peek(queue)) is not None:
                request = self.requests[head]
                target = self._make_room(request, ctx, step)
                if target is None:
                    break  # a later request of this queue is no more urgent
                self.pop(queue)
                self.pull_onto(step, request, target, ctx)

    def _make_room(self, request: Request, ctx: DispatchContext, step: Step) -> str | None:
        """An instance for ``request``, evicting lower-tier requests there if needed."""
        tokens = self.tokens(request)
        able = sorted(_serving(ctx, request.model), key=lambda i: (step.running(i.name), i.name))
        for load in able:
            if step.room(load.name, tokens):
                return load.name
        candidates = []
        for load in able:
            tiers = self._tiers.get(load.name, {})
            lowest = max((t for t, ids in tiers.items() if ids and t > request.tier), default=None)
            if lowest is not None:
                candidates.append((-lowest, load.name))
        for _, name in sorted(candidates):
            victims = self._victims(name, request.tier, step)
            if victims is None or not self._fits_after(name, victims, tokens, step):
                continue
            for victim in victims:
                self._tiers[name][int(self.requests[victim].tier)].pop(victim)
                self.evict(step, victim, name)
            return name
        return None

    def _victims(self, instance: str, tier: Tier, step: Step) -> list[str] | None:
        """Running requests of a lower tier than ``tier`` on ``instance``, in eviction order, as
        many as it takes for a request to fit (all of them if it never does)."""
        ordered: list[str] = []
        for t in sorted(self._tiers.get(instance, {}), reverse=True):
            if t <= tier:
                break
            ordered.extend(
                r
                for r in reversed(self._tiers[instance][t])
                if r not in step.pulled and self.requests[r].resumable  # else it starts over
            )
        return ordered or None

    def _fits_after(self, instance: str, victims: list[str], tokens: int, step: Step) -> bool:
        """Does the request fit once a prefix of ``victims`` is evicted? Trims ``victims`` to
        the shortest such prefix."""
        load, inflight = step.loads[instance], self.inflight[instance]
        requests, held = step.requests.get(instance, 0), step.tokens.get(instance, 0)
        for n, victim in enumerate(victims, start=1):
            held -= inflight[victim]
            if has_room(load, requests - n, held, tokens):
                del victims[n:]
                return True
        return False


TIER_WEIGHTS = (4.0, 2.0, 1.0)  # interactive, standard, batch: twice the next, as PROSERVE's 2:1


@dataclass(slots=True)
class _Held:
    """What PROSERVE keeps of a request routed to an instance's queue."""

    instance: str
    first_token_deadline: float
    exec_s: float
    weight: float
    seq: int
    urgent: bool = False
    entry: int = 0  # seq of its live entry in the URGENT or NORMAL watch heap


class ProservePolicy(_Learns, QueuedPolicy):
    """PROSERVE (PROSERVE §4): GoRouting places each request on an instance's queue and that
    queue is ordered by SlideBatching; the instance pulls from it while it has room.

    *Gain* (§2, TDG): meeting a request's token deadlines is worth its tier weight
    (``TIER_WEIGHTS``; the paper uses 2 : 1 for its two priorities, §5.1). A waiting request's next token is
    its first, so its gain is ``w_p · w_tier`` with the first-token deadline ``arrival + TTFT SLO``
    or, for an end-to-end SLO only, the end-to-end deadline minus its expected decode time (the last
    token's deadline walked back at the profile's per-token pace).

    *SlideBatching* (§4.2, Alg. 1): ``remain = first-token deadline − now``; ``exec`` is the
    request's work on a saturated instance (prompt work plus expected output over throughput: the
    request-level counterpart of the batch time it takes); a request is URGENT when
    ``remain < γ · φ_a(Q)``, ``φ_a`` (Eq. 8, the paper's choice for co-located serving) being the
    time to execute the instance's whole queue — its queued work plus the work of what it runs
    (the ``n_d · b_d`` term of §4.3). URGENT requests go first by descending gain density
    ``w / exec``, the NORMAL ones by ascending ``remain``: deadline-first at low load, density-first
    as the boundary slides under load. ``φ_a`` ignores ``t_budget / (t_budget − t_c)``: a
    request-level budget (seconds) dwarfs the per-batch overhead ``t_c``, so the factor is 1.

    *GoRouting* (§4.3, Alg. 2, co-located variant): for every instance the gain of its queue with
    and without the request, every request placed at the end (``φ_a``); ``Δ_p`` is the difference.
    Candidates are the instances with ``Δ_p ≥ α · Δ_max``. With ``load_s`` as ``ESTIMATEEXEC`` and
    the request's first-token SLO (its first-token deadline − arrival): the least loaded light one
    (``load < μ · SLO``) takes the request if there is one, else the *most* loaded that stays under
    ``λ · SLO`` with the request — keeping lighter instances free for later long or high-priority
    requests — else the least loaded; with ``Δ_max ≤ 0`` a random instance (seeded). α, μ, λ, γ are
    not given in the paper; ours are settings (``BaselineConfig``, ``QLM_BASELINES__PROSERVE_*``).

    Not reproduced: chunked-prefill batch formation inside the engine (the engine is vLLM, which
    admits in the order pulled), the online correction of the latency model, and the PD-disaggregated
    variant.
    """

    name = "proserve"

    def __init__(
        self,
        profile: RctProfile,
        *,
        weights: Sequence[float] = TIER_WEIGHTS,
        alpha: float = 0.9,
        mu: float = 0.1,
        lam: float = 0.7,
        gamma: float = 1.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.estimates = ServiceEstimates(profile)
        self.weights = tuple(weights)
        self.alpha, self.mu, self.lam, self.gamma = alpha, mu, lam, gamma
        self._rng = random.Random(seed)
        self._held: dict[str, _Held] = {}
        self._queued_s: dict[str, float] = {}  # Σ exec of the instance's queue
        self._running_s: dict[str, float] = {}  # Σ exec of what it runs
        self._by_deadline: dict[str, list[tuple[float, int, float, str]]] = {}  # sorted
        self._normal: dict[str, list[tuple[float, int, str]]] = {}  # min first-token deadline
        self._urgent: dict[str, list[tuple[float, int, str]]] = {}  # max first-token deadline

    def load_s(self, instance: str) -> float:
        """``ESTIMATEEXEC(p)``: seconds to execute everything queued on and run by ``instance``."""
        return self._queued_s.get(instance, 0.0) + self._running_s.get(instance, 0.0)

    def route(self, request: Request, ctx: DispatchContext) -> str:
        able = _serving(ctx, request.model)
        if not able:
            return model_queue(request.model)  # nobody serves it: the harness reports it
        generated = self.generated.get(request.id, 0)
        weight = self.weights[int(request.tier)]
        options = []
        for load in able:
            deadline = self._first_token_deadline(request, generated, load)
            exec_s = self.estimates.work_s(request, generated, load)
            options.append(
                (
                    load.name,
                    deadline,
                    exec_s,
                    self._gain_delta(load.name, ctx.now, deadline, exec_s, weight),
                )
            )
        best = max(o[3] for o in options)
        if best > 0:
            candidates = [o for o in options if o[3] >= self.alpha * best]
            chosen = self._capability_aware(candidates, request.arrival_s)
        else:
            chosen = self._rng.choice(options)
        name, deadline, exec_s, _ = chosen
        self._seq += 1
        self._held[request.id] = _Held(name, deadline, exec_s, weight, self._seq)
        self._queued_s[name] = self._queued_s.get(name, 0.0) + exec_s
        bisect.insort(
            self._by_deadline.setdefault(name, []), (deadline, self._seq, weight, request.id)
        )
        return instance_queue(name)

    def key(self, request: Request, ctx: DispatchContext) -> tuple[float, ...]:
        held = self._held[request.id]
        held.urgent = held.first_token_deadline - ctx.now < self.gamma * self.load_s(held.instance)
        return self._file(request.id, held)

    def refresh(self, ctx: DispatchContext) -> None:
        """Slide the URGENT/NORMAL boundary of each queue to ``now + γ · φ_a``."""
        for name in list(self._normal.keys() | self._urgent.keys()):
            boundary = ctx.now + self.gamma * self.load_s(name)
            normal, urgent = self._normal.get(name, []), self._urgent.get(name, [])
            while normal and normal[0][0] < boundary:
                entry = heapq.heappop(normal)
                if self._watched(entry):
                    self._held[entry[2]].urgent = True
                    self.requeue(entry[2], self._file(entry[2], self._held[entry[2]]))
            while urgent and -urgent[0][0] >= boundary:
                entry = heapq.heappop(urgent)
                if self._watched(entry):
                    self._held[entry[2]].urgent = False
                    self.requeue(entry[2], self._file(entry[2], self._held[entry[2]]))
            # Entries of pulled requests may never reach the top: drop them now and then.
            waiting = len(self._by_deadline.get(name, ()))
            for heap in (normal, urgent):
                if len(heap) > 2 * waiting + 64:
                    heap[:] = [e for e in heap if self._watched(e)]
                    heapq.heapify(heap)

    def on_pull(self, request: Request, instance: str, ctx: DispatchContext) -> None:
        held = self._held[request.id]
        self._queued_s[instance] -= held.exec_s
        self._running_s[instance] = self._running_s.get(instance, 0.0) + held.exec_s
        entries = self._by_deadline[instance]
        entries.pop(bisect.bisect_left(entries, (held.first_token_deadline, held.seq)))
        if not entries:
            self._queued_s[instance] = 0.0  # no drift from the running sums

    def on_finish(self, completion: Completion) -> None:
        self.estimates.observe(completion)
        held = self._held.pop(completion.request.id, None)
        if held is None:
            return
        self._release(held, completion.instance)

    def on_return(self, request: Request) -> None:
        held = self._held.pop(request.id, None)  # routed afresh when it is queued again
        if held is not None:
            self._release(held, held.instance)

    def _release(self, held: _Held, name: str) -> None:
        self._running_s[name] = self._running_s.get(name, 0.0) - held.exec_s
        if not self.inflight.get(name):
            self._running_s[name] = 0.0

    def _watched(self, entry: tuple[float, int, str]) -> bool:
        """Is this the live watch entry of a waiting request?"""
        held = self._held.get(entry[2])
        return held is not None and held.entry == entry[1] and self.waiting(entry[2])

    def _file(self, request_id: str, held: _Held) -> tuple[float, ...]:
        """The request's SlideBatching key, and its entry in the heap its urgency is watched in."""
        self._seq += 1
        held.entry = self._seq
        if held.urgent:
            entry = (-held.first_token_deadline, self._seq, request_id)
            heapq.heappush(self._urgent.setdefault(held.instance, []), entry)
            return (0.0, -held.weight / max(held.exec_s, 1e-9))
        entry = (held.first_token_deadline, self._seq, request_id)
        heapq.heappush(self._normal.setdefault(held.instance, []), entry)
        return (1.0, held.first_token_deadline)

    def _first_token_deadline(self, request: Request, generated: int, load: InstanceLoad) -> float:
        if request.slo.ttft_s is not None and generated == 0:
            return request.arrival_s + request.slo.ttft_s
        return request.deadline_s - self.estimates.decode_s(request, generated, load)

    def _gain_delta(
        self, instance: str, now: float, deadline: float, exec_s: float, weight: float
    ) -> float:
        """``post_gain − pre_gain`` with every request at the end of the queue (``φ_a``): the
        request's own gain if it makes its deadline, minus the gain of the queued requests that
        made theirs only without it (deadline within ``[now + φ, now + φ + exec)``)."""
        load = self.load_s(instance)
        gain = weight if deadline - now >= load + exec_s else 0.0
        entries = self._by_deadline.get(instance, [])
        lo = bisect.bisect_left(entries, (now + load,))
        hi = bisect.bisect_left(entries, (now + load + exec_s,))
        return gain - sum(e[2] for e in entries[lo:hi])

    def _capability_aware(
        self, candidates: list[tuple[str, float, float, float]], arrival_s: float
    ) -> tuple[str, float, float, float]:
        """Alg. 2 lines 10–17: light first, else the most loaded that stays under ``λ · SLO``."""
        light, moderate = [], []
        for option in candidates:
            name, deadline, exec_s, _ = option
            slo = deadline - arrival_s
            if self.load_s(name) < self.mu * slo:
                light.append(option)
            if self.load_s(name) + exec_s <= self.lam * slo:
                moderate.append(option)
        if light:
            return min(light, key=lambda o: (self.load_s(o[0]), o[0]))
        if moderate:
            return max(moderate, key=lambda o: (self.load_s(o[0]), o[0]))
        return min(candidates, key=lambda o: (self.load_s(o[0]), o[0]))


@dataclass(frozen=True, slots=True)
class BatchPlanInput:
    """One SHEPHERD planning round: batches × instances.

    ``exec_s[j][i]``: deterministic execution time of batch ``j`` on instance ``i``;
    ``deadlines[j]``: its requests' deadlines, seconds from now; ``available_s[i]``: when instance
    ``i`` should finish its current batch, seconds from now; ``idle``: the instances that have
    none, which start a batch now.
    """

    exec_s: tuple[tuple[float, ...], ...]
    deadlines: tuple[tuple[float, ...], ...]
    available_s: tuple[float, ...]
    idle: tuple[int, ...]


def build_batch_ilp(
    plan: BatchPlanInput,
) -> tuple[pulp.LpProblem, dict[tuple[int, int, int], pulp.LpVariable]]:
    """The ILP of SHEPHERD's ordering and placement (as QLM §8 describes it), over batches.

    ``x[j,i,k] = 1`` puts batch ``j`` at position ``k`` of instance ``i``, ``k < K =
    ⌈J / I⌉ + 1`` (a plan that piles more on one instance is replanned before it matters); a batch
    is placed at most once, a position holds at most one batch, positions fill from the front. The
    batch at position ``k`` completes at ``T[i,k] = a_i + Σ_{k' ≤ k} Σ_j e[j,i] x[j,i,k']``, so
    ``c_j ≥ T[i,k] − M_i (1 − x[j,i,k])`` with ``M_i = a_i + Σ_j e[j,i]``, and (a cut)
    ``c_j ≥ Σ (a_i + e[j,i]) x[j,i,k]``. ``u[j,q] = 1`` counts the ``q``-th earliest deadline of
    batch ``j`` as met: ``u[j,q] ≤ Σ x[j,·,·]``, ``c_j ≤ d[j,q] + (H − d[j,q]) (1 − u[j,q])``
    (``H`` the horizon), ``u[j,q−1] ≤ u[j,q]``, and ``u = 0`` for a deadline already past. Every
    idle instance gets a batch at position 0 while batches last (work conserving). Maximise
    ``Σ u − ε Σ_j 2^(J−1−j) c_j``: the most requests on time, then the batches in deadline order
    (batch ``j`` holds the ``j``-th earliest deadlines) as early as possible.
    """
    n_batches, n_instances = len(plan.exec_s), len(plan.available_s)
    batches, instances = range(n_batches), range(n_instances)
    positions = range(min(n_batches, -(-n_batches // n_instances) + 1))
    horizon = max(plan.available_s) + sum(max(row) for row in plan.exec_s)
    eps = 1e-3 / max(horizon, 1.0) / 2**n_batches
    prob = pulp.LpProblem("shepherd", pulp.LpMaximize)
    x = {
        (j, i, k): prob.add_variable(f"x_{j}_{i}_{k}", cat=pulp.LpBinary)
        for j in batches
        for i in instances
        for k in positions
    }
    c = [prob.add_variable(f"c_{j}", lowBound=0, upBound=horizon) for j in batches]
    u = {
        (j, q): prob.add_variable(f"u_{j}_{q}", cat=pulp.LpBinary)
        for j in batches
        for q in range(len(plan.deadlines[j]))
    }
    prob += pulp.lpSum(u.values()) - eps * pulp.lpSum(
        2 ** (n_batches - 1 - j) * c[j] for j in batches
    )
    for j in batches:
        placed = pulp.lpSum(x[j, i, k] for i in instances for k in positions)
        prob += placed <= 1
        prob += c[j] >= pulp.lpSum(
            (plan.available_s[i] + plan.exec_s[j][i]) * x[j, i, k]
            for i in instances
            for k in positions
        )
        for q, deadline in enumerate(plan.deadlines[j]):
            if deadline <= 0:
                prob += u[j, q] == 0
                continue
            if q > 0:
                prob += u[j, q - 1] <= u[j, q]
            prob += u[j, q] <= placed
            if deadline < horizon:
                prob += c[j] <= deadline + (horizon - deadline) * (1 - u[j, q])
    for i in instances:
        big_m = plan.available_s[i] + sum(plan.exec_s[j][i] for j in batches)
        finish = pulp.LpAffineExpression(constant=plan.available_s[i])
        for k in positions:
            occupied = pulp.lpSum(x[j, i, k] for j in batches)
            prob += occupied <= 1
            if k > 0:
                prob += occupied <= pulp.lpSum(x[j, i, k - 1] for j in batches)
            finish = finish + pulp.lpSum(plan.exec_s[j][i] * x[j, i, k] for j in batches)
            for j in batches:
                prob += c[j] >= finish - big_m * (1 - x[j, i, k])
    prob += pulp.lpSum(x[j, i, 0] for j in batches for i in plan.idle) == min(
        n_batches, len(plan.idle)
    )
    return prob, x


def solve_batch_ilp(plan: BatchPlanInput, time_limit_s: float) -> dict[int, int] | None:
    """Which batch each idle instance runs now (instance index -> batch index), or ``None`` when
    CBC found no solution in time."""
    prob, x = build_batch_ilp(plan)
    try:
        prob.solve(make_solver("cbc", time_limit_s, warm=False))
    except pulp.PulpSolverError:
        return None
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    chosen: dict[int, int] = {}
    for (j, i, k), var in x.items():
        if k == 0 and i in plan.idle and (var.value() or 0.0) > 0.5:
            chosen[i] = j
    return chosen


AUTO_BATCH_SIZES = (8, 16, 32, 64, 128, 256)
"""The batch sizes SHEPHERD's rule chooses from (``ShepherdPolicy._batch_size``)."""


class ShepherdPolicy(_Learns, QueuedPolicy):
    """SHEPHERD as the QLM paper runs it as a baseline (QLM §8: "dynamic batching and an ILP
    formulation for ordering and placement ... assumes fixed batches with deterministic execution
    times"): static batches, one at a time per instance.

    Waiting requests form one earliest-deadline queue per model. When an instance serving the
    model is idle (its previous batch has finished entirely), the earliest ``max_batches ×
    batch_size`` requests are cut, in deadline order, into batches of ``batch_size`` (fewer when
    fewer wait: dynamic batching does not wait to fill a batch); ``batch_size`` is a fixed size,
    or by default chosen at each round by SHEPHERD's rule (``_batch_size``: the size that makes
    the most deadlines per second). Each batch's execution time is
    deterministic: the profile's prefill of all its prompts plus its longest expected output
    (estimator mean) decoded at the profile's pace for that batch size. ``build_batch_ilp`` places
    and orders the batches on all instances serving the model (busy ones from the time their batch
    should end) to maximise the requests that make their deadlines; each idle instance pulls the
    batch it was given for position 0, and the rest wait for the next round (rolling horizon). If
    CBC finds no solution within its time limit, batches go to idle instances in EDF order. The engine runs continuous
    batching, but no request joins a batch in flight, which is SHEPHERD's static batch.

    Not reproduced: SHEPHERD's own planner (Herd) groups models and GPUs periodically and its
    online scheduler (Flex) preempts a running batch for a larger one; QLM's description has
    neither and neither has a counterpart for an LLM batch whose length is unknown.
    """

    name = "shepherd"

    def __init__(
        self,
        profile: RctProfile,
        *,
        batch_size: int | None = None,
        max_batches: int = 4,
        time_limit_s: float = 0.25,
    ) -> None:
        super().__init__()
        check_setting(
            batch_size is None or batch_size >= 1, "shepherd batch size", ">= 1", batch_size
        )
        check_setting(max_batches >= 1, "shepherd max batches", ">= 1", max_batches)
        check_setting(time_limit_s > 0, "shepherd ILP time limit", "> 0", time_limit_s)
        self.estimates = ServiceEstimates(profile)
        self.batch_size = batch_size  # None: chosen at each round (``_batch_size``)
        self.max_batches = max_batches
        self.time_limit_s = time_limit_s
        self._busy_until: dict[str, float] = {}

    def key(self, request: Request, ctx: DispatchContext) -> tuple[float, ...]:
        return (request.deadline_s,)

    def on_finish(self, completion: Completion) -> None:
        self.estimates.observe(completion)

    def pull(self, ctx: DispatchContext, step: Step) -> None:
        idle = {i.name for i in ctx.instances if i.up and not self.inflight.get(i.name)}
        for model in sorted({m for i in ctx.instances if i.name in idle for m in i.models}):
            queue = model_queue(model)
            servers = _serving(ctx, model)
            free = [s for s in servers if s.name in idle]
            if not free or self.peek(queue) is None:
                continue
            size = self.batch_size or self._batch_size(queue, free, ctx.now)
            waiting: list[Request] = []
            while len(waiting) < self.max_batches * size and self.peek(queue) is not None:
                waiting.append(self.pop(queue))
            batches = [waiting[k : k + size] for k in range(0, len(waiting), size)]
            chosen = self._plan(batches, servers, ctx.now)
            for load in free:
                j = chosen.get(load.name)
                if j is None:
                    continue
                started = self._start(batches[j], load, ctx, step)
                batches[j] = []
                idle.discard(load.name)
                self._busy_until[load.name] = ctx.now + self._exec_s(started, load)
            for batch in batches:
                for request in batch:
                    self.push(request, queue, self.key(request, ctx))

    def _start(
        self, batch: list[Request], load: InstanceLoad, ctx: DispatchContext, step: Step
    ) -> list[Request]:
        """Pull the batch onto the idle instance; what does not fit goes back to the queue."""
        started = []
        for request in batch:
            if step.room(load.name, self.tokens(request)):
                self.pull_onto(step, request, load.name, ctx)
                started.append(request)
            else:
                self.push(request, model_queue(request.model), self.key(request, ctx))
        return started

    def _batch_size(self, queue: str, free: Sequence[InstanceLoad], now: float) -> int:
        """SHEPHERD's rule for the batch size, at each round: the size (a power of two from
        ``AUTO_BATCH_SIZES``, within what the free instances run at once) whose batch of the
        earliest-deadline requests makes the most deadlines per second of its deterministic
        execution time (goodput rate: batches run one at a time on an instance); between sizes
        of equal goodput, the one serving the most requests per second — when every waiting
        request is late already (a backlog), the largest, which drains it fastest, not the
        smallest."""
        cap = min((f.max_running or AUTO_BATCH_SIZES[-1]) for f in free)
        sizes = [b for b in AUTO_BATCH_SIZES if b <= cap] or [AUTO_BATCH_SIZES[0]]
        head = self.peek_many(queue, sizes[-1])
        best, best_rate = sizes[0], (-1.0, -1.0)
        for b in sizes:
            batch = head[:b]
            if len(batch) < b and b > sizes[0]:
                break  # no more waiting requests than a smaller batch holds
            exec_s = max(self._exec_s(batch, free[0]), 1e-9)
            met = sum(r.deadline_s >= now + exec_s for r in batch)
            rate = (met / exec_s, len(batch) / exec_s)
            if rate > best_rate:
                best, best_rate = b, rate
        return best

    def _exec_s(self, batch: Sequence[Request], load: InstanceLoad) -> float:
        if not batch:
            return 0.0
        hw = self.estimates.hardware(batch[0].model, load)
        prompts = sum(self.tokens(r) for r in batch)
        longest = max(self.estimates.output(r, self.generated.get(r.id, 0)) for r in batch)
        return hw.prefill_s(prompts) + longest * hw.decode_s(len(batch))

    def _plan(
        self, batches: list[list[Request]], servers: list[InstanceLoad], now: float
    ) -> dict[str, int]:
        """Batch index for each idle server: the ILP's choice, or EDF order as the fallback."""
        idle = tuple(i for i, s in enumerate(servers) if not self.inflight.get(s.name))
        available = tuple(
            0.0 if i in idle else max(0.0, self._busy_until.get(s.name, now) - now)
            for i, s in enumerate(servers)
        )
        edf = {servers[i].name: j for j, i in enumerate(idle[: len(batches)])}
        if len(batches) <= 1:
            return edf
        plan = BatchPlanInput(
            exec_s=tuple(tuple(self._exec_s(b, s) for s in servers) for b in batches),
            deadlines=tuple(tuple(sorted(r.deadline_s - now for r in b)) for b in batches),
            available_s=available,
            idle=idle,
        )
        chosen = solve_batch_ilp(plan, self.time_limit_s)
        if chosen is None:
            return edf
        return {servers[i].name: j for i, j in chosen.items()}


@dataclass(frozen=True, slots=True)
class BaselineConfig:
    """Every baseline's parameters (``QLM_BASELINES__*``): PROSERVE's (``ProservePolicy``), the
    priority policy's preemption, SHEPHERD's batch size (None: its own rule at each round),
    batches planned at once and ILP time limit."""

    priority_preempt: bool = True
    proserve_alpha: float = 0.9
    proserve_mu: float = 0.1
    proserve_lam: float = 0.7
    proserve_gamma: float = 1.0
    shepherd_batch_size: int | None = None
    shepherd_max_batches: int = 4
    shepherd_time_limit_s: float = 0.25


def create_baseline(
    name: str, *, profile: RctProfile | None = None, config: BaselineConfig | None = None
) -> Policy | None:
    """The baseline called ``name`` (``None`` if there is none) with ``config``'s parameters;
    ``profile`` defaults to the shipped RCT profile, for the policies that estimate service
    times."""
    c = config or BaselineConfig()
    if name == "fcfs":
        return FcfsDispatch(dispatch="least-loaded")
    if name == "fcfs-rr":
        return FcfsDispatch(dispatch="round-robin")
    if name == "edf":
        return EdfPolicy()
    if name == "priority":
        return PriorityPolicy(preempt=c.priority_preempt)
    if name in ("sedf", "proserve", "shepherd"):
        profile = profile or default_profile()
        if name == "sedf":
            return SlackEdfPolicy(profile)
        if name == "proserve":
            return ProservePolicy(
                profile,
                alpha=c.proserve_alpha,
                mu=c.proserve_mu,
                lam=c.proserve_lam,
                gamma=c.proserve_gamma,
            )
        return ShepherdPolicy(
            profile,
            batch_size=c.shepherd_batch_size,
            max_batches=c.shepherd_max_batches,
            time_limit_s=c.shepherd_time_limit_s,
        )
    return None
