"""The planning problem of §7 as data, and the one function that scores a plan.

A *plan* puts every request group on one virtual queue (instance) in an order. The planner minimises
the expected weighted SLO violation of the groups, subject to each group's chance constraint
``P(completion <= deadline) >= Δ``, with a model-switch cost whenever consecutive groups on a queue
need different models (Eqs. 6–13).

Uncertainty is represented by sample-average approximation (SAA): ``S`` scenarios of every group's
processing time, drawn once per problem from the RCT estimator's output-length distributions (the
same draw for every instance, scaled by each instance's speed, so instances are compared on the same
luck). In scenario ``s`` a queue is a single machine in the fluid sense of Eq. 2: the groups' work is
served one after the other at the instance's throughput Θ, and a group completes at
``max(fluid finish, fluid start + latency floor)`` — its last request cannot finish before it has
been prefilled and decoded (Eq. 4), however fast the batch drains.

A group with a time-to-first-token deadline (the earliest of its requests', FlowPrefill) has its
first token predicted too: its first request is pulled ``lead`` seconds before the group's fluid
start — while the ``b − 1`` other slots of the instance's batch still hold work, half of a
request's on average (``ProblemFamily``) — and not before now, and its first token comes one
prefill later. A scenario meets the group's SLO when it meets both deadlines, as a request's SLO
is met (``RequestRecord.slo_met``); the chance constraint is met when at least ``ceil(Δ·S)``
scenarios meet it.

The score has two parts. The chance constraint is elastic: a group whose constraint is unmet costs
``risk_weight`` (much larger than any violation cost) × its weight × its *shortfall*, the fraction
of the ``ceil(Δ·S)`` scenarios it needs that it misses. So a plan meeting every chance constraint is
always preferred; under overload the planner gives up the fewest, least important groups and still
raises the odds of those it cannot make safe (a group at P = 0.6 is worth more than one at 0.1) —
the §A.3 fallback reports the groups left short. Then the expected weighted violation, in seconds:
end-to-end lateness plus first-token lateness, each weighted by the group's weight.
Every solver (construction, local search, the MILP, brute force) scores plans with this
function, so their objectives are comparable exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

RISK_WEIGHT = 1e4
"""Cost of one unit of weight whose chance constraint is unmet (seconds of weighted violation)."""


FLOW_WEIGHT = 0.01
"""Weight of the expected weighted completion time ``Σ w·E[C]``: a tie-breaker that serves more
value per second of work first (Smith's rule, the gain density of PROSERVE) among plans that are
otherwise equal — e.g. once every group meets its deadline, or none can."""


@dataclass(frozen=True, slots=True)
class PlanGroup:
    """One request group as the planner sees it."""

    id: str
    model: str
    deadline_s: float  # absolute, the group's earliest deadline
    weight: float  # importance: tier weight × number of requests
    ttft_deadline_s: float = math.inf  # absolute, its earliest time-to-first-token deadline

    @property
    def due_s(self) -> float:
        """The earlier of its two deadlines: what earliest-deadline-first orders by."""
        return min(self.deadline_s, self.ttft_deadline_s)


class GroupTable(Sequence[PlanGroup]):
    """The groups of a plan problem as columns: ids, models, deadlines, weights and TTFT
    deadlines, one list or array each. A plan of 18,000 groups holds five objects instead of
    18,000 ``PlanGroup`` s (which outlive the young garbage collections and bring on full ones);
    ``table[i]`` is the ``PlanGroup`` of row ``i``, made when asked."""

    __slots__ = ("deadline_s", "ids", "models", "ttft_deadline_s", "weight")

    def __init__(
        self,
        ids: Sequence[str],
        models: Sequence[str],
        deadline_s: FloatArray,
        weight: FloatArray,
        ttft_deadline_s: FloatArray,
    ) -> None:
        n = len(ids)
        self.ids = ids
        self.models = models
        self.deadline_s = np.asarray(deadline_s, np.float64).reshape(n)
        self.weight = np.asarray(weight, np.float64).reshape(n)
        self.ttft_deadline_s = np.asarray(ttft_deadline_s, np.float64).reshape(n)
        if len(models) != n:
            raise ValueError(f"{n} ids and {len(models)} models")

    @classmethod
    def of(cls, groups: Sequence[PlanGroup]) -> GroupTable:
        """The table of ``groups`` (itself when it is one)."""
        if isinstance(groups, GroupTable):
            return groups
        return cls(
            tuple(g.id for g in groups),
            tuple(g.model for g in groups),
            np.array([g.deadline_s for g in groups], np.float64),
            np.array([g.weight for g in groups], np.float64),
            np.array([g.ttft_deadline_s for g in groups], np.float64),
        )

    def take(self, rows: IntArray) -> GroupTable:
        """The table of the groups at ``rows``, in that order."""
        picked = rows.tolist()
        ids, models = self.ids, self.models
        return GroupTable(
            [ids[i] for i in picked],
            [models[i] for i in picked],
            self.deadline_s[rows],
            self.weight[rows],
            self.ttft_deadline_s[rows],
        )

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> PlanGroup: ...

    @overload
    def __getitem__(self, i: slice) -> GroupTable: ...

    def __getitem__(self, i: int | slice) -> PlanGroup | GroupTable:
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        return PlanGroup(
            self.ids[i],
            self.models[i],
            float(self.deadline_s[i]),
            float(self.weight[i]),
            float(self.ttft_deadline_s[i]),
        )

    def __iter__(self) -> Iterator[PlanGroup]:
        for k in range(len(self)):
            yield self[k]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"GroupTable({list(self)!r})"


@dataclass(frozen=True, slots=True)
class PlanInstance:
    """One virtual queue's instance: what it serves, what it runs now and when it is free."""

    name: str
    models: tuple[str, ...]
    active_model: str | None
    ready_s: float  # absolute time the work already running drains (fluid)
    switch_s: dict[str, float]  # time to make each model active on this instance


@dataclass(frozen=True)
class PlanProblem:
    """Groups × instances × scenarios, as arrays.

    ``proc[i, g, s]``: seconds of instance ``g`` that group ``i`` needs in scenario ``s`` (``inf``
    when ``g`` does not serve its model); ``floor[i, g, s]``: the latency floor of its last request.

    First tokens (for groups with a TTFT deadline): ``first[i, g]``, seconds from pulling the
    group's first request on instance ``g`` to its first token; ``lead[g]``, how long before a
    group's fluid start its first request is pulled; ``now_s``, the earliest a request is pulled.
    Without ``first``, pulling is instant and the lead 0.
    """

    groups: GroupTable  # (a sequence of PlanGroup is made one)
    instances: tuple[PlanInstance, ...]
    proc: FloatArray
    floor: FloatArray
    delta: float = 0.9
    risk_weight: float = RISK_WEIGHT
    flow_weight: float = FLOW_WEIGHT
    first: FloatArray | None = None
    lead: FloatArray | None = None
    now_s: float = -math.inf

    def __post_init__(self) -> None:
        table = GroupTable.of(self.groups)
        object.__setattr__(self, "groups", table)
        n, q = len(table), len(self.instances)
        if self.proc.shape[:2] != (n, q) or self.floor.shape != self.proc.shape:
            raise ValueError(f"proc/floor must be ({n}, {q}, S), got {self.proc.shape}")
        if not 0 < self.delta <= 1:
            raise ValueError(f"delta must be in (0, 1], got {self.delta}")
        models = sorted(set(table.models) | {m for i in self.instances for m in i.models})
        index = {m: k for k, m in enumerate(models)}
        object.__setattr__(self, "models", tuple(models))
        object.__setattr__(
            self, "model_idx", np.array([index[m] for m in table.models], np.int64).reshape(n)
        )
        object.__setattr__(self, "deadline", table.deadline_s)
        object.__setattr__(self, "weight", table.weight)
        object.__setattr__(self, "ready", np.array([i.ready_s for i in self.instances], np.float64))
        object.__setattr__(
            self,
            "active",
            np.array(
                [index.get(i.active_model or "", -1) for i in self.instances],
                np.int64,
            ),
        )
        switch = np.full((q, len(models)), np.inf)
        for g, inst in enumerate(self.instances):
            for m in inst.models:
                switch[g, index[m]] = inst.switch_s.get(m, 0.0)
        object.__setattr__(self, "switch", switch)
        object.__setattr__(self, "eligible", np.isfinite(self.proc[:, :, 0]))
        object.__setattr__(self, "required_ok", math.ceil(self.delta * self.scenarios - 1e-9))
        # Padded copies with one extra group ``pad`` = n: no work, no weight, never late, and a
        # model of its own whose "switch" costs nothing (so rows of different lengths batch).
        s_count = self.scenarios
        zeros = np.zeros((1, q, s_count))
        object.__setattr__(self, "pad", n)
        object.__setattr__(self, "proc_pad", _padded(self.proc, zeros))
        object.__setattr__(self, "floor_pad", _padded(self.floor, zeros))
        object.__setattr__(self, "model_pad", np.append(self.model_idx, len(models)))
        object.__setattr__(self, "switch_pad", np.concatenate([switch, np.zeros((q, 1))], axis=1))
        object.__setattr__(self, "deadline_pad", np.append(self.deadline, np.inf))
        object.__setattr__(self, "weight_pad", np.append(self.weight, 0.0))
        self._first_tokens(n, q)

    def _first_tokens(self, n: int, q: int) -> None:
        """The TTFT arrays: per group and instance, the latest fluid start whose first token
        meets the group's TTFT deadline (``ttft_start``) and the lateness of a first request
        pulled now (``ttft_now``); ``inf`` and ``-inf`` for a group without one, and the pad."""
        ttft = self.groups.ttft_deadline_s
        has = bool(np.isfinite(ttft).any())
        first = np.zeros((n, q)) if self.first is None else np.asarray(self.first, np.float64)
        lead = np.zeros(q) if self.lead is None else np.asarray(self.lead, np.float64)
        if first.shape != (n, q) or lead.shape != (q,):
            raise ValueError(f"first must be ({n}, {q}) and lead ({q},)")
        start = np.full((n + 1, q), np.inf)
        late_now = np.full((n + 1, q), -np.inf)
        if has:
            rows = np.isfinite(ttft)
            latest_pull = ttft[rows, None] - first[rows]  # (rows, q)
            start[:n][rows] = latest_pull + lead[None, :]
            late_now[:n][rows] = self.now_s - latest_pull
        object.__setattr__(self, "ttft", ttft)
        object.__setattr__(self, "has_ttft", has)
        object.__setattr__(self, "ttft_start_pad", start)
        object.__setattr__(self, "ttft_now_pad", late_now)

    # Derived in __post_init__.
    models: tuple[str, ...] = field(init=False, repr=False)
    model_idx: IntArray = field(init=False, repr=False)
    deadline: FloatArray = field(init=False, repr=False)
    weight: FloatArray = field(init=False, repr=False)
    ready: FloatArray = field(init=False, repr=False)
    active: IntArray = field(init=False, repr=False)
    switch: FloatArray = field(init=False, repr=False)
    eligible: npt.NDArray[np.bool_] = field(init=False, repr=False)
    required_ok: int = field(init=False, repr=False)
    pad: int = field(init=False, repr=False)
    proc_pad: FloatArray = field(init=False, repr=False)
    floor_pad: FloatArray = field(init=False, repr=False)
    model_pad: IntArray = field(init=False, repr=False)
    switch_pad: FloatArray = field(init=False, repr=False)
    deadline_pad: FloatArray = field(init=False, repr=False)
    weight_pad: FloatArray = field(init=False, repr=False)
    ttft: FloatArray = field(init=False, repr=False)
    has_ttft: bool = field(init=False, repr=False)
    ttft_start_pad: FloatArray = field(init=False, repr=False)
    ttft_now_pad: FloatArray = field(init=False, repr=False)

    @property
    def due(self) -> FloatArray:
        """Per group, the earlier of its end-to-end and TTFT deadlines (EDF's key)."""
        return np.minimum(self.deadline, self.ttft) if self.has_ttft else self.deadline

    @property
    def scenarios(self) -> int:
        return int(self.proc.shape[2])

    @property
    def size(self) -> tuple[int, int]:
        """(queues, groups)."""
        return len(self.instances), len(self.groups)


def padded_empty(n: int, q: int, s_count: int) -> FloatArray:
    """An ``(n, q, S)`` array to fill, whose ``PlanProblem`` pads it without a copy: it is the
    first ``n`` rows of an array with a zero row after them."""
    base = np.empty((n + 1, q, s_count))
    base[n] = 0.0
    return base[:n]


def _padded(values: FloatArray, zeros: FloatArray) -> FloatArray:
    """``values`` with ``zeros`` appended as its last row: the array ``values`` is the head of
    when it has one (``padded_empty``; at 20,000 groups a copy is ~40 MB), else a copy."""
    base = values.base
    n = len(values)
    if (
        isinstance(base, np.ndarray)
        and base.shape == (n + 1, *values.shape[1:])
        and base.flags.c_contiguous
        and values.flags.c_contiguous
        and values.ctypes.data == base.ctypes.data
        and not base[n].any()
    ):
        return base
    return np.concatenate([values, zeros])


Plan = tuple[tuple[int, ...], ...]
"""Group indices per instance, in service order."""


@dataclass(frozen=True, slots=True)
class QueueScore:
    cost: float
    violation: FloatArray  # expected violation (s) per group of the queue, in order (e2e + TTFT)
    p_meet: FloatArray  # fraction of scenarios meeting the deadline(s), per group
    missed: npt.NDArray[np.bool_]  # chance constraint unmet, per group
    penalty: float = 0.0  # the cost without the flow tie-breaker: violation and risk
    completion: FloatArray | None = None  # (groups, scenarios) completion times, in order


def score_orders(problem: PlanProblem, g: int, orders: IntArray) -> FloatArray:
    """Cost of several candidate orders of queue ``g`` at once: ``orders`` is (m, L) of group
    indices (all rows the same length). Returns (m,) costs; ``inf`` if a group is not servable."""
    return score_many(problem, np.full(len(orders), g, np.int64), orders)


def score_many(problem: PlanProblem, queues: IntArray, orders: IntArray) -> FloatArray:
    """Cost of candidate orders of possibly different queues in one numpy pass: row ``r`` is an
    order of queue ``queues[r]``; rows shorter than the widest are padded with ``problem.pad``
    (a group of no work, no weight and no model switch) at the end."""
    m, length = orders.shape
    if length == 0:
        return np.zeros(m)
    gq = queues[:, None]
    p = problem.proc_pad[orders, gq, :]  # (m, L, S)
    models = problem.model_pad[orders]  # (m, L)
    prev = np.concatenate([problem.active[queues][:, None], models[:, :-1]], axis=1)
    sw = np.where(models != prev, problem.switch_pad[gq, models], 0.0)
    fin = problem.ready[queues][:, None, None] + np.cumsum(p + sw[:, :, None], axis=1)
    start = np.subtract(fin, p, out=p)  # (in place: no new (m, L, S) array on the hot path)
    done = np.maximum(fin, start + problem.floor_pad[orders, gq, :])
    dl = problem.deadline_pad[orders][:, :, None]
    late = np.maximum(done - dl, 0.0).mean(axis=2)
    if problem.has_ttft:
        first_late = np.subtract(start, problem.ttft_start_pad[orders, gq][:, :, None], out=start)
        np.maximum(first_late, problem.ttft_now_pad[orders, gq][:, :, None], out=first_late)
        late += np.maximum(first_late, 0.0).mean(axis=2)
        ok = ((done <= dl) & (first_late <= 0.0)).sum(axis=2)
    else:
        ok = (done <= dl).sum(axis=2)
    w = problem.weight_pad[orders]
    short = np.maximum(problem.required_ok - ok, 0) / problem.required_ok
    flow = (w * (done.mean(axis=2) - problem.ready[queues][:, None])).sum(axis=1)
    cost: FloatArray = (
        (w * late).sum(axis=1)
        + problem.risk_weight * (w * short).sum(axis=1)
        + problem.flow_weight * flow
    )
    return cost


def score_queue(problem: PlanProblem, g: int, order: Sequence[int]) -> QueueScore:
    """The cost of one queue with the per-group details (expected violation, P(meet), missed)."""
    if not order:
        empty = np.zeros(0)
        return QueueScore(0.0, empty, empty, np.zeros(0, bool), 0.0, np.zeros((0, 1)))
    idx = np.asarray(order, np.int64)
    p = problem.proc[idx, g, :]
    models = problem.model_idx[idx]
    prev = np.concatenate([[problem.active[g]], models[:-1]])
    sw = np.where(models != prev, problem.switch[g, models], 0.0)
    fin = problem.ready[g] + np.cumsum(p + sw[:, None], axis=0)
    start = fin - p
    done = np.maximum(fin, start + problem.floor[idx, g, :])
    dl = problem.deadline[idx][:, None]
    late = np.maximum(done - dl, 0.0).mean(axis=1)
    if problem.has_ttft:
        first_late = np.maximum(
            start - problem.ttft_start_pad[idx, g][:, None], problem.ttft_now_pad[idx, g][:, None]
        )
        late = late + np.maximum(first_late, 0.0).mean(axis=1)
        ok = ((done <= dl) & (first_late <= 0.0)).sum(axis=1)
    else:
        ok = (done <= dl).sum(axis=1)
    missed = ok < problem.required_ok
    w = problem.weight[idx]
    short = np.maximum(problem.required_ok - ok, 0) / problem.required_ok
    flow = float((w * (done.mean(axis=1) - problem.ready[g])).sum())
    cost = float(
        (w * late).sum() + problem.risk_weight * (w * short).sum() + problem.flow_weight * flow
    )
    penalty = cost - problem.flow_weight * flow
    return QueueScore(cost, late, ok / problem.scenarios, missed, penalty, done)


def score_plan(problem: PlanProblem, plan: Plan) -> float:
    """The objective of a whole plan (sum over queues); ``inf`` if a group is misplaced."""
    return sum(score_queue(problem, g, order).cost for g, order in enumerate(plan))


def check_plan(problem: PlanProblem, plan: Plan) -> None:
    """Raise ``ValueError`` unless ``plan`` places every group exactly once, where it is served."""
    if len(plan) != len(problem.instances):
        raise ValueError(f"plan has {len(plan)} queues, problem {len(problem.instances)}")
    lengths = [len(order) for order in plan]
    placed = np.fromiter((i for order in plan for i in order), np.int64, sum(lengths))
    if not np.array_equal(np.sort(placed), np.arange(len(problem.groups))):
        raise ValueError("plan must place every group exactly once")
    queue = np.repeat(np.arange(len(plan)), lengths)
    wrong = np.flatnonzero(~problem.eligible[placed, queue])
    if len(wrong):
        i, g = int(placed[wrong[0]]), int(queue[wrong[0]])
        raise ValueError(
            f"group {problem.groups[i].id} ({problem.groups[i].model}) placed on "
            f"{problem.instances[g].name}, which does not serve it"
        )


def subset(problem: PlanProblem, rows: Sequence[int]) -> PlanProblem:
    """The same problem over the groups at ``rows`` only."""
    idx = np.asarray(rows, dtype=np.int64)
    q, s_count = problem.proc.shape[1:]
    proc = padded_empty(len(idx), q, s_count)
    floor = padded_empty(len(idx), q, s_count)
    np.take(problem.proc, idx, axis=0, out=proc, mode="clip")  # (clip: not buffered)
    np.take(problem.floor, idx, axis=0, out=floor, mode="clip")
    return PlanProblem(
        problem.groups.take(idx),
        problem.instances,
        proc,
        floor,
        delta=problem.delta,
        risk_weight=problem.risk_weight,
        flow_weight=problem.flow_weight,
        first=None if problem.first is None else problem.first[idx],
        lead=problem.lead,
        now_s=problem.now_s,
    )
