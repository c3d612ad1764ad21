"""Seeded random plan problems for tests and the planner benchmark.

Groups draw their requests' input and output lengths from a real trace's lengths (passed in), so
that work and its spread look like production; deadlines are the three SLO classes of the W_B
workload (20 s, 60 s, 300 s) minus a random age; instances are A100-like with per-model speeds.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt

from qlm.planner.program import GroupTable, PlanGroup, PlanInstance, PlanProblem

MODELS = ("llama-3-8b", "llama-2-7b", "llama-2-13b")
SPEED = {"llama-3-8b": 1.0, "llama-2-7b": 1.1, "llama-2-13b": 0.6}
"""Relative token throughput of each model on one instance."""
THROUGHPUT_TPS = 2500.0
PROMPT_COST = 0.15  # one prompt token costs this fraction of an output token
SLOS = ((20.0, 3.0), (60.0, 2.0), (300.0, 1.0))  # (seconds, tier weight)


def random_problem(
    queues: int,
    groups: int,
    *,
    seed: int = 0,
    models: int = 3,
    scenarios: int = 16,
    lengths: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None = None,
    load: float = 1.0,
    delta: float = 0.9,
) -> PlanProblem:
    """A problem of ``queues`` instances and ``groups`` groups over ``models`` models.
    ``lengths``: (inputs, outputs) to draw from (default: lognormal like Azure conv).
    ``load``: the queued work relative to what the fleet can do before the median deadline."""
    rng = np.random.default_rng(seed)
    names = MODELS[:models]
    if lengths is None:
        inputs = rng.lognormal(6.5, 1.0, 4096).astype(np.int64) + 1
        outputs = rng.lognormal(5.0, 0.9, 4096).astype(np.int64) + 1
    else:
        inputs, outputs = lengths
    # Each instance serves one or two models; every model has at least one instance.
    served: list[tuple[str, ...]] = []
    for g in range(queues):
        first = names[g % len(names)]
        second = names[(g + 1) % len(names)] if len(names) > 1 and rng.random() < 0.5 else first
        served.append(tuple(dict.fromkeys((first, second))))
    instances = tuple(
        PlanInstance(
            name=f"i{g}",
            models=served[g],
            active_model=served[g][0],
            ready_s=float(rng.uniform(0, 5)),
            switch_s={
                m: (0.0 if m == served[g][0] else float(rng.uniform(4, 12))) for m in served[g]
            },
        )
        for g in range(queues)
    )
    offered = sorted({m for models_of in served for m in models_of}, key=names.index)
    sizes = rng.integers(1, 33, groups)
    total_work = 0.0
    samples = np.zeros((groups, scenarios))
    floors = np.zeros((groups, scenarios))
    plan_groups: list[PlanGroup] = []
    for i in range(groups):
        model = offered[int(rng.integers(len(offered)))] if i >= len(offered) else offered[i]
        picks = rng.integers(len(inputs), size=sizes[i])
        # Scenarios of the group's output: each request's length redrawn from the trace.
        draws = outputs[rng.integers(len(outputs), size=(scenarios, sizes[i]))]
        work = (inputs[picks].sum() * PROMPT_COST + draws.sum(axis=1)) / THROUGHPUT_TPS
        samples[i] = work / SPEED[model]
        floors[i] = draws[:, -1] * 0.02 + 0.05 + inputs[picks[-1]] * 1e-4
        total_work += float(samples[i].mean())
        slo, tier_w = SLOS[int(rng.integers(len(SLOS)))]
        plan_groups.append(PlanGroup(f"g{i}", model, 0.0 + slo, tier_w * float(sizes[i])))
    # Scale the work so that each queue holds ``load`` × 60 s of it (the standard SLO).
    samples *= load * 60.0 * queues / max(total_work, 1e-9)
    ages = rng.uniform(0, 20, groups)
    plan_groups = [
        PlanGroup(g.id, g.model, g.deadline_s - float(ages[i]), g.weight)
        for i, g in enumerate(plan_groups)
    ]
    proc = np.full((groups, queues, scenarios), np.inf)
    floor = np.full((groups, queues, scenarios), np.inf)
    for g, inst in enumerate(instances):
        for i, grp in enumerate(plan_groups):
            if grp.model in inst.models:
                proc[i, g] = samples[i]
                floor[i, g] = floors[i]
    return PlanProblem(GroupTable.of(plan_groups), instances, proc, floor, delta=delta)


def shifted(problem: PlanProblem, by_s: float) -> PlanProblem:
    """The same problem with every ready time and deadline ``by_s`` later (e.g. posed at unix
    times, as production plans, instead of from 0, as simulations do)."""
    groups = GroupTable.of(
        [dataclasses.replace(g, deadline_s=g.deadline_s + by_s) for g in problem.groups]
    )
    instances = tuple(dataclasses.replace(i, ready_s=i.ready_s + by_s) for i in problem.instances)
    return PlanProblem(
        groups,
        instances,
        problem.proc,
        problem.floor,
        delta=problem.delta,
        risk_weight=problem.risk_weight,
        flow_weight=problem.flow_weight,
    )
