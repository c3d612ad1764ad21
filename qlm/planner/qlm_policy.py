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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from qlm.agents.decide import (
    AgentConfig,
    HeadGroup,
    InstanceCosts,
    RunningRequest,
    make_room,
    plan_tiers,
)
from qlm.clock import work_seconds
from qlm.domain import (
    Decision,
    Evict,
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
from qlm.planner.admission import Admission, TokenBucket, admit
from qlm.planner.arrivals import ArrivalWindow, ClassKey, class_of
from qlm.planner.budget import Budget, Clock, Deadline
from qlm.planner.policy import (
    DispatchContext,
    InstanceLoad,
    ModelSwitching,
    has_room,
    prompt_tokens,
)
from qlm.planner.program import FloatArray, PlanGroup, PlanInstance, PlanProblem, score_queue
from qlm.planner.solve import Solution, capacity_needed, solve
from qlm.rct.estimator import EstimatorInstance, Queued, RCTEstimator, prompt_bin
from qlm.rct.profile import HardwareProfile, RctProfile, default_profile
from qlm.rct.trigger import Violation, violations
from qlm.virtual_queues import GroupPrediction, VirtualQueueSet, VirtualQueuesSnapshot

log = logging.getLogger(__name__)

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
    seed: int = 0
    step_budget_s: float = 0.5
    """With a wall-time ``budget`` (production): what a control step spends on work that can wait
    for the next one (the agents step at least every quarter of a second) — grouping arrivals in
    its first half, pulling in the second (each instance its share), a recluster or a plan only
    while the first half lasts (else first at the next step). A simulated run does it all."""
    grouping: GroupingConfig = DEFAULT_GROUPING
    """How requests are grouped (δ × average batch size bounds a group: ``DEFAULT_GROUPING``)."""

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
        ok = self.solver in ("auto", "cbc", "highs")
        check_setting(ok, "planner.solver", "auto, cbc or highs", self.solver)
        for name in (
            "period_s",
            "min_interval_s",
            "check_interval_s",
            "rate_window_s",
            "step_budget_s",
        ):
            value = getattr(self, name)
            check_setting(value > 0, f"planner.{name}", "> 0", value)
        ok = 0 < self.max_utilisation <= 1
        check_setting(ok, "planner.max_utilisation", "in (0, 1]", self.max_utilisation)
        ok = 0 <= self.concurrency_hysteresis < 1
        check_setting(
            ok, "planner.concurrency_hysteresis", "in [0, 1)", self.concurrency_hysteresis
        )


@dataclass(slots=True)
class _Inflight:
    request: Request
    pulled_s: float
    generated: int  # output tokens it had when pulled (resumed after an eviction)
    running: Queued = field(init=False)  # as the estimator sees it behind a new pull

    def __post_init__(self) -> None:
        self.running = Queued(self.request, self.generated, running=True)


@dataclass(frozen=True, slots=True)
class _Fluid:
    """The fluid model of one instance at one concurrency limit: the admission verdict and what
    a request of each class is worth and costs there."""

    admission: Admission
    class_value: dict[ClassKey, float]  # tier weight × P(meet SLO) of the class
    class_output: dict[ClassKey, float]  # mean output of the class's recent arrivals
    per_output_s: dict[str, float]  # GPU-seconds per output token, per model
    per_input_s: dict[str, float]  # GPU-seconds per prompt token, per model

    def cost(self, req: Request, output: float) -> float:
        key = class_of(req)
        out = self.class_output.get(key, output)
        return req.input_tokens * self.per_input_s.get(
            req.model, 0.0
        ) + out * self.per_output_s.get(req.model, 0.0)

    def density(self, requests: Sequence[Request], output: float) -> float | None:
        """Value per GPU-second of a group (None when its class has not arrived lately)."""
        key = class_of(requests[0])
        value = self.class_value.get(key)
        if value is None:
            return None
        cost = sum(self.cost(r, output) for r in requests) / len(requests)
        return value / max(cost, 1e-12)


CLASS_SAMPLE = 256
"""Recent arrivals of a request class whose lengths give the class's means (``_concurrency``)."""

FLUID_SHARE = 0.25
"""The share of the budget within which the concurrency choice re-evaluates instances (the least
recently evaluated first; the others keep their last evaluation), before the search."""

SEARCH_SHARE = 0.75
"""The share of the search's budget by which the solver stops; the capacity signal (computed
when some group is left at risk) has the rest."""

BATCH_CHOICES = (16, 32, 64, 96, 128, 192, 256, 384, 512)
"""Concurrency limits the planner considers for an instance (capped by its ``max_num_seqs``)."""


@dataclass(frozen=True)
class ProblemFamily:
    """The plan problem at every concurrency limit the planner may choose per instance.

    With ``b`` requests running, decode runs at ``decode_s(b)`` per step for all ``b`` (the
    profile), so a group's fluid work is its prompt work plus ``output × decode_s(b) / b``; its last
    request's latency floor is its prefill plus ``output × (decode_s(b) + b × refill)``, where
    ``refill`` is the prompt work per output token of the waiting mix (chunked prefill shares each
    step with decode). A larger ``b`` drains faster and makes every request slower: the trade-off
    the planner settles per instance.
    """

    groups: tuple[PlanGroup, ...]
    instances: tuple[PlanInstance, ...]
    batches: tuple[tuple[int, ...], ...]  # per instance, the limits it may use
    delta: float
    scenarios: _Scenarios
    speeds: tuple[_Speed, ...]  # per instance
    _terms: dict[tuple[_Speed, int], tuple[FloatArray, FloatArray]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def terms(self, g: int, b: int) -> tuple[FloatArray, FloatArray]:
        """Instance ``g``'s ``(work, floor)`` per group and scenario, ``(n, S)`` each, at limit
        ``b``: computed when first asked (a plan asks for one limit per instance) and shared by
        the instances alike in hardware and calibration."""
        key = (self.speeds[g], b)
        out = self._terms.get(key)
        if out is None:
            out = self._terms[key] = self.scenarios.terms(self.speeds[g], b)
        return out

    def problem(self, choice: Sequence[int]) -> PlanProblem:
        """The problem with instance ``g`` limited to ``choice[g]`` running requests."""
        n, q = len(self.groups), len(self.instances)
        s_count = self.scenarios.count
        proc = np.empty((n, q, s_count))
        floor = np.empty((n, q, s_count))
        for g, b in enumerate(choice):
            proc[:, g], floor[:, g] = self.terms(g, b)
        return PlanProblem(self.groups, self.instances, proc, floor, delta=self.delta)


@dataclass(frozen=True)
class _Speed:
    """What an instance's terms depend on: its models' hardware profiles and its calibration."""

    hardware: tuple[tuple[str, HardwareProfile], ...]
    wait_f: float
    eps_f: float


@dataclass(frozen=True, eq=False)
class _Scenarios:
    """The waiting groups' lengths, drawn once per family (``(n, S)`` output scenarios)."""

    models: npt.NDArray[np.str_]
    inputs: FloatArray
    last_inputs: FloatArray
    out_mean: FloatArray
    out_s: FloatArray
    last_s: FloatArray

    @property
    def count(self) -> int:
        return int(self.out_s.shape[1])

    def terms(self, speed: _Speed, b: int) -> tuple[FloatArray, FloatArray]:
        n, s_count = self.out_s.shape
        p_arr = np.full((n, s_count), np.inf)
        f_arr = np.full((n, s_count), np.inf)
        for m, hw in speed.hardware:
            rows = np.flatnonzero(self.models == m)
            if not len(rows):
                continue
            w_in = hw.input_token_work_s
            refill = w_in * self.inputs[rows].sum() / max(float(self.out_mean[rows].sum()), 1.0)
            dec = hw.decode_s(b) * hw.inefficiency
            p_arr[rows] = (
                self.inputs[rows, None] * w_in + self.out_s[rows] * dec / b
            ) * speed.wait_f
            f_arr[rows] = (hw.prefill_base_s + hw.prefill_per_token_s * self.last_inputs[rows])[
                :, None
            ] + self.last_s[rows] * (dec + b * refill) * speed.eps_f
        return p_arr, f_arr


def build_family(
    groups: Sequence[tuple[str, Sequence[Request], Tier]],
    instances: Sequence[InstanceLoad],
    ready_s: Mapping[str, float],
    estimator: RCTEstimator,
    config: PlannerConfig,
    rng: np.random.Generator,
) -> ProblemFamily:
    """The plan problems of the waiting groups (id, requests in FCFS order, tier) on the up
    instances, with scenarios of each group's output drawn from the estimator's posterior."""
    up = [i for i in instances if i.up]
    n, s_count = len(groups), config.scenarios
    z_total = rng.standard_normal((n, s_count))
    z_last = rng.standard_normal((n, s_count))
    loads = [estimator.group_load(gid, requests) for gid, requests, _ in groups]
    plan_groups = tuple(
        PlanGroup(gid, ld.model, ld.earliest_deadline_s, config.tier_weights[tier] * ld.size)
        for (gid, _, tier), ld in zip(groups, loads, strict=True)
    )
    out = np.array([[ld.output_mean, math.sqrt(ld.output_var)] for ld in loads]).reshape(n, 2)
    last = np.array([[ld.last_output_mean, math.sqrt(ld.last_output_var)] for ld in loads])
    out_s = np.maximum(out[:, :1] + out[:, 1:] * z_total, 0.0)  # (n, S)
    last_s = np.maximum(last.reshape(n, 2)[:, :1] + last.reshape(n, 2)[:, 1:] * z_last, 1.0)
    models = np.array([ld.model for ld in loads])
    inputs = np.array([ld.input_tokens for ld in loads], np.float64)
    last_inputs = np.array([ld.last_input_tokens for ld in loads], np.float64)
    scenarios = _Scenarios(models, inputs, last_inputs, out[:, 0], out_s, last_s)
    batches: list[tuple[int, ...]] = []
    speeds: list[_Speed] = []
    plan_instances: list[PlanInstance] = []
    for inst in up:
        wait_f, eps_f = estimator.calibration_factors(inst.name)
        limits = tuple(
            sorted({b for b in BATCH_CHOICES if b < inst.max_running} | {inst.max_running})
        )
        batches.append(limits)
        hws = {m: estimator.profile.hardware_for(m, inst.gpu, inst.gpu_count) for m in inst.models}
        speeds.append(_Speed(tuple(hws.items()), wait_f, eps_f))
        switch = {m: 0.0 if m == inst.active_model else hws[m].warm_load_s for m in inst.models}
        plan_instances.append(
            PlanInstance(inst.name, inst.models, inst.active_model, ready_s[inst.name], switch)
        )
    return ProblemFamily(
        plan_groups,
        tuple(plan_instances),
        tuple(batches),
        config.delta,
        scenarios,
        tuple(speeds),
    )


def _subset(problem: PlanProblem, rows: Sequence[int]) -> PlanProblem:
    """The same problem over the groups at ``rows`` only."""
    idx = np.asarray(rows, dtype=np.int64)
    return PlanProblem(
        tuple(problem.groups[i] for i in rows),
        problem.instances,
        problem.proc[idx],
        problem.floor[idx],
        delta=problem.delta,
        risk_weight=problem.risk_weight,
        flow_weight=problem.flow_weight,
    )


def hopeless(problem: PlanProblem, g: int, now: float) -> npt.NDArray[np.bool_]:
    """Per group, whether it misses its deadline on instance ``g`` even started now and in its
    luckiest scenario: its last request's latency floor alone takes it past the deadline. Such
    work is lost to its SLO whatever the plan; serving it before work that can still make it
    (as earliest-deadline-first would: it has the earliest deadlines) only spreads the loss."""
    return np.asarray(problem.floor[:, g].min(axis=1) + now > problem.deadline)


SLACK_MARGIN = 1.3
"""A group the admission would defer keeps its place if, served earliest deadline first behind
everything due before it, it completes within ``1 / SLACK_MARGIN`` of the time left to its
deadline (median scenario)."""


def in_time(
    problem: PlanProblem,
    g: int,
    order: Sequence[int],
    now: float,
    late: npt.NDArray[np.bool_],
    groups: Sequence[PlanGroup],
) -> set[str]:
    """The groups of ``order`` (on instance ``g``) that still complete well before their
    deadline if everything on the instance is served earliest deadline first (median scenario;
    groups past saving take no time). Cost-aware admission's knapsack counts capacity per second
    in steady state; it does not see that a batch request due in five minutes can wait out a
    burst. Measured on W_B at 1.4×, where the instance is only just overloaded: without this
    the admission deferred standard and batch work the instance could have served in time
    (94.4 % of SLOs met against 97.0 %); at 1.8× it is neutral (85.2 → 85.4 %)."""
    work = np.median(problem.proc[:, g], axis=1)
    floor = np.median(problem.floor[:, g], axis=1)
    t = float(problem.ready[g])
    out: set[str] = set()
    for i in sorted(order, key=lambda i: (problem.deadline[i], groups[i].id)):
        if late[i]:
            continue
        t += float(work[i])
        finish = max(t, now + float(floor[i]))
        if now + SLACK_MARGIN * (finish - now) <= problem.deadline[i]:
            out.add(groups[i].id)
    return out


def pick_limit(values: Mapping[int, float], current: int | None, hysteresis: float) -> int:
    """The concurrency limit worth the most (the smallest of equals), unless ``current`` is
    within ``hysteresis`` (a fraction) of it: a change costs a transient the values do not see."""
    if not values:
        raise ValueError("no concurrency limit to choose from")
    limits = sorted(values)
    best = limits[0]
    for b in limits[1:]:
        if values[b] > values[best] * (1 + 1e-9):
            best = b
    threshold = values[best] * (1.0 - hysteresis)
    if current is not None and values.get(current, -math.inf) >= threshold:
        return current
    return best


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
        self._inflight: dict[str, dict[str, _Inflight]] = {}
        self._generated: dict[str, int] = {}
        self._instances: tuple[InstanceLoad, ...] = ()
        self._up: frozenset[str] = frozenset()
        self._last_plan_s = -math.inf
        self._last_check_s = -math.inf
        self._last_plan_cost_s = 0.0
        self._changed = False
        self._plans_made = 0
        self._batch: dict[str, int] = {}  # concurrency limit per instance, chosen by the planner
        self._fixed: int | None = None  # fix_concurrency
        self._admission: dict[str, _Fluid] = {}  # per instance, at its limit (defer_expensive)
        self._deferred: set[str] = set()  # groups waiting behind all admitted ones
        self._buckets: dict[str, TokenBucket] = {}  # per instance, paces deferred work
        self._arrivals = ArrivalWindow(CLASS_SAMPLE)  # the last rate_window_s
        self._started: set[str] = set()  # in flight and running in the engine (KV allocated)
        self._swapped: dict[str, dict[str, _Inflight]] = {}  # per instance, KV in CPU memory
        self._preemptions: dict[str, int] = {}
        self._asked_active: dict[str, str] = {}  # model each instance was told to activate
        self._slots: dict[str, list[Any]] = {}  # per step: queue deadlines and load, for _place
        self._family_cache: tuple[tuple[float, int], tuple[ProblemFamily, list[list[int]]]] | None
        self._family_cache = None  # per step: the plan problem built for the violation check
        self._inbox: dict[str, tuple[Request, int]] = {}  # handed, not grouped yet (output so far)
        # Per instance: the plan that last evaluated its fluid model, and that evaluation.
        self._fluids: dict[str, tuple[int, dict[int, _Fluid] | None]] = {}
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
        arrivals —, then the agents act in the second half."""
        now = ctx.now
        self._observe(ctx)
        wall = self._measure
        start = self._clock() if wall else 0.0
        half = self.config.step_budget_s / 2
        owed, self._owed = self._owed, ""
        if owed:
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
            self._inflight.setdefault(inst.name, {})
            if inst.up and inst.name not in held:
                self.queues.add_instance(inst.name)
            elif not inst.up and inst.name in held:
                # Fault isolation: its groups go back to the planner (the trigger "instances"
                # re-plans them onto the others); its requests come back through ``arrived``.
                self.queues.drop_instance(inst.name)
                self._batch.pop(inst.name, None)
        self._started.update(ctx.started)
        for inst in ctx.instances:  # preemptions counted before the completions they come with
            self.estimator.watch(self._view(inst))
        for done in ctx.finished:
            self._inflight.get(done.instance, {}).pop(done.request.id, None)
            self._swapped.get(done.instance, {}).pop(done.request.id, None)
            self._generated.pop(done.request.id, None)
            self._started.discard(done.request.id)
            self._preemptions.pop(done.request.id, None)
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
        sent_before = [
            s for s in (*self._inflight.values(), *self._swapped.values()) if req.id in s
        ]
        back = bool(sent_before) or req.id in self._generated
        if not back and not generated:  # new: not one coming back to run again
            self._arrivals.add(now, req)
        for sent in sent_before:
            sent.pop(req.id, None)  # an evicted request comes back
        self._started.discard(req.id)
        if generated:
            self._generated[req.id] = generated
        else:  # started over (or never started): nothing of an earlier attempt is kept
            self._generated.pop(req.id, None)
        gid = self.grouper.add(req, now)
        held_by = self.queues.instance_of(gid)
        if held_by is None:
            self._place(gid, req)
        elif held_by in self._slots:
            self._slots[held_by][1] += 1  # its group grew
        self._changed = True

    def _plan_stage(self, now: float, *, recluster: bool = True) -> None:
        """Recluster the groups when it is due, and re-plan when a trigger fires (with a
        wall-time budget, not in the step that reclustered: the plan goes first at the next)."""
        if recluster and self.grouper.needs_recluster(now):
            self.queues.sync(self.grouper.recluster(now))
            self._slots = {}
            for gid in self.queues.unassigned():
                self._place(gid, self.grouper.peek(gid))
            self._changed = True
            if self._measure:
                self._owed = "plan"
                return
        trigger = self._trigger(now)
        if trigger:
            try:
                self.plan(now, trigger)
            except Exception:  # keep serving in the current order; the next trigger retries
                log.exception("planning (%s) failed; keeping the current virtual queues", trigger)
                self._last_plan_s = now

    def _forget(self, request_id: str) -> None:
        """A cancelled request: out of its group if it waits, out of the agents' books if sent."""
        self._inbox.pop(request_id, None)
        if self.grouper.group_of(request_id) is not None:
            self.queues.remove_request(request_id)
            self._changed = True
        for sent in (*self._inflight.values(), *self._swapped.values()):
            sent.pop(request_id, None)
        self._generated.pop(request_id, None)
        self._started.discard(request_id)
        self._preemptions.pop(request_id, None)
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
            groups, self._instances, self._ready(now), self.estimator, self.config, rng
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
            self._batch.get(inst.name, limits[-1])
            if self._batch.get(inst.name) in limits
            else limits[-1]
            for inst, limits in zip(family.instances, family.batches, strict=True)
        ]

    def _fluid(
        self, now: float, family: ProblemFamily, deadline: Deadline | None = None
    ) -> list[dict[int, _Fluid] | None]:
        """Per instance and concurrency limit, a steady-state fluid model of what keeps arriving
        (the last ``rate_window_s``; None for an instance none of it is for). A larger batch
        serves more requests per second and serves each one slower. For a limit ``b``, a request
        costs ``input × w_in + output × decode_s(b) / b`` GPU-seconds (its class's mean output)
        and its class (model, tier, SLO) meets its SLO alone with probability
        ``P(output × (decode_s(b) + b × refill) + prefill ≤ SLO)`` (the output posterior).
        Requests are admitted by value per GPU-second up to ``max_utilisation`` of the instance
        (``qlm.planner.admission``); the model gives the expected weighted SLOs met per second
        (which limit to use) and the value density below which work is deferred.

        Instances are evaluated the least recently evaluated first (one never evaluated before
        the others), one at least; once ``deadline`` is spent the others keep their last
        evaluation, or have none until their turn (their limit stays, their admission defers
        nothing)."""
        horizon = self.config.rate_window_s
        window = self._arrivals
        window.expire(now - horizon)
        span = max(min(horizon, now - window.first_s), 1.0)
        classes = window.classes()
        means: dict[ClassKey, tuple[float, float]] = {}
        # The output belief depends on the prompt's length: one request of each prompt bin
        # stands for the class's recent arrivals in it, weighted by their share.
        mix: dict[ClassKey, list[tuple[Request, float]]] = {}
        for key in classes:
            recent = window.recent(key)  # enough for a mean; bounded under a backlog
            means[key] = (
                sum(r.input_tokens for r in recent) / len(recent),
                sum(self.estimator.expected_output(r) for r in recent) / len(recent),
            )
            by_bin: dict[int, list[Request]] = {}
            for r in recent:
                by_bin.setdefault(prompt_bin(r.input_tokens), []).append(r)
            mix[key] = [(rs[-1], len(rs) / len(recent)) for rs in by_bin.values()]
        out: list[dict[int, _Fluid] | None] = [None] * len(family.instances)
        # Instances alike in models, hardware, limits and learnt decode speed have the same
        # fluid model: computed once (a fleet of replicas, before their speeds part).
        alike: dict[tuple[object, ...], dict[int, _Fluid] | None] = {}
        loads = {i.name: i for i in self._instances}
        self._fluids = {
            i.name: self._fluids[i.name] for i in family.instances if i.name in self._fluids
        }
        turn = sorted(
            range(len(family.instances)),
            key=lambda g: (self._fluids.get(family.instances[g].name, (-1, None))[0], g),
        )
        for k, g in enumerate(turn):
            inst, limits = family.instances[g], family.batches[g]
            ld = loads[inst.name]
            eps_f = self.estimator.calibration_factors(inst.name)[1]  # decode as observed
            same = (inst.models, ld.gpu, ld.gpu_count, limits, eps_f)
            if same in alike:
                out[g] = alike[same]
                self._fluids[inst.name] = (self._plans_made, out[g])
                continue
            if k > 0 and deadline is not None and deadline.spent():
                last = self._fluids.get(inst.name, (-1, None))[1]
                if last is not None and set(last) != set(limits):
                    last = None
                out[g] = last  # (None until its turn comes: its limit stays, nothing deferred)
                continue
            serving = {m: max(1, sum(m in i.models for i in family.instances)) for m in inst.models}
            keys = [k for k in classes if k[0] in inst.models]
            if not keys:
                out[g] = alike.setdefault(same, None)
                self._fluids[inst.name] = (self._plans_made, None)
                continue
            hws = {
                m: self.estimator.profile.hardware_for(m, ld.gpu, ld.gpu_count) for m in inst.models
            }
            # One row per class and prompt length, standing for its arrivals in the window.
            lengths = [window.counts(k) for k in keys]
            row = np.repeat(np.arange(len(keys)), [len(c) for c in lengths])
            inputs = np.array([n for c in lengths for n in c], np.float64)
            arrived = np.array([a for c in lengths for a in c.values()], np.float64)
            w_in = np.array([hws[k[0]].input_token_work_s for k in keys])[row]
            weights = arrived / np.array([span * serving[k[0]] for k in keys])[row]
            outputs = np.array([means[k][1] for k in keys])
            prompt_work = float(np.sum(inputs * w_in * weights))
            output_rate = float(np.sum(outputs[row] * weights))
            refill = prompt_work / max(output_rate, 1e-9)
            per_input = {m: hw.input_token_work_s for m, hw in hws.items()}
            fluids: dict[int, _Fluid] = {}
            for b in limits:
                per_output = {
                    m: hw.decode_s(b) * hw.inefficiency * eps_f / b for m, hw in hws.items()
                }
                per_out = np.array([per_output[k[0]] for k in keys])[row]
                costs = inputs * w_in + outputs[row] * per_out
                refill_b = refill
                # The refill is the prompt work of what is served: with deferral on, the
                # admitted work's, which depends on the SLOs the refill lets classes meet —
                # one more round settles it.
                for _ in range(2 if self.config.defer_expensive else 1):
                    class_value: dict[ClassKey, float] = {}
                    for key in keys:
                        model, tier, slo = key
                        hw = hws[model]
                        dec = hw.decode_s(b) * hw.inefficiency
                        per_token = (dec + b * refill_b) * eps_f
                        budget = (slo - hw.prefill_s(means[key][0])) / per_token
                        p_meet = sum(
                            share
                            * self.estimator.posterior(r).p_remaining_within(
                                budget, cap=r.max_tokens
                            )
                            for r, share in mix[key]
                        )
                        class_value[key] = self.config.tier_weights[tier] * p_meet
                    values = np.array([class_value[k] for k in keys])[row]
                    admission = admit(values, costs, weights, self.config.max_utilisation)
                    if not admission.threshold:
                        break
                    kept = values >= admission.threshold * costs
                    refill_b = float(np.sum((inputs * w_in * weights)[kept])) / max(
                        float(np.sum((outputs[row] * weights)[kept])), 1e-9
                    )
                fluids[b] = _Fluid(
                    admission, class_value, {k: means[k][1] for k in keys}, per_output, per_input
                )
            out[g] = alike.setdefault(same, fluids)
            self._fluids[inst.name] = (self._plans_made, fluids)
        return out

    def _concurrency(
        self, family: ProblemFamily, fluid: Sequence[dict[int, _Fluid] | None], choice: list[int]
    ) -> list[int]:
        """Each instance's concurrency limit: the one whose admitted work meets the most
        expected weighted SLOs per second (``_fluid``). A plan judged only on today's queue
        would pick a small batch that looks fast and then drown in what keeps arriving; this
        judges the stream instead. The current limit is kept unless another is worth
        more than ``concurrency_hysteresis`` more: every change costs a transient (a lower limit
        waits for running requests to drain, a higher one admits a burst of prompts whose prefills
        slow every running request), which the steady-state model does not see; without it the
        choice flips with the noise of the arrival window (measured on W_B at 1.8×: 74.2 % of
        SLOs met without hysteresis, 76.5 % with 5 %, 75.1 % with 15 %)."""
        out: list[int] = []
        for inst, fluids, current in zip(family.instances, fluid, choice, strict=True):
            if fluids is None:
                out.append(current)
                continue
            values = {b: f.admission.value for b, f in fluids.items()}
            out.append(
                pick_limit(values, self._batch.get(inst.name), self.config.concurrency_hysteresis)
            )
        return out

    def _deferred_in(self, name: str, gids: Sequence[str]) -> set[str]:
        """The groups of ``gids`` that ``name``'s admission defers (``defer_expensive``)."""
        fluid = self._admission.get(name)
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
                if gid not in self._deferred:
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
        instance's concurrency limit and admission (``_fluid``), then order and assignment of the
        admitted groups by the solver; deferred groups wait behind them, earliest deadline first."""
        started = self._clock()
        family, current = self._family(now)
        self._plans_made += 1
        choice = self._choice(family)
        choose = self.config.choose_concurrency and self._fixed is None
        fluid = self._fluid(now, family, self.config.budget.start(self._clock).part(FLUID_SHARE))
        best = self._concurrency(family, fluid, choice) if choose else choice
        # Deferral waits for half a rate window of history: a first burst is not a rate.
        settled = now - self._arrivals.first_s >= self.config.rate_window_s / 2
        for inst, b, fluids in zip(family.instances, best, fluid, strict=True):
            self._batch[inst.name] = b
            if self.config.defer_expensive and fluids is not None and settled:
                self._admission[inst.name] = fluids[b]
            else:
                self._admission.pop(inst.name, None)
        # Cost-aware admission: a group its instance's admission defers, or that can no longer
        # meet its deadline, stays on that instance behind every admitted group; the solver
        # orders and places the admitted ones only.
        deferred: dict[str, list[int]] = {}
        self._deferred = set()
        full = family.problem(best)
        for g, (inst, order) in enumerate(zip(family.instances, current, strict=True)):
            gids = self._deferred_in(inst.name, [family.groups[i].id for i in order])
            late = hopeless(full, g, now)
            gids -= in_time(full, g, order, now, late, family.groups)
            if inst.name in self._admission:
                gids |= {family.groups[i].id for i in order if late[i]}
            self._deferred |= gids
            deferred[inst.name] = sorted(
                (i for i in order if family.groups[i].id in gids),
                key=lambda i: (bool(late[i]), family.groups[i].deadline_s, family.groups[i].id),
            )
        keep = [i for i, g in enumerate(family.groups) if g.id not in self._deferred]
        problem = full if len(keep) == len(family.groups) else _subset(full, keep)
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
            concurrency=dict(self._batch),
            deferred=len(self._deferred),
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
            running = self._inflight.get(inst.name, {})
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
        at its deadline slot among the admitted groups, or behind them all if the instance's
        admission defers it (the next plan revisits it)."""
        able = [i for i in self._instances if i.up and req.model in i.models]
        if not able:
            return  # no instance serves it now; it waits for one (the planner places it)

        def slots(name: str) -> list[Any]:
            # [deadlines of the admitted groups in queue order, waiting + in flight, queue length]
            entry = self._slots.get(name)
            if entry is None:
                gids = self.queues.queue(name)
                admitted = [self.grouper.group(g) for g in gids if g not in self._deferred]
                entry = self._slots[name] = [
                    [g.earliest_deadline_s for g in admitted],
                    sum(self.grouper.group(g).size for g in gids)
                    + len(self._inflight.get(name, {})),
                    len(gids),
                ]
            return entry

        target = min(able, key=lambda i: (slots(i.name)[1], i.name))
        deadlines, _, length = entry = slots(target.name)
        group = self.grouper.group(gid)
        entry[1] += group.size
        entry[2] += 1
        self._deferred.discard(gid)
        if self._deferred_in(target.name, [gid]):
            self._deferred.add(gid)
            self.queues.assign(gid, target.name, length)
            return
        deadline = group.earliest_deadline_s
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
            swapped = self._swapped.setdefault(load.name, {})
            parked = sum(prompt_tokens(x.request, x.generated) for x in swapped.values())
            limit = self._batch.get(load.name, load.max_running)
            fluid = self._admission.get(load.name)
            self._buckets.setdefault(load.name, TokenBucket()).refill(
                now, fluid.admission.spare if fluid is not None else 0.0
            )
            inst = replace(
                load,
                max_running=min(load.max_running, limit),
                outstanding_requests=load.outstanding_requests - len(swapped),
                outstanding_tokens=load.outstanding_tokens - parked,
            )
            count = tokens = 0
            while not (count and bounded and self._clock() >= until):
                req = self.queues.next_request(inst.name)
                back = min(swapped.values(), key=lambda x: x.request.deadline_s, default=None)
                if back is not None and (req is None or back.request.deadline_s <= req.deadline_s):
                    need = prompt_tokens(back.request, back.generated)
                    if back.request.model != load.active_model or not has_room(
                        inst, count, tokens, need
                    ):
                        break
                    del swapped[back.request.id]
                    self._inflight[inst.name][back.request.id] = back
                    count += 1
                    tokens += need
                    decisions.append(SwapIn(back.request.id, inst.name))
                    continue
                if req is None:
                    break
                need = prompt_tokens(req, self._generated.get(req.id, 0))
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
                self._inflight[inst.name][req.id] = _Inflight(
                    req, now, self._generated.get(req.id, 0)
                )
                decisions.append(Pull(req.id, inst.name))
            free = max(0, inst.max_running - inst.outstanding_requests - count)
            decisions.extend(self._make_room(now, load, free))
            if self.config.agent.warm_start and len(load.models) > 1:
                decisions.extend(self._tiers(load))
        return decisions

    @staticmethod
    def _view(load: InstanceLoad) -> EstimatorInstance:
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
        running = [x.running for x in self._inflight.get(load.name, {}).values()]
        view = self._view(load)
        self.estimator.forget([req.id])
        queued = Queued(req, self._generated.get(req.id, 0))
        self.estimator.estimate_requests(
            view,
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
        if gid is None or gid not in self._deferred:
            return True
        fluid = self._admission.get(name)
        if fluid is None:
            return True
        cost = fluid.cost(req, self.estimator.expected_output(req))
        if self._buckets[name].take(cost):
            return True
        if idle:
            self._buckets[name].level -= cost
            return True
        queue = self.queues.queue(name)
        if any(g not in self._deferred for g in queue):
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
            for x in self._inflight.get(load.name, {}).values()
            if x.request.id not in self._started
        ]
        if waiting:
            oldest = min(waiting, key=lambda x: (x.pulled_s, x.request.arrival_s, x.request.id))
            models = [oldest.request.model, *models]
        changes = plan_tiers(
            load.name, models, tiers, dict(load.model_weights_gb), load.cpu_cache_gb
        )
        asked = self._asked_active.get(load.name)
        out: list[Decision] = []
        for c in changes:
            if c.tier is ModelTier.ACTIVE:
                if asked == c.model:
                    continue  # already switching to it
                self._asked_active[load.name] = c.model
            out.append(c)
        if tiers.get(asked or "") is ModelTier.ACTIVE:
            self._asked_active.pop(load.name, None)
        return out

    def _make_room(self, now: float, load: InstanceLoad, free: int) -> list[Decision]:
        if not (self.config.agent.evict or self.config.agent.swap):
            return []
        gid = self.queues.head_group(load.name)
        running = self._inflight.get(load.name, {})
        if gid is None or not running or self.grouper.group(gid).size <= free:
            return []
        group = self.grouper.group(gid)
        nxt = group.requests[0]
        hw = self.estimator.profile.hardware_for(nxt.model, load.gpu, load.gpu_count)
        eps_f = self.estimator.calibration_factors(load.name)[1]
        n_run = len(running)
        mix_in = sum(x.request.input_tokens for x in running.values()) * hw.input_token_work_s
        mix_out = sum(self.estimator.expected_output(x.request) for x in running.values())
        per_token = (
            hw.decode_s(n_run) * hw.inefficiency + n_run * mix_in / max(mix_out, 1.0)
        ) * eps_f
        head = HeadGroup(
            gid,
            group.earliest_deadline_s,
            group.size,
            hw.prefill_s(nxt.input_tokens) + self.estimator.expected_output(nxt) * per_token,
        )
        views = []
        for item in running.values():
            share = per_token
            done = item.generated + int(max(0.0, now - item.pulled_s) / share)
            done = min(done, item.request.max_tokens - 1)
            mean, _ = self.estimator.output_moments(item.request, done)
            views.append(
                RunningRequest(
                    item.request, done, mean * per_token, self._preemptions.get(item.request.id, 0)
                )
            )
        costs = InstanceCosts(
            kv_bytes_per_token=hw.kv_bytes_per_token,
            host_link_gbs=load.host_link_gbs,
            swap_free_gb=load.swap_free_gb,
            prefill_base_s=hw.prefill_base_s,
            prefill_per_token_s=hw.prefill_per_token_s,
        )
        out: list[Decision] = []
        for d in make_room(now, load.name, head, free, views, costs, self.config.agent):
            rid = d.request_id
            if isinstance(d, SwapOut) and rid not in self._started:
                if not self.config.agent.evict:
                    continue  # not running yet: no KV cache to swap, and eviction is off
                d = Evict(rid, load.name)  # not running yet: no KV cache to swap
            if isinstance(d, SwapOut):
                self._swapped.setdefault(load.name, {})[rid] = running.pop(rid)
            self._preemptions[rid] = self._preemptions.get(rid, 0) + 1
            out.append(d)
        return out
