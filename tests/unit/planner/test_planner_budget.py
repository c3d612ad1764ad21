"""Every part of a plan stops when its budget is spent, and a plan cut short is still whole.

The budgets here are fakes (``RunsOut``: spent from its N-th question on; ``ManualClock``: time
that moves only when the test says): nothing depends on how fast the machine is."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from builders import make_profile, make_request

from qlm.domain import SLO, Pull
from qlm.planner import PlannerConfig, QlmPolicy, milp
from qlm.planner.budget import Budget, Deadline
from qlm.planner.milp import MILP_MIN_S, solve_milp
from qlm.planner.policy import DispatchContext, InstanceLoad
from qlm.planner.program import Plan, PlanProblem, check_plan, score_plan, score_queue
from qlm.planner.solve import (
    INSERTION_CELLS,
    SWAP_CELLS,
    _adjacent_swaps,
    _best_insertion,
    _deadline_slot,
    _insertion_positions,
    capacity_needed,
    edf_plan,
    local_search,
    solve,
    warm_plan,
)
from qlm.planner.synthetic import random_problem


class RunsOut(Deadline):
    """Answers ``after`` times that there is budget left, then that it is spent; counts the
    questions (``checks``) and, as any deadline, the candidate orders scored (``count``)."""

    def __init__(self, after: int, budget: Budget | None = None) -> None:
        super().__init__(budget or Budget(time_s=None), lambda: 0.0)
        self.after = after
        self.checks = 0

    def left_s(self) -> float:
        return 0.0 if self.checks >= self.after else math.inf

    def spent(self) -> bool:
        self.checks += 1
        return self.checks > self.after


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def backlog(
    queues: int = 8, groups: int = 2400, held: int = 240, seed: int = 7
) -> tuple[PlanProblem, Plan]:
    """A plan problem and a previous plan that holds only the first ``held`` groups (by index):
    the others arrived at once and are missing from it."""
    problem = random_problem(queues, groups, seed=seed, models=2, load=2.0)
    previous = tuple(tuple(i for i in order if i < held) for order in edf_plan(problem))
    return problem, previous


def tails(problem: PlanProblem, plan: Plan, appended: set[int]) -> None:
    """Every group of ``appended`` sits behind all the others of its queue, and they are in
    deadline order there."""
    for order in plan:
        flags = [i in appended for i in order]
        first = flags.index(True) if True in flags else len(order)
        assert all(flags[first:]), "an appended group is followed by an inserted one"
        tail = order[first:]
        assert list(tail) == sorted(tail, key=lambda i: (problem.deadline[i], i))


def test_warm_plan_with_thousands_of_missing_groups_stops_inserting_when_the_budget_is_out() -> (
    None
):
    problem, previous = backlog()
    missing = sorted(
        set(range(len(problem.groups))) - {i for o in previous for i in o},
        key=lambda i: (problem.deadline[i], i),
    )
    assert len(missing) == 2160
    meter = RunsOut(after=5)
    plan = warm_plan(problem, previous, meter)
    check_plan(problem, plan)  # every group exactly once, where it is served
    assert meter.checks == 6  # five insertions, then the budget was found spent
    tails(problem, plan, set(missing[5:]))
    # The groups it held keep their order.
    for order, before in zip(plan, previous, strict=True):
        assert [i for i in order if i in set(before)] == list(before)


def test_a_budget_spent_at_once_still_yields_a_complete_plan_no_worse_than_edf() -> None:
    problem, previous = backlog()
    sol = solve(problem, RunsOut(after=0), previous=previous)
    check_plan(problem, sol.plan)
    assert sol.status == "fallback"
    assert sol.evaluations == 0  # nothing was searched
    assert sol.objective <= sol.edf_objective
    assert sol.objective == pytest.approx(score_plan(problem, sol.plan))


def test_a_warm_plan_cut_short_puts_what_it_could_not_insert_at_the_tails_in_edf_order() -> None:
    problem, previous = backlog(queues=4, groups=300, held=200, seed=3)
    missing = set(range(len(problem.groups))) - {i for o in previous for i in o}
    plan = warm_plan(problem, previous, RunsOut(after=0))
    check_plan(problem, plan)
    tails(problem, plan, missing)


def test_the_local_search_stops_at_once_when_the_budget_is_spent() -> None:
    problem = random_problem(4, 400, seed=1, load=2.0)
    start = edf_plan(problem)
    spent = RunsOut(after=0)
    assert local_search(problem, start, spent) == start
    assert spent.count == 0
    few = RunsOut(after=3)
    local_search(problem, start, few)
    many = RunsOut(after=30)
    local_search(problem, start, many)
    assert 0 < few.count < many.count  # the work done grows with the checks allowed


def test_the_swaps_of_a_long_queue_are_scored_in_batches_between_checks() -> None:
    problem = random_problem(1, 600, seed=2, models=1, load=3.0)
    queues = [list(o) for o in edf_plan(problem)]
    costs = [score_plan(problem, tuple(tuple(o) for o in queues))]
    meter = RunsOut(after=0)
    _adjacent_swaps(problem, meter, queues, costs, 0)
    assert meter.count == SWAP_CELLS // 600  # the first batch only, not all 599 swaps
    whole = RunsOut(after=10**6)
    _adjacent_swaps(problem, whole, [list(o) for o in edf_plan(problem)], list(costs), 0)
    assert whole.count == 599


def test_an_insertion_among_long_queues_is_scored_in_blocks_and_cut_short_between_them() -> None:
    """At 3,000 groups on 16 queues one insertion scores ~2.4 million cells: in blocks, with the
    time budget asked between them; a whole insertion answers the first cheapest candidate, as
    one batch does, and one cut short the cheapest of the blocks it scored."""
    problem = random_problem(16, 3000, seed=3)
    queues = [list(o) for o in edf_plan(problem)]
    x = queues[0].pop(len(queues[0]) // 2)
    costs = [score_queue(problem, g, o).cost for g, o in enumerate(queues)]
    candidates = [  # every candidate (queue, position), in the order an insertion scores them
        (int(g), int(p))
        for g in np.flatnonzero(problem.eligible[x])
        for p in _insertion_positions(
            len(queues[g]), Budget().max_positions, _deadline_slot(problem, queues[g], x)
        )
    ]

    def added(g: int, p: int) -> float:
        return score_queue(problem, g, [*queues[g][:p], x, *queues[g][p:]]).cost - costs[g]

    whole = RunsOut(after=10**6)
    best = _best_insertion(problem, whole, queues, x, costs)
    assert whole.count == len(candidates)
    by_hand = [added(g, p) for g, p in candidates]
    first = int(np.argmin(by_hand))
    assert best[1:] == candidates[first]
    assert best[0] == pytest.approx(by_hand[first], rel=1e-9, abs=1e-6)

    width = max(len(queues[g]) for g in np.flatnonzero(problem.eligible[x]))
    block = INSERTION_CELLS // ((width + 1) * problem.proc.shape[2])
    assert 0 < block < len(candidates)
    cut = RunsOut(after=0)  # out of time from the start: one block, the cheapest of it
    cheapest = _best_insertion(problem, cut, queues, x, costs)
    assert cut.count == block
    assert cheapest[1:] == candidates[int(np.argmin(by_hand[:block]))]


def test_the_milp_gets_what_is_left_of_the_deadline_and_is_not_run_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    problem = random_problem(2, 5, seed=4)
    clock = ManualClock()
    deadline = Budget(time_s=1.0).start(clock)
    clock.now = 1.0 - MILP_MIN_S / 2
    assert solve_milp(problem, start=edf_plan(problem), solver="highs", deadline=deadline) is None
    given: list[float | None] = []
    real = milp.make_solver

    def spy(name: str, time_limit_s: float | None, warm: bool) -> object:
        given.append(time_limit_s)
        return real(name, time_limit_s, warm)

    monkeypatch.setattr(milp, "make_solver", spy)
    clock.now = 0.5  # 0.5 s left: the solver may not have more, whatever it is asked
    solve_milp(
        problem, start=edf_plan(problem), time_limit_s=30.0, solver="highs", deadline=deadline
    )
    assert given == [0.5]


def test_solve_does_not_start_the_milp_with_less_than_its_minimum_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    problem = random_problem(2, 5, seed=4)
    made: list[float | None] = []
    real = milp.make_solver

    def spy(name: str, time_limit_s: float | None, warm: bool) -> object:
        made.append(time_limit_s)
        return real(name, time_limit_s, warm)

    monkeypatch.setattr(milp, "make_solver", spy)
    clock = ManualClock()
    deadline = Budget(time_s=1.0, milp_max_groups=8).start(clock)
    clock.now = 1.0 - MILP_MIN_S / 2  # the search may go on (the clock stands still), not the MILP
    sol = solve(problem, deadline)
    check_plan(problem, sol.plan)
    assert made == [] and sol.status == "heuristic"
    clock.now = 0.0
    solve(problem, Budget(time_s=1.0).start(clock))
    assert made == [1.0]


def test_the_capacity_search_tries_no_more_edf_plans_than_its_budget_allows() -> None:
    problem = random_problem(4, 200, seed=3, load=2.0)
    whole = RunsOut(after=10**6)
    exact = capacity_needed(problem, deadline=whole)
    assert exact is not None and exact > 1.0
    tries = whole.count // len(problem.instances)
    assert tries > 4
    short = RunsOut(after=3)
    rough = capacity_needed(problem, deadline=short)
    assert short.count == 3 * len(problem.instances)  # three EDF plans tried
    # What it says is a capacity found to be enough (coarser than 2 %), or nothing was.
    assert rough is None or rough >= exact
    assert capacity_needed(problem, deadline=RunsOut(after=0), hint=2.5) == 2.5


def test_a_part_of_a_deadline_ends_at_its_share_of_the_time_and_counts_its_own_orders() -> None:
    clock = ManualClock()
    whole = Budget(time_s=1.0, evaluations=100).start(clock)
    search = whole.part(0.75)
    search.charge(100)
    assert search.spent() and not whole.spent()  # its count is its own
    other = whole.part(0.75)
    clock.now = 0.8
    assert other.spent() and not whole.spent()  # 0.8 s of 1 s: past the share, not the whole
    assert whole.left_s() == pytest.approx(0.2)


def test_a_plan_whose_clock_runs_out_still_queues_every_group_exactly_once() -> None:
    """The policy plans on its own clock: here each reading of it is a second later, so every
    budget is spent as soon as it is asked."""
    ticks = iter(float(i) for i in range(10**6))
    config = dataclasses.replace(
        PlannerConfig.for_simulation(),
        budget=Budget(time_s=0.1),
        defer_expensive=False,
        step_budget_s=1e9,  # the step itself is not bounded here: only the plan's budget
    )
    qlm = QlmPolicy(make_profile(), config=config, clock=lambda: next(ticks))
    instances = tuple(
        InstanceLoad(name=f"i{k}", models=("m",), gpu="G", max_running=1) for k in range(3)
    )
    rng = np.random.default_rng(0)
    reqs = tuple(
        make_request(k, arrival_s=0.0, slo=SLO(float(rng.choice([5.0, 60.0, 600.0]))))
        for k in range(400)
    )
    qlm.decide(DispatchContext(0.0, reqs, instances))
    for _ in range(3):  # a recluster due waits for a step of its own, then placing, the plan
        if qlm.last_plan is None:
            qlm.decide(DispatchContext(0.0, (), instances))
    record = qlm.last_plan
    assert record is not None
    assert record.status == "fallback"
    queued = [g for inst in instances for g in qlm.queues.queue(inst.name)]
    assert len(queued) == len(set(queued)) == len(qlm.grouper)


def wall_policy(clock: ManualClock | object, **config: object) -> QlmPolicy:
    """The policy as production runs it (a wall-time budget), on a clock the test moves."""
    base = dataclasses.replace(PlannerConfig(), defer_expensive=False, choose_concurrency=False)
    return QlmPolicy(make_profile(), config=dataclasses.replace(base, **config), clock=clock)  # type: ignore[arg-type]


class Ticking:
    """A clock that moves ``tick`` seconds at every reading."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_a_burst_of_arrivals_is_grouped_over_steps_within_the_step_budget() -> None:
    clock = Ticking(0.01)  # every reading: 10 ms later
    qlm = wall_policy(clock, step_budget_s=0.5)
    busy = InstanceLoad(name="i0", models=("m",), gpu="G", max_running=1, outstanding_requests=1)
    burst = tuple(make_request(k, arrival_s=0.0, slo=SLO(600.0)) for k in range(200))
    qlm.decide(DispatchContext(0.0, burst, (busy,)))
    first = qlm.grouper.num_requests
    assert 1 <= first < 200  # the first half of the step (0.25 s) took what fitted
    assert qlm.ungrouped == 200 - first
    qlm.decide(DispatchContext(0.5, (burst[-1],), (busy,), cancelled=(burst[-2].id,)))
    steps = 2
    while qlm.grouper.num_requests < 198 and steps < 100:
        qlm.decide(DispatchContext(0.5 + steps, (), (busy,)))
        steps += 1
    # Every request handed was grouped once (the one handed twice too), the cancelled one never.
    assert qlm.grouper.num_requests == 199 and qlm.ungrouped == 0 and steps > 2
    assert qlm.grouper.group_of(burst[-2].id) is None


def test_pulls_stop_at_the_step_budget_and_go_on_at_the_next_step() -> None:
    clock = Ticking(0.01)
    qlm = wall_policy(clock, step_budget_s=0.2)
    reqs = tuple(make_request(k, arrival_s=0.0, slo=SLO(600.0)) for k in range(40))
    idle = InstanceLoad(name="i0", models=("m",), gpu="G", max_running=64)
    pulled: list[str] = []
    for step in range(40):
        out = qlm.decide(DispatchContext(float(step), reqs if step == 0 else (), (idle,)))
        pulled += [d.request_id for d in out if isinstance(d, Pull)]
        idle = dataclasses.replace(idle, outstanding_requests=len(pulled))
        if len(pulled) == 40:
            break
    assert sorted(pulled) == sorted(r.id for r in reqs)  # each once
    assert step > 1  # not all in one step: the clock ran out


def test_a_recluster_gets_a_step_of_its_own_its_new_groups_the_next_and_then_the_plan() -> None:
    clock = ManualClock()
    qlm = wall_policy(clock, period_s=1.0, min_interval_s=0.1)
    qlm.grouper.set_config(dataclasses.replace(qlm.grouper.config, recluster_interval_s=1.0))
    inst = InstanceLoad(name="i0", models=("m",), gpu="G", max_running=1, outstanding_requests=1)
    qlm.decide(DispatchContext(0.0, (make_request(0, arrival_s=0.0, slo=SLO(600.0)),), (inst,)))
    qlm.take_plans()
    late = (make_request(1, arrival_s=5.0, slo=SLO(600.0)),)
    qlm.decide(DispatchContext(5.0, late, (inst,)))  # a recluster and the period are due
    assert qlm.take_plans() == [] and qlm.grouper.needs_recluster(5.0)  # grouped arrivals only
    qlm.decide(DispatchContext(5.1, (), (inst,)))
    assert qlm.take_plans() == [] and not qlm.grouper.needs_recluster(5.1)  # reclustered only
    qlm.decide(DispatchContext(5.2, (), (inst,)))  # the groups it made new are placed
    assert qlm.take_plans() == [] and not qlm.queues.unassigned()
    qlm.decide(DispatchContext(5.3, (), (inst,)))
    assert [p.trigger for p in qlm.take_plans()] == ["period"]


def test_a_step_with_no_arrivals_reclusters_at_once() -> None:
    clock = ManualClock()
    qlm = wall_policy(clock, period_s=1.0, min_interval_s=0.1)
    qlm.grouper.set_config(dataclasses.replace(qlm.grouper.config, recluster_interval_s=1.0))
    inst = InstanceLoad(name="i0", models=("m",), gpu="G", max_running=1, outstanding_requests=1)
    qlm.decide(DispatchContext(0.0, (make_request(0, arrival_s=0.0, slo=SLO(600.0)),), (inst,)))
    assert qlm.grouper.needs_recluster(5.0)
    qlm.decide(DispatchContext(5.0, (), (inst,)))
    assert not qlm.grouper.needs_recluster(5.0)


def test_the_concurrency_choice_evaluates_one_instance_per_plan_once_its_share_is_spent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each reading of the clock is a second later: the share of the budget the concurrency
    choice has is spent at once. One instance is evaluated per plan, in turn (the least recently
    evaluated first), and the others keep their last evaluation."""
    import qlm.planner.concurrency as module

    evaluated: list[int] = []  # the limits evaluated (one admission per limit and round)
    real = module.admit

    def counting(*args: object, **kwargs: object) -> object:
        evaluated.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "admit", counting)
    qlm = wall_policy(
        Ticking(1.0), step_budget_s=1e9, period_s=1.0, min_interval_s=0.1, keep_up=0.0
    )
    # Instances that differ (their limits) so that each has a fluid model of its own.
    fleet = tuple(
        InstanceLoad(name=f"i{k}", models=("m",), gpu="G", max_running=m, outstanding_requests=m)
        for k, m in enumerate((48, 96, 160))
    )
    reqs = tuple(make_request(k, arrival_s=0.0, slo=SLO(600.0)) for k in range(30))
    per_plan = []
    for step in range(4):
        evaluated.clear()
        qlm.decide(DispatchContext(2.0 * step, reqs if step == 0 else (), fleet))
        if qlm.take_plans():
            per_plan.append(len(evaluated))
    # One instance per plan: 3, 4 and 6 limits (up to 48, 96 and 160 running), then again.
    assert per_plan == [3, 4, 6, 3]


def test_a_solve_far_over_its_budget_says_which_stage_took_the_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    problem = random_problem(2, 12, seed=3)
    clock = ManualClock()

    class Slow(Deadline):  # every question about the budget finds a second gone
        def spent(self) -> bool:
            clock.now += 1.0
            return super().spent()

    with caplog.at_level("WARNING", logger="qlm.planner.solve"):
        solve(problem, Slow(Budget(time_s=0.1, milp_max_groups=0), clock))
    [record] = [r for r in caplog.records if "budget" in r.getMessage()]
    assert "12 groups on 2 queues" in record.getMessage() and "edf 0.000 s" in record.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="qlm.planner.solve"):
        solve(problem, Budget(time_s=10.0, milp_max_groups=0).start(ManualClock()))
    assert not caplog.records  # within its budget: nothing said
