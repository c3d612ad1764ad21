"""The agent's operations: when it makes room, whom it preempts, swap or evict, model tiers."""

from __future__ import annotations

import dataclasses

import pytest
from builders import make_catalog, make_profile, make_request

from qlm.agents import (
    AgentConfig,
    HeadGroup,
    InstanceCosts,
    RunningRequest,
    make_room,
    plan_tiers,
    prefers_swap,
)
from qlm.domain import (
    SLO,
    Evict,
    InstanceSpec,
    ModelTier,
    RequestStatus,
    SetModelTier,
    SwapOut,
    Tier,
)
from qlm.fleet import parse_instances
from qlm.planner import POLICIES, PlannerConfig, QlmPolicy, create_policy
from qlm.rct.output_model import NIG
from qlm.rct.profile import default_profile
from qlm.sim.cluster import ClusterSimulation, Outage

ON = AgentConfig(evict=True, swap=True, min_victim_slack_s=1.0, resume_delay_s=1.0)
COSTS = InstanceCosts(
    kv_bytes_per_token=131072,
    host_link_gbs=25.0,
    swap_free_gb=64.0,
    prefill_base_s=0.01,
    prefill_per_token_s=6e-5,
)


def running(i: int, deadline_s: float, remaining_s: float = 30.0, **kw: object) -> RunningRequest:
    req = make_request(i, arrival_s=0.0, slo=SLO(deadline_s), input_tokens=1000)
    return RunningRequest(req, generated=100, remaining_s=remaining_s, **kw)  # type: ignore[arg-type]


# Outputs of ~1,800 tokens expected (log-mean 7.5): the agent knows the batch will run long.
LONG_OUTPUTS = dataclasses.replace(
    make_profile(), output_priors={"default": NIG(mu=7.5, kappa=20.0, alpha=11.0, beta=5.0)}
)
HEAD = HeadGroup("g1", deadline_s=20.0, waiting=2, service_s=5.0)


def test_no_preemption_when_there_is_room_or_a_slot_frees_in_time() -> None:
    batch = [running(0, 300.0), running(1, 300.0)]
    assert make_room(0.0, "i0", HEAD, 2, batch, COSTS, ON) == []
    soon = [running(0, 300.0, remaining_s=3.0), running(1, 300.0)]
    assert make_room(0.0, "i0", HEAD, 0, soon, COSTS, ON) == []


def test_no_preemption_for_a_head_that_cannot_be_saved() -> None:
    hopeless = dataclasses.replace(HEAD, deadline_s=4.0)
    assert make_room(0.0, "i0", hopeless, 0, [running(0, 300.0)], COSTS, ON) == []


def test_preempts_the_least_urgent_with_enough_slack_as_many_as_needed() -> None:
    batch = [running(0, 300.0), running(1, 200.0), running(2, 15.0), running(3, 35.0)]
    out = make_room(0.0, "i0", HEAD, 0, batch, COSTS, ON)
    # r0002 is more urgent than the head, r0003 would miss after a resume: r0000, then r0001.
    assert [d.request_id for d in out] == ["r0000", "r0001"]
    assert all(d.instance == "i0" for d in out)


def test_a_request_is_preempted_at_most_max_preemptions_times() -> None:
    out = make_room(0.0, "i0", HEAD, 1, [running(0, 300.0, preemptions=1)], COSTS, ON)
    assert out == []


@pytest.mark.parametrize(
    ("link_gbs", "swap"),
    [(25.0, True), (0.5, False), (0.0, False)],  # 2 x 1100 x 128 KiB over 0.5 GB/s > recompute
)
def test_swap_is_chosen_exactly_when_it_is_cheaper_than_recompute(
    link_gbs: float, swap: bool
) -> None:
    costs = dataclasses.replace(COSTS, host_link_gbs=link_gbs)
    assert prefers_swap(costs, 1100) is swap
    out = make_room(0.0, "i0", HEAD, 1, [running(0, 300.0)], costs, ON)
    assert [type(d) for d in out] == [SwapOut if swap else Evict]


def test_swap_falls_back_to_eviction_when_cpu_swap_space_is_full() -> None:
    full = dataclasses.replace(COSTS, swap_free_gb=0.01)
    out = make_room(0.0, "i0", HEAD, 1, [running(0, 300.0)], full, ON)
    assert [type(d) for d in out] == [Evict]
    assert make_room(0.0, "i0", HEAD, 1, [running(0, 300.0)], full, AgentConfig()) == []


def test_preempted_requests_resume_and_finish_with_their_full_output() -> None:
    """Long batch requests fill the instance; urgent ones arrive: the agent swaps or evicts
    batch requests, which later resume (swap in, or re-prefill with their partial output)."""
    reqs = [
        make_request(
            i,
            arrival_s=0.0,
            slo=SLO(600.0),
            tier=Tier.BATCH,
            replay_output_tokens=2000,
            max_tokens=2500,
        )
        for i in range(4)
    ] + [
        make_request(
            10 + i,
            arrival_s=2.0,
            slo=SLO(6.0),
            tier=Tier.INTERACTIVE,
            replay_output_tokens=20,
            max_tokens=50,
        )
        for i in range(2)
    ]
    results = {}
    variants = (
        ("off", AgentConfig()),
        ("swap", ON),
        ("evict", dataclasses.replace(ON, swap=False)),
    )
    for name, agent in variants:
        config = PlannerConfig.for_simulation(2000, agent=agent, choose_concurrency=False)
        policy = QlmPolicy(LONG_OUTPUTS, config=config, measure_solve_time=False)
        sim = ClusterSimulation(
            [InstanceSpec("i0", "G", ("m",))],
            policy,
            catalog=make_catalog(),
            engine_config={"max_num_seqs": 4},
        )
        results[name] = sim.run(reqs)
    for name, result in results.items():
        assert all(r.status is RequestStatus.FINISHED for r in result.records), name
        assert all(r.output_tokens == r.request.replay_output_tokens for r in result.records), name
        urgent = [r for r in result.records if r.request.tier is Tier.INTERACTIVE]
        assert all(r.slo_met for r in urgent) is (name != "off"), name
    assert sum(r.swaps for r in results["swap"].records) >= 1
    assert sum(r.evictions for r in results["evict"].records) >= 1
    assert sum(r.swaps for r in results["evict"].records) == 0


def test_tiers_follow_the_virtual_queue_within_the_cpu_budget() -> None:
    tiers = {"a": ModelTier.ACTIVE, "b": ModelTier.COLD, "c": ModelTier.WARM, "d": ModelTier.COLD}
    sizes = {"a": 16.0, "b": 16.0, "c": 26.0, "d": 16.0}
    # Queue: b, d, b, c — b becomes active; d warm (16 GB of the 20 GB budget); c no longer fits.
    out = plan_tiers("i0", ["b", "d", "b", "c"], tiers, sizes, cpu_budget_gb=20.0)
    assert out == [
        SetModelTier("i0", "c", ModelTier.COLD),
        SetModelTier("i0", "d", ModelTier.WARM),
        SetModelTier("i0", "b", ModelTier.ACTIVE),
    ]
    settled = {"a": ModelTier.WARM, "b": ModelTier.ACTIVE, "c": ModelTier.COLD, "d": ModelTier.WARM}
    assert plan_tiers("i0", ["b", "d"], settled, sizes, cpu_budget_gb=20.0) == [
        SetModelTier("i0", "a", ModelTier.COLD)
    ]
    assert plan_tiers("i0", [], tiers, sizes, cpu_budget_gb=20.0) == []


def test_a_warm_head_keeps_its_cpu_copy_until_it_has_loaded() -> None:
    # b is warm (16 GB of the 20) and about to load: d (16 GB) does not fit beside it yet.
    tiers = {"a": ModelTier.ACTIVE, "b": ModelTier.WARM, "d": ModelTier.COLD}
    sizes = {"a": 16.0, "b": 16.0, "d": 16.0}
    out = plan_tiers("i0", ["b", "d"], tiers, sizes, cpu_budget_gb=20.0)
    assert out == [SetModelTier("i0", "b", ModelTier.ACTIVE)]


def test_a_tight_cpu_budget_serves_every_request_of_three_models() -> None:
    """Between everything fits and nothing does: the warm head's CPU copy counts, and a tier
    change the engine refuses does not stop the simulation."""
    specs = parse_instances("1xA100:llama-2-7b+llama-3-8b+llama-2-13b")
    models = ["llama-3-8b", "llama-2-13b", "llama-2-7b", "llama-3-8b"]
    reqs = [
        make_request(
            i,
            model=models[(i // 5) % 4],
            input_tokens=100,
            max_tokens=200,
            arrival_s=0.5 * i,
            slo=SLO(e2e_s=60.0 if i % 2 else 400.0),
            replay_output_tokens=100,
        )
        for i in range(80)
    ]
    for budget in (20.0, 30.0):
        policy = create_policy("qlm", profile=default_profile())
        sim = ClusterSimulation(specs, policy, engine_config={"cpu_model_cache_gb": budget})
        result = sim.run(reqs)
        assert result.summary["finished"] == 80, budget


def test_warm_start_switches_models_itself_and_leaves_no_request_behind() -> None:
    """Two models on one instance; the engine only switches when the agent says so (explicit),
    so a request sent for a model that is then switched away must still be served."""
    reqs = [
        make_request(
            i,
            model="m" if i % 3 else "n",
            arrival_s=0.2 * i,
            slo=SLO(30.0 if i % 2 else 120.0),
            replay_output_tokens=30 + 7 * (i % 5),
        )
        for i in range(60)
    ]
    config = PlannerConfig.for_simulation(2000, choose_concurrency=False)
    policy = QlmPolicy(make_profile(), config=config, measure_solve_time=False)
    assert policy.model_switching == "explicit"
    sim = ClusterSimulation(
        [InstanceSpec("i0", "G", ("m", "n"))],
        policy,
        catalog=make_catalog(),
        engine_config={"max_num_seqs": 4},
    )
    result = sim.run(reqs)
    assert all(r.status is RequestStatus.FINISHED for r in result.records)
    assert sim.engines[0].config.model_switching == "explicit"
    assert result.summary["model_switches"] >= 1


@pytest.mark.parametrize("name", ["qlm", "fcfs", "edf", "priority", "proserve"])
def test_a_failed_instance_loses_no_request(name: str) -> None:
    """i0 fails mid-run and comes back later: its requests resume elsewhere (or on it) with the
    output they had, nothing is sent to it while it is down, and every request finishes."""
    reqs = [
        make_request(i, arrival_s=0.1 * i, slo=SLO(60.0), replay_output_tokens=200, max_tokens=300)
        for i in range(40)
    ]
    planner = PlannerConfig.for_simulation(2000)
    policy = create_policy(name, profile=make_profile(), planner=planner)
    sim = ClusterSimulation(
        [InstanceSpec("i0", "G", ("m",)), InstanceSpec("i1", "G", ("m",))],
        policy,
        catalog=make_catalog(),
        engine_config={"max_num_seqs": 4},
    )
    result = sim.run(reqs, outages=[Outage("i0", fail_s=1.0, recover_s=8.0)])
    assert all(r.status is RequestStatus.FINISHED for r in result.records)
    assert all(r.output_tokens == 200 for r in result.records)
    moved = [r for r in result.records if r.failovers]
    assert moved  # i0 was running something when it failed
    assert all(r.finish_s is not None and r.finish_s > 1.0 for r in moved)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_forgets_what_ran_on_a_failed_instance(name: str) -> None:
    """Batch work fills both instances, i0 fails while urgent work keeps arriving and comes back:
    no policy may act later on a request it still believes runs on i0 (e.g. evict it there)."""
    reqs = [
        make_request(
            i,
            arrival_s=0.05 * i,
            slo=SLO(30.0 if i % 3 else 600.0),
            tier=Tier.INTERACTIVE if i % 3 else Tier.BATCH,
            replay_output_tokens=150,
            max_tokens=300,
        )
        for i in range(60)
    ]
    planner = PlannerConfig.for_simulation(2000, agent=AgentConfig(evict=True, swap=True))
    policy = create_policy(name, profile=make_profile(), planner=planner)
    sim = ClusterSimulation(
        [InstanceSpec("i0", "G", ("m",)), InstanceSpec("i1", "G", ("m",))],
        policy,
        catalog=make_catalog(),
        engine_config={"max_num_seqs": 4},
    )
    result = sim.run(reqs, outages=[Outage("i0", fail_s=0.5, recover_s=3.0)])
    assert all(r.status is RequestStatus.FINISHED for r in result.records)
    assert all(r.output_tokens == 150 for r in result.records)


def test_a_structured_answer_is_never_preempted_its_work_would_be_lost() -> None:
    structured = running(0, 300.0)
    structured = dataclasses.replace(
        structured, request=dataclasses.replace(structured.request, resumable=False)
    )
    out = make_room(0.0, "i0", HEAD, 0, [structured, running(1, 200.0)], COSTS, ON)
    assert [d.request_id for d in out] == ["r0001"]  # r0000 is the least urgent, but kept
