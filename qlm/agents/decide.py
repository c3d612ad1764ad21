"""What an agent does for the head of its virtual queue when the instance is full (§5, Insight 2).

*Pull* (admit the head group's next request while there is room) is the controller's loop over the
virtual queue; this module decides the preemptive operations. When the head group would miss its
SLO waiting for a slot to free on its own, but could still meet it if started now, the agent makes
room: it takes the least urgent running requests off the instance — those whose deadlines are later
than the head group's and that keep enough slack to finish after resuming. For each one it chooses:

- **KV swap** (``SwapOut``): copy its KV cache to CPU memory and back later — when moving
  ``(prompt + generated) × KV bytes`` over the host link twice costs less than recomputing them,
  and the CPU swap space holds it;
- **evict** (``Evict``): abort it; it keeps the tokens generated so far and later resumes as
  prompt + partial output (recomputed), back in its group.

A request is preempted at most ``max_preemptions`` times, so nothing starves by bouncing, and
never when it is not ``resumable`` (a structured answer would start over: on vLLM, which has no
per-request swap, a swap becomes an eviction). Pure: no
clock, no engine; the controller gives the view and applies the decisions.
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
    Eviction and swap are off by default: on W_B at 1.8× the Azure-conv rate on one A100 (600 s),
    without cost-aware admission, QLM attained 84.7 % without them, 82.8 % with swap and eviction
    and 77.1 % with eviction alone (with admission on they hardly fire: 87.9 % and 88.3 %) —
    interactive requests miss there because decoding in a full batch is slow, not because they
    wait for a slot, so preempting only wastes work. ``experiments/ablation.py`` measures where
    they pay. ``min_victim_slack_s``: a running request is only preempted if it would still have
    this much slack after waiting ``resume_delay_s`` and being served again."""

    evict: bool = False
    swap: bool = False
    warm_start: bool = True
    max_preemptions: int = 1
    min_victim_slack_s: float = 10.0
    resume_delay_s: float = 10.0


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """A request the instance is running, as the agent counts it."""

    request: Request
    generated: int  # output tokens so far (estimated by the agent)
    remaining_s: float  # expected time to finish if left alone
    preemptions: int = 0


@dataclass(frozen=True, slots=True)
class HeadGroup:
    """The head of the virtual queue: its earliest deadline, how many requests wait in it, and
    the time its next request needs once started (prefill + expected decode)."""

    group_id: str
    deadline_s: float
    waiting: int
    service_s: float


@dataclass(frozen=True, slots=True)
class InstanceCosts:
    """What preemption costs on this instance."""

    kv_bytes_per_token: int
    host_link_gbs: float  # one way; 0 when the engine cannot swap
    swap_free_gb: float
    prefill_base_s: float
    prefill_per_token_s: float

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


def make_room(
    now: float,
    instance: str,
    head: HeadGroup,
    free_slots: int,
    running: Sequence[RunningRequest],
    costs: InstanceCosts,
    config: AgentConfig,
) -> list[Evict | SwapOut]:
    """Preempt running requests for the head group if it is at risk and can be saved (see the
    module docstring) on ``instance``."""
    if not (config.evict or config.swap) or head.waiting <= free_slots:
        return []
    slack = head.deadline_s - now - head.service_s
    if slack <= 0:
        return []  # cannot be saved: preempting others would only add misses
    natural_wait = min((r.remaining_s for r in running), default=0.0)
    if natural_wait <= slack:
        return []  # a slot frees in time on its own
    victims = [
        r
        for r in running
        if r.request.deadline_s > head.deadline_s
        and r.request.resumable  # preempted, a structured answer would start over
        and r.preemptions < config.max_preemptions
        and r.request.deadline_s - now - config.resume_delay_s - r.remaining_s
        >= config.min_victim_slack_s
    ]
    victims.sort(key=lambda r: (-r.request.deadline_s, r.request.id))  # least urgent first
    need = min(head.waiting - free_slots, len(victims))
    decisions: list[Evict | SwapOut] = []
    swap_free = costs.swap_free_gb
    for victim in victims[:need]:
        tokens = victim.request.input_tokens + victim.generated
        size_gb = tokens * costs.kv_bytes_per_token / GB
        if config.swap and prefers_swap(costs, tokens) and size_gb <= swap_free:
            swap_free -= size_gb
            decisions.append(SwapOut(victim.request.id, instance))
        elif config.evict:
            decisions.append(Evict(victim.request.id, instance))
    return decisions


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
