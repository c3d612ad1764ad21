"""The plan problem as a mixed-integer program (PuLP), for exact solutions and reference runs.

Formulation (immediate-successor, not position-indexed, so the number of binaries grows with group
pairs rather than groups × queues × positions):

- ``first[g,i]``: group ``i`` heads queue ``g``; ``nxt[i,j]``: ``j`` directly follows ``i``;
  ``x[i,g]``: ``i`` is on queue ``g``. Every group has exactly one predecessor (a group or a queue
  head), every node at most one successor, and a successor shares its predecessor's queue.
- ``F[i,s]``: fluid finish of ``i`` in scenario ``s`` (``F[j] >= F[i] + switch(i→j) + p[j]`` when
  ``j`` follows ``i``; ``F[i] >= ready[g] + switch(active→i) + p[i,g]`` when it heads ``g``); the
  completion ``C[i,s] >= F[i,s]`` and ``>= F[i,s] − p[i] + floor[i]`` (the latency floor). As
  processing times are positive, the finish times rule out cycles (as in MTZ).
- ``T[i,s] >= C[i,s] − D[i]`` (violation), ``u[i,s]`` marks a missed scenario
  (``C − D <= M·u``), and ``Σ_s u[i,s] <= S − ceil(Δ·S) + ceil(Δ·S)·r[i]``: ``r[i] ∈ [0, 1]`` is
  the shortfall of the chance constraint of ``i``, at the cost ``risk_weight · w[i] · r[i]``.
- First tokens, for a group with a TTFT deadline ``E[i]``: its pull ``P[i,s] >= F[i,s] − p[i] −
  lead[g]`` and ``>= now``, ``TF[i,s] >= P[i,s] + first[i,g] − E[i]`` (first-token violation),
  and a scenario missing either deadline is missed (``P + first − E <= M·u``).
- Objective: ``Σ_i w[i] · mean_s (T[i,s] + TF[i,s]) + risk_weight · Σ_i w[i]·r[i] + flow_weight ·
  Σ_i w[i] · (mean_s C[i,s] − ready of its queue)`` — ``program.score_plan``
  exactly, so MILP and heuristic objectives compare one to one.

Solved with CBC (bundled with PuLP) or HiGHS (``highspy``) when installed, warm-started from a
given plan, under a time limit. A solver that fails — PuLP's bundled CBC 2.10 exits with a
segmentation fault on some warm-started problems under the planner's 0.1 s limit — yields no
plan, so the caller keeps its heuristic one.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

import numpy as np
import pulp

from qlm.planner.budget import Deadline
from qlm.planner.program import Plan, PlanProblem
from qlm.solvers import make_solver, note_failure, resolve_solver

log = logging.getLogger(__name__)

MILP_MIN_S = 0.05
"""Under a deadline the MILP is run only with at least this much of it left."""


def build_milp(problem: PlanProblem) -> tuple[pulp.LpProblem, dict[str, Any]]:
    """The PuLP model of ``problem`` and its variables (for warm starts and reading plans)."""
    n, q = len(problem.groups), len(problem.instances)
    s_count = problem.scenarios
    p, fl, w = problem.proc, problem.floor, problem.weight
    # Times enter relative to the earliest ready time: in production they are unix seconds
    # (~1.8e9), and a big-M of that size times the solvers' integrality tolerance (1e-6) would let
    # a "binary" at 0.999999 relax a head constraint by half an hour. Differences, and so every
    # violation and the objective (``Σ_g x = 1``), are unchanged by the shift.
    origin = _origin(problem)
    ready, dl = problem.ready - origin, problem.deadline - origin
    elig = problem.eligible
    finite_p = np.where(np.isfinite(p), p, 0.0)
    finite_fl = np.where(np.isfinite(fl), fl, 0.0)
    max_switch = float(np.where(np.isfinite(problem.switch), problem.switch, 0.0).max(initial=0.0))
    # Per-scenario bounds on any finish time: the tighter the big-Ms, the stronger the relaxation.
    upper = ready.max() + finite_p.max(axis=1).sum(axis=0) + n * max_switch + 1e-6
    upper = upper * (1 + 1e-9)  # (S,), with room for rounding in sums taken in another order
    lower = np.where(elig[:, :, None], ready[None, :, None] + p, np.inf).min(axis=1)
    lower = lower - 1e-6 - 1e-9 * np.abs(lower)  # (n, S)
    lp = pulp.LpProblem("qlm_plan", pulp.LpMinimize)
    x = {
        (i, g): lp.add_variable(f"x_{i}_{g}", cat="Binary")
        for i in range(n)
        for g in range(q)
        if elig[i, g]
    }
    first = {
        (g, i): lp.add_variable(f"first_{g}_{i}", cat="Binary")
        for i in range(n)
        for g in range(q)
        if elig[i, g]
    }
    nxt = {
        (i, j): lp.add_variable(f"nxt_{i}_{j}", cat="Binary")
        for i in range(n)
        for j in range(n)
        if i != j and (elig[i] & elig[j]).any()
    }
    fin = {
        (i, s): lp.add_variable(f"F_{i}_{s}", lowBound=float(lower[i, s]), upBound=float(upper[s]))
        for i in range(n)
        for s in range(s_count)
    }
    comp = {
        (i, s): lp.add_variable(f"C_{i}_{s}", lowBound=0) for i in range(n) for s in range(s_count)
    }
    late = {
        (i, s): lp.add_variable(f"T_{i}_{s}", lowBound=0) for i in range(n) for s in range(s_count)
    }
    miss = {
        (i, s): lp.add_variable(f"u_{i}_{s}", cat="Binary")
        for i in range(n)
        for s in range(s_count)
    }
    relax = {i: lp.add_variable(f"r_{i}", lowBound=0, upBound=1) for i in range(n)}
    timed = [i for i in range(n) if np.isfinite(problem.ttft[i])]  # groups with a TTFT deadline
    timed_set = set(timed)
    first_s = np.zeros((n, q)) if problem.first is None else problem.first
    lead = np.zeros(q) if problem.lead is None else problem.lead
    now = problem.now_s - origin
    pull = {
        (i, s): lp.add_variable(f"P_{i}_{s}", lowBound=float(now) if np.isfinite(now) else None)
        for i in timed
        for s in range(s_count)
    }
    first_late = {
        (i, s): lp.add_variable(f"TF_{i}_{s}", lowBound=0) for i in timed for s in range(s_count)
    }

    lp += (
        pulp.lpSum(float(w[i]) / s_count * late[i, s] for i in range(n) for s in range(s_count))
        + pulp.lpSum(float(w[i]) / s_count * v for (i, _), v in first_late.items())
        + pulp.lpSum(problem.risk_weight * float(w[i]) * relax[i] for i in range(n))
        + pulp.lpSum(
            problem.flow_weight * float(w[i]) / s_count * comp[i, s]
            for i in range(n)
            for s in range(s_count)
        )
        - pulp.lpSum(problem.flow_weight * float(w[i]) * float(ready[g]) * x[i, g] for (i, g) in x),
        "expected_weighted_violation",
    )
    allowed_misses = s_count - problem.required_ok
    for i in range(n):
        on = [g for g in range(q) if elig[i, g]]
        lp += pulp.lpSum(x[i, g] for g in on) == 1, f"assign_{i}"
        preds = [first[g, i] for g in on] + [nxt[j, i] for j in range(n) if (j, i) in nxt]
        lp += pulp.lpSum(preds) == 1, f"one_pred_{i}"
        lp += pulp.lpSum(nxt[i, j] for j in range(n) if (i, j) in nxt) <= 1, f"one_succ_{i}"
        for g in on:
            lp += x[i, g] >= first[g, i], f"head_on_{g}_{i}"
        m_i = problem.model_idx[i]
        for s in range(s_count):
            p_is = pulp.lpSum(float(p[i, g, s]) * x[i, g] for g in on)
            floor_is = pulp.lpSum(float(fl[i, g, s]) * x[i, g] for g in on)
            lp += comp[i, s] >= fin[i, s], f"c_fluid_{i}_{s}"
            lp += comp[i, s] >= fin[i, s] - p_is + floor_is, f"c_floor_{i}_{s}"
            lp += late[i, s] >= comp[i, s] - float(dl[i]), f"late_{i}_{s}"
            c_max = float(upper[s] + finite_fl[i].max(axis=0)[s])
            if i in timed_set:
                e_i = float(problem.ttft[i] - origin)
                first_is = pulp.lpSum(float(first_s[i, g]) * x[i, g] for g in on)
                lead_i = pulp.lpSum(float(lead[g]) * x[i, g] for g in on)
                lp += pull[i, s] >= fin[i, s] - p_is - lead_i, f"pull_{i}_{s}"
                lp += first_late[i, s] >= pull[i, s] + first_is - e_i, f"first_late_{i}_{s}"
                f_max = max(float(upper[s]), float(now)) + float(first_s[i, on].max())
                if f_max > e_i:
                    lp += (
                        pull[i, s] + first_is - e_i <= (f_max - e_i) * miss[i, s],
                        f"first_miss_{i}_{s}",
                    )
            if c_max > dl[i]:
                lp += (
                    comp[i, s] - float(dl[i]) <= (c_max - float(dl[i])) * miss[i, s],
                    f"miss_{i}_{s}",
                )
            elif i not in timed_set:
                lp += miss[i, s] == 0, f"miss_{i}_{s}"
            for g in on:
                sw = float(problem.switch[g, m_i]) if problem.active[g] != m_i else 0.0
                lp += (
                    fin[i, s]
                    >= float(ready[g])
                    + sw
                    + float(p[i, g, s])
                    - float(upper[s]) * (1 - first[g, i]),
                    f"head_{g}_{i}_{s}",
                )
        lp += (
            pulp.lpSum(miss[i, s] for s in range(s_count))
            <= allowed_misses + problem.required_ok * relax[i],
            f"chance_{i}",
        )
    for g in range(q):
        lp += pulp.lpSum(first[g, i] for i in range(n) if (g, i) in first) <= 1, f"one_head_{g}"
    for (i, j), v in nxt.items():
        m_i, m_j = problem.model_idx[i], problem.model_idx[j]
        on_j = [g for g in range(q) if elig[j, g]]
        for g in range(q):
            if (i, g) in x:
                if (j, g) in x:
                    lp += x[j, g] >= x[i, g] + v - 1, f"same_{i}_{j}_{g}"
                else:
                    lp += x[i, g] + v <= 1, f"noshare_{i}_{j}_{g}"
        sw_j = (
            pulp.lpSum(float(problem.switch[g, m_j]) * x[j, g] for g in on_j) if m_i != m_j else 0.0
        )
        for s in range(s_count):
            p_js = pulp.lpSum(float(p[j, g, s]) * x[j, g] for g in on_j)
            big_m = float(upper[s] + max_switch + finite_p[j, :, s].max() - lower[j, s])
            lp += fin[j, s] >= fin[i, s] + sw_j + p_js - big_m * (1 - v), f"seq_{i}_{j}_{s}"
    variables = {
        "x": x,
        "first": first,
        "nxt": nxt,
        "F": fin,
        "C": comp,
        "T": late,
        "u": miss,
        "r": relax,
        "P": pull,
        "TF": first_late,
    }
    return lp, variables


def _origin(problem: PlanProblem) -> float:
    """The time the model's times are measured from (the earliest ready time)."""
    return float(problem.ready.min()) if problem.ready.size else 0.0


def _warm_values(problem: PlanProblem, plan: Plan, variables: dict[str, Any]) -> None:
    """Set every variable's initial value to the plan's."""
    for var in (*variables["x"].values(), *variables["first"].values(), *variables["nxt"].values()):
        var.setInitialValue(0)
    s_count = problem.scenarios
    origin = _origin(problem)
    for g, order in enumerate(plan):
        prev_model = problem.active[g]
        t = np.full(s_count, problem.ready[g] - origin)
        for k, i in enumerate(order):
            variables["x"][i, g].setInitialValue(1)
            if k == 0:
                variables["first"][g, i].setInitialValue(1)
            else:
                variables["nxt"][order[k - 1], i].setInitialValue(1)
            m = problem.model_idx[i]
            if m != prev_model:
                t = t + problem.switch[g, m]
                prev_model = m
            p = problem.proc[i, g]
            t = t + p
            c = np.maximum(t, t - p + problem.floor[i, g])
            dl = problem.deadline[i] - origin
            missed = c > dl
            if (i, 0) in variables["P"]:
                lead = 0.0 if problem.lead is None else float(problem.lead[g])
                first = 0.0 if problem.first is None else float(problem.first[i, g])
                pulled = np.maximum(t - p - lead, problem.now_s - origin)
                first_late = pulled + first - (problem.ttft[i] - origin)
                missed = missed | (first_late > 0)
                for s in range(s_count):
                    variables["P"][i, s].setInitialValue(float(pulled[s]))
                    variables["TF"][i, s].setInitialValue(float(max(first_late[s], 0.0)))
            for s in range(s_count):
                variables["F"][i, s].setInitialValue(float(t[s]))
                variables["C"][i, s].setInitialValue(float(c[s]))
                variables["T"][i, s].setInitialValue(float(max(c[s] - dl, 0.0)))
                variables["u"][i, s].setInitialValue(int(missed[s]))
            short = max(0, problem.required_ok - (s_count - int(missed.sum())))
            variables["r"][i].setInitialValue(short / problem.required_ok)


def _read_plan(problem: PlanProblem, variables: dict[str, Any]) -> Plan | None:
    def on(var: Any) -> bool:
        return var.varValue is not None and var.varValue > 0.5

    succ = {i: j for (i, j), v in variables["nxt"].items() if on(v)}
    queues: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for g in range(len(problem.instances)):
        head = [i for (h, i), v in variables["first"].items() if h == g and on(v)]
        order: list[int] = []
        cur = head[0] if head else None
        while cur is not None and cur not in seen:
            order.append(cur)
            seen.add(cur)
            cur = succ.get(cur)
        queues.append(tuple(order))
    if len(seen) != len(problem.groups):
        return None
    return tuple(queues)


def solve_milp(
    problem: PlanProblem,
    *,
    start: Plan | None = None,
    time_limit_s: float | None = None,
    solver: str = "cbc",
    deadline: Deadline | None = None,
) -> tuple[Plan, Literal["optimal", "feasible"], float | None] | None:
    """Solve exactly (or until the time limit). Returns (plan, status, gap) with status
    ``optimal`` or ``feasible``, or ``None`` when the solver found no plan or failed.

    ``deadline``: the solver gets what is left of it once the model is built (at most
    ``time_limit_s``); with less than ``MILP_MIN_S`` left it is not run (``None``)."""
    lp, variables = build_milp(problem)
    if start is not None:
        _warm_values(problem, start, variables)
    if deadline is not None:
        left = deadline.left_s()
        if left < MILP_MIN_S or deadline.spent():
            return None
        if not math.isinf(left):
            time_limit_s = left if time_limit_s is None else min(time_limit_s, left)
    # Whole hundredths, rounded down: the solver never gets more than it was given.
    limit = None if time_limit_s is None else max(0.01, math.floor(time_limit_s * 100) / 100)
    try:
        status = lp.solve(make_solver(solver, limit, start is not None))
    except pulp.PulpSolverError as exc:
        note_failure(resolve_solver(solver), exc)
        return None
    plan = _read_plan(problem, variables)
    if plan is None:
        return None
    optimal = pulp.LpStatus[status] == "Optimal" and lp.sol_status == pulp.LpSolutionOptimal
    gap = 0.0 if optimal else _relative_gap(lp)
    return plan, "optimal" if optimal else "feasible", gap


def _relative_gap(lp: pulp.LpProblem) -> float | None:
    """The MIP gap the solver reached, where it reports one: HiGHS does (through its model);
    PuLP's CBC interface reads only the solution file, which has no bound."""
    model = getattr(lp, "solverModel", None)
    if model is None or not hasattr(model, "getInfo"):
        return None
    gap = float(model.getInfo().mip_gap)
    return gap if math.isfinite(gap) else None
