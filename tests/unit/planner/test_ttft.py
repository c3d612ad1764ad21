"""Time-to-first-token deadlines in the plan: the groups carry them, the scenario model predicts
first tokens, the objective counts their violations, and the QLM policy serves them in time."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from builders import make_profile, make_request

from qlm.domain import SLO, Pull, Tier
from qlm.planner import PlannerConfig, QlmPolicy
from qlm.planner.act import Acted
from qlm.planner.family import build_family
from qlm.planner.policy import Completion, DispatchContext, InstanceLoad
from qlm.planner.program import (
    PlanGroup,
    PlanInstance,
    PlanProblem,
    score_many,
    score_orders,
    score_queue,
    subset,
)
from qlm.planner.solve import Budget, brute_force, capacity_needed, edf_plan, solve
from qlm.rct.estimator import RCTEstimator

PROFILE = make_profile()


def problem(
    proc: list[float],
    deadlines: list[float],
    ttft: list[float],
    *,
    first: float = 0.5,
    lead: float = 0.0,
    now: float = 0.0,
    weights: list[float] | None = None,
) -> PlanProblem:
    """One queue, one scenario, no latency floor: ``proc[i]`` seconds, deadlines, TTFT
    deadlines (``inf``: none), first token ``first`` s after a pull."""
    n = len(proc)
    groups = tuple(
        PlanGroup(f"g{i}", "m", deadlines[i], (weights or [1.0] * n)[i], ttft[i]) for i in range(n)
    )
    inst = (PlanInstance("i0", ("m",), "m", 0.0, {"m": 0.0}),)
    p = np.array(proc, float)[:, None, None]
    return PlanProblem(
        groups,
        inst,
        p,
        np.zeros_like(p),
        flow_weight=0.0,
        first=np.full((n, 1), first),
        lead=np.array([lead]),
        now_s=now,
    )


def test_a_first_token_after_its_deadline_is_a_violation_weighted_like_a_late_completion() -> None:
    # g0 (4 s of work) then g1, whose first token is due at 2 s: pulled at 4 s, first token at
    # 4.5 s, 2.5 s late; both complete in time.
    pr = problem([4.0, 1.0], [100.0, 100.0], [math.inf, 2.0], weights=[1.0, 3.0])
    s = score_queue(pr, 0, [0, 1])
    assert s.violation.tolist() == [0.0, 2.5]
    assert s.missed.tolist() == [False, True]  # its SLO is missed: P(meet) 0
    assert s.cost == pytest.approx(3.0 * 2.5 + pr.risk_weight * 3.0)
    ahead = score_queue(pr, 0, [1, 0])  # first token at 0.5 s
    assert ahead.cost == 0.0 and not ahead.missed.any()


def test_a_request_is_pulled_lead_seconds_before_its_fluid_start_and_never_before_now() -> None:
    # Fluid start 4 s, lead 3 s: pulled at 1 s, first token at 1.5 s.
    pr = problem([4.0, 1.0], [100.0, 100.0], [math.inf, 1.5], lead=3.0)
    assert score_queue(pr, 0, [0, 1]).violation.tolist() == [0.0, 0.0]
    # A lead longer than the wait: pulled now (10 s), first token at 10.5 s, 0.5 s late.
    later = problem([4.0, 1.0], [100.0, 100.0], [math.inf, 10.0], lead=30.0, now=10.0)
    assert score_queue(later, 0, [0, 1]).violation.tolist() == [0.0, 0.5]


def test_a_scenario_meets_the_slo_only_when_it_meets_both_deadlines() -> None:
    pr = problem([1.0], [0.5], [10.0])  # first token in time, completion late
    assert score_queue(pr, 0, [0]).p_meet.tolist() == [0.0]
    pr = problem([1.0], [10.0], [0.4])  # completion in time, first token late
    assert score_queue(pr, 0, [0]).p_meet.tolist() == [0.0]
    pr = problem([1.0], [10.0], [0.5])
    assert score_queue(pr, 0, [0]).p_meet.tolist() == [1.0]


def random_ttft_problem(seed: int, n: int = 7, q: int = 2, s: int = 4) -> PlanProblem:
    rng = np.random.default_rng(seed)
    groups = tuple(
        PlanGroup(
            f"g{i}",
            "m",
            float(rng.uniform(2, 20)),
            float(rng.uniform(1, 4)),
            float(rng.uniform(0.5, 6)) if rng.random() < 0.6 else math.inf,
        )
        for i in range(n)
    )
    instances = tuple(
        PlanInstance(f"i{g}", ("m",), "m", float(rng.uniform(0, 2)), {"m": 0.0}) for g in range(q)
    )
    proc = rng.uniform(0.5, 3.0, (n, q, s))
    floor = rng.uniform(0.2, 2.0, (n, q, s))
    return PlanProblem(
        groups,
        instances,
        proc,
        floor,
        first=rng.uniform(0.1, 0.6, (n, q)),
        lead=rng.uniform(0.0, 2.0, q),
        now_s=0.5,
    )


def test_the_batched_scores_equal_the_single_queue_score_with_ttft_deadlines() -> None:
    pr = random_ttft_problem(1)
    assert pr.has_ttft
    orders = np.array([[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]])
    many = score_many(pr, np.array([0, 1, 0]), orders)
    for r, (g, order) in enumerate(zip([0, 1, 0], orders, strict=True)):
        assert many[r] == pytest.approx(score_queue(pr, g, order.tolist()).cost)
    assert score_orders(pr, 1, orders[:2]) == pytest.approx(many[:2] * 0 + [
        score_queue(pr, 1, orders[0].tolist()).cost,
        score_queue(pr, 1, orders[1].tolist()).cost,
    ])  # fmt: skip
    padded = np.array([[4, 5, pr.pad, pr.pad]])  # rows shorter than the widest are padded
    assert score_many(pr, np.array([1]), padded)[0] == pytest.approx(
        score_queue(pr, 1, [4, 5]).cost
    )
    part = subset(pr, [1, 3, 5])  # a subset keeps the first tokens of its groups
    assert score_queue(part, 0, [0, 1, 2]).cost == pytest.approx(score_queue(pr, 0, [1, 3, 5]).cost)


def test_without_ttft_deadlines_first_tokens_change_nothing() -> None:
    pr = random_ttft_problem(2)
    plain = dataclasses.replace(
        pr, groups=tuple(dataclasses.replace(g, ttft_deadline_s=math.inf) for g in pr.groups)
    )
    bare = PlanProblem(plain.groups, pr.instances, pr.proc, pr.floor)
    assert not plain.has_ttft
    for order in ([0, 1, 2, 3], [6, 5, 4]):
        assert score_queue(plain, 0, order).cost == score_queue(bare, 0, order).cost


@pytest.mark.parametrize("solver", ["highs", "cbc"])
@pytest.mark.parametrize("seed", [3, 4])
def test_the_planner_matches_brute_force_with_ttft_deadlines(seed: int, solver: str) -> None:
    pr = random_ttft_problem(seed, n=5, q=2, s=3)
    _, best = brute_force(pr)
    sol = solve(pr, Budget(time_s=20.0, milp_max_groups=8), solver=solver)
    assert sol.objective == pytest.approx(best, rel=1e-6, abs=1e-6)


def test_edf_orders_by_the_earlier_of_the_two_deadlines() -> None:
    pr = problem([1.0, 1.0, 1.0], [10.0, 5.0, 20.0], [math.inf, math.inf, 2.0])
    assert edf_plan(pr) == ((2, 1, 0),)


def test_a_group_whose_first_token_is_late_even_if_pulled_now_is_left_out_of_capacity() -> None:
    pr = problem([1.0, 1.0], [100.0, 100.0], [math.inf, 0.2], now=0.0)  # first token at 0.5 s
    assert capacity_needed(pr) == 1.0  # more capacity cannot help it


def test_the_family_gives_each_group_its_earliest_ttft_deadline_and_predicts_first_tokens() -> None:
    est = RCTEstimator(PROFILE)
    timed = [
        make_request(0, arrival_s=1.0, slo=SLO(30.0, 2.0), input_tokens=1000),
        make_request(1, arrival_s=2.0, slo=SLO(30.0, 0.5)),
    ]
    plain = [make_request(2, arrival_s=0.0)]
    inst = InstanceLoad("i0", ("m",), gpu="G", max_running=32)
    config = PlannerConfig.for_simulation()
    family = build_family(
        [("a", timed, Tier.INTERACTIVE), ("b", plain, Tier.BATCH)],
        [inst],
        {"i0": 3.0},
        est,
        config,
        np.random.default_rng(0),
        now=2.5,
    )
    assert [g.ttft_deadline_s for g in family.groups] == [2.5, math.inf]
    pr = family.problem([32])
    assert pr.has_ttft and pr.now_s == 2.5
    assert pr.first is not None and pr.lead is not None
    hw = PROFILE.hardware_for("m", "G", 1)
    step = hw.decode_s(32) * hw.inefficiency
    assert pr.first[0, 0] == pytest.approx(hw.prefill_s(1000) + step)  # its first request's
    work = pr.proc[:, 0].mean(axis=1).sum() / 3  # mean fluid work per waiting request
    assert pr.lead[0] == pytest.approx(31 / 2 * work)
    no_ttft = build_family(
        [("b", plain, Tier.BATCH)], [inst], {"i0": 3.0}, est, config, np.random.default_rng(0)
    )
    assert not no_ttft.problem([32]).has_ttft


def test_the_policy_puts_a_group_with_a_first_token_deadline_first_in_line() -> None:
    qlm = QlmPolicy(PROFILE, config=PlannerConfig.for_simulation(2000), measure_solve_time=False)
    busy = InstanceLoad(
        "i0", ("m",), gpu="G", max_running=2, outstanding_requests=2, outstanding_tokens=400
    )
    std = [make_request(i, arrival_s=0.0, slo=SLO(10.0)) for i in range(3)]
    qlm.decide(DispatchContext(0.0, tuple(std), (busy,)))
    chat = make_request(9, arrival_s=0.5, slo=SLO(20.0, 1.0), tier=Tier.INTERACTIVE)
    qlm.decide(DispatchContext(0.5, (chat,), (busy,)))
    assert qlm.queues.next_request("i0") == chat  # its first token is due first


def full_policy() -> tuple[QlmPolicy, InstanceLoad]:
    """A policy whose instance (64 slots) runs its concurrency limit, 16 requests, and has
    completed one every 2 s lately."""
    qlm = QlmPolicy(PROFILE, config=PlannerConfig.for_simulation(2000), measure_solve_time=False)
    qlm.fix_concurrency(16)
    inst = InstanceLoad("i0", ("m",), gpu="G", max_running=64)
    done = [make_request(100 + i, arrival_s=0.0) for i in range(4)]
    qlm.decide(DispatchContext(0.0, tuple(done), (inst,)))
    for k in range(4):
        comp = Completion(done[k], "i0", 50, 0.1, 0.2, 2.0 * (k + 1))
        qlm.decide(DispatchContext(2.0 * (k + 1), (), (inst,), finished=(comp,)))
    return qlm, dataclasses.replace(inst, outstanding_requests=16, outstanding_tokens=3200)


def test_a_first_token_that_would_miss_waiting_for_a_slot_is_pulled_beyond_the_limit() -> None:
    qlm, busy = full_policy()
    chat = make_request(1, arrival_s=8.5, slo=SLO(20.0, 1.0), tier=Tier.INTERACTIVE)
    out = qlm.decide(DispatchContext(8.5, (chat,), (busy,)))
    assert Pull("r0001", "i0") in out  # a slot frees every 2 s: too late for a 1 s TTFT


def test_a_first_token_behind_others_in_plan_order_is_pulled_ahead_of_them_alone() -> None:
    # Batch work is ahead of a chat request in plan order: the chat's turn comes after theirs,
    # as slots free (every 2 s). At 10.5 s that is too late for its 7 s TTFT: it alone is
    # pulled beyond the limit; those ahead keep their place and wait for their slots.
    qlm, busy = full_policy()
    ahead = [make_request(i, arrival_s=8.5, slo=SLO(300.0), tier=Tier.BATCH) for i in (1, 2)]
    chat = make_request(3, arrival_s=8.5, slo=SLO(20.0, 7.0), tier=Tier.INTERACTIVE)
    assert qlm.decide(DispatchContext(8.5, (*ahead, chat), (busy,))) == []  # in time, waiting
    gid = qlm.grouper.group_of("r0003")
    qlm.queues.set_order("i0", [g for g in qlm.queues.queue("i0") if g != gid] + [gid])

    def waiting() -> list[str]:
        return [r.id for g in qlm.queues.queue("i0") for r in qlm.grouper.group(g).requests]

    assert waiting() == ["r0001", "r0002", "r0003"]
    acted = Acted()
    qlm.agents.act(10.5, (busy,), acted)
    assert acted.decisions == [Pull("r0003", "i0")]
    assert waiting() == ["r0001", "r0002"]


def test_a_first_token_that_meets_its_deadline_waiting_waits_for_its_slot() -> None:
    qlm, busy = full_policy()
    chat = make_request(1, arrival_s=8.5, slo=SLO(20.0, 15.0), tier=Tier.INTERACTIVE)
    assert qlm.decide(DispatchContext(8.5, (chat,), (busy,))) == []


def test_a_first_token_already_late_is_not_pulled_beyond_the_limit() -> None:
    qlm, busy = full_policy()
    chat = make_request(1, arrival_s=8.5, slo=SLO(20.0, 0.01), tier=Tier.INTERACTIVE)
    assert qlm.decide(DispatchContext(8.5, (chat,), (busy,))) == []


def test_a_request_back_with_output_has_had_its_first_token() -> None:
    qlm = QlmPolicy(PROFILE, config=PlannerConfig.for_simulation(2000), measure_solve_time=False)
    busy = InstanceLoad(
        "i0", ("m",), gpu="G", max_running=1, outstanding_requests=1, outstanding_tokens=200
    )
    back = make_request(1, arrival_s=0.0, slo=SLO(20.0, 1.0), tier=Tier.INTERACTIVE)
    qlm.decide(DispatchContext(5.0, (back,), (busy,), generated=(("r0001", 30),)))
    gid = qlm.grouper.group_of("r0001")
    assert gid is not None and qlm.grouper.group(gid).earliest_ttft_deadline_s is None


@pytest.mark.parametrize(("bound", "chat"), [(2500, True), (0, True), (2500, False)])
def test_the_agents_keep_few_prompts_waiting_inside_the_engine(bound: int, chat: bool) -> None:
    """A chat request with a TTFT deadline and six batch prompts of 1,000 tokens wait and there
    are slots for all: with at most 2,500 prompt tokens pulled and not yet started the agent
    pulls the chat request and two batch prompts, and two more once the engine has started
    those; without a bound, or with no first token at stake, it pulls every one at once."""
    from qlm.agents.decide import AgentConfig

    agent = AgentConfig(prefill_queue_tokens=bound)
    qlm = QlmPolicy(
        PROFILE, config=PlannerConfig.for_simulation(2000, agent=agent), measure_solve_time=False
    )
    inst = InstanceLoad("i0", ("m",), gpu="G", max_running=64)
    batch = tuple(
        make_request(i, arrival_s=0.0, input_tokens=1000, slo=SLO(300.0), tier=Tier.BATCH)
        for i in range(6)
    )
    talk = make_request(9, arrival_s=0.0, input_tokens=200, slo=SLO(20.0, 10.0))
    reqs = (talk, *batch) if chat else batch
    first = [d.request_id for d in qlm.decide(DispatchContext(0.0, reqs, (inst,)))]
    held = [rid for rid in first if rid != talk.id]
    if not bound or not chat:
        assert len(held) == 6
        return
    assert talk.id in first and len(held) == 2
    busy = dataclasses.replace(inst, outstanding_requests=3, outstanding_tokens=2200)
    assert qlm.decide(DispatchContext(0.1, (), (busy,))) == []  # not started yet: no more
    more = qlm.decide(DispatchContext(0.2, (), (busy,), started=tuple(first)))
    assert len(more) == 2 and not {d.request_id for d in more} & set(first)
