"""Strict priority tiers, FCFS inside a tier, preemptive: QLLM's scheduler."""

from __future__ import annotations

from qlm.domain import Request, Tier
from qlm.planner.baselines.estimates import serving
from qlm.planner.policy import Completion, DispatchContext, has_room
from qlm.planner.queued import QueuedPolicy, Step


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
        able = sorted(serving(ctx, request.model), key=lambda i: (step.running(i.name), i.name))
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
