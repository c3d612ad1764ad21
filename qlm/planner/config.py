"""The QLM policy's settings (``PlannerConfig``) and its defaults: tier weights and grouping."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from qlm.agents.decide import AgentConfig
from qlm.domain import Tier
from qlm.errors import check_setting
from qlm.groups import GroupingConfig
from qlm.planner.budget import Budget

DEFAULT_TIER_WEIGHTS: Mapping[Tier, float] = {
    Tier.INTERACTIVE: 2.0,
    Tier.STANDARD: 1.5,
    Tier.BATCH: 1.0,
}


DEFAULT_GROUPING = GroupingConfig(avg_batch_size=8.0)
"""Groups of at most δ × 8 = 32 requests: finer than the grouping module's placeholder (§8.3: small
groups decide more finely and cost the planner more — this planner is fast enough for them). On W_B
at 1.8× the Azure rate it lifts SLO attainment from 69 % (128-request groups) to 74 %."""


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """Settings of the QLM policy. ``delta``: the chance constraint's Δ; ``scenarios``: SAA
    samples per group; ``budget``: the solver's limit per plan."""

    delta: float = 0.9
    scenarios: int = 16
    tier_weights: Mapping[Tier, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    budget: Budget = field(default_factory=lambda: Budget(time_s=0.1))
    period_s: float = 10.0
    min_interval_s: float = 1.0
    check_interval_s: float = 1.0
    keep_up: float = 2.0
    solver: str = "auto"
    agent: AgentConfig = field(default_factory=AgentConfig)
    choose_concurrency: bool = True
    rate_window_s: float = 60.0
    max_utilisation: float = 0.95
    concurrency_hysteresis: float = 0.05
    defer_expensive: bool = True
    throughput_floor: float = 0.9
    """Under a sustained overload (an instance's virtual queue never empty for ``floor_window_s``)
    the concurrency choice keeps the instance serving at least this share of the requests arriving
    per second plus what clears its queue within that window (or of the most any limit serves,
    when none keeps up); a shorter burst, and 0, choose by SLOs met alone. A smaller batch meets
    more SLOs of what it serves and serves fewer: under a sustained overload the backlog grows
    (experiments/README.md, "Throughput and the concurrency limit")."""
    throughput_tolerance: float = 0.05
    """While an instance's best concurrency limit leaves work deferred (an overload: the fluid
    model cannot serve all that arrives), the limits worth within this share of the best are
    within the model's noise, and the one of them that serves the most requests per second is
    chosen: what a smaller batch does not serve waits, which its steady-state value does not
    count. 0 chooses by SLOs met alone; an instance that serves all it gets always does."""
    floor_window_s: float = 300.0
    """The window over which the throughput floor counts the arrivals it keeps up with and the
    work the instance served, and within which it clears the instance's virtual queue."""
    overload_after_s: float = 300.0
    """How long an instance's virtual queue must hold requests at every plan before it is
    overloaded: the throughput floor and tolerance apply from then on (a shorter burst is
    absorbed by the queue)."""
    seed: int = 0
    step_budget_s: float = 0.5
    """With a wall-time ``budget`` (production): what a control step spends on work that can wait
    for the next one (the agents step at least every quarter of a second) — grouping arrivals in
    its first half, pulling in the second (each instance its share), a recluster or a plan only
    while the first half lasts (else first at the next step). A simulated run does it all."""
    grouping: GroupingConfig = DEFAULT_GROUPING
    """How requests are grouped (δ × average batch size bounds a group: ``DEFAULT_GROUPING``)."""
    placement: str = "planned"
    """``planned``: the solver assigns groups to instances and orders them; ``round-robin``: each
    group is placed on the next instance serving its model in turn when it is made, and the
    solver only orders each instance's queue (the baseline ``qlm-rr``: QLM's ordering behind a
    round-robin balancer)."""
    max_wait_s: Mapping[Tier, float] = field(default_factory=dict)
    """Starvation guard: a request of a tier listed here that has waited this long since its
    arrival is pulled ahead of the plan's order, at the next free slot of its instance (tiers
    left out: no maximum)."""

    @classmethod
    def for_simulation(cls, evaluations: int = 5000, **overrides: object) -> PlannerConfig:
        """The planner as production runs it, with its compute budget counted in scored candidate
        orders instead of seconds (and no MILP, whose time limit is wall time), so that a
        simulated run is the same on any machine."""
        budget = Budget(time_s=None, evaluations=evaluations, milp_max_groups=0)
        return cls(budget=budget, **overrides)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        check_setting(0 < self.delta < 1, "planner.delta", "in (0, 1)", self.delta)
        check_setting(self.scenarios >= 1, "planner.scenarios", ">= 1", self.scenarios)
        ok = self.placement in ("planned", "round-robin")
        check_setting(ok, "planner.placement", "planned or round-robin", self.placement)
        ok = self.solver in ("auto", "cbc", "highs")
        check_setting(ok, "planner.solver", "auto, cbc or highs", self.solver)
        for name in (
            "period_s",
            "min_interval_s",
            "check_interval_s",
            "rate_window_s",
            "floor_window_s",
            "overload_after_s",
            "step_budget_s",
        ):
            value = getattr(self, name)
            check_setting(value > 0, f"planner.{name}", "> 0", value)
        ok = 0 <= self.throughput_floor <= 1
        check_setting(ok, "planner.throughput_floor", "in [0, 1]", self.throughput_floor)
        ok = 0 <= self.throughput_tolerance < 1
        check_setting(ok, "planner.throughput_tolerance", "in [0, 1)", self.throughput_tolerance)
        ok = 0 < self.max_utilisation <= 1
        check_setting(ok, "planner.max_utilisation", "in (0, 1]", self.max_utilisation)
        ok = 0 <= self.concurrency_hysteresis < 1
        check_setting(
            ok, "planner.concurrency_hysteresis", "in [0, 1)", self.concurrency_hysteresis
        )
        for tier, wait in self.max_wait_s.items():
            check_setting(wait > 0, f"planner.max_wait_s.{tier.name.lower()}", "> 0", wait)
