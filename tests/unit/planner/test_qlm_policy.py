"""QLM's policy: groups in virtual queues, re-planned on its triggers, pulled while there is room."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import numpy as np
import pytest
from builders import make_catalog, make_profile, make_request

from qlm.domain import SLO, InstanceSpec, Pull, Request, RequestStatus, Tier
from qlm.errors import ConfigError, RequestFailed
from qlm.planner import PlannerConfig, QlmPolicy, create_policy, qlm_policy
from qlm.planner.admission import hopeless, hopeless_all, in_time
from qlm.planner.concurrency import pick_limit
from qlm.planner.policy import Completion, DispatchContext, InstanceLoad
from qlm.planner.program import PlanGroup, PlanInstance, PlanProblem
from qlm.planner.synthetic import random_problem
from qlm.rct.estimator import RCTEstimator
from qlm.rct.trigger import Violation, violations
from qlm.sim.cluster import ClusterSimulation

PROFILE = make_profile()
CONFIG = PlannerConfig.for_simulation(2000)


def load(name: str = "i0", **overrides: object) -> InstanceLoad:
    fields: dict[str, object] = {"name": name, "models": ("m",), "gpu": "G", "max_running": 2}
    fields.update(overrides)
    return InstanceLoad(**fields)  # type: ignore[arg-type]


def policy(**config: object) -> QlmPolicy:
    return QlmPolicy(
        PROFILE, config=dataclasses.replace(CONFIG, **config), measure_solve_time=False
    )


def test_pulls_only_while_the_instance_has_room() -> None:
    qlm = policy()
    reqs = [make_request(i, arrival_s=0.0) for i in range(5)]
    out = qlm.decide(DispatchContext(0.0, tuple(reqs), (load(max_running=2),)))
    assert [type(d) for d in out] == [Pull, Pull]
    busy = load(max_running=2, outstanding_requests=2, outstanding_tokens=400)
    assert qlm.decide(DispatchContext(0.5, (), (busy,))) == []


def test_the_engines_preemptions_reach_the_estimator_with_the_completions_they_came_with() -> None:
    qlm = policy()
    reqs = [make_request(i, arrival_s=0.0) for i in range(2)]
    qlm.decide(DispatchContext(0.0, tuple(reqs), (load(preemptions_total=4),)))
    assert qlm.estimator.preemption_rate("i0") == 0.0  # what it did before is not counted
    done = Completion(reqs[0], "i0", 50, 0.1, 0.2, 5.0)
    later = load(preemptions_total=10, outstanding_requests=1, outstanding_tokens=200)
    qlm.decide(DispatchContext(5.0, (), (later,), finished=(done,)))
    assert qlm.estimator.preemption_rate("i0") > 0.0  # six since, with one completion


def test_urgent_group_is_pulled_before_a_lax_one_that_arrived_first() -> None:
    qlm = policy()
    lax = [make_request(i, arrival_s=0.0, slo=SLO(600.0), tier=Tier.BATCH) for i in range(4)]
    urgent = [
        make_request(10 + i, arrival_s=0.0, slo=SLO(5.0), tier=Tier.INTERACTIVE) for i in range(2)
    ]
    busy = load(max_running=2, outstanding_requests=2, outstanding_tokens=400)
    assert qlm.decide(DispatchContext(0.0, (*lax, *urgent), (busy,))) == []
    out = qlm.decide(DispatchContext(2.0, (), (load(max_running=2),)))
    assert sorted(d.request_id for d in out if isinstance(d, Pull)) == ["r0010", "r0011"]


def test_instance_change_and_period_trigger_a_plan() -> None:
    qlm = policy(period_s=5.0, min_interval_s=1.0)
    busy = load(max_running=1, outstanding_requests=1, outstanding_tokens=200)
    qlm.decide(DispatchContext(0.0, (make_request(0, slo=SLO(600.0)),), (busy,)))
    assert [p.trigger for p in qlm.take_plans()] == ["instances"]
    qlm.decide(DispatchContext(0.5, (make_request(1, slo=SLO(600.0)),), (busy,)))
    assert qlm.take_plans() == []  # within min_interval_s, and nothing at risk
    qlm.decide(DispatchContext(6.0, (), (busy,)))
    assert [p.trigger for p in qlm.take_plans()] == ["period"]
    assert qlm.take_plans() == []  # each plan is handed over once
    second = load("i1", max_running=1)
    qlm.decide(DispatchContext(7.5, (), (busy, second)))
    assert [p.trigger for p in qlm.take_plans()] == ["instances"]


def test_predicted_violation_triggers_a_plan_and_reports_risk() -> None:
    qlm = policy(period_s=1000.0)
    busy = load(max_running=1, outstanding_requests=1, outstanding_tokens=200)
    qlm.decide(DispatchContext(0.0, (make_request(0, slo=SLO(600.0)),), (busy,)))
    hopeless = make_request(1, arrival_s=2.0, slo=SLO(0.01), tier=Tier.INTERACTIVE)
    qlm.decide(DispatchContext(2.0, (hopeless,), (busy,)))
    plan = qlm.last_plan
    assert plan is not None and plan.trigger == "violation"
    assert plan.at_risk  # a 10 ms SLO behind a running request cannot be met


def test_down_instance_gets_nothing() -> None:
    qlm = policy()
    reqs = [make_request(i) for i in range(3)]
    out = qlm.decide(
        DispatchContext(0.0, tuple(reqs), (load("i0", up=False), load("i1", max_running=8)))
    )
    assert {d.instance for d in out} == {"i1"} and len(out) == 3


def test_a_down_instance_does_not_break_the_idle_check_of_later_steps() -> None:
    # A failed instance leaves the virtual queues; the triggers must look only at those left
    # (this raised at every step once an instance was down and another had emptied its queue).
    qlm = policy(min_interval_s=1.0, period_s=1000.0)
    busy = {"max_running": 1, "outstanding_requests": 1, "outstanding_tokens": 200}
    reqs = tuple(
        make_request(
            i,
            slo=SLO(600.0 if i % 2 else 5.0),
            tier=Tier.BATCH if i % 2 else Tier.INTERACTIVE,
            input_tokens=100 if i % 2 else 2000,
        )
        for i in range(20)
    )
    free = load("i2", max_running=100)
    qlm.decide(DispatchContext(0.0, reqs, (load("i0", **busy), load("i1", **busy), free)))
    down = load("i0", up=False)
    qlm.decide(DispatchContext(0.5, (), (down, load("i1", **busy), free)))
    assert qlm.queues.queue("i1") and not qlm.queues.queue("i2")  # i2 pulled all of its own
    ran = load("i2", max_running=100, outstanding_requests=5, outstanding_tokens=1000)
    qlm.decide(DispatchContext(5.0, (), (down, load("i1", **busy), ran)))
    qlm.decide(DispatchContext(6.0, (), (down, load("i1", **busy), free)))
    assert (
        qlm.last_plan is not None and qlm.last_plan.trigger == "idle"
    )  # i2 idle with i1's queue waiting: re-planned


def test_runs_a_workload_to_the_end() -> None:
    tiers = list(Tier)
    reqs = [
        make_request(
            i,
            arrival_s=i * 0.05,
            input_tokens=100 + 37 * i % 900,
            replay_output_tokens=1 + 53 * i % 300,
            tier=tiers[i % 3],
            slo=SLO(e2e_s=5.0 + 10 * (i % 3)),
        )
        for i in range(150)
    ]
    specs = [InstanceSpec("i0", "G", ("m",)), InstanceSpec("i1", "G", ("m",))]
    qlm = policy()
    sim = ClusterSimulation(specs, qlm, catalog=make_catalog(), engine_config={"max_num_seqs": 8})
    result = sim.run(reqs)
    assert all(r.status is RequestStatus.FINISHED for r in result.records)
    assert all(r.output_tokens == r.request.replay_output_tokens for r in result.records)
    assert result.plans and all(p.status == "heuristic" for p in result.plans)


def test_decisions_do_not_depend_on_true_output_lengths() -> None:
    reqs = [
        make_request(i, arrival_s=i * 0.2, tier=list(Tier)[i % 3], slo=SLO(3.0 + 7 * (i % 3)))
        for i in range(30)
    ]
    runs = []
    for truth in (None, 1, 10**6):
        qlm = policy(min_interval_s=0.5, check_interval_s=0.5)
        decisions = []
        for k, r in enumerate(reqs):
            busy = load(max_running=4, outstanding_requests=k % 5, outstanding_tokens=200 * (k % 5))
            arrived = (dataclasses.replace(r, replay_output_tokens=truth),)
            decisions.append(qlm.decide(DispatchContext(r.arrival_s, arrived, (busy,))))
        runs.append(decisions)
    assert runs[0] == runs[1] == runs[2]
    assert sum(len(d) for d in runs[0]) > 10


def test_create_policy_knows_qlm() -> None:
    assert create_policy("qlm", profile=PROFILE).name == "qlm"


def test_bad_planner_settings_get_one_line_naming_the_setting() -> None:
    import re

    import pytest

    from qlm.errors import ConfigError
    from qlm.planner.solve import Budget

    for kwargs, name in (
        ({"delta": 1.0}, "planner.delta"),
        ({"scenarios": 0}, "planner.scenarios"),
        ({"solver": "gurobi"}, "planner.solver"),
        ({"period_s": 0.0}, "planner.period_s"),
        ({"max_utilisation": 1.5}, "planner.max_utilisation"),
    ):
        with pytest.raises(ConfigError, match=f"^{re.escape(name)} must be"):
            PlannerConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^planner\.budget\.time_s must be"):
        Budget(time_s=0.0)


def test_a_given_estimator_and_output_predictor_are_the_ones_used() -> None:
    estimator = RCTEstimator(PROFILE)
    seen: list[str] = []

    def predict(request: Request) -> float:
        seen.append(request.id)
        return 10.0

    qlm = QlmPolicy(
        PROFILE,
        config=CONFIG,
        measure_solve_time=False,
        estimator=estimator,
        predict_output=predict,
    )
    assert qlm.estimator is estimator
    qlm.decide(DispatchContext(0.0, (make_request(0), make_request(1)), (load(),)))
    assert {"r0000", "r0001"} <= set(seen)  # the grouper clustered on the given prediction


def test_a_fixed_concurrency_limit_is_held_at_every_plan() -> None:
    qlm = policy()
    qlm.fix_concurrency(40)  # the choices under 64 running at most are 16, 32 and 64
    reqs = tuple(make_request(i, slo=SLO(600.0)) for i in range(40))
    out = qlm.decide(DispatchContext(0.0, reqs, (load(max_running=64),)))
    assert qlm.last_plan is not None and qlm.last_plan.concurrency == {"i0": 32}
    assert sum(isinstance(d, Pull) for d in out) == 32
    with pytest.raises(ConfigError, match="concurrency limit"):
        qlm.fix_concurrency(0)


@pytest.mark.parametrize("simulated", [True, False])
def test_plans_are_spaced_by_their_compute_only_when_the_budget_is_wall_time(
    simulated: bool,
) -> None:
    """A simulated run (budget in evaluations) must not depend on how fast the machine is."""
    ticks = iter(float(100 * i) for i in range(1000))  # every plan "takes" 100 s of compute
    config = dataclasses.replace(CONFIG, period_s=5.0, min_interval_s=1.0)
    if not simulated:
        config = dataclasses.replace(config, budget=dataclasses.replace(config.budget, time_s=0.1))
    qlm = QlmPolicy(PROFILE, config=config, clock=lambda: next(ticks))
    busy = load(max_running=1, outstanding_requests=1, outstanding_tokens=200)
    qlm.decide(DispatchContext(0.0, (make_request(0, slo=SLO(600.0)),), (busy,)))
    qlm.decide(DispatchContext(6.0, (), (busy,)))  # the period is due
    assert len(qlm.take_plans()) == (2 if simulated else 1)


def test_the_concurrency_limit_worth_the_most_wins_unless_the_current_one_is_close() -> None:
    values = {16: 1.0, 64: 2.0, 128: 2.08, 256: 2.08}
    assert pick_limit(values, None, 0.05) == 128  # the smallest of equals
    assert pick_limit(values, 64, 0.05) == 64  # 2.0 is within 5 % of 2.08: no change
    assert pick_limit(values, 64, 0.0) == 128
    assert pick_limit(values, 16, 0.05) == 128  # 1.0 is far below
    assert pick_limit(values, 32, 0.05) == 128  # no longer a choice (fewer slots now)
    # The limit in use stays only while it serves what arrives: 64 serves 5.5 a second.
    rates = {16: 3.0, 64: 5.5, 128: 7.0, 256: 8.0}
    assert pick_limit(values, 64, 0.05, rates, arriving=5.0) == 64
    assert pick_limit(values, 64, 0.05, rates, arriving=5.8) == 128
    with pytest.raises(ValueError):
        pick_limit({}, None, 0.05)


def test_round_robin_placement_keeps_each_group_on_its_instance_and_only_orders_it() -> None:
    """``qlm-rr`` (QLM's ordering behind a round-robin balancer): each new group goes to the
    next instance serving its model in turn, and no plan moves it off that instance, however
    uneven the instances' queues; ``qlm`` places by load and may move them."""
    busy = load("i0", max_running=1, outstanding_requests=1, outstanding_tokens=200)
    free = load("i1", max_running=1, outstanding_requests=1, outstanding_tokens=200)
    slos = (SLO(20.0), SLO(60.0), SLO(300.0), SLO(30.0), SLO(90.0), SLO(600.0))
    arrivals = tuple(
        make_request(i, slo=slo, input_tokens=100 + 500 * i) for i, slo in enumerate(slos)
    )

    def placed_then_planned(p: QlmPolicy) -> tuple[dict[str, str | None], dict[str, str | None]]:
        p.decide(DispatchContext(0.0, arrivals, (busy, free)))
        placed = {g: p.queues.instance_of(g) for g in p.grouper.group_ids()}
        p.plan(1.0, "manual")
        return placed, {g: p.queues.instance_of(g) for g in placed}

    rr = policy(placement="round-robin")
    assert rr.name == "qlm-rr"
    placed, planned = placed_then_planned(rr)
    assert [placed[g] for g in sorted(placed)] == ["i0", "i1"] * (len(placed) // 2) + (
        ["i0"] if len(placed) % 2 else []
    )  # in turn
    assert planned == placed
    before, after = placed_then_planned(policy())
    assert before != after  # (the planner's own placement moves some here)
    with pytest.raises(ConfigError, match=r"planner\.placement"):
        PlannerConfig(placement="random")


def test_a_hysteresis_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"planner\.concurrency_hysteresis"):
        PlannerConfig(concurrency_hysteresis=1.0)


def overloaded() -> tuple[QlmPolicy, InstanceLoad]:
    """A policy that saw 20 s of cheap prompts (200 tokens) and very long ones (60,000) arrive
    faster than its busy instance serves them, and that instance."""
    qlm = policy(defer_expensive=True, rate_window_s=20.0)
    busy = load(max_running=8, outstanding_requests=8, outstanding_tokens=8000)
    i = 0
    for t in range(20):
        burst = []
        for size in (200, 200, 60_000):
            burst.append(make_request(i, arrival_s=float(t), input_tokens=size, slo=SLO(60.0)))
            i += 1
        qlm.decide(DispatchContext(float(t), tuple(burst), (busy,)))
    return qlm, busy


def test_under_overload_cost_aware_admission_defers_the_costliest_groups() -> None:
    """Cheap prompts (200 tokens) and very long ones (60,000) arrive faster than the instance
    serves them: the long ones wait behind every cheap one, paced by the spare capacity."""
    qlm, _ = overloaded()
    record = qlm.plan(20.0, "test")
    assert record.deferred > 0
    order = qlm.queues.queue("i0")
    costly = [all(r.input_tokens == 60_000 for r in qlm.grouper.group(g).requests) for g in order]
    assert any(costly) and not any(
        all(r.input_tokens == 200 for r in qlm.grouper.group(g).requests)
        and g in qlm.admission.deferred
        for g in order
    )
    assert costly == sorted(costly)  # every costly group behind every cheap one
    free = load(max_running=8)
    pulled = [d for d in qlm.decide(DispatchContext(20.5, (), (free,))) if isinstance(d, Pull)]
    assert len(pulled) == 8
    inputs = {r.id: r.input_tokens for g in order for r in qlm.grouper.group(g).requests}
    assert all(inputs.get(d.request_id, 200) == 200 for d in pulled)


def test_the_snapshot_marks_the_groups_the_plan_deferred_which_its_at_risk_never_lists() -> None:
    """What ``qlm ops queues`` and ``qlm ops plans`` count apart: the snapshot judges every
    queued group (deferred ones too) against Δ now, the plan lists only the planned groups it
    left at risk; the snapshot says which groups are deferred, so the two can be told apart."""
    qlm, _ = overloaded()
    record = qlm.plan(20.0, "test")
    assert record.deferred > 0
    groups = [g for q in qlm.snapshot(20.0).queues for g in q.groups]
    marked = {g.id for g in groups if g.deferred}
    assert marked == qlm.admission.deferred and len(marked) == record.deferred
    assert not marked & set(record.at_risk)
    assert record.groups == len(groups) - len(marked)  # the plan counts the planned ones


def test_a_group_with_a_first_token_deadline_is_never_deferred() -> None:
    """Under the overload above, a new costly request is deferred behind the queue; the same
    request with a first-token deadline is placed at its deadline slot instead, by the placement
    between plans and by the next plan (deferred, its first token would be late)."""
    qlm, busy = overloaded()
    qlm.plan(20.0, "test")
    plain = make_request(900, arrival_s=20.0, input_tokens=60_000, slo=SLO(60.0), model="m")
    urgent = make_request(901, arrival_s=20.0, input_tokens=60_000, slo=SLO(60.0, ttft_s=2.0))
    qlm.decide(DispatchContext(20.0, (plain, urgent), (busy,)))

    def deferred(rid: str) -> bool:
        gid = qlm.grouper.group_of(rid)
        assert gid is not None
        return gid in qlm.admission.deferred

    def position(rid: str) -> int:
        return qlm.queues.queue("i0").index(qlm.grouper.group_of(rid))

    assert deferred(plain.id) and not deferred(urgent.id)
    assert position(urgent.id) < position(plain.id)
    qlm.plan(20.5, "test")
    held = [g for g in qlm.queues.queue("i0") if g in qlm.admission.deferred]
    assert held and not deferred(urgent.id)
    assert all(position(urgent.id) < qlm.queues.queue("i0").index(g) for g in held)


def test_deferred_work_is_paced_by_the_spare_capacity_or_an_idle_instance() -> None:
    qlm = policy(defer_expensive=True, rate_window_s=20.0)
    busy = load(max_running=8, outstanding_requests=8, outstanding_tokens=8000)
    cheap: list[str] = []
    i = 0
    for t in range(20):
        burst = []
        for size in (200, 200, 60_000):
            burst.append(make_request(i, arrival_s=float(t), input_tokens=size, slo=SLO(60.0)))
            cheap += [burst[-1].id] if size == 200 else []
            i += 1
        qlm.decide(DispatchContext(float(t), tuple(burst), (busy,)))
    qlm.plan(20.0, "test")
    # Only costly work waits now (20 requests of ~3 GPU-s each), and the instance is running
    # something with 7 slots free: the bucket lets through what the spare capacity gathered
    # since deferral began (~0.6 GPU-s per s for ~10 s), not 7.
    one = load(max_running=8, outstanding_requests=1, outstanding_tokens=300)
    out = qlm.decide(DispatchContext(20.1, (), (one,), cancelled=tuple(cheap)))
    assert 1 <= len([d for d in out if isinstance(d, Pull)]) < 4
    out = qlm.decide(DispatchContext(20.2, (), (one,)))
    assert not [d for d in out if isinstance(d, Pull)]  # spent
    # An idle instance takes one (then it is no longer idle, and the bucket is empty).
    out = qlm.decide(DispatchContext(20.3, (), (load(max_running=8),)))
    assert len([d for d in out if isinstance(d, Pull)]) == 1


def test_a_group_past_saving_waits_behind_the_groups_that_can_still_meet_their_slo() -> None:
    """Under earliest-deadline-first the group whose deadline has passed would go first (it has
    the earliest deadline) and make the next one late too; cost-aware admission defers it."""
    late = [make_request(i, arrival_s=0.0, slo=SLO(5.0), tier=Tier.INTERACTIVE) for i in range(2)]
    ok = [make_request(10 + i, arrival_s=25.0, slo=SLO(120.0), tier=Tier.BATCH) for i in range(2)]
    busy = load(max_running=2, outstanding_requests=2, outstanding_tokens=400)
    heads = {}
    for admission in (True, False):
        qlm = policy(rate_window_s=20.0, defer_expensive=admission)
        qlm.decide(DispatchContext(0.0, tuple(late), (busy,)))
        qlm.decide(DispatchContext(25.0, tuple(ok), (busy,)))
        record = qlm.plan(30.0, "test")
        assert record.deferred == (1 if admission else 0)
        pulled = [d.request_id for d in qlm.decide(DispatchContext(30.5, (), (load(),)))]
        heads[admission] = sorted(pulled)
    assert heads == {True: ["r0010", "r0011"], False: ["r0000", "r0001"]}


def test_hopeless_asks_whether_the_luckiest_scenario_started_now_still_misses() -> None:
    groups = tuple(PlanGroup(f"g{i}", "m", d, 1.0) for i, d in enumerate((10.0, 20.0, 30.0)))
    inst = PlanInstance("i0", ("m",), "m", 0.0, {"m": 0.0})
    floor = np.array([[[5.0, 9.0]], [[12.0, 15.0]], [[25.0, 8.0]]])  # (groups, 1 instance, S)
    problem = PlanProblem(groups, (inst,), floor.copy(), floor)
    assert hopeless(problem, 0, now=4.0).tolist() == [False, False, False]
    assert hopeless(problem, 0, now=6.0).tolist() == [True, False, False]
    assert hopeless(problem, 0, now=9.0).tolist() == [True, True, False]


@pytest.mark.parametrize("seed", range(3))
def test_hopeless_on_every_instance_at_once_is_hopeless_on_each(seed: int) -> None:
    problem = random_problem(4, 30, seed=seed, scenarios=6)
    for now in (0.0, 50.0, 500.0):
        every = hopeless_all(problem, now)
        for g in range(4):
            assert every[:, g].tolist() == hopeless(problem, g, now).tolist()


def test_work_with_slack_for_its_turn_keeps_its_place_however_costly() -> None:
    """Served earliest deadline first from t = 0: a (10 s of work, due 5), b (20 s, due 100),
    c (20 s, due 45). a ends at 10 (too late, 5), b's turn comes after c's (c ends at 30, within
    45 / 1.3 = 34.6), b ends at 50 (50 × 1.3 = 65 ≤ 100). d is past saving and takes no time."""
    deadlines = (5.0, 100.0, 45.0, 1.0)
    groups = tuple(PlanGroup(f"g{i}", "m", d, 1.0) for i, d in enumerate(deadlines))
    inst = PlanInstance("i0", ("m",), "m", 0.0, {"m": 0.0})
    proc = np.array([[[10.0]], [[20.0]], [[20.0]], [[50.0]]])
    problem = PlanProblem(groups, (inst,), proc, np.ones_like(proc))
    late = np.array([False, False, False, True])
    assert in_time(problem, 0, [0, 1, 2, 3], 0.0, late, groups) == {"g1", "g2"}
    # Later, with c's deadline nearer: c no longer has the margin, and b still has.
    tight = PlanProblem(
        tuple(PlanGroup(g.id, "m", 38.0 if g.id == "g2" else g.deadline_s, 1.0) for g in groups),
        (inst,),
        proc,
        np.ones_like(proc),
    )
    assert in_time(tight, 0, [0, 1, 2, 3], 0.0, late, tight.groups) == {"g1"}


def test_cost_aware_admission_is_on_by_default_and_can_be_turned_off() -> None:
    assert PlannerConfig().defer_expensive and CONFIG.defer_expensive


def test_without_cost_aware_admission_nothing_is_deferred() -> None:
    qlm = policy(rate_window_s=20.0, defer_expensive=False)
    busy = load(max_running=8, outstanding_requests=8, outstanding_tokens=8000)
    for t in range(20):
        reqs = (make_request(2 * t, arrival_s=float(t), input_tokens=60_000, slo=SLO(60.0)),)
        qlm.decide(DispatchContext(float(t), reqs, (busy,)))
    assert qlm.plan(20.0, "test").deferred == 0


def test_completions_teach_the_estimator_how_fast_the_instance_really_decodes() -> None:
    """The same policy on engines two and four times as slow per decode step as the catalog's
    learns, from the requests it pulled, that they decode slower (its ε factor follows)."""
    reqs = [
        make_request(i, arrival_s=i * 0.1, input_tokens=100, replay_output_tokens=200, slo=SLO(60))
        for i in range(400)
    ]
    specs = [InstanceSpec("i0", "G", ("m",))]
    factors = {}
    for name, catalog in (
        ("catalog", make_catalog()),
        ("slow", make_catalog(base_ms=20.0, per_seq_ms=0.1)),
        ("slower", make_catalog(base_ms=40.0, per_seq_ms=0.2)),
    ):
        qlm = policy()
        sim = ClusterSimulation(specs, qlm, catalog=catalog, engine_config={"max_num_seqs": 8})
        assert all(r.status is RequestStatus.FINISHED for r in sim.run(reqs).records)
        factors[name] = qlm.estimator.calibration_factors("i0")[1]
    # Each doubling of the step time moves the factor up (by less than 2: the profile's
    # pseudo-evidence shrinks it toward 1); without learning all three would stay at 1.0.
    assert factors["catalog"] < factors["slow"] < factors["slower"], factors
    assert factors["slower"] > 1.4 * factors["slow"], factors


def test_the_violation_trigger_is_the_risk_the_policy_reports() -> None:
    """A plan is triggered exactly when a queued, admitted group's P(meet SLO) over the
    planner's scenarios — what ``estimates`` reports to operators — is below Δ."""
    qlm = policy(period_s=1000.0)
    busy = load(max_running=1, outstanding_requests=1, outstanding_tokens=200)
    reqs = tuple(
        make_request(i, arrival_s=0.0, slo=SLO(float(5 + 4 * i)), input_tokens=100 + 37 * i)
        for i in range(12)
    )
    qlm.decide(DispatchContext(0.0, reqs, (busy,)))
    seen = []
    for now in (1.0, 3.0, 6.0, 10.0, 15.0, 21.0, 28.0, 36.0):
        groups, _ = qlm.estimates(now)
        risks = [p for gid, (_, _, p) in groups.items() if gid not in qlm.admission.deferred]
        seen += risks
        # The chance constraint: at least ceil(delta x S) of the S scenarios meet the deadline.
        scenarios = qlm.config.scenarios
        required = math.ceil(qlm.config.delta * scenarios - 1e-9)
        expected = any(round(p * scenarios) < required for p in risks)
        assert qlm._predicts_violation(now) == expected, (now, risks)
        # (as the trigger's records, one per admitted group, answered it)
        records = [Violation(str(k), "i0", k, p, 0.0, 0.0) for k, p in enumerate(risks)]
        assert bool(violations(records, required / scenarios)) == expected
    # Not vacuous: some group was neither surely met nor surely missed.
    assert any(0.05 < p < qlm.config.delta for p in seen), seen


def test_within_the_tolerance_the_limit_that_serves_the_most_wins() -> None:
    values = {16: 1.0, 64: 2.0, 96: 1.95, 128: 1.7, 256: 1.5}
    rates = {16: 4.0, 64: 7.0, 96: 8.0, 128: 8.5, 256: 9.5}
    assert pick_limit(values, None, 0.05, rates, 0.05) == 96  # 1.95 is within 5 % of 2.0
    assert pick_limit(values, None, 0.05, rates, 0.0) == 64  # no tolerance: SLOs alone
    assert pick_limit(values, None, 0.05, rates, 0.2) == 128  # 1.7 is within 20 %, 1.5 is not
    # The limit in use stays within tolerance + hysteresis; one below it gives way.
    assert pick_limit({**values, 96: 1.88}, 96, 0.05, rates, 0.05) == 96
    assert pick_limit({**values, 96: 1.88}, None, 0.05, rates, 0.05) == 64
    assert pick_limit({**values, 96: 1.78}, 96, 0.05, rates, 0.05) == 64


def test_the_throughput_tolerance_applies_only_in_a_sustained_overload() -> None:
    """Values within the tolerance are alike; the one that serves more wins only in a sustained
    overload — the instance has something to keep up with (a backlog held a whole window) and
    the best limit leaves work deferred. An instance that serves all it gets, or whose backlog
    is a burst the queue absorbs, keeps the smallest limit worth the most: there a larger batch
    only slows each request."""
    from types import SimpleNamespace

    from qlm.planner.admission import Admission
    from qlm.planner.concurrency import Fluid, choose_limits

    def fluids(threshold: float) -> dict[int, Fluid]:
        return {
            b: Fluid(Admission(value, threshold, 0.0), {}, {}, {}, {}, rate)
            for b, value, rate in ((64, 3.0, 8.0), (96, 2.9, 9.0), (256, 2.0, 10.0))
        }

    family: Any = SimpleNamespace(instances=(SimpleNamespace(name="i0"),))
    sustained = {"i0": 9.0}
    for threshold, keep_up, expected in ((0.5, sustained, 96), (0.0, sustained, 64), (0.5, {}, 64)):
        chosen = choose_limits(
            family, [fluids(threshold)], [64], {}, 0.05, keep_up=keep_up, tolerance=0.05
        )
        assert chosen == [expected]
    assert choose_limits(family, [fluids(0.5)], [64], {}, 0.05, 0.0, sustained) == [64]
    with pytest.raises(ConfigError, match=r"planner\.throughput_tolerance"):
        PlannerConfig(throughput_tolerance=1.0)


def test_a_throughput_floor_rules_out_the_limits_that_serve_too_few_requests() -> None:
    """Limit 64 meets the most SLOs and serves 80 % of the requests per second that 256 does:
    under overload (more to keep up with than any limit serves) it wins unless the floor asks
    for more than 80 % of the most served, when the best of those left wins; when fewer arrive,
    the floor is a share of them, and the smaller limit keeps up with them."""
    from types import SimpleNamespace

    from qlm.planner.admission import Admission
    from qlm.planner.concurrency import Fluid, choose_limits

    def fluid(value: float, rate: float) -> Fluid:
        return Fluid(Admission(value, 0.0, 0.0), {}, {}, {}, {}, rate)

    fluids = {64: fluid(3.0, 8.0), 128: fluid(2.5, 9.5), 256: fluid(2.0, 10.0)}
    family: Any = SimpleNamespace(instances=(SimpleNamespace(name="i0"),))

    def chosen(floor: float, keep_up: float, current: int | None = None) -> int:
        now = {} if current is None else {"i0": current}
        [limit] = choose_limits(family, [fluids], [64], now, 0.05, floor, {"i0": keep_up})
        return limit

    assert chosen(0.0, 12.0) == 64 and chosen(0.8, 12.0) == 64
    assert chosen(0.9, 12.0) == 128 and chosen(0.99, 12.0) == 256
    # 7 to keep up with per second: 64 serves them all; 9: only 128 and 256 serve 95 % of them.
    assert chosen(0.95, 7.0) == 64
    assert chosen(0.95, 9.0) == 128
    assert chosen(0.0, 9.0) == 64
    # 8.6: 64 serves too few (8.0 < 0.95 × 8.6), unless it is the limit in use, which stays
    # while it serves within the hysteresis of the floor.
    assert chosen(0.95, 8.6) == 128
    assert chosen(0.95, 8.6, current=64) == 64
    # Nothing to keep up with (no rate known for the instance): SLOs alone.
    assert choose_limits(family, [fluids], [64], {}, 0.05, 0.95) == [64]
    # The instance serves 1.2 times what the fluid model rates it at (``ServedWork``): 64
    # serves 9.6 a second, 95 % of 9.
    served = {"i0": 1.2}
    assert choose_limits(family, [fluids], [64], {}, 0.05, 0.95, {"i0": 9.0}, 0.0, served) == [64]
    assert choose_limits(family, [fluids], [64], {}, 0.05, 0.95, {"i0": 11.0}, 0.0, served) == [128]
    with pytest.raises(ConfigError, match=r"planner\.throughput_floor"):
        PlannerConfig(throughput_floor=1.5)


def test_served_work_is_counted_while_every_slot_is_taken() -> None:
    """What an instance completed while it was full, in the fluid model's GPU-seconds per
    second of that time: steps while it had free slots count neither time nor work, nor does
    anything older than the window; too little time full reads as 1 (as modelled)."""
    from qlm.planner.concurrency import ServedWork

    served = ServedWork(window_s=100.0)
    served.step("i0", 0.0, True, 0.0)
    served.step("i0", 10.0, True, 12.0)  # full from 0 to 10 s: 12 GPU-s in 10 s
    served.step("i0", 20.0, False, 15.0)  # full from 10 to 20 s: 15 in 10 s
    served.step("i0", 30.0, True, 50.0)  # had free slots from 20 to 30 s: not counted
    served.step("i0", 40.0, True, 13.0)
    assert served.ratio("i0", 40.0, least_s=30.0) == pytest.approx((12 + 15 + 13) / 30)
    assert served.ratio("i0", 40.0, least_s=31.0) == 1.0
    assert served.ratio("i1", 40.0, least_s=1.0) == 1.0
    # 111 s: the first step (it ended at 10 s) is out of the window.
    served.step("i0", 111.0, True, 71.0)
    assert served.ratio("i0", 111.0, least_s=1.0) == pytest.approx((15 + 13 + 71) / 91)
    served.forget(["i1"])
    assert served.ratio("i0", 111.0, least_s=1.0) == 1.0


def test_the_throughput_floor_applies_once_an_instance_has_been_overloaded_a_while() -> None:
    """A queue that has held requests at every plan for ``overload_after_s`` is an overload:
    the floor then keeps up with the arrivals of the last ``floor_window_s`` plus the rate that
    clears the queue within that window. A shorter burst is left to the queue, and a queue that
    empties starts the count again."""
    qlm = policy(
        throughput_floor=0.95,
        floor_window_s=100.0,
        overload_after_s=100.0,
        rate_window_s=60.0,
        defer_expensive=False,
    )
    qlm.fix_concurrency(64)  # (what it pulls when free: everything)
    busy = load(max_running=64, outstanding_requests=64, outstanding_tokens=12_800)

    def keep_up(now: float, arrivals: tuple[Request, ...] = ()) -> dict[str, float]:
        qlm.decide(DispatchContext(now, arrivals, (busy,)))
        family, _ = qlm._family(now)
        rates, served = qlm._keep_up_rates(now, family)
        assert set(served) == set(rates)  # (nothing completed: as modelled)
        assert all(v == 1.0 for v in served.values())
        return rates

    first = tuple(make_request(i, arrival_s=0.0, slo=SLO(3600.0)) for i in range(20))
    assert keep_up(0.0, first) == {}  # (backlogged from now on)
    later = tuple(make_request(100 + i, arrival_s=60.0, slo=SLO(3600.0)) for i in range(10))
    assert keep_up(60.0, later) == {}
    # At 120 s: backlogged for 120 s; of the last 100 s, 10 arrivals (0.1/s); 30 queued,
    # cleared within the window.
    assert keep_up(120.0) == pytest.approx({"i0": 0.1 + 30 / 100})
    # The instance frees and pulls every request: the queue empties, and the count restarts.
    qlm.decide(DispatchContext(121.0, (), (load(max_running=64),)))
    assert not qlm.queues.queue("i0")
    assert keep_up(122.0) == {}
    again = tuple(make_request(200 + i, arrival_s=130.0, slo=SLO(3600.0)) for i in range(5))
    assert keep_up(130.0, again) == {} and keep_up(200.0) == {}
    assert keep_up(230.0) == pytest.approx({"i0": 5 / 100 + 5 / 100})
    # Off (floor and tolerance 0), nothing is tracked and nothing kept up with.
    off = policy(throughput_floor=0.0, throughput_tolerance=0.0)
    off.decide(DispatchContext(0.0, first, (busy,)))
    assert off._keep_up_rates(500.0, off._family(500.0)[0]) == ({}, {})


def test_the_policy_charges_what_a_full_instance_completes_to_its_served_work() -> None:
    """Completions count toward ``ServedWork`` at the fluid model's cost, at the concurrency
    limit in use, while every slot of that limit was taken: the instance served 2 requests of
    200 prompt and 50 output tokens in the 100 s it was full."""
    from qlm.planner.policy import Completion

    qlm = policy(throughput_floor=0.9, rate_window_s=60.0, defer_expensive=False)
    qlm.fix_concurrency(2)
    reqs = [make_request(i, arrival_s=0.0, slo=SLO(3600.0)) for i in range(4)]
    full = load(max_running=2, outstanding_requests=2, outstanding_tokens=400)
    qlm.decide(DispatchContext(0.0, tuple(reqs), (full,)))
    qlm.admission.limits["i0"] = 2
    qlm.decide(DispatchContext(0.0, (), (full,)))  # (full from now on, at limit 2)
    done = tuple(Completion(r, "i0", 50, 1.0, 2.0, 100.0) for r in reqs[:2])
    qlm.decide(DispatchContext(100.0, (), (full,), finished=done))
    hw = PROFILE.hardware_for("m", "G", 1)
    per_output = hw.decode_s(2) * hw.inefficiency / 2
    expected = 2 * (200 * hw.input_token_work_s + 50 * per_output) / 100.0
    assert qlm._served.ratio("i0", 100.0, least_s=60.0) == pytest.approx(expected)
    # With free slots (fewer outstanding than the limit), nothing more is counted.
    qlm.decide(DispatchContext(150.0, (), (load(max_running=2, outstanding_requests=1),)))
    more = (Completion(reqs[2], "i0", 50, 1.0, 2.0, 190.0),)
    qlm.decide(DispatchContext(200.0, (), (full,), finished=more))
    assert qlm._served.ratio("i0", 200.0, least_s=60.0) == pytest.approx(expected * 100 / 150)


def backlog(n: int, start: int = 0) -> list[Request]:
    """``n`` requests of three SLO classes and prompt lengths, arrived over ``n`` / 100 s."""
    slos = (SLO(20.0), SLO(60.0), SLO(600.0))
    return [
        make_request(
            i,
            arrival_s=i / 100,
            slo=slos[i % 3],
            tier=(Tier.INTERACTIVE, Tier.STANDARD, Tier.BATCH)[i % 3],
            input_tokens=100 + 37 * (i % 50),
        )
        for i in range(start, start + n)
    ]


def test_a_large_batch_is_grouped_by_one_reclustering_and_every_group_placed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    qlm = policy()

    def refuse(*args: object) -> str:
        raise AssertionError("classified one by one")

    monkeypatch.setattr(qlm.grouper, "add", refuse)
    idle = (load("i0", max_running=0), load("i1", max_running=0))
    qlm.decide(DispatchContext(20.0, tuple(backlog(qlm_policy.BATCH_MIN)), idle))
    assert qlm.grouper.num_requests == qlm_policy.BATCH_MIN and not qlm.ungrouped
    assert not qlm.queues.unassigned()
    assert qlm.queues.queue("i0") and qlm.queues.queue("i1")


def test_a_batch_below_a_quarter_of_what_is_held_is_classified_request_by_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    qlm = policy()
    idle = (load(max_running=0),)
    qlm.decide(DispatchContext(40.0, tuple(backlog(4 * qlm_policy.BATCH_MIN)), idle))
    added = []
    add = qlm.grouper.add
    monkeypatch.setattr(qlm.grouper, "add", lambda r, now: added.append(r.id) or add(r, now))
    more = backlog(qlm_policy.BATCH_MIN - 1, start=10_000)
    qlm.decide(DispatchContext(41.0, tuple(more), idle))
    assert added == [r.id for r in more]
    assert qlm.grouper.num_requests == 5 * qlm_policy.BATCH_MIN - 1


def test_a_batch_that_cannot_be_grouped_at_once_is_classified_alone_and_a_bad_one_rejected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    qlm = policy()

    def fail(*args: object) -> None:
        raise RuntimeError("k-means failed")

    monkeypatch.setattr(qlm.grouper, "add_many", fail)
    add = qlm.grouper.add

    def add_but_r0007(r: Request, now: float) -> str:
        if r.id == "r0007":
            raise ValueError("a bad request")
        return add(r, now)

    monkeypatch.setattr(qlm.grouper, "add", add_but_r0007)
    requests = backlog(qlm_policy.BATCH_MIN)
    with pytest.raises(RequestFailed) as failed:
        qlm.decide(DispatchContext(20.0, tuple(requests), (load(max_running=0),)))
    assert failed.value.request_id == "r0007"
    assert qlm.grouper.num_requests == qlm_policy.BATCH_MIN - 1
    assert qlm.grouper.group_of("r0007") is None and not qlm.ungrouped


def test_a_step_that_fell_behind_leaves_what_is_left_to_one_reclustering() -> None:
    ticks = itertools.count()  # every reading of the policy's clock: a second later
    qlm = QlmPolicy(
        PROFILE, config=CONFIG, measure_solve_time=True, clock=lambda: float(next(ticks))
    )
    idle = (load(max_running=0),)
    qlm.decide(DispatchContext(60.0, tuple(backlog(5 * qlm_policy.BATCH_MIN)), idle))
    assert qlm.grouper.num_requests == 5 * qlm_policy.BATCH_MIN  # one batch
    more = backlog(qlm_policy.BATCH_MIN + 1, start=10_000)  # below a quarter: one by one
    qlm.decide(DispatchContext(61.0, tuple(more), idle))
    assert qlm.ungrouped == qlm_policy.BATCH_MIN  # the step's time ran out after one
    qlm.decide(DispatchContext(62.0, (), idle))
    assert qlm.ungrouped == 0  # fallen behind: the rest at once
    assert qlm.grouper.num_requests == 6 * qlm_policy.BATCH_MIN + 1


def test_a_plan_on_a_predicted_violation_is_spaced_by_the_problem_its_check_built_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [0.0]

    def now() -> float:
        clock[0] += 0.001  # (the solver's budget runs out)
        return clock[0]

    build = qlm_policy.build_family

    def slow_build(*args: Any, **kwargs: Any) -> Any:
        clock[0] += 100.0  # building the plan problem "takes" 100 s of compute
        return build(*args, **kwargs)

    monkeypatch.setattr(qlm_policy, "build_family", slow_build)
    config = dataclasses.replace(
        CONFIG,
        period_s=10_000.0,
        defer_expensive=False,  # (a late group is not deferred: its miss is predicted each time)
        budget=dataclasses.replace(CONFIG.budget, time_s=0.1),
        grouping=dataclasses.replace(CONFIG.grouping, recluster_interval_s=1e6),
    )
    qlm = QlmPolicy(PROFILE, config=config, clock=now)
    busy = (load(max_running=1, outstanding_requests=1, outstanding_tokens=200),)

    def step(at: float, i: int) -> list[str]:
        late = make_request(i, arrival_s=0.0, slo=SLO(1.0))  # (one group: no recluster due)
        qlm.decide(DispatchContext(at, (late,), busy))
        return [p.trigger for p in qlm.take_plans()]

    assert step(0.0, 0) == ["instances"]  # its own problem: 100 s, so none before 200 s
    assert step(300.0, 1) == ["violation"]  # the check built the problem, the plan used it
    assert step(450.0, 2) == []  # 2 x (100 s + the plan) not passed yet
    assert step(700.0, 3) == ["violation"]


def test_a_request_the_books_do_not_know_is_taken_back_without_changing_them() -> None:
    """``AgentBooks.known``: every request the books hold anything of; ``take_back`` of any
    other, with no output, changes nothing and says it does not come back (what a batch's
    admission skips it for)."""
    from qlm.planner.books import AgentBooks, Inflight

    books = AgentBooks()
    books.inflight["a"] = {"r0001": Inflight(make_request(1), 0.0, 0)}
    books.swapped["a"] = {"r0002": Inflight(make_request(2), 0.0, 3)}
    books.started.add("r0003")
    books.generated["r0004"] = 5
    assert books.known() == {"r0001", "r0002", "r0003", "r0004"}
    before = (
        {k: dict(v) for k, v in books.inflight.items()},
        {k: dict(v) for k, v in books.swapped.items()},
        set(books.started),
        dict(books.generated),
    )
    assert not books.take_back("r0009", 0)
    after = (
        {k: dict(v) for k, v in books.inflight.items()},
        {k: dict(v) for k, v in books.swapped.items()},
        set(books.started),
        dict(books.generated),
    )
    assert after == before
    assert books.take_back("r0001", 0) and "r0001" not in books.known()
