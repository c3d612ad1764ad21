"""QLM's own policy: request groups in virtual queues, ordered by the stochastic planner.

Every step runs four stages in order (``QlmPolicy.decide``): *observe* — instances joining or
leaving, completions teaching the RCT estimator, cancellations; *group* — arrivals are classified
into request groups (§4), and a group the queues do not hold yet is put on the least-loaded
instance serving its model at its deadline slot; *plan* — the groups are reclustered when due,
and when a trigger fires the planner re-orders and re-assigns every group (``build_family`` +
``solve``); *act* — each instance pulls from the head of its own virtual queue while it has room
(§5 *pull*, *load balancing*: a running request never migrates), makes room for an urgent head
group and warm-starts models.

Triggers: a predicted violation (the estimator's completion distribution of the current
order gives some group ``P(meet) < Δ`` — checked when groups changed, at most every
``check_interval_s``), an instance joining, leaving or going idle while others have work, and the
period ``period_s`` otherwise. Never more often than ``min_interval_s`` nor, on the wall clock, than
``keep_up`` × the last plan's compute time (problem, solve, concurrency choice, capacity).

Bounds (production, where the budget is wall time, on the clock the policy is given): a plan's
solver and capacity signal share its ``budget`` (``qlm.planner.budget``); a step groups arrivals
and pulls within ``step_budget_s`` and leaves the rest, a recluster or a plan that did not fit,
to the next step. A simulated run, whose budget is counted in scored orders, does everything at
every step, so that it is the same on any machine.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from qlm.agents.decide import (
    HeadGroup,
    InstanceCosts,
    RunningRequest,
    make_room,
    plan_tiers,
)
from qlm.clock import work_seconds
from qlm.domain import (
    Decision,
    ModelTier,
    PlanRecord,
    Pull,
    Request,
    SwapIn,
    SwapOut,
    Tier,
)
from qlm.errors import RequestFailed, check_setting
from qlm.groups import Grouper, GroupingConfig, PredictOutput, default_predict_output
from qlm.planner.admission import TokenBucket, hopeless, in_time
from qlm.planner.arrivals import ArrivalWindow
from qlm.planner.books import AdmissionState, AgentBooks, Inflight
from qlm.planner.budget import Clock
from qlm.planner.concurrency import (
    CLASS_SAMPLE,
    FLUID_SHARE,
    FluidModels,
    choose_limits,
)
from qlm.planner.config import PlannerConfig
from qlm.planner.family import ProblemFamily, build_family
from qlm.planner.policy import (
    DispatchContext,
    InstanceLoad,
    ModelSwitching,
    has_room,
    prompt_tokens,
)
from qlm.planner.program import score_queue, subset
from qlm.planner.solve import Solution, capacity_needed, solve
from qlm.rct.estimator import EstimatorInstance, Queued, RCTEstimator
from qlm.rct.profile import RctProfile, default_profile
from qlm.rct.trigger import Violation, violations
from qlm.virtual_queues import GroupPrediction, VirtualQueueSet, VirtualQueuesSnapshot

log = logging.getLogger(__name__)


MAX_LINE = 64
"""Requests at the head of a queue whose first tokens ``_pull_ahead`` looks after."""

SEARCH_SHARE = 0.75
"""The share of the search's budget by which the solver stops; the capacity signal (computed
when some group is left at risk) has the rest."""


class QlmPolicy:
    """Groups, RCT estimator and planner behind the one ``Policy`` interface (module docstring)."""

    name = "qlm"

    def __init__(
        self,
        profile: RctProfile | None = None,
        *,
        config: PlannerConfig | None = None,
        grouping: GroupingConfig | None = None,
        measure_solve_time: bool | None = None,
        estimator: RCTEstimator | None = None,
        predict_output: PredictOutput | None = None,
        clock: Clock = work_seconds,
    ) -> None:
        """``measure_solve_time``: space plans by ``keep_up`` × their measured compute time; by
        default only when the budget is wall time (production). A budget counted in evaluations
        (``PlannerConfig.for_simulation``) leaves the wall clock out, so that a simulated run is
        the same on any machine and under any load.

        ``estimator`` replaces the RCT estimator built from ``profile``, and ``predict_output`` the
        output length the grouper clusters on (default: a fixed guess under ``max_tokens``);
        ``experiments/policies.py --oracle`` gives both the true output lengths, to measure what
        knowing them would be worth.

        ``clock`` (seconds, monotonic) times the plans — their budget when it is wall time, and
        the ``keep_up`` spacing — and, when plans are spaced by their compute, bounds each step
        (``PlannerConfig.step_budget_s``)."""
        self.config = config or PlannerConfig()
        self._clock = clock
        # The agents switch models themselves (warm start), so engines must not switch on their own.
        self.model_switching: ModelSwitching = (
            "explicit" if self.config.agent.warm_start else "fcfs"
        )
        self.estimator = estimator or RCTEstimator(profile or default_profile())
        self.grouper = Grouper(
            grouping or self.config.grouping,
            predict_output=predict_output or default_predict_output,
        )
        self.queues = VirtualQueueSet(self.grouper)
        self.last_plan: PlanRecord | None = None
        self._new_plans: list[PlanRecord] = []  # made since the last ``take_plans``
        self.last_solution: Solution | None = None
        self._measure = (
            self.config.budget.time_s is not None
            if measure_solve_time is None
            else measure_solve_time
        )
        self.books = AgentBooks()  # what the agents sent to each instance (``qlm.planner.books``)
        self._instances: tuple[InstanceLoad, ...] = ()
        self._up: frozenset[str] = frozenset()
        self._last_plan_s = -math.inf
        self._last_check_s = -math.inf
        self._last_plan_cost_s = 0.0
        self._changed = False
        self._plans_made = 0
        self.admission = AdmissionState()  # what the last plan chose (``qlm.planner.books``)
        self._fixed: int | None = None  # fix_concurrency
        self._buckets: dict[str, TokenBucket] = {}  # per instance, paces deferred work
        self._arrivals = ArrivalWindow(CLASS_SAMPLE)  # the last rate_window_s
        self._slots: dict[str, list[Any]] = {}  # per step: queue deadlines and load, for _place
        self._family_cache: tuple[tuple[float, int], tuple[ProblemFamily, list[list[int]]]] | None
        self._family_cache = None  # per step: the plan problem built for the violation check
        self._inbox: dict[str, tuple[Request, int]] = {}  # handed, not grouped yet (output so far)
        self._fluid_models = FluidModels(self.estimator, self.config)  # the concurrency choice
        # Left for the next step (wall-time budget): "rethink" (recluster if due, plan if a
        # trigger fires) or "plan" (the step reclustered; a trigger is checked first thing).
        self._owed = ""

    @property
    def ungrouped(self) -> int:
        """Requests handed to the policy that a bounded step has not grouped yet (the next step
        takes them first)."""
        return len(self._inbox)

    @property
    def last_checked_s(self) -> float:
        """When the current virtual queues were last judged against the SLOs: a violation check
        (which re-plans when it predicts a miss) or a plan, whichever came later."""
        return max(self._last_check_s, self._last_plan_s)

    # --- the step --------------------------------------------------------------------------------

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        """One step: observe, group, plan, act (module docstring).

        With a wall-time budget a step is bounded: arrivals are grouped while the first half of
        ``step_budget_s`` lasts (the rest wait for the next step, first in line), then a
        recluster or a plan only if time is left — else it goes first at the next step
        (``_owed``), and never both in one step; a recluster never in a step that grouped
        arrivals, and the groups it made new are placed at the next step, the plan at the one
        after —, then the agents act in the second half."""
        now = ctx.now
        self._observe(ctx)
        wall = self._measure
        start = self._clock() if wall else 0.0
        half = self.config.step_budget_s / 2
        owed, self._owed = self._owed, ""
        if owed == "place":
            self._place_unassigned()
            self._owed = "plan"
        elif owed:
            self._plan_stage(now, recluster=owed == "rethink")
        taken = self._group(now, start + half if wall else math.inf)
        if not owed:
            if wall and (
                self._clock() - start >= half or (taken and self.grouper.needs_recluster(now))
            ):  # a recluster (the largest part, at 100,000 requests) gets a step of its own
                self._owed = "rethink"
            else:
                self._plan_stage(now)
        return self._act(now, start + self.config.step_budget_s if wall else math.inf)

    def _observe(self, ctx: DispatchContext) -> None:
        """What changed since the last step: instances up or down (a down instance's groups go
        back to the planner), requests started, completions (they teach the estimator),
        cancellations; arrivals wait in the inbox for ``_group``."""
        self._instances = ctx.instances
        held = set(self.queues.instances())
        for inst in ctx.instances:
            self.books.inflight.setdefault(inst.name, {})
            if inst.up and inst.name not in held:
                self.queues.add_instance(inst.name)
            elif not inst.up and inst.name in held:
                # Fault isolation: its groups go back to the planner (the trigger "instances"
                # re-plans them onto the others); its requests come back through ``arrived``.
                self.queues.drop_instance(inst.name)
                self.admission.limits.pop(inst.name, None)
        self.books.started_at(ctx.started, ctx.now)
        for inst in ctx.instances:  # preemptions counted before the completions they come with
            self.estimator.watch(self._estimator_instance(inst))
        for done in ctx.finished:
            self.books.finished(done.instance, done.request.id, done.finish_s)
            self.estimator.observe(
                done.request,
                output_tokens=done.output_tokens,
                scheduled_s=done.scheduled_s,
                first_token_s=done.first_token_s,
                finish_s=done.finish_s,
                instance=done.instance,
            )
        self._slots = {}  # the queues may have changed since the last step
        self._family_cache = None
        for rid in ctx.cancelled:
            self._forget(rid)
        generated = dict(ctx.generated)
        for req in ctx.arrived:
            if req.id not in self._inbox:  # (handed again after a failed step: once is enough)
                self._inbox[req.id] = (req, generated.get(req.id, 0))

    def _group(self, now: float, until: float) -> int:
        """Group the requests handed to the policy (new ones, and ones back from an engine),
        oldest first, until ``until`` on the policy's clock (at least one). How many it took."""
        taken = 0
        while self._inbox and not (taken and self._clock() >= until):
            taken += 1
            req, generated = self._inbox.pop(next(iter(self._inbox)))
            try:
                self._take(now, req, generated)
            except Exception as exc:
                raise RequestFailed(req.id, exc) from exc
        return taken

    def _take(self, now: float, req: Request, generated: int) -> None:
        """Group one request handed to the policy and place its group if it is new."""
        if self.grouper.group_of(req.id) is not None:
            return  # handed again after a failed step: already held
        back = self.books.take_back(req.id, generated)
        if not back and not generated:  # new: not one coming back to run again
            self._arrivals.add(now, req)
        if generated and req.slo.ttft_s is not None:
            # It has had its first token: only its e2e is due.
            req = replace(req, slo=replace(req.slo, ttft_s=None))
        gid = self.grouper.add(req, now)
        held_by = self.queues.instance_of(gid)
        if held_by is None:
            self._place(gid, req)
        elif held_by in self._slots:
            self._slots[held_by][1] += 1  # its group grew
        self._changed = True

    def _plan_stage(self, now: float, *, recluster: bool = True) -> None:
        """Recluster the groups when it is due, and re-plan when a trigger fires (with a
        wall-time budget, not in the step that reclustered: the new groups are placed first at
        the next step, and the plan at the one after)."""
        if recluster and self.grouper.needs_recluster(now):
            self.queues.sync(self.grouper.recluster(now))
            self._slots = {}
            if self._measure:  # the new groups are placed first at the next step, then a plan
                self._changed = True
                self._owed = "place"
                return
            self._place_unassigned()
            self._changed = True
        trigger = self._trigger(now)
        if trigger:
            try:
                self.plan(now, trigger)
            except Exception:  # keep serving in the current order; the next trigger retries
                log.exception("planning (%s) failed; keeping the current virtual queues", trigger)
                self._last_plan_s = now

    def _place_unassigned(self) -> None:
        """Each group no queue holds (new from a recluster) at its deadline slot (``_place``)."""
        for gid in self.queues.unassigned():
            self._place(gid, self.grouper.peek(gid))

    def _forget(self, request_id: str) -> None:
        """A cancelled request: out of its group if it waits, out of the agents' books if sent."""
        self._inbox.pop(request_id, None)
        if self.grouper.group_of(request_id) is not None:
            self.queues.remove_request(request_id)
            self._changed = True
        self.books.forget(request_id)
        self.estimator.forget([request_id])

    def learn_output(self, request: Request, output_tokens: int) -> bool:
        """``Policy.learn_output``: the output-length belief only."""
        self.estimator.observe(request, output_tokens=output_tokens)
        return True

    def take_plans(self) -> list[PlanRecord]:
        """``Policy.take_plans``: the plans made since the last call, handed over once."""
        plans, self._new_plans = self._new_plans, []
        return plans

    def snapshot(self, now: float) -> VirtualQueuesSnapshot:
        """``Policy.snapshot``: the virtual queues with the planner's predictions
        (``estimates``), a group at risk when its ``P(meet SLO)`` is below Δ."""
        groups, drain = self.estimates(now)
        queues = self.queues.snapshot(groups, drain, self.config.delta)
        return VirtualQueuesSnapshot(now, self.config.delta, tuple(queues))

    # --- planning --------------------------------------------------------------------------------

    def _trigger(self, now: float) -> str:
        up = frozenset(i.name for i in self._instances if i.up)
        if not len(self.grouper):
            self._up = up
            return ""
        if up != self._up:
            return "instances"  # a failure or a join is acted on at once
        gap = self.config.min_interval_s
        if self._measure:
            gap = max(gap, self.config.keep_up * self._last_plan_cost_s)
        if now - self._last_plan_s < gap:
            return ""
        # (A down instance has left the virtual queues: only the up ones are asked.)
        up_loads = [i for i in self._instances if i.up]
        if any(self.queues.queue(i.name) for i in up_loads) and any(
            not self.queues.queue(i.name) and i.outstanding_requests == 0 for i in up_loads
        ):
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
        served = {m for i in self._instances if i.up for m in i.models}
        for g in self.grouper.groups():  # not on any up instance: the planner places them
            if g.id not in index and g.model in served:  # (else they wait for an instance)
                index[g.id] = len(groups)
                groups.append((g.id, g.requests, g.tier))
        return groups, [o for o, i in zip(current, self._instances, strict=True) if i.up]

    def _family(self, now: float) -> tuple[ProblemFamily, list[list[int]]]:
        key = (now, self._plans_made)
        if self._family_cache is not None and self._family_cache[0] == key:
            return self._family_cache[1]  # the violation check's, in the same step: same draws
        groups, current = self._groups()
        # What the estimator keeps of a group's requests goes when the group ends, not while no
        # instance is up to plan it on.
        self.estimator.keep_group_loads(self.grouper.group_ids())
        rng = np.random.default_rng((self.config.seed, self._plans_made))
        family = build_family(
            groups, self._instances, self._ready(now), self.estimator, self.config, rng, now
        )
        self._family_cache = (key, (family, current))
        return family, current

    def fix_concurrency(self, limit: int) -> None:
        """Hold every instance's concurrency limit at ``limit`` (capped at what it runs at most)
        instead of choosing it: a yardstick for the choice."""
        check_setting(limit >= 1, "concurrency limit", ">= 1", limit)
        self._fixed = limit

    def _choice(self, family: ProblemFamily) -> list[int]:
        """Each instance's current concurrency limit (its largest before the first plan)."""
        if self._fixed is not None:
            fixed = self._fixed
            return [
                max([b for b in limits if b <= fixed] or [limits[0]]) for limits in family.batches
            ]
        return [
            self.admission.limits.get(inst.name, limits[-1])
            if self.admission.limits.get(inst.name) in limits
            else limits[-1]
            for inst, limits in zip(family.instances, family.batches, strict=True)
        ]

    def _deferred_in(self, name: str, gids: Sequence[str]) -> set[str]:
        """The groups of ``gids`` that ``name``'s admission defers (``defer_expensive``)."""
        fluid = self.admission.fluids.get(name)
        if fluid is None or not fluid.admission.threshold:
            return set()
        out: set[str] = set()
        for gid in gids:
            reqs = self.grouper.group(gid).requests
            density = fluid.density(reqs, self.estimator.expected_output(reqs[0]))
            if density is not None and fluid.admission.defers(density):
                out.add(gid)
        return out

    def _predicts_violation(self, now: float) -> bool:
        """Some admitted group is predicted to miss its chance constraint where it is (a
        deferred one is expected to)."""
        family, current = self._family(now)
        if len(family.groups) != sum(len(o) for o in current):
            return True  # some group has no queue
        problem = family.problem(self._choice(family))
        up = [i for i in self._instances if i.up]
        risks = []
        for g, order in enumerate(current):
            score = score_queue(problem, g, order)
            done = score.completion if score.completion is not None else np.zeros((0, 1))
            for k, i in enumerate(order):
                gid = family.groups[i].id
                if gid not in self.admission.deferred:
                    risks.append(
                        Violation(
                            gid,
                            up[g].name,
                            k,
                            float(score.p_meet[k]),  # over the planner's scenarios
                            float(done[k].mean()),
                            float(problem.deadline[i]),
                        )
                    )
        # P(meet) below Δ, counted as the plan's chance constraint counts it: fewer scenarios
        # met than ``required_ok`` (the same test, without Δ·S's rounding).
        return bool(violations(risks, problem.required_ok / problem.scenarios))

    def estimates(self, now: float) -> tuple[dict[str, GroupPrediction], dict[str, float]]:
        """What the planner's model predicts of the current virtual queues: per group
        ``(mean, std, P(meet SLO))`` of its completion (its last request's) over the scenarios,
        and per instance when its queue drains. For operators and clients, not for decisions."""
        if not len(self.grouper):
            return {}, {i.name: now for i in self._instances if i.up}
        family, current = self._family(now)
        problem = family.problem(self._choice(family))
        groups: dict[str, GroupPrediction] = {}
        drain: dict[str, float] = {}
        for g, order in enumerate(current):
            score = score_queue(problem, g, order)
            done = score.completion if score.completion is not None else np.zeros((0, 1))
            for k, i in enumerate(order):
                row = done[k]
                groups[problem.groups[i].id] = GroupPrediction(
                    float(row.mean()),
                    float(row.std()),
                    float(score.p_meet[k]),
                )
            drain[problem.instances[g].name] = (
                float(done[-1].mean()) if len(order) else problem.instances[g].ready_s
            )
        return groups, drain

    def plan(self, now: float, trigger: str = "manual") -> PlanRecord:
        """Re-plan every waiting group now and apply the plan to the virtual queues: first each
        instance's concurrency limit and admission (``qlm.planner.concurrency``), then order and assignment of the
        admitted groups by the solver; deferred groups wait behind them, earliest deadline first."""
        started = self._clock()
        family, current = self._family(now)
        self._plans_made += 1
        choice = self._choice(family)
        choose = self.config.choose_concurrency and self._fixed is None
        fluid = self._fluid_models.evaluate(
            now,
            family,
            self._instances,
            self._arrivals,
            self._plans_made,
            self.config.budget.start(self._clock).part(FLUID_SHARE),
        )
        best = (
            choose_limits(
                family, fluid, choice, self.admission.limits, self.config.concurrency_hysteresis
            )
            if choose
            else choice
        )
        # Deferral waits for half a rate window of history: a first burst is not a rate.
        settled = now - self._arrivals.first_s >= self.config.rate_window_s / 2
        for inst, b, fluids in zip(family.instances, best, fluid, strict=True):
            self.admission.limits[inst.name] = b
            if self.config.defer_expensive and fluids is not None and settled:
                self.admission.fluids[inst.name] = fluids[b]
            else:
                self.admission.fluids.pop(inst.name, None)
        # Cost-aware admission: a group its instance's admission defers, or that can no longer
        # meet its deadline, stays on that instance behind every admitted group; the solver
        # orders and places the admitted ones only.
        deferred: dict[str, list[int]] = {}
        self.admission.deferred = set()
        full = family.problem(best)
        for g, (inst, order) in enumerate(zip(family.instances, current, strict=True)):
            gids = self._deferred_in(inst.name, [family.groups[i].id for i in order])
            late = hopeless(full, g, now)
            gids -= in_time(full, g, order, now, late, family.groups)
            if inst.name in self.admission.fluids:
                gids |= {family.groups[i].id for i in order if late[i]}
            self.admission.deferred |= gids
            deferred[inst.name] = sorted(
                (i for i in order if family.groups[i].id in gids),
                key=lambda i: (bool(late[i]), family.groups[i].deadline_s, family.groups[i].id),
            )
        keep = [i for i, g in enumerate(family.groups) if g.id not in self.admission.deferred]
        problem = full if len(keep) == len(family.groups) else subset(full, keep)
        position = {i: k for k, i in enumerate(keep)}
        previous = [[position[i] for i in order if i in position] for order in current]
        # The search's deadline: the solver stops at SEARCH_SHARE of it, the capacity signal
        # has the rest.
        deadline = self.config.budget.start(self._clock)
        solution = solve(
            problem, deadline.part(SEARCH_SHARE), previous=previous, solver=self.config.solver
        )
        orders = {
            inst.name: [problem.groups[i].id for i in order]
            + [family.groups[i].id for i in deferred[inst.name]]
            for inst, order in zip(problem.instances, solution.plan, strict=True)
        }
        self.queues.set_orders(orders)
        self._last_plan_s = now
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
            capacity_needed=(
                capacity_needed(problem, hint=self._capacity_hint(), deadline=deadline)
                if solution.at_risk
                else 1.0
            ),
            solve_s=solution.solve_s,
            evaluations=solution.evaluations,
            concurrency=dict(self.admission.limits),
            deferred=len(self.admission.deferred),
        )
        self.last_plan = record
        self._new_plans.append(record)
        # What keeping up costs is the whole plan (problem, solve, concurrency, capacity), not
        # only the solver's share of it.
        self._last_plan_cost_s = self._clock() - started
        return record

    def _capacity_hint(self) -> float | None:
        last = self.last_plan.capacity_needed if self.last_plan is not None else None
        return last if last is not None and last > 1.0 else None

    def _ready(self, now: float) -> dict[str, float]:
        """When each instance's running work drains, in the fluid model: remaining expected output
        of its in-flight requests (each has had an equal share of the throughput so far)."""
        out: dict[str, float] = {}
        for inst in self._instances:
            running = self.books.inflight.get(inst.name, {})
            if not running or not inst.up:
                out[inst.name] = now
                continue
            n_run = len(running)
            work = 0.0
            for item in running.values():
                hw = self.estimator.profile.hardware_for(
                    item.request.model, inst.gpu, inst.gpu_count
                )
                per_token = hw.decode_s(n_run) * hw.inefficiency / n_run  # fluid share of a step
                done = item.generated + int(max(0.0, now - item.pulled_s) / (per_token * n_run))
                mean, _ = self.estimator.output_moments(
                    item.request, min(done, item.request.max_tokens - 1)
                )
                work += mean * per_token
            out[inst.name] = now + work * self.estimator.calibration_factors(inst.name)[0]
        return out

    def _place(self, gid: str, req: Request) -> None:
        """A new group between plans: on the eligible instance with the fewest waiting requests,
        at its deadline slot (its earliest deadline, end-to-end or first-token) among the admitted
        groups, or behind them all if the instance's admission defers it (the next plan revisits
        it)."""
        able = [i for i in self._instances if i.up and req.model in i.models]
        if not able:
            return  # no instance serves it now; it waits for one (the planner places it)

        def slots(name: str) -> list[Any]:
            # [deadlines of the admitted groups in queue order, waiting + in flight, queue length]
            entry = self._slots.get(name)
            if entry is None:
                gids = self.queues.queue(name)
                admitted = [self.grouper.group(g) for g in gids if g not in self.admission.deferred]
                entry = self._slots[name] = [
                    [g.due_s for g in admitted],
                    sum(self.grouper.group(g).size for g in gids)
                    + len(self.books.inflight.get(name, {})),
                    len(gids),
                ]
            return entry

        target = min(able, key=lambda i: (slots(i.name)[1], i.name))
        deadlines, _, length = entry = slots(target.name)
        group = self.grouper.group(gid)
        entry[1] += group.size
        entry[2] += 1
        self.admission.deferred.discard(gid)
        if self._deferred_in(target.name, [gid]):
            self.admission.deferred.add(gid)
            self.queues.assign(gid, target.name, length)
            return
        deadline = group.due_s
        pos = 0
        while pos < len(deadlines) and deadlines[pos] <= deadline:
            pos += 1
        self.queues.assign(gid, target.name, pos)
        deadlines.insert(pos, deadline)

    # --- acting ---------------------------------------------------------------------------------

    def _act(self, now: float, deadline: float = math.inf) -> list[Decision]:
        """Per instance: swap back in what waits in CPU memory when it is the most urgent, pull the
        head group's requests while there is room, then make room for the head group if it is at
        risk (``qlm.agents.make_room``). Before ``deadline`` on the policy's clock: each instance
        has its share of the time left (and one pull at least); what does not fit is pulled at
        the next step."""
        decisions: list[Decision] = []
        up = [load for load in self._instances if load.up]
        bounded = math.isfinite(deadline)
        for k, load in enumerate(up):
            until = math.inf
            if bounded:
                now_s = self._clock()
                until = now_s + max(deadline - now_s, 0.0) / (len(up) - k)
            swapped = self.books.swapped.setdefault(load.name, {})
            parked = sum(prompt_tokens(x.request, x.generated) for x in swapped.values())
            limit = self.admission.limits.get(load.name, load.max_running)
            fluid = self.admission.fluids.get(load.name)
            self._buckets.setdefault(load.name, TokenBucket()).refill(
                now, fluid.admission.spare if fluid is not None else 0.0
            )
            inst = replace(
                load,
                max_running=min(load.max_running, limit),
                outstanding_requests=load.outstanding_requests - len(swapped),
                outstanding_tokens=load.outstanding_tokens - parked,
            )
            count, tokens = self._pull_ahead(now, load, inst, decisions)
            while not (count and bounded and self._clock() >= until):
                req = self.queues.next_request(inst.name)
                back = min(  # (one of another model waits for its model: ``_tiers``)
                    (x for x in swapped.values() if x.request.model == load.active_model),
                    key=lambda x: x.request.deadline_s,
                    default=None,
                )
                if back is not None and (req is None or back.request.deadline_s <= req.deadline_s):
                    need = prompt_tokens(back.request, back.generated)
                    if not has_room(inst, count, tokens, need):
                        break
                    del swapped[back.request.id]
                    self.books.inflight[inst.name][back.request.id] = back
                    count += 1
                    tokens += need
                    decisions.append(SwapIn(back.request.id, inst.name))
                    continue
                if req is None:
                    break
                need = prompt_tokens(req, self.books.generated.get(req.id, 0))
                if not has_room(inst, count, tokens, need):
                    break
                verdict = self._may_pull(
                    inst.name, req, idle=inst.outstanding_requests + count == 0
                )
                if verdict is None:
                    continue  # a deferred group went behind the admitted ones: a new head
                if not verdict:
                    break
                self.queues.pop_next(inst.name)
                self._remember(now, load, req)
                count += 1
                tokens += need
                self.books.inflight[inst.name][req.id] = Inflight(
                    req, now, self.books.generated.get(req.id, 0)
                )
                decisions.append(Pull(req.id, inst.name))
            free = max(0, inst.max_running - inst.outstanding_requests - count)
            decisions.extend(self._make_room(now, load, free))
            if self.config.agent.warm_start and len(load.models) > 1:
                decisions.extend(self._tiers(load))
        return decisions

    def _pull_ahead(
        self, now: float, load: InstanceLoad, inst: InstanceLoad, decisions: list[Decision]
    ) -> tuple[int, int]:
        """Pulls that do not wait for the plan's order or for a slot under the concurrency limit;
        how many requests and prompt tokens they took.

        - *Starvation guard* (``PlannerConfig.max_wait_s``): a request that has waited its
          tier's maximum since its arrival is pulled first, oldest first, within the
          concurrency limit (``Pull.overdue`` when the plan would not have pulled it next).
        - *First tokens*: a request at the head of the queue whose TTFT deadline would pass while
          it waits for a slot under the concurrency limit, and can still be met, is pulled
          beyond the limit (within the engine's ``max_num_seqs`` and KV cache): a slot frees at
          the pace the running requests complete (``_slot_waits``). The line behind the head
          counts: the head is pulled ahead while some request among the first ``MAX_LINE``
          with a TTFT deadline would miss it waiting for its slot."""
        count = tokens = 0
        if self.config.max_wait_s:
            count, tokens = self._pull_overdue(now, load, inst, decisions)
        engine = replace(inst, max_running=max(inst.max_running, load.max_running))
        waits: list[float] | None = None
        while True:
            req = self.queues.next_request(inst.name)
            if req is None or self._first_token(now, load, req) is None:
                break
            need = prompt_tokens(req)
            if has_room(inst, count, tokens, need) or not has_room(engine, count, tokens, need):
                break  # the plan's pull takes it now, or the engine has no room either
            if waits is None:
                waits = self._slot_waits(now, load)
            over = max(0, inst.outstanding_requests + count - inst.max_running)
            if not self._first_tokens_late(now, load, inst.name, waits[over:]):
                break
            self.queues.pop_next(inst.name)
            self._remember(now, load, req)
            count += 1
            tokens += need
            self.books.inflight[inst.name][req.id] = Inflight(req, now, 0)
            decisions.append(Pull(req.id, inst.name))
        return count, tokens

    def _first_token(self, now: float, load: InstanceLoad, req: Request) -> float | None:
        """The latest time ``req`` may be pulled for its first token to meet its TTFT deadline
        on ``load`` (its prefill and the decode step it rides); None when it has no TTFT SLO left
        to meet, its group is deferred, or it is too late already."""
        if req.slo.ttft_s is None or req.id in self.books.generated:
            return None
        if self.grouper.group_of(req.id) in self.admission.deferred:
            return None
        hw = self.estimator.profile.hardware_for(req.model, load.gpu, load.gpu_count)
        running = max(len(self.books.inflight.get(load.name, {})), 1)
        latest = req.arrival_s + req.slo.ttft_s - hw.prefill_s(req.input_tokens)
        latest -= hw.decode_s(running) * hw.inefficiency
        return latest if latest >= now else None

    def _first_tokens_late(
        self, now: float, load: InstanceLoad, name: str, waits: Sequence[float]
    ) -> bool:
        """Whether some request in the line at the head of ``name``'s queue (requests with a TTFT
        deadline it can still meet, in queue order) would miss it waiting for its slot: the
        ``j``-th in line gets the slot ``waits[j]`` from now (none when its pace is unknown)."""
        if not waits:
            return False
        j = 0
        for gid in self.queues.queue(name):
            for req in self.grouper.group(gid).requests:
                latest = self._first_token(now, load, req)
                if latest is None or j >= MAX_LINE:
                    return False
                if j >= len(waits) or now + waits[j] > latest:
                    return True
                j += 1
        return False

    def _pull_overdue(
        self, now: float, load: InstanceLoad, inst: InstanceLoad, decisions: list[Decision]
    ) -> tuple[int, int]:
        """The starvation guard of ``_pull_ahead``."""
        limits = self.config.max_wait_s
        overdue: list[Request] = []
        for gid in self.queues.queue(inst.name):
            group = self.grouper.group(gid)
            limit = limits.get(group.tier)
            if limit is None:
                continue
            for r in group.requests:  # (in arrival order)
                if now - r.arrival_s < limit:
                    break
                overdue.append(r)
        count = tokens = 0
        for req in sorted(overdue, key=lambda r: (r.arrival_s, r.id)):
            need = prompt_tokens(req, self.books.generated.get(req.id, 0))
            if not has_room(inst, count, tokens, need):
                break
            head = self.queues.head_group(inst.name)
            of = self.grouper.group_of(req.id)
            promoted = (
                of != head
                or of in self.admission.deferred
                or self.queues.next_request(inst.name) is not req
            )
            self.queues.remove_request(req.id)
            self._changed = True
            self._remember(now, load, req)
            count += 1
            tokens += need
            self.books.inflight[inst.name][req.id] = Inflight(
                req, now, self.books.generated.get(req.id, 0)
            )
            decisions.append(Pull(req.id, inst.name, overdue=promoted))
        return count, tokens

    def _slot_waits(self, now: float, load: InstanceLoad) -> list[float]:
        """Seconds until the 1st, 2nd, … slot of the instance frees (a running request
        completes), at the pace of its last ``RECENT_FINISHES`` completions (the time since the
        oldest of them over their number); before it has had 4, each running request completes
        at the rate ``1 / remaining`` (its expected remaining output at the batch's time per
        token), so the k-th completion comes after ``k / Σ 1/remaining``."""
        running = self.books.inflight.get(load.name, {})
        n_run = max(len(running), load.outstanding_requests)
        slots = n_run + MAX_LINE  # (the requests pulled meanwhile complete at the same pace)
        recent = self.books.finishes.get(load.name)
        if recent is not None and len(recent) >= 4:
            gap = max(now - recent[0], 0.0) / len(recent)
            return [(k + 1) * gap for k in range(slots)]
        if not running:
            return []  # nothing known of its pace
        eps_f = self.estimator.calibration_factors(load.name)[1]
        rate = 0.0
        for item in running.values():
            hw = self.estimator.profile.hardware_for(item.request.model, load.gpu, load.gpu_count)
            per_token = hw.decode_s(n_run) * hw.inefficiency * eps_f
            done = item.generated + int(max(0.0, now - item.pulled_s) / per_token)
            left, _ = self.estimator.output_moments(
                item.request, min(done, item.request.max_tokens - 1)
            )
            rate += 1.0 / max(left * per_token, per_token)
        return [(k + 1) / rate for k in range(slots)]

    @staticmethod
    def _estimator_instance(load: InstanceLoad) -> EstimatorInstance:
        warm = frozenset(m for m, tier in load.model_tiers if tier is ModelTier.WARM)
        return EstimatorInstance(
            load.name,
            load.gpu,
            load.gpu_count,
            load.active_model,
            warm,
            preemptions_total=load.preemptions_total,
        )

    def _remember(self, now: float, load: InstanceLoad, req: Request) -> None:
        """Predict the completion of a request as it is pulled, behind what runs on the
        instance, and keep the prediction: its outcome teaches the estimator's online
        calibration of this instance (``RCTEstimator.observe``), which the plan problem, the
        drain times and making room use. In pull dispatch nothing waits inside the engine, so
        what it learns is the decode speed (ε), with the batch refilled from the virtual queue
        while it holds more work; the profile's Θ stays the planner's. A request pulled again
        (after an eviction) is judged on its latest pull."""
        running = [x.running for x in self.books.inflight.get(load.name, {}).values()]
        instance = self._estimator_instance(load)
        self.estimator.forget([req.id])
        queued = Queued(req, self.books.generated.get(req.id, 0))
        self.estimator.estimate_requests(
            instance,
            [*running, queued],
            now,
            remember=True,
            only=[-1],
            refilled=self.queues.next_request(load.name) is not None,
        )

    def _may_pull(self, name: str, req: Request, *, idle: bool) -> bool | None:
        """Admitted work is always pulled; deferred work at the pace of the instance's spare
        capacity (``qlm.planner.admission.TokenBucket``), or when the instance runs nothing at
        all (an idle GPU serves whatever waits). A deferred group at the head that
        must wait goes behind the admitted groups queued since the last plan (None: look at the
        new head)."""
        gid = self.grouper.group_of(req.id)
        if gid is None or gid not in self.admission.deferred:
            return True
        fluid = self.admission.fluids.get(name)
        if fluid is None:
            return True
        cost = fluid.cost(req, self.estimator.expected_output(req))
        if self._buckets[name].take(cost):
            return True
        if idle:
            self._buckets[name].level -= cost
            return True
        queue = self.queues.queue(name)
        if any(g not in self.admission.deferred for g in queue):
            self.queues.move_group(gid, name)  # to the tail, behind the admitted ones
            self._slots.pop(name, None)
            return None
        return False

    def _tiers(self, load: InstanceLoad) -> list[Decision]:
        """Warm start: model tiers from the virtual queue's order, behind the requests already
        sent that have not started (the oldest one's model first: a request waiting in the engine
        for a model that is switched away would wait for its return)."""
        models = [self.grouper.group(g).model for g in self.queues.queue(load.name)]
        tiers = dict(load.model_tiers)
        waiting = [  # sent, not started: they run before anything still in the queue
            x
            for x in self.books.inflight.get(load.name, {}).values()
            if x.request.id not in self.books.started
        ]
        if waiting:
            oldest = min(waiting, key=lambda x: (x.pulled_s, x.request.arrival_s, x.request.id))
            models = [oldest.request.model, *models]
        # A request swapped out to CPU memory resumes only on its model: it stays warm, and
        # becomes active when nothing else waits.
        parked = sorted(
            self.books.swapped.get(load.name, {}).values(), key=lambda x: x.request.deadline_s
        )
        models += [x.request.model for x in parked]
        changes = plan_tiers(
            load.name, models, tiers, dict(load.model_weights_gb), load.cpu_cache_gb
        )
        asked = self.books.asked_active.get(load.name)
        out: list[Decision] = []
        for c in changes:
            if c.tier is ModelTier.ACTIVE:
                if asked == c.model:
                    continue  # already switching to it
                self.books.asked_active[load.name] = c.model
            out.append(c)
        if tiers.get(asked or "") is ModelTier.ACTIVE:
            self.books.asked_active.pop(load.name, None)
        return out

    def _make_room(self, now: float, load: InstanceLoad, free: int) -> list[Decision]:
        """Preempt running requests for what waits at the head when it pays
        (``qlm.agents.make_room``): the head group waiting for slots, or — when the next model to
        run is not the active one — the requests waiting for the running batch to drain before
        the switch."""
        if not (self.config.agent.evict or self.config.agent.swap):
            return []
        inflight = self.books.inflight.get(load.name, {})
        running = {rid: x for rid, x in inflight.items() if rid in self.books.started}
        if not running or load.active_model is None:
            return []
        sent = sorted(
            (x for rid, x in inflight.items() if rid not in self.books.started),
            key=lambda x: (x.pulled_s, x.request.arrival_s, x.request.id),
        )
        gid = self.queues.head_group(load.name)
        group = self.grouper.group(gid) if gid is not None else None
        # The model the instance serves next (``_tiers``): the oldest sent request's, else the
        # head group's.
        target = sent[0].request.model if sent else (group.model if group else None)
        if target is None:
            return []
        switching = target != load.active_model
        weights = self.config.tier_weights
        if switching:
            waiting = [x.request for x in sent if x.request.model == target]
            if group is not None and group.model == target:
                waiting += list(group.requests[: max(0, free)])
            if not waiting:
                return []
            tiers = dict(load.model_tiers)
            hw_t = self.estimator.profile.hardware_for(target, load.gpu, load.gpu_count)
            switch_s = hw_t.warm_load_s if tiers.get(target) is ModelTier.WARM else hw_t.cold_load_s
        else:
            if group is None or group.size <= free:
                return []
            waiting = list(group.requests)
            switch_s = 0.0
        nxt = min(waiting, key=lambda r: r.deadline_s)
        hw = self.estimator.profile.hardware_for(load.active_model, load.gpu, load.gpu_count)
        hw_head = self.estimator.profile.hardware_for(nxt.model, load.gpu, load.gpu_count)
        eps_f = self.estimator.calibration_factors(load.name)[1]
        n_run = len(running)
        mix_in = sum(x.request.input_tokens for x in running.values()) * hw.input_token_work_s
        mix_out = sum(self.estimator.expected_output(x.request) for x in running.values())
        per_token = (
            hw.decode_s(n_run) * hw.inefficiency + n_run * mix_in / max(mix_out, 1.0)
        ) * eps_f
        head_token = per_token if not switching else hw_head.decode_s(len(waiting)) * eps_f
        head = HeadGroup(
            gid or "",
            nxt.deadline_s,
            len(waiting),
            hw_head.prefill_s(nxt.input_tokens) + self.estimator.expected_output(nxt) * head_token,
            weight=max(weights[r.tier] for r in waiting),
            deadlines=tuple(r.deadline_s for r in waiting),
            switching=switching,
            switch_s=switch_s,
        )
        views = []
        for item in running.values():
            began = item.started_s if item.started_s is not None else item.pulled_s
            done = item.generated + int(max(0.0, now - began) / per_token)
            done = min(done, item.request.max_tokens - 1)
            mean, _ = self.estimator.output_moments(item.request, done)
            views.append(
                RunningRequest(
                    item.request,
                    done,
                    mean * per_token,
                    self.books.preemptions.get(item.request.id, 0),
                    weights[item.request.tier],
                )
            )
        fluid = self.admission.fluids.get(load.name)
        costs = InstanceCosts(
            kv_bytes_per_token=hw.kv_bytes_per_token,
            host_link_gbs=load.host_link_gbs,
            swap_free_gb=load.swap_free_gb,
            prefill_base_s=hw.prefill_base_s,
            prefill_per_token_s=hw.prefill_per_token_s,
            gpu_second_value=fluid.admission.threshold if fluid is not None else 0.0,
        )
        out: list[Decision] = []
        for d in make_room(now, load.name, head, free, views, costs, self.config.agent):
            rid = d.request_id
            if isinstance(d, SwapOut):
                self.books.swapped.setdefault(load.name, {})[rid] = inflight.pop(rid)
            self.books.preemptions[rid] = self.books.preemptions.get(rid, 0) + 1
            out.append(d)
        return out
