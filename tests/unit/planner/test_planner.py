"""The plan problem, its scoring, and the solvers agree with brute force where it is tractable."""

from __future__ import annotations

from typing import Any

import numpy as np
import pulp
import pytest

from qlm.planner.milp import _relative_gap, build_milp, solve_milp
from qlm.planner.program import (
    Plan,
    PlanGroup,
    PlanInstance,
    PlanProblem,
    check_plan,
    score_plan,
    score_queue,
)
from qlm.planner.solve import Budget, brute_force, capacity_needed, edf_plan, solve
from qlm.planner.synthetic import random_problem, shifted


def tiny(
    proc: list[list[float]],
    deadlines: list[float],
    *,
    models: list[str] | None = None,
    served: list[tuple[str, ...]] | None = None,
    weights: list[float] | None = None,
    switch_s: float = 0.0,
    delta: float = 0.9,
) -> PlanProblem:
    """Deterministic problem (one scenario): ``proc[i][g]`` seconds, zero latency floor."""
    n, q = len(proc), len(proc[0])
    models = models or ["m"] * n
    served = served or [("m", "n")] * q
    instances = tuple(
        PlanInstance(f"i{g}", served[g], served[g][0], 0.0, {m: switch_s for m in served[g]})
        for g in range(q)
    )
    groups = tuple(
        PlanGroup(f"g{i}", models[i], deadlines[i], (weights or [1.0] * n)[i]) for i in range(n)
    )
    p = np.array(proc, float)[:, :, None]
    for i in range(n):
        for g in range(q):
            if models[i] not in served[g]:
                p[i, g] = np.inf
    floor = np.where(np.isfinite(p), 0.0, np.inf)
    return PlanProblem(groups, instances, p, floor, delta=delta, flow_weight=0.0)


def test_score_is_expected_weighted_violation_plus_risk() -> None:
    # One queue: g0 (2 s, due 1 s) then g1 (3 s, due 10 s): g0 is 1 s late and misses.
    pr = tiny([[2.0], [3.0]], [1.0, 10.0], weights=[2.0, 1.0])
    s = score_queue(pr, 0, [0, 1])
    assert s.violation.tolist() == [1.0, 0.0]
    assert s.missed.tolist() == [True, False]
    assert s.cost == pytest.approx(2.0 * 1.0 + pr.risk_weight * 2.0)


def test_model_switch_cost_is_charged_between_different_models() -> None:
    pr = tiny([[1.0], [1.0], [1.0]], [100.0] * 3, models=["m", "n", "m"], switch_s=5.0)
    # m (active) -> n (switch) -> m (switch): g2 finishes at 1+5+1+5+1 = 13.
    assert score_queue(pr, 0, [0, 1, 2]).cost == 0.0
    pr_tight = tiny(
        [[1.0], [1.0], [1.0]], [100.0, 100.0, 12.5], models=["m", "n", "m"], switch_s=5.0
    )
    assert score_queue(pr_tight, 0, [0, 1, 2]).missed.tolist() == [False, False, True]
    assert not score_queue(pr_tight, 0, [0, 2, 1]).missed.any()


def test_latency_floor_bounds_completion() -> None:
    pr = tiny([[1.0]], [3.0])
    floor = np.full_like(pr.proc, 4.0)
    slow = PlanProblem(pr.groups, pr.instances, pr.proc, floor, flow_weight=0.0)
    assert score_queue(slow, 0, [0]).violation.tolist() == [1.0]


def test_chance_constraint_counts_scenarios() -> None:
    groups = (PlanGroup("g", "m", 10.0, 1.0),)
    inst = (PlanInstance("i", ("m",), "m", 0.0, {"m": 0.0}),)
    proc = np.array([[[5.0] * 9 + [20.0]]])  # 9 of 10 scenarios meet the deadline
    ok = PlanProblem(groups, inst, proc, np.zeros_like(proc), delta=0.9)
    strict = PlanProblem(groups, inst, proc, np.zeros_like(proc), delta=0.95)
    assert not score_queue(ok, 0, [0]).missed[0]
    assert score_queue(strict, 0, [0]).missed[0]
    assert score_queue(ok, 0, [0]).violation[0] == pytest.approx(1.0)  # (20 - 10) / 10


def test_check_plan_rejects_misplaced_and_missing_groups() -> None:
    pr = tiny([[1.0, 1.0], [1.0, 1.0]], [5.0, 5.0], models=["m", "n"], served=[("m",), ("m", "n")])
    check_plan(pr, ((0,), (1,)))
    with pytest.raises(ValueError, match="does not serve"):
        check_plan(pr, ((1,), (0,)))
    with pytest.raises(ValueError, match="exactly once"):
        check_plan(pr, ((0,), ()))


def test_solver_moves_a_hopeless_group_behind_feasible_ones() -> None:
    # EDF runs the long, already-late g0 first and makes g1 and g2 miss too.
    pr = tiny([[10.0], [1.0], [1.0]], [2.0, 3.0, 4.0])
    edf = edf_plan(pr)
    assert edf == ((0, 1, 2),)
    sol = solve(pr, Budget(time_s=None, evaluations=10_000, milp_max_groups=0))
    assert sol.plan == ((1, 2, 0),)
    assert sol.at_risk == (0,)
    assert sol.objective < sol.edf_objective


@pytest.mark.parametrize("seed", range(6))
def test_planner_objective_equals_brute_force_on_small_problems(seed: int) -> None:
    rng = np.random.default_rng(seed)
    q = 2 if seed else 1
    n = 7 if seed else 5  # up to 2 queues and 7 groups
    pr = random_problem(q, n, seed=seed, scenarios=6, load=float(rng.choice([0.5, 1.0, 2.0])))
    _, best = brute_force(pr)
    sol = solve(pr, Budget(time_s=None, milp_max_groups=8), solver="cbc")
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(best, rel=1e-6, abs=1e-6)
    assert sol.objective <= sol.edf_objective + 1e-9


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_milp_objective_matches_score_and_respects_eligibility(solver: str) -> None:
    pr = random_problem(2, 6, seed=11, scenarios=4)
    result = solve_milp(pr, solver=solver)
    assert result is not None
    plan, status, _ = result
    check_plan(pr, plan)
    assert status == "optimal"
    assert score_plan(pr, plan) == pytest.approx(brute_force(pr)[1], rel=1e-6, abs=1e-6)


def test_solution_is_never_worse_than_edf_and_budget_is_respected() -> None:
    pr = random_problem(4, 40, seed=3)
    sol = solve(pr, Budget(time_s=None, evaluations=500, milp_max_groups=0))
    check_plan(pr, sol.plan)
    assert sol.objective <= sol.edf_objective
    # One batch may overshoot the count; never by more than a batch of candidates.
    assert sol.evaluations < 500 + 40 * 41


def test_warm_start_keeps_a_good_plan_and_places_new_groups() -> None:
    pr = random_problem(3, 20, seed=5)
    first = solve(pr, Budget(time_s=None, evaluations=20_000, milp_max_groups=0))
    partial = tuple(tuple(i for i in o if i < 15) for o in first.plan)
    again = solve(pr, Budget(time_s=None, evaluations=1, milp_max_groups=0), previous=partial)
    check_plan(pr, again.plan)
    assert again.method.startswith(("warm", "edf"))


def test_simulated_budget_is_reproducible() -> None:
    pr = random_problem(4, 32, seed=2)
    a = solve(pr, Budget(time_s=None, evaluations=3000, milp_max_groups=0))
    b = solve(pr, Budget(time_s=None, evaluations=3000, milp_max_groups=0))
    assert a.plan == b.plan and a.objective == b.objective


def test_capacity_needed_grows_with_load() -> None:
    light = capacity_needed(tiny([[1.0], [1.0]], [5.0, 5.0]))
    heavy = capacity_needed(tiny([[4.0], [4.0]], [5.0, 5.0]))
    assert light == 1.0
    assert heavy is not None and 1.5 < heavy < 1.7  # both done by 5 s needs 8/5 the speed


@pytest.mark.parametrize("hint", [1.01, 1.2, 1.6, 1.62, 2.0, 9.0, 63.0])
def test_capacity_needed_from_a_hint_lands_within_the_same_two_percent(hint: float) -> None:
    problem = tiny([[4.0], [4.0]], [5.0, 5.0])
    assert capacity_needed(problem) == pytest.approx(1.6, rel=0.02)
    assert capacity_needed(problem, hint=hint) == pytest.approx(1.6, rel=0.02)
    hopeless = tiny([[400.0], [400.0]], [5.0, 5.0])  # needs 160 x, more than the limit of 64
    assert capacity_needed(hopeless, hint=hint) is None


def test_flow_term_serves_more_value_per_second_first() -> None:
    # Nothing is late either way: Smith's rule (weight / work) decides the order.
    pr = tiny([[4.0], [1.0]], [100.0, 100.0], weights=[1.0, 1.0])
    flow = PlanProblem(pr.groups, pr.instances, pr.proc, pr.floor, flow_weight=0.01)
    assert score_queue(flow, 0, [1, 0]).cost < score_queue(flow, 0, [0, 1]).cost
    assert solve(flow, Budget(time_s=None, evaluations=1000, milp_max_groups=0)).plan == ((1, 0),)


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_milp_gap_is_zero_when_proved_optimal(solver: str) -> None:
    small = random_problem(2, 5, seed=1, scenarios=4)
    result = solve_milp(small, solver=solver)
    assert result is not None and result[1:] == ("optimal", 0.0)


def test_milp_gap_is_read_from_a_solver_that_reports_one() -> None:
    class Info:
        mip_gap = 0.25

    class Model:
        def getInfo(self) -> Info:
            return Info()

    lp = pulp.LpProblem("p")
    assert _relative_gap(lp) is None  # CBC through PuLP: no bound in the solution file
    lp.solverModel = Model()
    assert _relative_gap(lp) == 0.25


def test_a_solver_that_crashes_leaves_the_heuristic_plan(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """PuLP's bundled CBC exits with a segmentation fault on some warm-started problems under
    a 0.1 s limit; PuLP raises, and the round must keep its heuristic plan, not fail."""

    class Crashing(pulp.LpSolver):  # type: ignore[misc]
        def actualSolve(self, lp: Any, **kwargs: Any) -> int:
            raise pulp.PulpSolverError("Pulp: Error while trying to execute cbc")

    monkeypatch.setattr("qlm.planner.milp.make_solver", lambda *a: Crashing(msg=False))
    pr = random_problem(2, 6, seed=11, scenarios=4)
    assert solve_milp(pr, solver="cbc") is None
    with caplog.at_level("DEBUG", logger="qlm.solvers"):
        sol = solve(pr, Budget(time_s=None, milp_max_groups=8), solver="cbc")
    check_plan(pr, sol.plan)
    assert "milp" not in sol.method and sol.status == "heuristic"
    assert sol.objective <= sol.edf_objective + 1e-9
    assert any("solver failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_milp_poses_unix_times_relative_to_the_earliest_ready_time(solver: str) -> None:
    """In production times are unix seconds: a big-M of 1.8e9 times the solvers' integrality
    tolerance would relax a constraint by half an hour. The constraints' numbers stay the size
    of the plan's horizon, and the answer is the same as for the problem at time 0."""
    base = random_problem(2, 6, seed=11, scenarios=4)
    late = shifted(base, 1.8e9)
    lp, variables = build_milp(late)
    numbers = [abs(c.constant) for c in lp.constraints()]
    numbers += [abs(a) for c in lp.constraints() for a in c.values()]
    numbers += [abs(v.upBound) for v in variables["F"].values()]
    assert max(numbers) < 1e5
    result = solve_milp(late, solver=solver)
    assert result is not None and result[1] == "optimal"
    assert score_plan(late, result[0]) == pytest.approx(brute_force(base)[1], rel=1e-6, abs=1e-6)
    warm = solve(late, Budget(time_s=None, milp_max_groups=8), solver=solver)
    assert warm.status == "optimal" and "milp" in warm.method
    assert warm.objective == pytest.approx(brute_force(base)[1], rel=1e-6, abs=1e-6)


def test_the_highs_banner_reaches_neither_the_commands_output_nor_the_log() -> None:
    """HiGHS greets on file descriptor 1 at its first solver object: a command printing JSON
    on stdout must get only its own output, and a JSON log on stderr only its lines."""
    import subprocess
    import sys

    pytest.importorskip("highspy")
    code = (
        "import pulp\n"
        "from qlm.solvers import make_solver\n"
        "p = pulp.LpProblem('x', pulp.LpMinimize)\n"
        "x = pulp.LpVariable('x', 0, 1, cat='Integer')\n"
        "p += x\n"
        "p += x >= 0\n"
        "p.solve(make_solver('highs', 1.0, False))\n"
        "print('{\"ok\": true}')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout == '{"ok": true}\n'
    assert done.stderr == ""


def _edf_one_queue_at_a_time(problem: PlanProblem) -> Plan:
    """EDF as it was written first: each group to the first queue where it finishes earliest,
    every queue priced in numpy (the reference ``edf_plan`` must agree with)."""
    p_mean = problem.proc.mean(axis=2)
    p_done = np.maximum(p_mean, problem.floor.mean(axis=2))
    load = problem.ready.copy()
    last = problem.active.copy()
    queues: list[list[int]] = [[] for _ in problem.instances]
    due = problem.due
    for i in sorted(range(len(problem.groups)), key=lambda i: (due[i], i)):
        m = problem.model_idx[i]
        sw = np.where(last != m, problem.switch[:, m], 0.0)
        best = int(np.argmin(load + sw + p_done[i]))
        load[best] += sw[best] + p_mean[i, best]
        last[best] = m
        queues[best].append(i)
    return tuple(tuple(o) for o in queues)


@pytest.mark.parametrize("models", [1, 3])
@pytest.mark.parametrize("seed", range(4))
def test_edf_places_each_group_where_it_finishes_first(seed: int, models: int) -> None:
    problem = random_problem(5, 60, seed=seed, models=models, scenarios=4)
    assert edf_plan(problem) == _edf_one_queue_at_a_time(problem)
