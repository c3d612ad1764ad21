"""Solving the plan problem fast: construction, local search, and the MILP where it pays.

The literal position-indexed MILP of §7 does not scale (CBC and HiGHS stall already at
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
import logging
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from qlm.planner.budget import Budget as Budget
from qlm.planner.budget import Deadline
from qlm.planner.milp import MILP_MIN_S
from qlm.planner.program import (
    IntArray,
    Plan,
    PlanProblem,
    QueueScore,
    check_plan,
    score_many,
    score_orders,
    score_queue,
)

Status = Literal["optimal", "feasible", "heuristic", "fallback"]

log = logging.getLogger(__name__)


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


def _score(problem: PlanProblem, meter: Deadline, g: int, orders: IntArray) -> np.ndarray:
    meter.charge(len(orders))
    return score_orders(problem, g, orders)


def _score_many(
    problem: PlanProblem, meter: Deadline, gs: IntArray, orders: IntArray
) -> np.ndarray:
    meter.charge(len(orders))
    return score_many(problem, gs, orders)


# --- construction --------------------------------------------------------------------------------


def edf_plan(problem: PlanProblem) -> Plan:
    """Groups by deadline; each to the eligible queue where it would finish first (mean times)."""
    plan = _edf_until(problem, None)
    assert plan is not None  # (without ``stop`` every group is placed)
    return plan


def _edf_until(problem: PlanProblem, stop: Callable[[], bool] | None) -> Plan | None:
    """``edf_plan``, or None when ``stop`` says so before every group is placed."""
    queues: list[list[int]] = [[] for _ in problem.instances]
    if not append_edf(problem, queues, _by_deadline(problem, range(len(problem.groups))), stop):
        return None
    return tuple(tuple(o) for o in queues)


def _by_deadline(problem: PlanProblem, groups: Iterable[int]) -> list[int]:
    """Earliest deadline first: end-to-end or first-token, whichever is earlier."""
    rows = np.fromiter(groups, np.int64)
    # (sorted by (due, index), as ``sorted(groups, key=lambda i: (due[i], i))``, in numpy)
    return rows[np.lexsort((rows, problem.due[rows]))].tolist()  # type: ignore[no-any-return]


EDF_CHECK = 512
"""Groups placed by ``append_edf`` between two looks at the clock, when it is given one."""


def append_edf(
    problem: PlanProblem,
    queues: list[list[int]],
    groups: Sequence[int],
    stop: Callable[[], bool] | None = None,
) -> bool:
    """Append ``groups``, in the order given, at the tails of ``queues``: each to the eligible
    queue where it would finish first behind what that queue holds (mean times, model switches
    included). Linear in groups × queues, with no search: the plan of last resort.

    ``stop`` is asked every ``EDF_CHECK`` groups; when it says so the rest are left out and the
    answer is False (True: every group placed)."""
    p_mean = problem.proc.mean(axis=2)
    p_done = np.maximum(p_mean, problem.floor.mean(axis=2))
    load = problem.ready.copy()
    last = problem.active.copy()
    for g, order in enumerate(queues):
        if order:
            idx = np.asarray(order, np.int64)
            models = problem.model_idx[idx]
            prev = np.concatenate([[last[g]], models[:-1]])
            sw = np.where(models != prev, problem.switch[g, models], 0.0)
            load[g] += float((sw + p_mean[idx, g]).sum())
            last[g] = models[-1]
    # In Python floats, one group after the other: the same sums, comparisons and first-lowest
    # choice as numpy's ``argmin(load + switch + done)`` per group, at a fraction of its calls.
    # (Flat lists, row k at [k * q, (k + 1) * q): a list per row would be tens of thousands of
    # objects that outlive the young collections, and their promotion brings on full ones.)
    rows = np.asarray(groups, np.int64)
    done_flat = p_done[rows].ravel().tolist()
    mean_flat = p_mean[rows].ravel().tolist()
    model_of = problem.model_idx[rows].tolist()
    switch_to = problem.switch.T.tolist()  # per model, its switch time on each queue
    loads = load.tolist()
    lasts = last.tolist()
    span = range(len(loads))
    queue_count = len(loads)
    for k, i in enumerate(groups):
        if stop is not None and k % EDF_CHECK == 0 and k and stop():
            return False
        m = model_of[k]
        row = k * queue_count
        done = done_flat[row : row + queue_count]
        sw_m = switch_to[m]
        if lasts.count(m) == queue_count:  # no switch anywhere: each v is loads + done
            finish = list(map(operator.add, loads, done))
            best = finish.index(min(finish))  # (the first lowest, as the loop below)
        else:
            best, best_v = 0, math.inf
            for g in span:
                v = loads[g] + (sw_m[g] if lasts[g] != m else 0.0) + done[g]
                if v < best_v:
                    best, best_v = g, v
        if not problem.eligible[i, best]:
            raise ValueError(
                f"group {problem.groups[i].id} has no instance serving {problem.models[m]}"
            )
        loads[best] += (sw_m[best] if lasts[best] != m else 0.0) + mean_flat[row + best]
        lasts[best] = m
        queues[best].append(i)
    return True


def _insertion_positions(length: int, limit: int, hint: int) -> np.ndarray:
    """Candidate insertion positions: all of them for short queues; otherwise head, tail, a
    window around ``hint`` and evenly spaced ones."""
    if length + 1 <= limit:
        return np.arange(length + 1)
    window = np.arange(max(0, hint - limit // 4), min(length, hint + limit // 4) + 1)
    spread = np.linspace(0, length, num=limit // 2).round().astype(np.int64)
    return np.unique(np.concatenate([[0, length], window, spread]))


def _deadline_slot(problem: PlanProblem, order: Sequence[int], x: int) -> int:
    dl = problem.due
    return int(np.searchsorted(dl[np.asarray(order, np.int64)], dl[x])) if order else 0


INSERTION_CELLS = 1 << 17
"""Cells (candidate rows × their length × scenarios) scored at once by an insertion: with 3,000
groups on 16 queues one insertion is ~2.4 million cells, 0.23 s on the development machine, three
times a plan's whole budget; in blocks of this size (~15 ms) the time budget is checked between
them."""


def _best_insertion(
    problem: PlanProblem, meter: Deadline, queues: list[list[int]], x: int, costs: list[float]
) -> tuple[float, int, int]:
    """Cheapest (added cost, queue, position) for inserting group ``x`` among the candidate
    positions on every queue that serves it (``_insertion_positions``), scored in blocks; when
    the time budget ends between blocks, the cheapest of those scored."""
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
    base = np.asarray(costs)
    # In blocks of about INSERTION_CELLS cells, with the time budget checked between them; the
    # first lowest cost wins, as in one batch.
    step = max(1, INSERTION_CELLS // ((width + 1) * problem.proc.shape[2]))
    best: tuple[float, int, int] | None = None
    for first in range(0, len(gs), step):
        if best is not None and meter.left_s() <= 0:
            break
        block = slice(first, first + step)
        scores = _score_many(problem, meter, gs[block], rows[block]) - base[gs[block]]
        k = int(np.argmin(scores))
        if best is None or scores[k] < best[0]:
            best = float(scores[k]), int(gs[block][k]), int(pos[block][k, 0])
    if best is None:
        raise ValueError(f"group {problem.groups[x].id} has no instance serving it")
    return best


REMOVAL_BLOCK = 64
"""Positions whose removal costs are scored at once: a long queue is scored block by block, so
that the time budget is checked between blocks (one block of a 1,000-group queue is ~10 ms)."""


def _removal_costs(
    problem: PlanProblem, meter: Deadline, order: list[int], g: int, start: int = 0, stop: int = -1
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
    return _score_many(problem, meter, np.full(len(positions), g, np.int64), rows)


def warm_plan(problem: PlanProblem, previous: Sequence[Sequence[int]], meter: Deadline) -> Plan:
    """``previous`` (group indices per queue, possibly partial) with every group it lacks inserted
    at its cheapest position, in deadline order, while ``meter`` lasts; the groups left when it
    is spent go to the queues' tails earliest deadline first (``append_edf``)."""
    placed: set[int] = set()
    queues: list[list[int]] = []
    for g, order in enumerate(previous):
        keep = [i for i in order if problem.eligible[i, g] and i not in placed]
        placed.update(keep)
        queues.append(keep)
    queues.extend([] for _ in range(len(problem.instances) - len(queues)))
    missing = _by_deadline(problem, set(range(len(problem.groups))) - placed)
    costs = [score_queue(problem, g, o).cost for g, o in enumerate(queues)] if missing else []
    for k, x in enumerate(missing):
        if meter.spent():
            append_edf(problem, queues, missing[k:])
            break
        _, g, pos = _best_insertion(problem, meter, queues, x, costs)
        queues[g].insert(pos, x)
        costs[g] = score_queue(problem, g, queues[g]).cost
    return tuple(tuple(o) for o in queues)


# --- local search --------------------------------------------------------------------------------


def local_search(problem: PlanProblem, start: Plan, meter: Deadline) -> Plan:
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
                    meter.charge(1)
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
    problem: PlanProblem, meter: Deadline, queues: list[list[int]], costs: list[float], g: int
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
    score = float(_score(problem, meter, g, candidate[None, :])[0])
    if score < costs[g] - 1e-9 * max(1.0, abs(costs[g])):
        queues[g] = [int(v) for v in candidate]
        costs[g] = score
        return True
    return False


SWAP_CELLS = 1 << 16
"""Rows × groups scored at once by the adjacent swaps: a queue of up to 256 groups in one batch,
a longer one in batches of fewer rows, with the budget checked between them."""


def _adjacent_swaps(
    problem: PlanProblem, meter: Deadline, queues: list[list[int]], costs: list[float], g: int
) -> bool:
    """Swap the two neighbours whose swap lowers the queue's cost most, if any does (of the
    swaps scored before the budget ran out)."""
    order = queues[g]
    k = len(order)
    if k < 2:
        return False
    base = np.asarray(order, np.int64)
    rows_per_batch = max(1, SWAP_CELLS // k)
    best_j, best = -1, math.inf
    for first in range(0, k - 1, rows_per_batch):
        if first and meter.spent():
            break
        idx = np.arange(first, min(first + rows_per_batch, k - 1))
        rows = np.repeat(base[None, :], len(idx), axis=0)
        r = np.arange(len(idx))
        rows[r, idx], rows[r, idx + 1] = base[idx + 1], base[idx]
        scores = _score(problem, meter, g, rows)
        j = int(np.argmin(scores))
        if scores[j] < best:
            best_j, best = int(idx[j]), float(scores[j])
    if best_j >= 0 and best < costs[g] - 1e-9 * max(1.0, abs(costs[g])):
        order[best_j], order[best_j + 1] = order[best_j + 1], order[best_j]
        costs[g] = best
        return True
    return False


# --- the planner's entry point -------------------------------------------------------------------


def solve(
    problem: PlanProblem,
    budget: Budget | Deadline | None = None,
    *,
    previous: Sequence[Sequence[int]] | None = None,
    solver: str = "auto",
) -> Solution:
    """The best plan found within ``budget``: construction, local search, then the MILP when the
    problem is small enough to prove optimality.

    ``budget``: a ``Deadline`` already running (the caller's clock, or a fake), or a ``Budget``
    started now on the wall clock (default ``Budget()``). Every stage asks the deadline between
    units of work and stops when it is spent; the EDF plan is always built and is the floor."""
    meter = budget if isinstance(budget, Deadline) else (budget or Budget()).start()
    began_s = meter.elapsed_s()  # (a deadline may have started before the solver)
    scores = _Scores(problem)
    parts = _Parts(meter)
    limits = meter.budget
    n = len(problem.groups)
    edf = edf_plan(problem)
    edf_cost = scores.total(edf)
    parts.done("edf")
    if n == 0:
        return _solution(scores, edf, "optimal", "empty", edf_cost, meter, began_s)
    best, best_cost, method = edf, edf_cost, "edf"
    if previous is not None:
        warm = warm_plan(problem, previous, meter)
        warm_cost = scores.total(warm)
        parts.done("warm")
        if warm_cost < best_cost:
            best, best_cost, method = warm, warm_cost, "warm"
    if meter.spent():
        return parts.check(_solution(scores, best, "fallback", method, edf_cost, meter, began_s))
    searched = local_search(problem, best, meter)
    searched_cost = scores.total(searched)
    parts.done("local")
    if searched_cost < best_cost - 1e-9:
        best, best_cost, method = searched, searched_cost, method + "+local"
    status: Status = "heuristic"
    gap: float | None = None
    left = meter.left_s()
    if n <= limits.milp_max_groups and left >= MILP_MIN_S and not meter.spent():
        from qlm.planner.milp import solve_milp  # PuLP is only imported when it is used

        result = solve_milp(problem, start=best, solver=solver, deadline=meter)
        parts.done("milp")
        if result is not None:
            plan, milp_status, gap = result
            cost = scores.total(plan)
            if cost <= best_cost + 1e-6 * max(1.0, abs(best_cost)):
                best, best_cost = plan, min(cost, best_cost)
                method += "+milp"
                status = milp_status
    return parts.check(_solution(scores, best, status, method, edf_cost, meter, began_s, gap))


OVERRUN = 2.0
"""A solve that took more than this × its time budget (and 50 ms more) logs where it went."""


class _Parts:
    """Seconds each stage of one solve took, on the deadline's clock, for the overrun warning."""

    def __init__(self, meter: Deadline) -> None:
        self.meter = meter
        self.last = meter.elapsed_s()
        self.seconds: dict[str, float] = {}

    def done(self, stage: str) -> None:
        now = self.meter.elapsed_s()
        self.seconds[stage] = now - self.last
        self.last = now

    def check(self, solution: Solution) -> Solution:
        self.done("finish")
        limit = self.meter.budget.time_s
        if limit is not None and solution.solve_s > OVERRUN * limit + 0.05:
            log.warning(
                "planning %d groups on %d queues took %.2f s of a %.2f s budget: %s",
                sum(len(o) for o in solution.plan),
                len(solution.plan),
                solution.solve_s,
                limit,
                ", ".join(f"{k} {v:.3f} s" for k, v in self.seconds.items()),
            )
        return solution


class _Scores:
    """The queues one ``solve`` scored whole, so that a queue no stage changed is scored once
    (most of them, in a large plan)."""

    def __init__(self, problem: PlanProblem) -> None:
        self.problem = problem
        self._seen: dict[tuple[int, tuple[int, ...]], QueueScore] = {}

    def queue(self, g: int, order: tuple[int, ...]) -> QueueScore:
        score = self._seen.get((g, order))
        if score is None:
            score = self._seen[(g, order)] = score_queue(self.problem, g, order)
        return score

    def total(self, plan: Plan) -> float:
        return sum(self.queue(g, o).cost for g, o in enumerate(plan))


def _solution(
    scores: _Scores,
    plan: Plan,
    status: Status,
    method: str,
    edf_cost: float,
    meter: Deadline,
    began_s: float,
    gap: float | None = None,
) -> Solution:
    check_plan(scores.problem, plan)
    at_risk: list[int] = []
    for g, order in enumerate(plan):
        details = scores.queue(g, order)
        at_risk.extend(np.asarray(order, np.int64)[details.missed].tolist())
    return Solution(
        plan=plan,
        objective=scores.total(plan),
        status=status,
        method=method,
        edf_objective=edf_cost,
        at_risk=tuple(sorted(at_risk)),
        gap=gap,
        evaluations=meter.count,
        solve_s=meter.elapsed_s() - began_s,
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


class _Spent(Exception):
    """The deadline ran out in the middle of a search."""


def capacity_needed(
    problem: PlanProblem,
    *,
    limit: float = 64.0,
    hint: float | None = None,
    deadline: Deadline | None = None,
) -> float | None:
    """By how much the fleet's throughput would have to grow for an EDF plan to meet every chance
    constraint that any capacity can meet (1.0: it already does), within 2 %. ``None`` if even
    ``limit`` times the capacity is not enough. Groups whose latency floor alone misses the
    deadline, or whose first token misses its deadline even if pulled now, are left out: more
    instances cannot help them.

    ``hint`` (the last plan's answer) brackets the search around it: a few EDF plans instead of a
    dozen when the answer moved little, and within the same 2 %.

    ``deadline`` is asked before each EDF plan tried (each is charged one scored order per
    queue). When it runs out first the answer is the smallest capacity found to be enough (an
    upper bound, coarser than 2 %), else ``hint`` (the last answer stands), else ``None``."""
    if not problem.groups:
        return 1.0
    enough: list[float] = []
    try:
        return _capacity_search(problem, limit, hint, deadline, enough)
    except _Spent:
        return min(enough, default=hint)


def _capacity_search(
    problem: PlanProblem,
    limit: float,
    hint: float | None,
    deadline: Deadline | None,
    enough: list[float],
) -> float | None:
    helpable: list[np.ndarray] = []  # (computed when first needed: a whole pass over floor)

    def can_help() -> np.ndarray:
        if not helpable:
            ok = problem.ready[None, :, None] + problem.floor <= problem.deadline[:, None, None]
            # (and whose first token, were it pulled now, is in time)
            first_ok = problem.ttft_now_pad[: len(problem.groups)] <= 0.0
            helpable.append(((ok.sum(axis=2) >= problem.required_ok) & first_ok).any(axis=1))
        return helpable[0]

    def late() -> bool:  # (the time budget only: the count was charged for the whole plan)
        return deadline is not None and deadline.left_s() <= 0

    def meets(alpha: float) -> bool:
        if deadline is not None:
            if deadline.spent():
                raise _Spent
            deadline.charge(len(problem.instances))
        scaled = replace(problem, proc=problem.proc / alpha)
        plan = _edf_until(scaled, late)
        if plan is None:
            raise _Spent
        for g, order in enumerate(plan):
            if late():
                raise _Spent
            missed = score_queue(scaled, g, order).missed
            if missed.any() and can_help()[np.asarray(order, np.int64)[missed]].any():
                return False
        enough.append(alpha)
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
