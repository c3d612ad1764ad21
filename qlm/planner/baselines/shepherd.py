"""SHEPHERD as the QLM paper runs it: fixed batches placed and ordered by an ILP."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pulp

from qlm.domain import Request
from qlm.errors import check_setting
from qlm.planner.baselines.estimates import LearnsOutput, ServiceEstimates, serving
from qlm.planner.policy import Completion, DispatchContext, InstanceLoad
from qlm.planner.queued import QueuedPolicy, Step, model_queue
from qlm.rct.profile import RctProfile
from qlm.solvers import make_solver


@dataclass(frozen=True, slots=True)
class BatchPlanInput:
    """One SHEPHERD planning round: batches × instances.

    ``exec_s[j][i]``: deterministic execution time of batch ``j`` on instance ``i``;
    ``deadlines[j]``: its requests' deadlines, seconds from now; ``available_s[i]``: when instance
    ``i`` should finish its current batch, seconds from now; ``idle``: the instances that have
    none, which start a batch now.
    """

    exec_s: tuple[tuple[float, ...], ...]
    deadlines: tuple[tuple[float, ...], ...]
    available_s: tuple[float, ...]
    idle: tuple[int, ...]


def build_batch_ilp(
    plan: BatchPlanInput,
) -> tuple[pulp.LpProblem, dict[tuple[int, int, int], pulp.LpVariable]]:
    """The ILP of SHEPHERD's ordering and placement (as QLM §8 describes it), over batches.

    ``x[j,i,k] = 1`` puts batch ``j`` at position ``k`` of instance ``i``, ``k < K =
    ⌈J / I⌉ + 1`` (a plan that piles more on one instance is replanned before it matters); a batch
    is placed at most once, a position holds at most one batch, positions fill from the front. The
    batch at position ``k`` completes at ``T[i,k] = a_i + Σ_{k' ≤ k} Σ_j e[j,i] x[j,i,k']``, so
    ``c_j ≥ T[i,k] − M_i (1 − x[j,i,k])`` with ``M_i = a_i + Σ_j e[j,i]``, and (a cut)
    ``c_j ≥ Σ (a_i + e[j,i]) x[j,i,k]``. ``u[j,q] = 1`` counts the ``q``-th earliest deadline of
    batch ``j`` as met: ``u[j,q] ≤ Σ x[j,·,·]``, ``c_j ≤ d[j,q] + (H − d[j,q]) (1 − u[j,q])``
    (``H`` the horizon), ``u[j,q−1] ≤ u[j,q]``, and ``u = 0`` for a deadline already past. Every
    idle instance gets a batch at position 0 while batches last (work conserving). Maximise
    ``Σ u − ε Σ_j 2^(J−1−j) c_j``: the most requests on time, then the batches in deadline order
    (batch ``j`` holds the ``j``-th earliest deadlines) as early as possible.
    """
    n_batches, n_instances = len(plan.exec_s), len(plan.available_s)
    batches, instances = range(n_batches), range(n_instances)
    positions = range(min(n_batches, -(-n_batches // n_instances) + 1))
    horizon = max(plan.available_s) + sum(max(row) for row in plan.exec_s)
    eps = 1e-3 / max(horizon, 1.0) / 2**n_batches
    prob = pulp.LpProblem("shepherd", pulp.LpMaximize)
    x = {
        (j, i, k): prob.add_variable(f"x_{j}_{i}_{k}", cat=pulp.LpBinary)
        for j in batches
        for i in instances
        for k in positions
    }
    c = [prob.add_variable(f"c_{j}", lowBound=0, upBound=horizon) for j in batches]
    u = {
        (j, q): prob.add_variable(f"u_{j}_{q}", cat=pulp.LpBinary)
        for j in batches
        for q in range(len(plan.deadlines[j]))
    }
    prob += pulp.lpSum(u.values()) - eps * pulp.lpSum(
        2 ** (n_batches - 1 - j) * c[j] for j in batches
    )
    for j in batches:
        placed = pulp.lpSum(x[j, i, k] for i in instances for k in positions)
        prob += placed <= 1
        prob += c[j] >= pulp.lpSum(
            (plan.available_s[i] + plan.exec_s[j][i]) * x[j, i, k]
            for i in instances
            for k in positions
        )
        for q, deadline in enumerate(plan.deadlines[j]):
            if deadline <= 0:
                prob += u[j, q] == 0
                continue
            if q > 0:
                prob += u[j, q - 1] <= u[j, q]
            prob += u[j, q] <= placed
            if deadline < horizon:
                prob += c[j] <= deadline + (horizon - deadline) * (1 - u[j, q])
    for i in instances:
        big_m = plan.available_s[i] + sum(plan.exec_s[j][i] for j in batches)
        finish = pulp.LpAffineExpression(constant=plan.available_s[i])
        for k in positions:
            occupied = pulp.lpSum(x[j, i, k] for j in batches)
            prob += occupied <= 1
            if k > 0:
                prob += occupied <= pulp.lpSum(x[j, i, k - 1] for j in batches)
            finish = finish + pulp.lpSum(plan.exec_s[j][i] * x[j, i, k] for j in batches)
            for j in batches:
                prob += c[j] >= finish - big_m * (1 - x[j, i, k])
    prob += pulp.lpSum(x[j, i, 0] for j in batches for i in plan.idle) == min(
        n_batches, len(plan.idle)
    )
    return prob, x


def solve_batch_ilp(plan: BatchPlanInput, time_limit_s: float) -> dict[int, int] | None:
    """Which batch each idle instance runs now (instance index -> batch index), or ``None`` when
    CBC found no solution in time."""
    prob, x = build_batch_ilp(plan)
    try:
        prob.solve(make_solver("cbc", time_limit_s, warm=False))
    except pulp.PulpSolverError:
        return None
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    chosen: dict[int, int] = {}
    for (j, i, k), var in x.items():
        if k == 0 and i in plan.idle and (var.value() or 0.0) > 0.5:
            chosen[i] = j
    return chosen


AUTO_BATCH_SIZES = (8, 16, 32, 64, 128, 256)
"""The batch sizes SHEPHERD's rule chooses from (``ShepherdPolicy._batch_size``)."""


class ShepherdPolicy(LearnsOutput, QueuedPolicy):
    """SHEPHERD as the QLM paper runs it as a baseline (QLM §8: "dynamic batching and an ILP
    formulation for ordering and placement ... assumes fixed batches with deterministic execution
    times"): static batches, one at a time per instance.

    Waiting requests form one earliest-deadline queue per model. When an instance serving the
    model is idle (its previous batch has finished entirely), the earliest ``max_batches ×
    batch_size`` requests are cut, in deadline order, into batches of ``batch_size`` (fewer when
    fewer wait: dynamic batching does not wait to fill a batch); ``batch_size`` is a fixed size,
    or by default chosen at each round by SHEPHERD's rule (``_batch_size``: the size that makes
    the most deadlines per second). Each batch's execution time is
    deterministic: the profile's prefill of all its prompts plus its longest expected output
    (estimator mean) decoded at the profile's pace for that batch size. ``build_batch_ilp`` places
    and orders the batches on all instances serving the model (busy ones from the time their batch
    should end) to maximise the requests that make their deadlines; each idle instance pulls the
    batch it was given for position 0, and the rest wait for the next round (rolling horizon). If
    CBC finds no solution within its time limit, batches go to idle instances in EDF order. The engine runs continuous
    batching, but no request joins a batch in flight, which is SHEPHERD's static batch.

    Not reproduced: SHEPHERD's own planner (Herd) groups models and GPUs periodically and its
    online scheduler (Flex) preempts a running batch for a larger one; QLM's description has
    neither and neither has a counterpart for an LLM batch whose length is unknown.
    """

    name = "shepherd"

    def __init__(
        self,
        profile: RctProfile,
        *,
        batch_size: int | None = None,
        max_batches: int = 4,
        time_limit_s: float = 0.25,
    ) -> None:
        super().__init__()
        check_setting(
            batch_size is None or batch_size >= 1, "shepherd batch size", ">= 1", batch_size
        )
        check_setting(max_batches >= 1, "shepherd max batches", ">= 1", max_batches)
        check_setting(time_limit_s > 0, "shepherd ILP time limit", "> 0", time_limit_s)
        self.estimates = ServiceEstimates(profile)
        self.batch_size = batch_size  # None: chosen at each round (``_batch_size``)
        self.max_batches = max_batches
        self.time_limit_s = time_limit_s
        self._busy_until: dict[str, float] = {}

    def key(self, request: Request, ctx: DispatchContext) -> tuple[float, ...]:
        return (request.deadline_s,)

    def on_finish(self, completion: Completion) -> None:
        self.estimates.observe(completion)

    def pull(self, ctx: DispatchContext, step: Step) -> None:
        idle = {i.name for i in ctx.instances if i.up and not self.inflight.get(i.name)}
        for model in sorted({m for i in ctx.instances if i.name in idle for m in i.models}):
            queue = model_queue(model)
            servers = serving(ctx, model)
            free = [s for s in servers if s.name in idle]
            if not free or self.peek(queue) is None:
                continue
            size = self.batch_size or self._batch_size(queue, free, ctx.now)
            waiting: list[Request] = []
            while len(waiting) < self.max_batches * size and self.peek(queue) is not None:
                waiting.append(self.pop(queue))
            batches = [waiting[k : k + size] for k in range(0, len(waiting), size)]
            chosen = self._plan(batches, servers, ctx.now)
            for load in free:
                j = chosen.get(load.name)
                if j is None:
                    continue
                started = self._start(batches[j], load, ctx, step)
                batches[j] = []
                idle.discard(load.name)
                self._busy_until[load.name] = ctx.now + self._exec_s(started, load)
            for batch in batches:
                for request in batch:
                    self.push(request, queue, self.key(request, ctx))

    def _start(
        self, batch: list[Request], load: InstanceLoad, ctx: DispatchContext, step: Step
    ) -> list[Request]:
        """Pull the batch onto the idle instance; what does not fit goes back to the queue."""
        started = []
        for request in batch:
            if step.room(load.name, self.tokens(request)):
                self.pull_onto(step, request, load.name, ctx)
                started.append(request)
            else:
                self.push(request, model_queue(request.model), self.key(request, ctx))
        return started

    def _batch_size(self, queue: str, free: Sequence[InstanceLoad], now: float) -> int:
        """SHEPHERD's rule for the batch size, at each round: the size (a power of two from
        ``AUTO_BATCH_SIZES``, within what the free instances run at once) whose batch of the
        earliest-deadline requests makes the most deadlines per second of its deterministic
        execution time (goodput rate: batches run one at a time on an instance); between sizes
        of equal goodput, the one serving the most requests per second — when every waiting
        request is late already (a backlog), the largest, which drains it fastest, not the
        smallest."""
        cap = min((f.max_running or AUTO_BATCH_SIZES[-1]) for f in free)
        sizes = [b for b in AUTO_BATCH_SIZES if b <= cap] or [AUTO_BATCH_SIZES[0]]
        head = self.peek_many(queue, sizes[-1])
        best, best_rate = sizes[0], (-1.0, -1.0)
        for b in sizes:
            batch = head[:b]
            if len(batch) < b and b > sizes[0]:
                break  # no more waiting requests than a smaller batch holds
            exec_s = max(self._exec_s(batch, free[0]), 1e-9)
            met = sum(r.deadline_s >= now + exec_s for r in batch)
            rate = (met / exec_s, len(batch) / exec_s)
            if rate > best_rate:
                best, best_rate = b, rate
        return best

    def _exec_s(self, batch: Sequence[Request], load: InstanceLoad) -> float:
        if not batch:
            return 0.0
        hw = self.estimates.hardware(batch[0].model, load)
        prompts = sum(self.tokens(r) for r in batch)
        longest = max(self.estimates.output(r, self.generated.get(r.id, 0)) for r in batch)
        return hw.prefill_s(prompts) + longest * hw.decode_s(len(batch))

    def _plan(
        self, batches: list[list[Request]], servers: list[InstanceLoad], now: float
    ) -> dict[str, int]:
        """Batch index for each idle server: the ILP's choice, or EDF order as the fallback."""
        idle = tuple(i for i, s in enumerate(servers) if not self.inflight.get(s.name))
        available = tuple(
            0.0 if i in idle else max(0.0, self._busy_until.get(s.name, now) - now)
            for i, s in enumerate(servers)
        )
        edf = {servers[i].name: j for j, i in enumerate(idle[: len(batches)])}
        if len(batches) <= 1:
            return edf
        plan = BatchPlanInput(
            exec_s=tuple(tuple(self._exec_s(b, s) for s in servers) for b in batches),
            deadlines=tuple(tuple(sorted(r.deadline_s - now for r in b)) for b in batches),
            available_s=available,
            idle=idle,
        )
        chosen = solve_batch_ilp(plan, self.time_limit_s)
        if chosen is None:
            return edf
        return {servers[i].name: j for i, j in chosen.items()}
