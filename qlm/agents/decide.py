"""What an agent does for the head of its virtual queue when the instance is busy (§5, Insight 2).

*Pull* (admit the head group's next request while there is room) is the controller's loop over the
virtual queue; this module decides the preemptive operations. The head group can be blocked two
ways: every slot is taken (*slots*: its requests start as running ones finish), or its model is
not the active one (*switch*: the engine switches models only once the running batch has
drained, so the head waits for the longest running request). Preempting running requests ends
the wait, at a price; the agent preempts exactly when it pays (``make_room``):

- **gain**: the weighted SLOs of the waiting requests that meet their deadline if started after
  the preemption (expected service time) and would miss waiting;
- **loss**: the weighted SLOs of the victims that would meet theirs left alone and miss once
  preempted (they wait ``resume_delay_s``, in a switch also the head's service and the switch
  back, and pay their recompute or transfer, with ``min_victim_slack_s`` to spare), plus the
  GPU time the operation wastes (the recompute, or the transfer out and back) at the value of a
  GPU-second at the margin (``InstanceCosts.gpu_second_value``: the cost-aware admission's
  threshold, weighted SLOs per GPU-second; 0 when the instance is not overloaded).

Victims are taken in order (in a switch the longest-running first, since only they hold the drain;
for slots the lowest tier first, the longest-running first within it) and the number with the largest net gain, if positive, is
preempted. For each one the agent chooses:

- **KV swap** (``SwapOut``): copy its KV cache to CPU memory and back later — when moving
  ``(prompt + generated) × KV bytes`` over the host link twice costs less than recomputing them,
  and the CPU swap space holds it; not for a switch when eviction is allowed (the swapped cache
  would wait through two switches, out of the plan, where an evicted request is planned again);
- **evict** (``Evict``): abort it; it keeps the tokens generated so far and later resumes as
  prompt + partial output (recomputed), back in its group.

Only requests due after the head group are preempted, each at most ``max_preemptions`` times, so
nothing starves by bouncing, and never when it is not ``resumable`` (a structured answer would
start over: on vLLM, which has no per-request swap, a swap becomes an eviction). Pure: no clock,
no engine; the controller gives the view and applies the decisions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qlm.domain import Evict, ModelTier, Request, SetModelTier, SwapOut

GB = 1e9


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Which operations the agent may use and how cautiously. ``warm_start``: choose model tiers
    from the virtual queue (``plan_tiers``) and switch models only when told to (off: the engine
    switches on its own, first come first served, as a multi-model vLLM host without QLM would).
    ``evict`` and ``swap`` (on): preempt running requests when it pays (``make_room``).
    ``resume_delay_s``: how long a preempted request is expected to wait before it runs again;
    ``min_victim_slack_s``: the slack it must keep after that to count as still meeting its
    deadline. ``prefill_queue_tokens``: while requests with TTFT deadlines wait for an instance, the
    most prompt tokens the agent keeps pulled onto it and not yet started (0: no bound); the rest
    waits in the virtual queue, where a first token due soon can still pass it."""

    evict: bool = True
    swap: bool = True
    warm_start: bool = True
    max_preemptions: int = 1
    min_victim_slack_s: float = 10.0
    resume_delay_s: float = 10.0
    prefill_queue_tokens: int = 4096


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """A request the instance is running, as the agent counts it; ``weight``: what meeting its
    SLO is worth (its tier's weight)."""

    request: Request
    generated: int  # output tokens so far (estimated by the agent)
    remaining_s: float  # expected time to finish if left alone
    preemptions: int = 0
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class HeadGroup:
    """What waits at the head of the virtual queue: its earliest deadline, how many requests
    wait, and the time one of them needs once started (prefill + expected decode). ``deadlines``:
    each waiting request's (default: ``deadline_s`` for all); ``weight``: what meeting one of
    their SLOs is worth. ``switch_s``: when its model is not the active one (``switching``), the
    time to load it once the running batch has drained."""

    group_id: str
    deadline_s: float
    waiting: int
    service_s: float
    weight: float = 1.0
    deadlines: tuple[float, ...] = ()
    switching: bool = False
    switch_s: float = 0.0


@dataclass(frozen=True, slots=True)
class InstanceCosts:
    """What preemption costs on this instance. ``gpu_second_value``: weighted SLOs a GPU-second
    is worth at the margin (0: the instance has time to spare)."""

    kv_bytes_per_token: int
    host_link_gbs: float  # one way; 0 when the engine cannot swap
    swap_free_gb: float
    prefill_base_s: float
    prefill_per_token_s: float
    gpu_second_value: float = 0.0

    def swap_s(self, tokens: int) -> float:
        """Out and back in over the host link."""
        if self.host_link_gbs <= 0:
            return float("inf")
        return 2 * tokens * self.kv_bytes_per_token / (self.host_link_gbs * GB)

    def recompute_s(self, tokens: int) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * tokens


def prefers_swap(costs: InstanceCosts, tokens: int) -> bool:
    """Insight 2: swap when copying the KV cache out and back is cheaper than recomputing it."""
    return costs.swap_s(tokens) < costs.recompute_s(tokens)


@dataclass(frozen=True, slots=True)
class _Option:
    victim: RunningRequest
    decision: Evict | SwapOut
    cost_s: float  # GPU time it wastes (recompute, or transfer out and back)
    stall_s: float  # GPU time before the head can start (a swap-out's copy)
    size_gb: float


def make_room(
    now: float,
    instance: str,
    head: HeadGroup,
    free_slots: int,
    running: Sequence[RunningRequest],
    costs: InstanceCosts,
    config: AgentConfig,
) -> list[Evict | SwapOut]:
    """The running requests to preempt on ``instance`` for ``head`` (module docstring): the
    number of victims with the largest positive net gain, none if no number pays."""
    if not (config.evict or config.swap) or not running:
        return []
    if not head.switching and head.waiting <= free_slots:
        return []
    deadlines = sorted(head.deadlines or (head.deadline_s,) * head.waiting)
    if not deadlines:
        return []

    def eligible(r: RunningRequest) -> bool:
        return (
            r.request.deadline_s > head.deadline_s
            and r.request.resumable  # preempted, a structured answer would start over
            and r.preemptions < config.max_preemptions
        )

    if head.switching:  # only the longest-running hold the switch: a prefix of them
        by_length = sorted(running, key=lambda r: (-r.remaining_s, r.request.id))
        candidates: list[RunningRequest] = []
        for r in by_length:
            if not eligible(r):
                break
            candidates.append(r)
        waiting = deadlines
    else:  # the first free slots start now; the rest wait for slots
        candidates = sorted(
            (r for r in running if eligible(r)),
            key=lambda r: (r.weight, -r.remaining_s, r.request.id),
        )
        waiting = deadlines[free_slots:]
        candidates = candidates[: len(waiting)]
    back_s = config.resume_delay_s
    if head.switching:  # the victims wait for the head's work and two switches
        back_s += head.service_s + 2 * head.switch_s
    options: list[_Option] = []
    swap_free = costs.swap_free_gb
    for r in candidates:
        tokens = r.request.input_tokens + r.generated
        size_gb = tokens * costs.kv_bytes_per_token / GB
        # In a switch an evicted request rejoins its group and is planned again; a swapped one
        # would wait in CPU memory through two switches, out of the plan: swap only for slots.
        swap = config.swap and not (head.switching and config.evict)
        if swap and prefers_swap(costs, tokens) and size_gb <= swap_free:
            swap_free -= size_gb
            cost = costs.swap_s(tokens)
            options.append(_Option(r, SwapOut(r.request.id, instance), cost, cost / 2, size_gb))
        elif config.evict:
            cost = costs.recompute_s(tokens)
            options.append(_Option(r, Evict(r.request.id, instance), cost, 0.0, 0.0))
        else:
            break  # it cannot be preempted: nor can anything behind it help
    best_net, best_k = 0.0, 0
    without = _starts(now, head, running, (), len(waiting))
    met_without = [s + head.service_s <= d for s, d in zip(without, waiting, strict=True)]
    for k in range(1, len(options) + 1):
        chosen = options[:k]
        stall = sum(o.stall_s for o in chosen)
        starts = _starts(now, head, running, [o.victim for o in chosen], len(waiting), stall)
        gain = 0.0
        for s, d, met in zip(starts, waiting, met_without, strict=True):
            gain += head.weight * ((s + head.service_s <= d) - met)
        loss = 0.0
        for o in chosen:
            v, deadline = o.victim, o.victim.request.deadline_s
            meets = now + v.remaining_s <= deadline
            late = now + back_s + o.cost_s + v.remaining_s + config.min_victim_slack_s > deadline
            loss += v.weight * (meets and late) + o.cost_s * costs.gpu_second_value
        if gain - loss > best_net + 1e-9:
            best_net, best_k = gain - loss, k
    return [o.decision for o in options[:best_k]]


def _starts(
    now: float,
    head: HeadGroup,
    running: Sequence[RunningRequest],
    victims: Sequence[RunningRequest],
    n: int,
    stall_s: float = 0.0,
) -> list[float]:
    """When each of ``n`` waiting requests starts, in deadline order, with ``victims``
    preempted: in a switch all at once when the rest has drained and the model loaded; for
    slots one per victim at once, then one per finishing request."""
    gone = {id(v) for v in victims}
    left = sorted(r.remaining_s for r in running if id(r) not in gone)
    if head.switching:
        return [now + stall_s + max(left, default=0.0) + head.switch_s] * n
    out = [now + stall_s] * min(len(victims), n)
    for j in range(n - len(out)):
        # The j-th slot to free; past the running batch, one service time per round.
        rounds, k = divmod(j, len(left)) if left else (j, 0)
        out.append(now + stall_s + (left[k] if left else 0.0) + rounds * head.service_s)
    return out


def plan_tiers(
    instance: str,
    queue_models: Sequence[str],
    tiers: Mapping[str, ModelTier],
    weights_gb: Mapping[str, float],
    cpu_budget_gb: float,
) -> list[SetModelTier]:
    """Model warm start (§5): the head group's model active; the models of the groups after it,
    in virtual-queue order, warm in CPU memory while ``cpu_budget_gb`` lasts, then the models no
    group needs now while memory is left; the rest cold.
    ``queue_models``: the model of each group in queue order (repeats allowed). Returns only the
    changes: demotions first (they free CPU memory), then warm-ups, then the head's activation.
    The model active now is left to the engine, which offloads it when the head's model loads."""
    if not queue_models:
        return []
    head = queue_models[0]
    warm: set[str] = set()
    left = cpu_budget_gb
    if tiers.get(head) is ModelTier.WARM:  # its CPU copy stays until it has loaded
        left -= weights_gb.get(head, 0.0)
    # Queue order first; then, while memory is left, the other models (warm ones first: keeping
    # them costs nothing, and the next arrival may need one).
    others = sorted((m for m in tiers if m not in queue_models), key=lambda m: (tiers[m], m))
    for m in (*dict.fromkeys(queue_models[1:]), *others):
        fits = weights_gb.get(m, float("inf")) <= left
        if fits and m != head and m in tiers and tiers[m] is not ModelTier.ACTIVE:
            warm.add(m)
            left -= weights_gb[m]
    changes = [
        SetModelTier(instance, m, ModelTier.COLD)
        for m, t in sorted(tiers.items())
        if t is ModelTier.WARM and m not in warm and m != head
    ]
    changes += [
        SetModelTier(instance, m, ModelTier.WARM)
        for m in sorted(warm)
        if tiers[m] is ModelTier.COLD
    ]
    if tiers.get(head) is not ModelTier.ACTIVE:
        changes.append(SetModelTier(instance, head, ModelTier.ACTIVE))
    return changes
