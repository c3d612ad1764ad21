"""The baseline policies: each orders and places requests as its paper says, pulls every request
eventually, and never looks at a request's true output length."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
from builders import make_catalog, make_profile, make_request

from qlm.domain import SLO, Decision, Evict, InstanceSpec, Pull, Request, RequestStatus, Tier
from qlm.errors import ConfigError
from qlm.planner import PlannerConfig, QlmPolicy, create_policy
from qlm.planner.baselines import create_baseline
from qlm.planner.baselines.edf import SlackEdfPolicy
from qlm.planner.baselines.priority import PriorityPolicy
from qlm.planner.baselines.proserve import ProservePolicy
from qlm.planner.baselines.shepherd import (
    AUTO_BATCH_SIZES,
    BatchPlanInput,
    ShepherdPolicy,
    solve_batch_ilp,
)
from qlm.planner.policy import Completion, DispatchContext, InstanceLoad, Policy
from qlm.planner.queued import model_queue
from qlm.settings import get_settings
from qlm.sim.cluster import ClusterSimulation
from qlm.wiring import baseline_config

NAMES = ("fcfs", "fcfs-rr", "edf", "sedf", "priority", "proserve", "shepherd")
PROFILE = make_profile()


def load(name: str = "i0", **overrides: Any) -> InstanceLoad:
    fields: dict[str, Any] = {"name": name, "models": ("m",), "gpu": "G", "max_running": 1}
    fields.update(overrides)
    return InstanceLoad(**fields)


def ctx(now: float, arrived: Sequence[Request] = (), *loads: InstanceLoad) -> DispatchContext:
    return DispatchContext(now=now, arrived=tuple(arrived), instances=loads or (load(),))


def pulls(decisions: Sequence[Decision]) -> list[str]:
    return [d.request_id for d in decisions if isinstance(d, Pull)]


def drive(
    policy: Policy, requests: Sequence[Request], *, instances: int = 1, max_running: int = 1
) -> list[Decision]:
    """A fake cluster, one step per second: requests arrive at their second, whatever was pulled
    finishes at the next step with 40 tokens, an evicted request comes back with 5. Returns every
    decision in order."""
    names = [f"i{k}" for k in range(instances)]
    running: dict[str, list[Request]] = {n: [] for n in names}
    by_id = {r.id: r for r in requests}
    back: list[Request] = []
    log: list[Decision] = []
    for now in range(200):
        arrived = [r for r in requests if now - 1 < r.arrival_s <= now] + back
        finished = tuple(
            Completion(r, n, 40, now - 1.0, now - 0.5, float(now))
            for n in names
            for r in running[n]
        )
        running = {n: [] for n in names}
        context = DispatchContext(
            now=float(now),
            arrived=tuple(arrived),
            instances=tuple(load(n, max_running=max_running) for n in names),
            finished=finished,
            generated=tuple((r.id, 5) for r in back),
        )
        back = []
        for d in policy.decide(context):
            log.append(d)
            if isinstance(d, Pull):
                running[d.instance].append(by_id[d.request_id])
            elif isinstance(d, Evict):
                running[d.instance].remove(by_id[d.request_id])
                back.append(by_id[d.request_id])
    return log


def test_edf_pulls_in_deadline_order() -> None:
    reqs = [
        make_request(0, arrival_s=0.0, slo=SLO(e2e_s=50.0)),
        make_request(1, arrival_s=0.0, slo=SLO(e2e_s=10.0)),
        make_request(2, arrival_s=0.0, slo=SLO(e2e_s=30.0)),
        make_request(3, arrival_s=1.0, slo=SLO(e2e_s=5.0)),  # deadline 6: overtakes 0 and 2
    ]
    order = pulls(drive(create_baseline("edf") or pytest.fail(), reqs))
    assert order == ["r0001", "r0003", "r0002", "r0000"]


def test_priority_pulls_interactive_before_batch_and_fcfs_inside_a_tier() -> None:
    reqs = [
        make_request(0, arrival_s=0.5, tier=Tier.BATCH),
        make_request(1, arrival_s=0.6, tier=Tier.STANDARD),
        make_request(2, arrival_s=0.7, tier=Tier.INTERACTIVE),
        make_request(3, arrival_s=0.8, tier=Tier.BATCH),
        make_request(4, arrival_s=0.9, tier=Tier.INTERACTIVE),
    ]
    order = pulls(drive(PriorityPolicy(), reqs))
    assert order == ["r0002", "r0004", "r0001", "r0000", "r0003"]


def test_priority_evicts_the_latest_lower_tier_request_to_make_room() -> None:
    policy = PriorityPolicy()
    batch = [make_request(i, arrival_s=0.0, tier=Tier.BATCH) for i in range(2)]
    assert pulls(policy.decide(ctx(0.0, batch, load(max_running=2)))) == ["r0000", "r0001"]
    full = load(max_running=2, outstanding_requests=2, outstanding_tokens=400)
    standard = make_request(2, arrival_s=1.0, tier=Tier.STANDARD)
    urgent = make_request(3, arrival_s=1.0, tier=Tier.INTERACTIVE)
    decisions = policy.decide(ctx(1.0, [standard, urgent], full))
    assert decisions == [
        Evict("r0001", "i0"),
        Pull("r0003", "i0"),
        Evict("r0000", "i0"),
        Pull("r0002", "i0"),
    ]
    # Now only higher tiers run: a batch request waits, it evicts nobody.
    assert policy.decide(ctx(2.0, [make_request(4, tier=Tier.BATCH)], full)) == []


def test_sedf_puts_late_requests_behind_the_others_latest_deadline_first() -> None:
    policy = SlackEdfPolicy(PROFILE)
    busy = load(outstanding_requests=1)
    reqs = [
        make_request(0, arrival_s=0.0, slo=SLO(e2e_s=40.0)),
        make_request(1, arrival_s=0.0, slo=SLO(e2e_s=11.0)),
        make_request(2, arrival_s=0.0, slo=SLO(e2e_s=20.0)),
        make_request(3, arrival_s=0.0, slo=SLO(e2e_s=10.5)),
    ]
    service = policy.estimates.service_s(reqs[0], 0, busy)
    assert 1.0 < service < 10.0
    assert policy.decide(ctx(0.0, reqs, busy)) == []  # all have slack; nothing has room
    # At t=10 the slack of r1 (deadline 11) and r3 (10.5) is negative: they go last, and the
    # later deadline of the two first (priority -1/deadline).
    order = pulls(policy.decide(ctx(10.0, (), load(max_running=4))))
    assert order == ["r0002", "r0000", "r0001", "r0003"]


def test_proserve_orders_urgent_requests_by_gain_density_then_the_rest_by_deadline() -> None:
    policy = ProservePolicy(PROFILE)
    tight = SLO(e2e_s=0.5)  # first-token deadline already past: URGENT
    reqs = [
        make_request(0, tier=Tier.INTERACTIVE, input_tokens=8000, slo=tight, arrival_s=0.0),
        make_request(1, tier=Tier.BATCH, input_tokens=200, slo=tight, arrival_s=0.0),
        make_request(2, tier=Tier.INTERACTIVE, input_tokens=200, slo=tight, arrival_s=0.0),
        make_request(3, tier=Tier.INTERACTIVE, input_tokens=100, slo=SLO(100.0), arrival_s=0.0),
        make_request(4, tier=Tier.BATCH, input_tokens=100, slo=SLO(80.0), arrival_s=0.0),
    ]
    assert policy.decide(ctx(0.0, reqs, load(outstanding_requests=1))) == []
    order = pulls(policy.decide(ctx(0.0, (), load(max_running=8))))
    # density w/exec: r2 4/0.04, r1 1/0.04, r0 4/0.43; then NORMAL by first-token deadline
    assert order == ["r0002", "r0001", "r0000", "r0004", "r0003"]


def test_proserve_routes_to_the_busier_instance_that_still_meets_the_slo() -> None:
    policy = ProservePolicy(PROFILE)
    a, b = load("a", max_running=64), load("b", max_running=64)
    far = SLO(e2e_s=1000.0)
    # About 6 s of work on b and 20 s on a (prompt work 5e-5 s per token).
    policy.decide(
        ctx(0.0, [make_request(0, input_tokens=120_000, slo=far)], b, load("a", up=False))
    )
    heavy = [make_request(i, input_tokens=100_000, slo=far) for i in range(1, 5)]
    policy.decide(ctx(0.0, heavy, a, load("b", up=False)))
    assert policy.load_s("b") == pytest.approx(6.0, abs=0.1)
    assert policy.load_s("a") == pytest.approx(20.0, abs=0.2)
    # SLO ~58 s: neither is light (< μ·SLO), both stay under λ·SLO: the busier one takes it and b
    # keeps its capacity for later requests. A least-loaded router would have picked b.
    loose = make_request(5, slo=SLO(e2e_s=60.0))
    assert policy.decide(ctx(0.0, [loose], a, b)) == [Pull("r0005", "a")]
    # SLO ~28 s: a would exceed λ·SLO, so b.
    tight = make_request(6, slo=SLO(e2e_s=30.0))
    assert policy.decide(ctx(0.0, [tight], a, b)) == [Pull("r0006", "b")]


def test_shepherd_runs_fixed_batches_one_at_a_time() -> None:
    policy = ShepherdPolicy(PROFILE, batch_size=4)
    reqs = [make_request(i, arrival_s=0.0, slo=SLO(e2e_s=100.0 + i)) for i in range(10)]
    first = pulls(policy.decide(ctx(0.0, reqs, load(max_running=64))))
    assert len(first) == 4
    busy = load(max_running=64, outstanding_requests=4)
    assert policy.decide(ctx(1.0, [make_request(10)], busy)) == []  # room, but a batch runs
    done = [Completion(r, "i0", 40, 0.0, 0.5, 2.0) for r in reqs if r.id in first]
    partly = DispatchContext(2.0, (), (busy,), finished=tuple(done[:3]))
    assert policy.decide(partly) == []  # the batch has not finished
    rest = DispatchContext(3.0, (), (load(max_running=64),), finished=tuple(done[3:]))
    second = pulls(policy.decide(rest))
    assert len(second) == 4 and not set(second) & set(first)


def test_shepherd_chooses_the_batch_size_that_makes_the_most_deadlines_per_second() -> None:
    idle = load(max_running=256)

    def queued(reqs: list[Request]) -> ShepherdPolicy:
        policy = ShepherdPolicy(PROFILE)  # no fixed size: its rule at each round
        for r in reqs:
            policy.push(r, model_queue(r.model), policy.key(r, ctx(0.0, [], idle)))
        return policy

    def rate(policy: ShepherdPolicy, batch: list[Request]) -> float:
        exec_s = policy._exec_s(batch, idle)
        return sum(r.deadline_s >= exec_s for r in batch) / exec_s

    loose = [make_request(i, arrival_s=0.0, slo=SLO(e2e_s=600.0 + i)) for i in range(300)]
    policy = queued(loose)
    chosen = policy._batch_size(model_queue("m"), [idle], now=0.0)
    rates = {b: rate(policy, loose[:b]) for b in AUTO_BATCH_SIZES}
    assert rates[chosen] == max(rates.values())
    assert chosen > AUTO_BATCH_SIZES[0]  # every deadline is loose: a larger batch serves more
    # Deadlines a large batch would miss: a smaller one makes more of them per second.
    tight = [make_request(i, arrival_s=0.0, slo=SLO(e2e_s=4.0)) for i in range(300)]
    policy = queued(tight)
    small = policy._batch_size(model_queue("m"), [idle], now=0.0)
    assert small < chosen
    assert rate(policy, tight[:small]) == max(rate(policy, tight[:b]) for b in AUTO_BATCH_SIZES)
    # Never more than the instance runs at once.
    assert queued(loose)._batch_size(model_queue("m"), [load(max_running=16)], 0.0) <= 16
    # A backlog already late: no size makes a deadline, and the largest drains it fastest.
    late = [make_request(i, arrival_s=0.0, slo=SLO(e2e_s=1.0)) for i in range(300)]
    assert queued(late)._batch_size(model_queue("m"), [idle], now=100.0) == AUTO_BATCH_SIZES[-1]


def test_every_baseline_parameter_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QLM_BASELINES__SHEPHERD_BATCH_SIZE", "64")
    monkeypatch.setenv("QLM_BASELINES__PROSERVE_ALPHA", "0.5")
    monkeypatch.setenv("QLM_BASELINES__PRIORITY_PREEMPT", "false")
    config = baseline_config(get_settings().baselines)
    shepherd = create_policy("shepherd", baselines=config)
    proserve = create_policy("proserve", baselines=config)
    priority = create_policy("priority", baselines=config)
    assert isinstance(shepherd, ShepherdPolicy) and shepherd.batch_size == 64
    assert isinstance(proserve, ProservePolicy) and proserve.alpha == 0.5
    assert isinstance(priority, PriorityPolicy) and not priority.preempt
    monkeypatch.setenv("QLM_BASELINES__SHEPHERD_BATCH_SIZE", "0")
    with pytest.raises(ConfigError, match=r"^setting QLM_BASELINES__SHEPHERD_BATCH_SIZE"):
        get_settings()


def test_shepherd_ilp_skips_a_batch_that_is_already_late() -> None:
    plan = BatchPlanInput(
        exec_s=((4.0,), (4.0,), (4.0,)),
        deadlines=((-1.0, -1.0), (9.0, 9.0), (5.0, 5.0)),
        available_s=(0.0,),
        idle=(0,),
    )
    # EDF would run batch 0 (late anyway) first and then miss one of the others.
    assert solve_batch_ilp(plan, time_limit_s=5.0) == {0: 2}


@pytest.mark.parametrize("name", NAMES)
def test_every_policy_finishes_every_request(name: str) -> None:
    tiers = list(Tier)
    reqs = [
        make_request(
            i,
            arrival_s=i * 0.05,
            input_tokens=100 + 37 * i % 900,
            replay_output_tokens=1 + 53 * i % 300,
            tier=tiers[i % 3],
            slo=SLO(e2e_s=5.0 + i % 7),
        )
        for i in range(120)
    ]
    policy = create_baseline(name, profile=PROFILE)
    assert policy is not None and policy.name == name
    specs = [InstanceSpec("i0", "G", ("m",)), InstanceSpec("i1", "G", ("m",))]
    sim = ClusterSimulation(
        specs, policy, catalog=make_catalog(), engine_config={"max_num_seqs": 8}
    )
    result = sim.run(reqs)
    assert all(r.status is RequestStatus.FINISHED for r in result.records)
    assert all(r.output_tokens == r.request.replay_output_tokens for r in result.records)
    if name == "priority":
        assert any(r.evictions for r in result.records)  # the load makes it preempt


@pytest.mark.parametrize("name", NAMES)
def test_no_policy_reads_the_true_output_length(name: str) -> None:
    reqs = [
        make_request(i, arrival_s=i * 0.1, input_tokens=100 + 97 * i % 700, tier=list(Tier)[i % 3])
        for i in range(24)
    ]
    runs = []
    for truth in (None, 1, 10**6):
        variant = [dataclasses.replace(r, replay_output_tokens=truth) for r in reqs]
        policy = create_baseline(name, profile=PROFILE)
        assert policy is not None
        runs.append(drive(policy, variant, instances=2, max_running=2))
    assert runs[0] == runs[1] == runs[2]
    assert len(pulls(runs[0])) >= len(reqs)


def test_unknown_baseline_is_none() -> None:
    assert create_baseline("qlm") is None


def test_priority_never_evicts_an_answer_that_would_start_over() -> None:
    """A structured or tool-calling request (``resumable`` False) loses its whole output when
    evicted: priority makes room with the others only."""
    policy = PriorityPolicy()
    batch = [make_request(0, arrival_s=0.0, tier=Tier.BATCH)]
    batch.append(
        dataclasses.replace(make_request(1, arrival_s=0.0, tier=Tier.BATCH), resumable=False)
    )
    assert pulls(policy.decide(ctx(0.0, batch, load(max_running=2)))) == ["r0000", "r0001"]
    full = load(max_running=2, outstanding_requests=2, outstanding_tokens=400)
    urgent = make_request(3, arrival_s=1.0, tier=Tier.INTERACTIVE)
    assert policy.decide(ctx(1.0, [urgent], full)) == [Evict("r0000", "i0"), Pull("r0003", "i0")]


def test_the_qlm_policy_counts_a_request_back_from_an_instance_once_and_forgets_its_output() -> (
    None
):
    """Coming back to run again (evicted, its instance lost, or restarted with nothing kept) a
    request is no new arrival for the rate the planner judges the stream by, and a restart
    leaves none of the earlier attempt's output in its books."""
    policy = create_policy("qlm", profile=PROFILE, planner=PlannerConfig.for_simulation(500))
    assert isinstance(policy, QlmPolicy)
    req = make_request(0, arrival_s=0.0)
    assert pulls(policy.decide(ctx(0.0, [req], load(max_running=4)))) == ["r0000"]
    back = DispatchContext(
        now=1.0, arrived=(req,), instances=(load(max_running=4),), generated=(("r0000", 7),)
    )
    assert pulls(policy.decide(back)) == ["r0000"]  # resumed with 7 tokens
    assert policy.books.generated == {"r0000": 7}
    again = ctx(2.0, [req], load(max_running=4))  # started over: nothing kept
    assert pulls(policy.decide(again)) == ["r0000"]
    assert policy.books.generated == {} and len(policy._arrivals) == 1
    other = make_request(1, arrival_s=3.0)
    assert pulls(policy.decide(ctx(3.0, [other], load(max_running=4)))) == ["r0001"]
    returned = ctx(4.0, [other], load(max_running=4))  # lost with its instance before a token
    assert pulls(policy.decide(returned)) == ["r0001"]
    assert len(policy._arrivals) == 2  # r0000 and r0001, once each
