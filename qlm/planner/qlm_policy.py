"""QLM's own policy: request groups in virtual queues, ordered by the stochastic planner.

Every step: completions teach the RCT estimator; arrivals are classified into request groups
(§4), and a group the queues do not hold yet is put on the least-loaded instance serving its model
at its deadline slot; when a trigger fires the planner re-orders and re-assigns every group
(``build_problem`` + ``solve``); then each instance pulls from the head of its own virtual queue
while it has room (§5 *pull*, *load balancing*: a running request never migrates).

Triggers (issue 4): a predicted violation (the estimator's completion distribution of the current
order gives some group ``P(meet) < Δ`` — checked when groups changed, at most every
``check_interval_s``), an instance joining, leaving or going idle while others have work, and the
period ``period_s`` otherwise. Never more often than ``min_interval_s`` nor, on the wall clock, than
``keep_up`` × the last solve's compute time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from qlm.domain import Decision, Pull, Request, Tier
from qlm.groups import Grouper, GroupingConfig
from qlm.planner.policy import DispatchContext, InstanceLoad, has_room, prompt_tokens
from qlm.planner.program import PlanGroup, PlanInstance, PlanProblem
from qlm.planner.solve import Budget, Solution, capacity_needed, solve
from qlm.rct.estimator import RCTEstimator
from qlm.rct.profile import RctProfile, default_profile
from qlm.virtual_queues import VirtualQueueSet

DEFAULT_TIER_WEIGHTS: Mapping[Tier, float] = {
    Tier.INTERACTIVE: 2.0,
    Tier.STANDARD: 1.5,
    Tier.BATCH: 1.0,
}


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
    seed: int = 0

    @classmethod
    def for_simulation(cls, evaluations: int = 5000, **overrides: object) -> PlannerConfig:
        """The planner as production runs it, with its compute budget counted in scored candidate
        orders instead of seconds (and no MILP, whose time limit is wall time), so that a
        simulated run is the same on any machine."""
        budget = Budget(time_s=None, evaluations=evaluations, milp_max_groups=0)
        return cls(budget=budget, **overrides)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if not 0 < self.delta < 1:
            raise ValueError(f"planner.delta must be in (0, 1), got {self.delta}")
        if self.scenarios < 1:
            raise ValueError(f"planner.scenarios must be >= 1, got {self.scenarios}")
        for name in ("period_s", "min_interval_s", "check_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"planner.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """One planning event, for the store, the API and the CLI: when, why and how it went."""

    at_s: float
    trigger: str
    groups: int
    status: str
    method: str
    objective: float
    edf_objective: float
    at_risk: tuple[str, ...]
    capacity_needed: float | None
    solve_s: float
    evaluations: int


@dataclass(slots=True)
class _Inflight:
    request: Request
    pulled_s: float
    generated: int  # output tokens it had when pulled (resumed after an eviction)


def build_problem(
    groups: Sequence[tuple[str, Sequence[Request], Tier]],
    instances: Sequence[InstanceLoad],
    ready_s: Mapping[str, float],
    estimator: RCTEstimator,
    config: PlannerConfig,
    rng: np.random.Generator,
) -> PlanProblem:
    """The plan problem of the waiting groups (id, requests in FCFS order, tier) on the up
    instances, with scenarios of each group's work drawn from the estimator."""
    up = [i for i in instances if i.up]
    n, q, s_count = len(groups), len(up), config.scenarios
    proc = np.full((n, q, s_count), np.inf)
    floor = np.full((n, q, s_count), np.inf)
    z_total = rng.standard_normal((n, s_count))
    z_last = rng.standard_normal((n, s_count))
    plan_groups: list[PlanGroup] = []
    for i, (gid, requests, tier) in enumerate(groups):
        load = estimator.group_load(gid, requests)
        plan_groups.append(
            PlanGroup(
                gid, load.model, load.earliest_deadline_s, config.tier_weights[tier] * load.size
            )
        )
        out = np.maximum(load.output_mean + math.sqrt(load.output_var) * z_total[i], 0.0)
        last = np.maximum(load.last_output_mean + math.sqrt(load.last_output_var) * z_last[i], 1.0)
        for g, inst in enumerate(up):
            if load.model not in inst.models:
                continue
            hw = estimator.profile.hardware_for(load.model, inst.gpu, inst.gpu_count)
            wait_f, eps_f = estimator.calibration_factors(inst.name)
            proc[i, g] = (
                load.input_tokens * hw.input_token_work_s + out / hw.throughput_tps
            ) * wait_f
            d = hw.decode_per_token_s * hw.inefficiency * eps_f
            floor[i, g] = hw.prefill_s(load.last_input_tokens) + last * d
    plan_instances = []
    for inst in up:
        switch = {}
        for m in inst.models:
            hw = estimator.profile.hardware_for(m, inst.gpu, inst.gpu_count)
            switch[m] = 0.0 if m == inst.active_model else hw.warm_load_s
        plan_instances.append(
            PlanInstance(inst.name, inst.models, inst.active_model, ready_s[inst.name], switch)
        )
    return PlanProblem(tuple(plan_groups), tuple(plan_instances), proc, floor, delta=config.delta)


class QlmPolicy:
    """Groups, RCT estimator and planner behind the one ``Policy`` interface."""

    name = "qlm"

    def __init__(
        self,
        profile: RctProfile | None = None,
        *,
        config: PlannerConfig | None = None,
        grouping: GroupingConfig | None = None,
        measure_solve_time: bool = True,
    ) -> None:
        self.config = config or PlannerConfig()
        self.estimator = RCTEstimator(profile or default_profile())
        self.grouper = Grouper(grouping or GroupingConfig())
        self.queues = VirtualQueueSet(self.grouper)
        self.plans: list[PlanRecord] = []
        self.last_solution: Solution | None = None
        self._measure = measure_solve_time
        self._inflight: dict[str, dict[str, _Inflight]] = {}
        self._generated: dict[str, int] = {}
        self._instances: tuple[InstanceLoad, ...] = ()
        self._up: frozenset[str] = frozenset()
        self._last_plan_s = -math.inf
        self._last_check_s = -math.inf
        self._last_solve_s = 0.0
        self._changed = False
        self._plans_made = 0

    # --- the step --------------------------------------------------------------------------------

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        now = ctx.now
        self._instances = ctx.instances
        for inst in ctx.instances:
            if inst.name not in self._inflight:
                self._inflight[inst.name] = {}
                self.queues.add_instance(inst.name)
        for done in ctx.finished:
            self._inflight.get(done.instance, {}).pop(done.request.id, None)
            self._generated.pop(done.request.id, None)
            self.estimator.observe(
                done.request,
                output_tokens=done.output_tokens,
                scheduled_s=done.scheduled_s,
                first_token_s=done.first_token_s,
                finish_s=done.finish_s,
            )
        generated = dict(ctx.generated)
        for req in ctx.arrived:
            for running in self._inflight.values():
                running.pop(req.id, None)  # an evicted request comes back
            if generated.get(req.id):
                self._generated[req.id] = generated[req.id]
            gid = self.grouper.add(req, now)
            if self.queues.instance_of(gid) is None:
                self._place(gid, req)
            self._changed = True
        if self.grouper.needs_recluster(now):
            self.queues.sync(self.grouper.recluster(now))
            for gid in self.queues.unassigned():
                self._place(gid, self.grouper.peek(gid))
            self._changed = True
        trigger = self._trigger(now)
        if trigger:
            self.plan(now, trigger)
        return self._pull(now)

    # --- planning --------------------------------------------------------------------------------

    def _trigger(self, now: float) -> str:
        up = frozenset(i.name for i in self._instances if i.up)
        if not len(self.grouper):
            self._up = up
            return ""
        gap = self.config.min_interval_s
        if self._measure:
            gap = max(gap, self.config.keep_up * self._last_solve_s)
        if now - self._last_plan_s < gap:
            return ""
        if up != self._up:
            return "instances"
        if any(not self.queues.queue(i.name) for i in self._instances if i.up) and any(
            self.queues.queue(i.name) for i in self._instances
        ):
            idle = [
                i
                for i in self._instances
                if i.up and not self.queues.queue(i.name) and i.outstanding_requests == 0
            ]
            if idle:
                return "idle"
        if now - self._last_plan_s >= self.config.period_s:
            return "period"
        if self._changed and now - self._last_check_s >= self.config.check_interval_s:
            self._last_check_s = now
            self._changed = False
            if self._predicts_violation(now):
                return "violation"
        return ""

    def _groups(self) -> tuple[list[tuple[str, Sequence[Request], Tier]], list[list[int]]]:
        groups: list[tuple[str, Sequence[Request], Tier]] = []
        current: list[list[int]] = []
        index: dict[str, int] = {}
        for inst in self._instances:
            order: list[int] = []
            if inst.up:
                for gid in self.queues.queue(inst.name):
                    g = self.grouper.group(gid)
                    index[gid] = len(groups)
                    order.append(len(groups))
                    groups.append((gid, g.requests, g.tier))
            current.append(order)
        for g in self.grouper.groups():  # not on any up instance: the planner places them
            if g.id not in index:
                index[g.id] = len(groups)
                groups.append((g.id, g.requests, g.tier))
        return groups, [o for o, i in zip(current, self._instances, strict=True) if i.up]

    def _problem(self, now: float) -> tuple[PlanProblem, list[list[int]]]:
        groups, current = self._groups()
        rng = np.random.default_rng((self.config.seed, self._plans_made))
        problem = build_problem(
            groups, self._instances, self._ready(now), self.estimator, self.config, rng
        )
        return problem, current

    def _predicts_violation(self, now: float) -> bool:
        problem, current = self._problem(now)
        if len(problem.groups) != sum(len(o) for o in current):
            return True  # some group has no queue
        from qlm.planner.program import score_queue

        return any(score_queue(problem, g, o).missed.any() for g, o in enumerate(current))

    def plan(self, now: float, trigger: str = "manual") -> PlanRecord:
        """Re-plan every waiting group now and apply the plan to the virtual queues."""
        problem, current = self._problem(now)
        self._plans_made += 1
        solution = solve(problem, self.config.budget, previous=current)
        orders = {
            inst.name: [problem.groups[i].id for i in order]
            for inst, order in zip(problem.instances, solution.plan, strict=True)
        }
        self.queues.set_orders(orders)
        self._last_plan_s = now
        self._last_solve_s = solution.solve_s
        self._up = frozenset(i.name for i in self._instances if i.up)
        self._changed = False
        self.last_solution = solution
        record = PlanRecord(
            at_s=now,
            trigger=trigger,
            groups=len(problem.groups),
            status=solution.status,
            method=solution.method,
            objective=solution.objective,
            edf_objective=solution.edf_objective,
            at_risk=tuple(problem.groups[i].id for i in solution.at_risk),
            capacity_needed=capacity_needed(problem) if solution.at_risk else 1.0,
            solve_s=solution.solve_s,
            evaluations=solution.evaluations,
        )
        self.plans.append(record)
        return record

    def _ready(self, now: float) -> dict[str, float]:
        """When each instance's running work drains, in the fluid model: remaining expected output
        of its in-flight requests (each has had an equal share of the throughput so far)."""
        out: dict[str, float] = {}
        for inst in self._instances:
            running = self._inflight.get(inst.name, {})
            if not running or not inst.up:
                out[inst.name] = now
                continue
            work = 0.0
            share = 0.0
            for item in running.values():
                hw = self.estimator.profile.hardware_for(
                    item.request.model, inst.gpu, inst.gpu_count
                )
                share = hw.throughput_tps / len(running)
                done = item.generated + int(max(0.0, now - item.pulled_s) * share)
                mean, _ = self.estimator.output_moments(
                    item.request, min(done, item.request.max_tokens - 1)
                )
                work += mean / hw.throughput_tps
            out[inst.name] = now + work * self.estimator.calibration_factors(inst.name)[0]
        return out

    def _place(self, gid: str, req: Request) -> None:
        """A new group between plans: on the eligible instance with the fewest waiting requests,
        at its deadline slot (the next plan revisits it)."""
        able = [i for i in self._instances if i.up and req.model in i.models]
        if not able:
            return  # no instance serves it now; it waits for one (the planner places it)
        target = min(
            able,
            key=lambda i: (
                sum(self.grouper.group(g).size for g in self.queues.queue(i.name))
                + len(self._inflight.get(i.name, {})),
                i.name,
            ),
        )
        queue = self.queues.queue(target.name)
        deadline = self.grouper.group(gid).earliest_deadline_s
        pos = 0
        while pos < len(queue) and self.grouper.group(queue[pos]).earliest_deadline_s <= deadline:
            pos += 1
        self.queues.assign(gid, target.name, pos)

    # --- pulling ---------------------------------------------------------------------------------

    def _pull(self, now: float) -> list[Decision]:
        decisions: list[Decision] = []
        for inst in self._instances:
            count = tokens = 0
            while True:
                req = self.queues.next_request(inst.name)
                if req is None:
                    break
                need = prompt_tokens(req, self._generated.get(req.id, 0))
                if not has_room(inst, count, tokens, need):
                    break
                self.queues.pop_next(inst.name)
                count += 1
                tokens += need
                self._inflight[inst.name][req.id] = _Inflight(
                    req, now, self._generated.get(req.id, 0)
                )
                decisions.append(Pull(req.id, inst.name))
        return decisions
