"""PROSERVE: GoRouting places each request on an instance's queue, SlideBatching orders it."""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass

from qlm.domain import Request
from qlm.planner.baselines.estimates import LearnsOutput, ServiceEstimates, serving
from qlm.planner.policy import Completion, DispatchContext, InstanceLoad
from qlm.planner.queued import QueuedPolicy, instance_queue, model_queue
from qlm.rct.profile import RctProfile

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


class ProservePolicy(LearnsOutput, QueuedPolicy):
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
        able = serving(ctx, request.model)
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
