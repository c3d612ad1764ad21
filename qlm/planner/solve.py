"""Solving the plan problem fast: construction, local search, and the MILP where it pays.

The literal position-indexed MILP of §7 does not scale (issue 4 measured CBC and HiGHS stalling at
2 × 8). This solver decomposes instead:

1. **Construction.** Two starts, both scored exactly: *EDF with earliest-finish assignment* (groups
   by deadline, each to the eligible queue where it would finish first, switch costs included) and
   the *warm start* — the current plan with departed groups dropped and new groups inserted at their
   cheapest position. The better one is the incumbent, so the result is never worse than EDF.
2. **Local search** on the exact SAA objective (``program.score_orders`` scores many candidate
   orders of a queue in one numpy pass): *relocate* — take a group out of a queue that costs
   something and put it at its best position on any queue that serves its model (this also moves
   hopeless groups to the tail, the Moore–Hodgson step that maximises met deadlines), and *swap*
   adjacent groups. Best move per group, passes until no move improves or the budget ends.
3. **MILP** (``qlm.planner.milp``): when the problem is small enough for CBC/HiGHS to prove
   optimality within the budget, the whole problem is solved exactly from the incumbent (warm
   start), and the status says ``optimal`` or ``feasible`` (time limit hit, gap reported).

The budget is compute time and/or a count of evaluated candidate orders; simulations use the count
so that a run is reproducible bit for bit on any machine. The best plan found is always returned.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from qlm.errors import check_setting
from qlm.planner.program import (
    IntArray,
    Plan,
    PlanProblem,
    check_plan,
    score_many,
    score_orders,
    score_queue,
)

Status = Literal["optimal", "feasible", "heuristic", "fallback"]


@dataclass(frozen=True, slots=True)
class Budget:
    """How long the planner may think: seconds of compute and/or candidate orders scored.
    ``milp_max_groups``: solve the MILP only up to this many groups (0 disables it)."""

    time_s: float | None = 0.1
    evaluations: int | None = None
    milp_max_groups: int = 8
    max_positions: int = 48

    def __post_init__(self) -> None:
        ok = self.time_s is None or self.time_s > 0
        check_setting(ok, "planner.budget.time_s", "> 0 or unset", self.time_s)
        ok = self.evaluations is None or self.evaluations >= 1
        check_setting(ok, "planner.budget.evaluations", ">= 1 or unset", self.evaluations)


@dataclass(frozen=True, slots=True)
class Solution:
    """A plan with how good it is and how it was found."""

    plan: Plan
    objective: float
    status: Status
    method: str
    edf_objective: float
    at_risk: tuple[int, ...]  # groups whose chance constraint the plan does not meet
    gap: float | None = None
    evaluations: int = 0
    solve_s: float = 0.0


class _Meter:
    """Counts candidate orders scored and watches the compute budget."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.count = 0
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left_s(self) -> float:
        if self.budget.time_s is None:
            return math.inf
        return self.budget.time_s - self.elapsed()

    def spent(self) -> bool:
        b = self.budget
        if b.evaluations is not None and self.count >= b.evaluations:
            return True
        return b.time_s is not None and self.elapsed() >= b.time_s

    def score(self, problem: PlanProblem, g: int, orders: IntArray) -> np.ndarray:
        self.count += len(orders)
        return score_orders(problem, g, orders)

    def score_many(self, problem: PlanProblem, gs: IntArray, orders: IntArray) -> np.ndarray:
        self.count += len(orders)
        return score_many(problem, gs, orders)


# --- construction --------------------------------------------------------------------------------


def edf_plan(problem: PlanProblem) -> Plan:
    """Groups by deadline; each to the eligible queue where it would finish first (mean times)."""
    q = len(problem.instances)
    p_mean = problem.proc.mean(axis=2)
    floor_mean = problem.floor.mean(axis=2)
    load = problem.ready.copy()
    last = problem.active.copy()
    queues: list[list[int]] = [[] for _ in range(q)]
    order = sorted(range(len(problem.groups)), key=lambda i: (problem.deadline[i], i))
    for i in order:
        m = problem.model_idx[i]
        best, best_t = -1, math.inf
        for g in np.flatnonzero(problem.eligible[i]):
            sw = problem.switch[g, m] if last[g] != m else 0.0
            t = load[g] + sw + max(p_mean[i, g], floor_mean[i, g])
            if t < best_t:
                best, best_t = int(g), t
        if best < 0:
            raise ValueError(
                f"group {problem.groups[i].id} has no instance serving {problem.models[m]}"
            )
        sw = problem.switch[best, m] if last[best] != m else 0.0
        load[best] += sw + p_mean[i, best]
        last[best] = m
        queues[best].append(i)
    return tuple(tuple(o) for o in queues)


def _insertion_positions(length: int, limit: int, hint: int) -> np.ndarray:
    """Candidate insertion positions: all of them for short queues; otherwise head, tail, a
    window around ``hint`` and evenly spaced ones."""
    if length + 1 <= limit:
        return np.arange(length + 1)
    window = np.arange(max(0, hint - limit // 4), min(length, hint + limit // 4) + 1)
    spread = np.linspace(0, length, num=limit // 2).round().astype(np.int64)
    return np.unique(np.concatenate([[0, length], window, spread]))


def _deadline_slot(problem: PlanProblem, order: Sequence[int], x: int) -> int:
    dl = problem.deadline
    return int(np.searchsorted(dl[np.asarray(order, np.int64)], dl[x])) if order else 0


def _best_insertion(
    problem: PlanProblem, meter: _Meter, queues: list[list[int]], x: int, costs: list[float]
) -> tuple[float, int, int]:
    """Cheapest (added cost, queue, position) for inserting group ``x``: every candidate position
    on every queue that serves it, scored in one batch."""
    eligible = np.flatnonzero(problem.eligible[x])
    lengths = np.array([len(queues[g]) for g in eligible], np.int64)
    width = int(lengths.max(initial=0))
    mat = np.full((len(eligible), width + 1), problem.pad, np.int64)
    owners: list[np.ndarray] = []
    places: list[np.ndarray] = []
    for r, g in enumerate(eligible):
        order = queues[g]
        mat[r, : len(order)] = order
        positions = _insertion_positions(
            len(order), meter.budget.max_positions, _deadline_slot(problem, order, x)
        )
        owners.append(np.full(len(positions), r, np.int64))
        places.append(positions)
    row_of = np.concatenate(owners)
    pos = np.concatenate(places)[:, None]
    cols = np.arange(width + 1)[None, :]
    src = np.where(cols < pos, cols, cols - 1)
    rows = mat[row_of[:, None], np.clip(src, 0, width)]
    rows[cols == pos] = x
    gs = eligible[row_of]
    scores = meter.score_many(problem, gs, rows) - np.asarray(costs)[gs]
    k = int(np.argmin(scores))
    return float(scores[k]), int(gs[k]), int(pos[k, 0])


REMOVAL_BLOCK = 64
"""Positions whose removal costs are scored at once: a long queue is scored block by block, so
that the time budget is checked between blocks (one block of a 1,000-group queue is ~10 ms)."""


def _removal_costs(
    problem: PlanProblem, meter: _Meter, order: list[int], g: int, start: int = 0, stop: int = -1
) -> np.ndarray:
    """Cost of queue ``g`` without each of its groups at positions ``start:stop`` (row ``j``:
    without ``order[start + j]``)."""
    k = len(order)
    stop = k if stop < 0 else min(stop, k)
    base = np.asarray(order, np.int64)
    positions = np.arange(start, stop)
    cols = np.arange(k - 1)
    # row j skips position p = positions[j]: columns before p map to themselves, after to +1
    index = cols[None, :] + (cols[None, :] >= positions[:, None])
    rows = base[index]
    return meter.score_many(problem, np.full(len(positions), g, np.int64), rows)


def warm_plan(problem: PlanProblem, previous: Sequence[Sequence[int]], meter: _Meter) -> Plan:
    """``previous`` (group indices per queue, possibly partial) with every group it lacks inserted
    at its cheapest position, in deadline order."""
    placed: set[int] = set()
    queues: list[list[int]] = []
    for g, order in enumerate(previous):
        keep = [i for i in order if problem.eligible[i, g] and i not in placed]
        placed.update(keep)
        queues.append(keep)
    queues.extend([] for _ in range(len(problem.instances) - len(queues)))
    costs = [score_queue(problem, g, o).cost for g, o in enumerate(queues)]
    missing = sorted(
        set(range(len(problem.groups))) - placed, key=lambda i: (problem.deadline[i], i)
    )
    for x in missing:
        _, g, pos = _best_insertion(problem, meter, queues, x, costs)
        queues[g].insert(pos, x)
        costs[g] = score_queue(problem, g, queues[g]).cost
    return tuple(tuple(o) for o in queues)


# --- local search --------------------------------------------------------------------------------


def local_search(problem: PlanProblem, start: Plan, meter: _Meter) -> Plan:
    """Relocate and adjacent-swap moves on the exact objective until none improves or the budget
    is spent. Relocation starts from queues that are late or at risk (only they can gain much);
    every queue is then put in Smith's order (weight per second of work) where that costs
    nothing, and its neighbours swapped where that helps."""
    queues = [list(o) for o in start]
    scores = [score_queue(problem, g, o) for g, o in enumerate(queues)]
    costs = [sc.cost for sc in scores]
    penalties = [sc.penalty for sc in scores]
    improved = True
    while improved and not meter.spent():
        improved = False
        for g in sorted(range(len(queues)), key=lambda g: -penalties[g]):
            if penalties[g] <= 1e-9:
                break
            order = list(queues[g])
            removal, block = np.empty(0), -1
            for k, x in enumerate(order):
                if meter.spent():
                    break
                if queues[g] == order and block != k // REMOVAL_BLOCK:
                    block = k // REMOVAL_BLOCK
                    first = block * REMOVAL_BLOCK
                    removal = _removal_costs(problem, meter, order, g, first, first + REMOVAL_BLOCK)
                if queues[g] != order:  # the queue changed: refresh what removal costs
                    if x not in queues[g]:
                        continue
                    rest = [i for i in queues[g] if i != x]
                    removed = score_queue(problem, g, rest).cost
                    meter.count += 1
                else:
                    rest = order[:k] + order[k + 1 :]
                    removed = float(removal[k % REMOVAL_BLOCK])
                trial_costs = list(costs)
                trial_costs[g] = removed
                trial = [rest if h == g else o for h, o in enumerate(queues)]
                delta, h, pos = _best_insertion(problem, meter, trial, x, trial_costs)
                gain = costs[g] - removed - delta
                if gain > 1e-9 * max(1.0, abs(costs[g])):
                    queues[g] = rest
                    queues[h].insert(pos, x)
                    for q in {g, h}:
                        sc = score_queue(problem, q, queues[q])
                        costs[q], penalties[q] = sc.cost, sc.penalty
                    improved = True
            if meter.spent():
                break
        for g in range(len(queues)):
            if meter.spent():
                break
            changed = _smith_order(problem, meter, queues, costs, g)
            changed |= _adjacent_swaps(problem, meter, queues, costs, g)
            if changed:
                penalties[g] = score_queue(problem, g, queues[g]).penalty
                improved = True
    return tuple(tuple(o) for o in queues)


def _smith_order(
    problem: PlanProblem, meter: _Meter, queues: list[list[int]], costs: list[float], g: int
) -> bool:
    """Try the queue in Smith's order (most weight per second of work first, models kept in
    blocks by their first appearance); keep it if it costs less."""
    order = queues[g]
    if len(order) < 2 or problem.flow_weight <= 0:
        return False
    idx = np.asarray(order, np.int64)
    density = problem.weight[idx] / np.maximum(problem.proc[idx, g, :].mean(axis=1), 1e-9)
    models = problem.model_idx[idx]
    first_seen = {int(m): k for k, m in reversed(list(enumerate(models)))}
    block = np.array([first_seen[int(m)] for m in models])
    candidate = idx[np.lexsort((-density, block))]
    if np.array_equal(candidate, idx):
        return False
    score = float(meter.score(problem, g, candidate[None, :])[0])
    if score < costs[g] - 1e-9 * max(1.0, abs(costs[g])):
        queues[g] = [int(v) for v in candidate]
        costs[g] = score
        return True
    return False


def _adjacent_swaps(
    problem: PlanProblem, meter: _Meter, queues: list[list[int]], costs: list[float], g: int
) -> bool:
    order = queues[g]
    k = len(order)
    if k < 2:
        return False
    base = np.asarray(order, np.int64)
    rows = np.repeat(base[None, :], k - 1, axis=0)
    idx = np.arange(k - 1)
    rows[idx, idx], rows[idx, idx + 1] = base[idx + 1], base[idx]
    scores = meter.score(problem, g, rows)
    j = int(np.argmin(scores))
    if scores[j] < costs[g] - 1e-9 * max(1.0, abs(costs[g])):
        queues[g] = [int(v) for v in rows[j]]
        costs[g] = float(scores[j])
        return True
    return False


# --- the planner's entry point -------------------------------------------------------------------


def solve(
    problem: PlanProblem,
    budget: Budget | None = None,
    *,
    previous: Sequence[Sequence[int]] | None = None,
    solver: str = "auto",
) -> Solution:
    """The best plan found within ``budget``: construction, local search, then the MILP when the
    problem is small enough to prove optimality."""
    budget = budget or Budget()
    meter = _Meter(budget)
    n = len(problem.groups)
    edf = edf_plan(problem)
    edf_cost = _total(problem, edf)
    if n == 0:
        return _solution(problem, edf, "optimal", "empty", edf_cost, meter)
    best, best_cost, method = edf, edf_cost, "edf"
    if previous is not None:
        warm = warm_plan(problem, previous, meter)
        warm_cost = _total(problem, warm)
        if warm_cost < best_cost:
            best, best_cost, method = warm, warm_cost, "warm"
    if meter.spent():
        return _solution(problem, best, "fallback", method, edf_cost, meter)
    searched = local_search(problem, best, meter)
    searched_cost = _total(problem, searched)
    if searched_cost < best_cost - 1e-9:
        best, best_cost, method = searched, searched_cost, method + "+local"
    status: Status = "heuristic"
    gap: float | None = None
    if n <= budget.milp_max_groups and meter.left_s() > 0:
        from qlm.planner.milp import solve_milp  # PuLP is only imported when it is used

        time_limit = None if budget.time_s is None else max(meter.left_s(), 0.05)
        result = solve_milp(problem, start=best, time_limit_s=time_limit, solver=solver)
        if result is not None:
            plan, milp_status, gap = result
            cost = _total(problem, plan)
            if cost <= best_cost + 1e-6 * max(1.0, abs(best_cost)):
                best, best_cost = plan, min(cost, best_cost)
                method += "+milp"
                status = milp_status
    return _solution(problem, best, status, method, edf_cost, meter, gap)


def _total(problem: PlanProblem, plan: Plan) -> float:
    return sum(score_queue(problem, g, o).cost for g, o in enumerate(plan))


def _solution(
    problem: PlanProblem,
    plan: Plan,
    status: Status,
    method: str,
    edf_cost: float,
    meter: _Meter,
    gap: float | None = None,
) -> Solution:
    check_plan(problem, plan)
    at_risk: list[int] = []
    for g, order in enumerate(plan):
        details = score_queue(problem, g, order)
        at_risk.extend(i for i, miss in zip(order, details.missed, strict=True) if miss)
    return Solution(
        plan=plan,
        objective=_total(problem, plan),
        status=status,
        method=method,
        edf_objective=edf_cost,
        at_risk=tuple(sorted(at_risk)),
        gap=gap,
        evaluations=meter.count,
        solve_s=meter.elapsed(),
    )


def brute_force(problem: PlanProblem) -> tuple[Plan, float]:
    """The optimal plan by enumerating every assignment and order (tiny problems only: the count
    is ``n! · C(n+q-1, q-1)``). Used to check the other solvers."""
    n, q = len(problem.groups), len(problem.instances)
    if n > 9:
        raise ValueError(f"brute force over {n} groups would take too long")
    cache: dict[tuple[int, tuple[int, ...]], float] = {}

    def cost(g: int, order: tuple[int, ...]) -> float:
        key = (g, order)
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = score_queue(problem, g, order).cost
        return hit

    best: tuple[Plan, float] = ((), math.inf)
    # A sequence of the n groups and q-1 separators (-1-k) read left to right is one plan.
    items = list(range(n)) + [-1 - k for k in range(q - 1)]
    for perm in itertools.permutations(items):
        seps = [v for v in perm if v < 0]
        if seps != sorted(seps, reverse=True):
            continue  # separators are interchangeable: keep one order of them
        plan: list[tuple[int, ...]] = []
        cur: list[int] = []
        for v in perm:
            if v < 0:
                plan.append(tuple(cur))
                cur = []
            else:
                cur.append(v)
        plan.append(tuple(cur))
        if any(not problem.eligible[i, g] for g, o in enumerate(plan) for i in o):
            continue
        total = sum(cost(g, o) for g, o in enumerate(plan))
        if total < best[1]:
            best = (tuple(plan), total)
    return best


# --- admission (§A.3) ----------------------------------------------------------------------------


def capacity_needed(
    problem: PlanProblem, *, limit: float = 64.0, hint: float | None = None
) -> float | None:
    """By how much the fleet's throughput would have to grow for an EDF plan to meet every chance
    constraint that any capacity can meet (1.0: it already does), within 2 %. ``None`` if even
    ``limit`` times the capacity is not enough. Groups whose latency floor alone misses the
    deadline are left out: more instances cannot help them.

    ``hint`` (the last plan's answer) brackets the search around it: a few EDF plans instead of a
    dozen when the answer moved little, and within the same 2 %."""
    if not problem.groups:
        return 1.0
    ok = (problem.ready[None, :, None] + problem.floor <= problem.deadline[:, None, None]).sum(
        axis=2
    )
    helpable = (ok >= problem.required_ok).any(axis=1)

    def meets(alpha: float) -> bool:
        scaled = replace(problem, proc=problem.proc / alpha)
        plan = edf_plan(scaled)
        for g, order in enumerate(plan):
            details = score_queue(scaled, g, order)
            if any(miss and helpable[i] for i, miss in zip(order, details.missed, strict=True)):
                return False
        return True

    if meets(1.0):
        return 1.0
    lo, hi = 1.0, limit
    if hint is not None and 1.0 < hint < limit:
        step = 1.1
        if meets(hint):  # walk down until it fails
            hi = hint
            while hi / step > lo and meets(hi / step):
                hi, step = hi / step, step * step
            lo = max(lo, hi / step)
        else:  # walk up until it holds
            lo = hint
            while lo * step < hi and not meets(lo * step):
                lo, step = lo * step, step * step
            if lo * step >= hi:
                if not meets(limit):
                    return None
            else:
                hi = lo * step
    elif not meets(limit):
        return None
    while hi / lo > 1.02:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if meets(mid) else (mid, hi)
    return hi
