"""QLM's own policy: request groups in virtual queues, ordered by the stochastic planner.

Every step runs four stages in order (``QlmPolicy.decide``): *observe* — instances joining or
leaving, completions teaching the RCT estimator, cancellations; *group* — arrivals are classified
into request groups (§4), and a group the queues do not hold yet is put on the least-loaded
instance serving its model at its deadline slot (a batch as large as a take-over's is grouped by
one re-clustering instead, ``BATCH_MIN``); *plan* — the groups are reclustered when due,
and when a trigger fires the planner re-orders and re-assigns every group (``build_family`` +
``solve``); *act* — each instance pulls from the head of its own virtual queue while it has room
(§5 *pull*, *load balancing*: a running request never migrates), makes room for an urgent head
group and warm-starts models. This module observes, groups and plans; the act stage is
``qlm.planner.act`` (``Agents``), and what the stages share is in ``qlm.planner.books``.

Triggers: a predicted violation (the estimator's completion distribution of the current
order gives some group ``P(meet) < Δ`` — checked when groups changed, at most every
``check_interval_s``), an instance joining, leaving or going idle while others have work, and the
period ``period_s`` otherwise. Never more often than ``min_interval_s`` nor, on the wall clock, than
``keep_up`` × the last plan's compute time (problem, solve, concurrency choice, capacity).

Bounds (production, where the budget is wall time, on the clock the policy is given): a whole
plan — the problem, the concurrency choice, admission, the solver and the capacity signal —
shares its ``budget`` (``qlm.planner.budget``), from its start; a step groups arrivals
and pulls within ``step_budget_s`` and leaves the rest, a recluster or a plan that did not fit,
to the next step. A simulated run, whose budget is counted in scored orders, does everything at
every step, so that it is the same on any machine.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from qlm.clock import work_seconds
from qlm.domain import (
    Decision,
    PlanRecord,
    Request,
)
from qlm.errors import RequestFailed, check_setting
from qlm.groups import Grouper, GroupingConfig, PredictOutput, default_predict_output
from qlm.planner.act import Acted, Agents, estimator_instance
from qlm.planner.admission import hopeless_all, in_time
from qlm.planner.arrivals import ArrivalRate, ArrivalWindow
from qlm.planner.books import AdmissionState, AgentBooks
from qlm.planner.budget import Clock
from qlm.planner.concurrency import (
    CLASS_SAMPLE,
    FLUID_SHARE,
    FluidModels,
    PromptRows,
    ServedWork,
    choose_limits,
    output_token_work_s,
    serving_count,
)
from qlm.planner.config import PlannerConfig
from qlm.planner.family import ProblemFamily, WaitingGroups, build_family
from qlm.planner.policy import (
    DispatchContext,
    InstanceLoad,
    ModelSwitching,
)
from qlm.planner.program import score_queue, subset
from qlm.planner.solve import Solution, capacity_needed, solve
from qlm.rct.estimator import RCTEstimator
from qlm.rct.profile import RctProfile, default_profile
from qlm.virtual_queues import GroupPrediction, VirtualQueueSet, VirtualQueuesSnapshot

log = logging.getLogger(__name__)


BATCH_MIN = 1000
BATCH_SHARE = 0.25
"""Handed at least ``BATCH_MIN`` requests to group, and at least ``BATCH_SHARE`` × the requests it
holds (a take-over of a backlog, or a flood), the policy groups them by one re-clustering of
every waiting request (``Grouper.add_many``) instead of classifying each: a re-clustering costs
a few microseconds per request held, an online classification tens per request added, so
from a quarter of what it holds on the re-clustering is the cheaper. Steps of a simulated run
hand it far fewer.

``BEHIND_SHARE``: with a wall-time budget, a step that ran out of its time for grouping with at
least ``BATCH_MIN`` requests left has fallen behind, and the next step takes them by one
re-clustering from this share of what the policy holds on: the requests a take-over hands over
last would otherwise be classified a few hundred a step (a 100,000-request take-over spent 80 s
of its 155 s so, on a loaded host)."""
BEHIND_SHARE = 1 / 16

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
        self._round_robin = self.config.placement == "round-robin"
        if self._round_robin:
            self.name = "qlm-rr"
        self._pins: dict[str, str] = {}  # round-robin placement: group -> its instance
        self._turn = 0
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
        self._arrivals = ArrivalWindow(CLASS_SAMPLE)  # the last rate_window_s
        self._arrival_rate = ArrivalRate(self.config.floor_window_s)  # (throughput floor only)
        self._backlogged_since: dict[str, float] = {}  # per instance: its queue held requests
        self._served = ServedWork(self.config.floor_window_s)  # (throughput floor only)
        self._slots: dict[str, list[Any]] = {}  # per step: queue deadlines and load, for _place
        self._family_cache: tuple[tuple[float, int], tuple[ProblemFamily, list[list[int]]]] | None
        self._family_cache = None  # per step: the plan problem built for the violation check
        self._family_cost_s = 0.0  # what building it took (wall-time budget only)
        # Handed, not grouped yet (output so far), oldest first: an OrderedDict pops its first
        # entry in constant time, where a dict's first entry is found past every one removed.
        self._inbox: OrderedDict[str, tuple[Request, int]] = OrderedDict()
        self._behind = False  # the last step left BATCH_MIN or more ungrouped (BEHIND_SHARE)
        self._fluid_models = FluidModels(self.estimator, self.config)  # the concurrency choice
        self._prompts = PromptRows()  # per group, its prompt lengths (admission's densities)
        self.agents = Agents(  # the act stage (``qlm.planner.act``)
            self.books,
            self.admission,
            self.queues,
            self.grouper,
            self.estimator,
            self.config,
            self._clock,
        )
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
        elif owed and self._batch_due():  # (planned after the batch: it changes every group)
            self._owed = owed
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
        acted = Acted()
        try:
            self.agents.act(
                now, self._instances, acted, start + self.config.step_budget_s if wall else math.inf
            )
        finally:  # (what the agents changed stays changed if the step fails part-way)
            if acted.requeued:
                self._changed = True
            for name in acted.reordered:
                self._slots.pop(name, None)
        return acted.decisions

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
        if self.config.throughput_floor:
            self._count_served(ctx)
        for inst in ctx.instances:  # preemptions counted before the completions they come with
            self.estimator.watch(estimator_instance(inst))
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
        oldest first, until ``until`` on the policy's clock (at least one); a batch
        (``BATCH_MIN``) all at once. How many it took."""
        if self._batch_due():
            self._behind = False
            return self._take_batch(now)
        taken = 0
        while self._inbox and not (taken and self._clock() >= until):
            taken += 1
            _, (req, generated) = self._inbox.popitem(last=False)
            try:
                self._take(now, req, generated)
            except Exception as exc:
                raise RequestFailed(req.id, exc) from exc
        self._behind = len(self._inbox) >= BATCH_MIN  # (only a bounded step leaves any)
        return taken

    def _batch_due(self) -> bool:
        waiting = len(self._inbox)
        share = BEHIND_SHARE if self._behind else BATCH_SHARE
        return waiting >= BATCH_MIN and waiting >= share * self.grouper.num_requests

    def _take(self, now: float, req: Request, generated: int) -> None:
        """Group one request handed to the policy and place its group if it is new."""
        admitted = self._admit(now, req, generated)
        if admitted is not None:
            self._classify(now, admitted)

    def _admit(
        self, now: float, req: Request, generated: int, known: set[str] | None = None
    ) -> Request | None:
        """A request handed to the policy, as it is grouped (None: it is held already).
        ``known``: the books' ``AgentBooks.known`` at the start of a batch, so that a new
        request is not looked for in every instance's books."""
        if self.grouper.group_of(req.id) is not None:
            return None  # handed again after a failed step: already held
        if known is None or generated or req.id in known:
            back = self.books.take_back(req.id, generated)
        else:
            back = False  # (nothing of it in the books: take_back would change nothing)
        if not back and not generated:  # new: not one coming back to run again
            self._arrivals.add(now, req)
            if self.config.throughput_floor:
                self._arrival_rate.add(now, req.model)
        if generated and req.slo.ttft_s is not None:
            # It has had its first token: only its e2e is due.
            req = replace(req, slo=replace(req.slo, ttft_s=None))
        return req

    def _classify(self, now: float, req: Request) -> None:
        """Classify one admitted request online and place its group if it is new."""
        gid = self.grouper.add(req, now)
        held_by = self.queues.instance_of(gid)
        if held_by is None:
            self._place(gid, req)
        elif held_by in self._slots:
            self._slots[held_by][1] += 1  # its group grew
        self._changed = True

    def _take_batch(self, now: float) -> int:
        """Group the whole inbox by one re-clustering (``BATCH_MIN``) and place every group
        it made new at its deadline slot. Should the re-clustering fail, each request is
        classified on its own, so that a request that breaks it is found and rejected alone.
        How many it took."""
        batch: list[tuple[Request, int]] = []  # admitted, with the output it resumes from
        taken = 0
        failed: RequestFailed | None = None
        known = self.books.known()  # (each request takes only itself out of the books)
        while self._inbox:
            _, (req, generated) = self._inbox.popitem(last=False)
            taken += 1
            try:
                admitted = self._admit(now, req, generated, known)
            except Exception as exc:  # the ones before it are taken; the rest wait
                failed = RequestFailed(req.id, exc)
                break
            if admitted is not None:
                batch.append((admitted, generated))
        try:
            result = self.grouper.add_many([req for req, _ in batch], now)
        except Exception:
            log.exception("grouping %d requests at once failed; classifying each", len(batch))
            self._classify_each(now, batch)
        else:
            self.queues.sync(result)
            self._slots = {}
            self._place_unassigned()
            self._changed = True
        if failed is not None:
            raise failed
        return taken

    def _classify_each(self, now: float, batch: Sequence[tuple[Request, int]]) -> None:
        """``_classify`` each of ``batch``; the first that fails is raised (``RequestFailed``)
        once the others are taken, and any other that fails waits in the inbox, first."""
        failed: list[tuple[Request, int, Exception]] = []
        for req, generated in batch:
            try:
                self._classify(now, req)
            except Exception as exc:
                failed.append((req, generated, exc))
        if failed:
            for req, generated, _ in reversed(failed[1:]):
                self._inbox[req.id] = (req, generated)
                self._inbox.move_to_end(req.id, last=False)
            first, _, cause = failed[0]
            raise RequestFailed(first.id, cause) from cause

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
        (``estimates``), a group at risk when its ``P(meet SLO)`` is below Δ, and deferred
        when the latest plan's admission put it behind the others."""
        groups, drain = self.estimates(now)
        queues = self.queues.snapshot(groups, drain, self.config.delta, self.admission.deferred)
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

    def _groups(self) -> tuple[WaitingGroups, list[list[int]]]:
        groups = WaitingGroups([], [], [])
        add_requests, add_tier = groups.requests.append, groups.tiers.append
        current: list[list[int]] = []
        index: dict[str, int] = {}
        view = self.grouper.group
        for inst in self._instances:
            order: list[int] = []
            if inst.up:
                gids = self.queues.queue(inst.name)
                start = len(groups)
                groups.ids.extend(gids)
                for g in map(view, gids):  # (one view at a time: none outlives the loop)
                    add_requests(g.requests)
                    add_tier(g.tier)
                order = list(range(start, len(groups)))
                index.update(zip(gids, order, strict=True))
            current.append(order)
        served = {m for i in self._instances if i.up for m in i.models}
        for gid in self.grouper.group_ids():  # not on any up instance: the planner places them
            if gid not in index:
                g = view(gid)
                if g.model in served:  # (else they wait for an instance)
                    index[gid] = len(groups)
                    groups.append(gid, g.requests, g.tier)
        return groups, [o for o, i in zip(current, self._instances, strict=True) if i.up]

    def _family(self, now: float) -> tuple[ProblemFamily, list[list[int]]]:
        key = (now, self._plans_made)
        if self._family_cache is not None and self._family_cache[0] == key:
            return self._family_cache[1]  # the violation check's, in the same step: same draws
        started = self._clock() if self._measure else 0.0
        groups, current = self._groups()
        # What the estimator keeps of a group's requests goes when the group ends, not while no
        # instance is up to plan it on.
        self.estimator.keep_group_loads(self.grouper.group_ids())
        self._prompts.keep(self.grouper.group_ids())
        rng = np.random.default_rng((self.config.seed, self._plans_made))
        pinned = None
        if self._round_robin:
            up = {i.name for i in self._instances if i.up}
            self._pins = {g: n for g, n in self._pins.items() if n in up}
            for gid, requests, _ in groups:
                if gid not in self._pins:
                    self._pin(gid, requests[0])
            pinned = self._pins
        family = build_family(
            groups, self._instances, self._ready(now), self.estimator, self.config, rng, now,
            pinned,
        )  # fmt: skip
        self._family_cache = (key, (family, current))
        self._family_cost_s = self._clock() - started if self._measure else 0.0
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

    def _count_served(self, ctx: DispatchContext) -> None:
        """Charge each completion's fluid-model work to its instance (``ServedWork``): its
        prompt at the profile's work per prompt token, its output at the decode time per token
        of the concurrency limit in use, as ``FluidModels.evaluate`` charges them."""
        work: dict[str, float] = {}
        loads = {i.name: i for i in ctx.instances}
        for done in ctx.finished:
            limit = self.admission.limits.get(done.instance)
            load = loads.get(done.instance)
            if limit is None or load is None:
                continue
            req = done.request
            hw = self.estimator.profile.hardware_for(req.model, load.gpu, load.gpu_count)
            eps_f = self.estimator.calibration_factors(done.instance)[1]
            per_output = output_token_work_s(hw, limit, eps_f)
            cost = req.input_tokens * hw.input_token_work_s + done.output_tokens * per_output
            work[done.instance] = work.get(done.instance, 0.0) + cost
        for inst in ctx.instances:
            limit = self.admission.limits.get(inst.name)
            full = inst.up and limit is not None and inst.outstanding_requests >= limit
            self._served.step(inst.name, ctx.now, full, work.get(inst.name, 0.0))

    def _keep_up_rates(
        self, now: float, family: ProblemFamily
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Per instance whose virtual queue has held requests at every plan of the last
        ``overload_after_s`` (an overload: a shorter burst is absorbed by the queue), the
        requests per second the throughput floor keeps up with (``choose_limits``): its share of
        the arrivals of the last ``floor_window_s`` (each model's shared evenly among the
        instances serving it) plus the rate that clears its virtual queue within that window;
        and how much more than the fluid model's rates it served meanwhile (``ServedWork``).
        The throughput tolerance applies to these instances only."""
        if not (self.config.throughput_floor or self.config.throughput_tolerance):
            return {}, {}  # (nothing reads them)
        rates = self._arrival_rate.rates(now)
        window = self.config.floor_window_s
        out: dict[str, float] = {}
        served: dict[str, float] = {}
        for inst in family.instances:
            queued = sum(map(self.grouper.size, self.queues.queue(inst.name)))
            if not queued:
                self._backlogged_since.pop(inst.name, None)
                continue
            since = self._backlogged_since.setdefault(inst.name, now)
            if now - since < self.config.overload_after_s:
                continue
            arriving = sum(rates.get(m, 0.0) / serving_count(family, m) for m in inst.models)
            out[inst.name] = arriving + queued / window
            if self.config.throughput_floor:
                least = self.config.rate_window_s  # (full that long: a rate to go by)
                served[inst.name] = self._served.ratio(inst.name, now, least)
        self._served.forget(i.name for i in family.instances)
        return out, served

    def _deferred_in(self, name: str, gids: Sequence[str]) -> set[str]:
        """The groups of ``gids`` that ``name``'s admission defers (``defer_expensive``)."""
        fluid = self.admission.fluids.get(name)
        if fluid is None or not fluid.admission.threshold:
            return set()
        groups = [(gid, self.grouper.group(gid).requests) for gid in gids]
        outputs = [self.estimator.expected_output(reqs[0]) for _, reqs in groups]
        densities = fluid.densities(groups, outputs, self._prompts)
        return {
            gid
            for (gid, _), density in zip(groups, densities, strict=True)
            if density is not None and fluid.admission.defers(density)
        }

    def _predicts_violation(self, now: float) -> bool:
        """Some admitted group is predicted to miss its chance constraint where it is (a
        deferred one is expected to)."""
        family, current = self._family(now)
        if len(family.groups) != sum(len(o) for o in current):
            return True  # some group has no queue
        problem = family.problem(self._choice(family))
        # P(meet) below Δ, counted as the plan's chance constraint counts it: fewer scenarios
        # met than ``required_ok`` (the same test, without Δ·S's rounding). Queue by queue in
        # numpy: the groups at risk only are looked up (no record per group).
        threshold = problem.required_ok / problem.scenarios
        ids = family.groups.ids
        deferred = self.admission.deferred
        for g, order in enumerate(current):
            at_risk = score_queue(problem, g, order).p_meet < threshold
            if at_risk.any():
                rows = np.asarray(order, np.int64)[at_risk].tolist()
                if any(ids[i] not in deferred for i in rows):
                    return True
        return False

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
                groups[problem.groups.ids[i]] = GroupPrediction(
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
        # One deadline for the whole plan, from here: the concurrency choice has the first
        # FLUID_SHARE of it, the solver stops at SEARCH_SHARE, the capacity signal has the rest.
        deadline = self.config.budget.start(self._clock)
        built = self._family_cache is not None and self._family_cache[0] == (now, self._plans_made)
        family, current = self._family(now)
        self._plans_made += 1
        choice = self._choice(family)
        choose = self.config.choose_concurrency and self._fixed is None
        keep_up, served = self._keep_up_rates(now, family) if choose else ({}, {})
        fluid = self._fluid_models.evaluate(
            now,
            family,
            self._instances,
            self._arrivals,
            self._plans_made,
            deadline.part(FLUID_SHARE),
        )
        best = (
            choose_limits(
                family,
                fluid,
                choice,
                self.admission.limits,
                self.config.concurrency_hysteresis,
                # (a rate to keep up with once a whole rate window has arrived)
                self.config.throughput_floor
                if now - self._arrivals.first_s >= self.config.rate_window_s
                else 0.0,
                keep_up,
                self.config.throughput_tolerance,
                served,
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
        lost = hopeless_all(full, now)
        ids = family.groups.ids
        ttft = family.groups.ttft_deadline_s.tolist()
        due = family.groups.deadline_s.tolist()
        for g, (inst, order) in enumerate(zip(family.instances, current, strict=True)):
            gids = self._deferred_in(inst.name, [ids[i] for i in order])
            late = lost[:, g]
            gids -= in_time(full, g, order, now, late, family.groups)
            gids -= {  # (a first-token deadline still ahead is never deferred, as in _place)
                ids[i] for i in order if now < ttft[i] < math.inf and not late[i]
            }
            if inst.name in self.admission.fluids:
                gids |= {ids[i] for i in order if late[i]}
            self.admission.deferred |= gids
            deferred[inst.name] = sorted(
                (i for i in order if ids[i] in gids),
                key=lambda i: (bool(late[i]), due[i], ids[i]),
            )
        held = self.admission.deferred
        keep = [i for i, gid in enumerate(ids) if gid not in held]
        problem = full if len(keep) == len(family.groups) else subset(full, keep)
        position = {i: k for k, i in enumerate(keep)}
        previous = [[position[i] for i in order if i in position] for order in current]
        solution = solve(
            problem, deadline.part(SEARCH_SHARE), previous=previous, solver=self.config.solver
        )
        kept_ids = problem.groups.ids
        orders = {
            inst.name: [kept_ids[i] for i in order] + [ids[i] for i in deferred[inst.name]]
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
            at_risk=tuple(kept_ids[i] for i in solution.at_risk),
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
        # only the solver's share of it — its problem included when the violation check of the
        # same step built it.
        self._last_plan_cost_s = self._clock() - started + (self._family_cost_s if built else 0.0)
        return record

    def _capacity_hint(self) -> float | None:
        last = self.last_plan.capacity_needed if self.last_plan is not None else None
        return last if last is not None and last > 1.0 else None

    def _ready(self, now: float) -> dict[str, float]:
        """When each instance's running work drains, in the fluid model: remaining expected output
        of its in-flight requests (each has had an equal share of the throughput so far)."""
        out: dict[str, float] = {}
        items: list[tuple[Request, int]] = []
        per_tokens: list[float] = []
        spans: list[tuple[InstanceLoad, int, int]] = []  # instance, its items' start and end
        for inst in self._instances:
            running = self.books.inflight.get(inst.name, {})
            out[inst.name] = now  # (in instance order; drained below if it runs anything)
            if not running or not inst.up:
                continue
            n_run = len(running)
            start = len(items)
            per_model: dict[str, float] = {}
            for item in running.values():
                per_token = per_model.get(item.request.model)
                if per_token is None:
                    hw = self.estimator.profile.hardware_for(
                        item.request.model, inst.gpu, inst.gpu_count
                    )
                    # fluid share of a step
                    per_token = per_model[item.request.model] = (
                        hw.decode_s(n_run) * hw.inefficiency / n_run
                    )
                done = item.generated + int(max(0.0, now - item.pulled_s) / (per_token * n_run))
                items.append((item.request, min(done, item.request.max_tokens - 1)))
                per_tokens.append(per_token)
            spans.append((inst, start, len(items)))
        means = np.array(self.estimator.expected_rests(items))
        terms = means * np.array(per_tokens)
        for inst, start, end in spans:
            # (a running total, added in order as one request after the other)
            work = float(np.cumsum(terms[start:end])[-1])
            out[inst.name] = now + work * self.estimator.calibration_factors(inst.name)[0]
        return out

    def _pin(self, gid: str, req: Request) -> str:
        """Round-robin placement: the next up instance serving the group's model, in name order."""
        able = sorted(i.name for i in self._instances if i.up and req.model in i.models)
        name = able[self._turn % len(able)]
        self._turn += 1
        self._pins[gid] = name
        return name

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
                deferred = self.admission.deferred
                entry = self._slots[name] = [
                    [self.grouper.due(g)[0] for g in gids if g not in deferred],
                    sum(map(self.grouper.size, gids)) + len(self.books.inflight.get(name, {})),
                    len(gids),
                ]
            return entry

        if self._round_robin:
            by_name = {i.name: i for i in able}
            pinned = self._pins.get(gid, "")
            target = by_name.get(pinned) or by_name[self._pin(gid, req)]
        else:
            target = min(able, key=lambda i: (slots(i.name)[1], i.name))
        deadlines, _, length = entry = slots(target.name)
        entry[1] += self.grouper.size(gid)
        entry[2] += 1
        self.admission.deferred.discard(gid)
        deadline, first_token = self.grouper.due(gid)
        # A first-token deadline is never deferred: held back behind the queue, it is missed.
        if not first_token and self._deferred_in(target.name, [gid]):
            self.admission.deferred.add(gid)
            self.queues.assign(gid, target.name, length)
            return
        pos = 0
        while pos < len(deadlines) and deadlines[pos] <= deadline:
            pos += 1
        self.queues.assign(gid, target.name, pos)
        deadlines.insert(pos, deadline)
