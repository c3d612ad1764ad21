"""The plan problem's groups as columns (``GroupTable``) and the waiting groups handed to
``build_family`` as columns (``WaitingGroups``): the same groups, the same numbers to the last
bit, as the ``PlanGroup`` objects and ``(id, requests, tier)`` tuples they replace."""

from __future__ import annotations

import math

import numpy as np
from builders import make_profile, make_request

from qlm.domain import SLO, Tier
from qlm.planner import PlannerConfig
from qlm.planner.family import WaitingGroups, build_family
from qlm.planner.policy import InstanceLoad
from qlm.planner.program import GroupTable, PlanGroup, PlanInstance, PlanProblem, subset
from qlm.planner.synthetic import random_problem
from qlm.rct.estimator import RCTEstimator

PROFILE = make_profile()

GROUPS = (
    PlanGroup("a", "m1", 10.0, 2.0),
    PlanGroup("b", "m2", 0.1 + 0.2, 1.5, 3.0),
    PlanGroup("c", "m1", 7.25, 0.5, math.inf),
)


def test_a_table_is_the_sequence_of_the_groups_it_was_made_from() -> None:
    table = GroupTable.of(GROUPS)
    assert len(table) == 3 and list(table) == list(GROUPS)
    assert [table[i] for i in range(3)] == list(GROUPS) and table[-1] == GROUPS[-1]
    assert table == GROUPS and GroupTable.of(table) is table
    assert list(table.take(np.array([2, 0]))) == [GROUPS[2], GROUPS[0]]
    assert list(table[1:]) == list(GROUPS[1:])
    assert table.ids == ("a", "b", "c") and table.models == ("m1", "m2", "m1")


def test_a_problem_reads_the_same_arrays_from_a_table_as_from_plan_groups() -> None:
    inst = PlanInstance("i0", ("m1", "m2"), "m1", 0.0, {"m1": 0.0, "m2": 2.0})
    proc = np.arange(6, dtype=np.float64).reshape(3, 1, 2) + 1.0
    objects = PlanProblem(GROUPS, (inst,), proc, proc * 0.5)
    table = PlanProblem(GroupTable.of(GROUPS), (inst,), proc, proc * 0.5)
    assert isinstance(objects.groups, GroupTable)
    for name in ("model_idx", "deadline", "weight", "ttft", "deadline_pad", "ttft_start_pad"):
        assert np.array_equal(getattr(objects, name), getattr(table, name)), name
    # (the old per-object arrays, built the way PlanProblem built them)
    assert np.array_equal(objects.deadline, np.array([g.deadline_s for g in GROUPS]))
    assert np.array_equal(objects.weight, np.array([g.weight for g in GROUPS]))
    assert objects.models == ("m1", "m2") and objects.model_idx.tolist() == [0, 1, 0]


def test_subset_keeps_the_groups_at_its_rows() -> None:
    problem = random_problem(4, 12, seed=3)
    rows = [5, 0, 11, 7]
    part = subset(problem, rows)
    assert list(part.groups) == [problem.groups[i] for i in rows]
    assert np.array_equal(part.deadline, problem.deadline[rows])
    assert np.array_equal(part.weight, problem.weight[rows])


def test_the_family_builds_the_same_groups_from_columns_as_from_tuples() -> None:
    est = RCTEstimator(PROFILE)
    triples = [
        ("a", [make_request(0, arrival_s=1.0, slo=SLO(30.0, 2.0))], Tier.INTERACTIVE),
        ("b", [make_request(1, arrival_s=0.5), make_request(2, arrival_s=0.7)], Tier.BATCH),
        ("c", [make_request(3, arrival_s=0.2, slo=SLO(12.5))], Tier.STANDARD),
    ]
    columns = WaitingGroups([], [], [])
    for gid, requests, tier in triples:
        columns.append(gid, requests, tier)
    assert list(columns) == triples and columns[1] == triples[1]
    assert list(columns.pairs()) == [(gid, reqs) for gid, reqs, _ in triples]
    inst = InstanceLoad("i0", ("m",), gpu="G", max_running=32)
    config = PlannerConfig.for_simulation()
    fams = [
        build_family(g, [inst], {"i0": 3.0}, est, config, np.random.default_rng(0), now=1.0)
        for g in (triples, columns)
    ]
    # What build_family made before: a PlanGroup per group, weight = tier weight × size.
    loads = est.group_loads([(gid, reqs) for gid, reqs, _ in triples])
    expected = [
        PlanGroup(gid, model, deadline, config.tier_weights[tier] * size, ttft)
        for (gid, _, tier), model, deadline, size, ttft in zip(
            triples,
            loads.models,
            loads.earliest_deadline_s.tolist(),
            loads.size.tolist(),
            loads.earliest_ttft_deadline_s.tolist(),
            strict=True,
        )
    ]
    for fam in fams:
        assert list(fam.groups) == expected
        assert fam.has_ttft
    a, b = (f.problem([32]) for f in fams)
    assert np.array_equal(a.proc, b.proc) and np.array_equal(a.floor, b.floor)
    assert np.array_equal(a.weight, b.weight) and np.array_equal(a.deadline, b.deadline)
