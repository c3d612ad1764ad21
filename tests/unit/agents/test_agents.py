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


def test_no_preemption_when_there_is_room_or_slots_free_in_time() -> None:
    batch = [running(0, 300.0), running(1, 300.0)]
    assert make_room(0.0, "i0", HEAD, 2, batch, COSTS, ON) == []
    soon = [running(0, 300.0, remaining_s=3.0), running(1, 300.0, remaining_s=4.0)]
    assert make_room(0.0, "i0", HEAD, 0, soon, COSTS, ON) == []


def test_preempts_only_for_the_requests_a_free_slot_would_not_save() -> None:
    # One slot frees at 3 s (its request meets 20 s), the other at 30 s (too late): the one
    # running long is preempted.
    soon = [running(0, 300.0, remaining_s=3.0), running(1, 300.0)]
    assert [d.request_id for d in make_room(0.0, "i0", HEAD, 0, soon, COSTS, ON)] == ["r0001"]


def test_the_cost_rule_fires_when_the_head_gains_more_than_the_victims_lose() -> None:
    urgent = dataclasses.replace(HEAD, waiting=1, weight=2.0)
    victim = [running(0, 300.0, weight=1.0)]
    assert len(make_room(0.0, "i0", urgent, 0, victim, COSTS, ON)) == 1
    # The victim would miss its own deadline once preempted: an SLO for an SLO of equal weight
    # does not pay; for one worth more it does.
    tight = [running(0, 31.5, weight=2.0)]
    assert make_room(0.0, "i0", urgent, 0, tight, COSTS, ON) == []
    assert len(make_room(0.0, "i0", urgent, 0, [running(0, 31.5, weight=1.0)], COSTS, ON)) == 1
    # Under overload a GPU-second is worth SLOs: recomputing 1,100 tokens (0.076 s) at 30
    # weighted SLOs per GPU-second costs more than the one SLO it saves.
    busy = dataclasses.replace(COSTS, gpu_second_value=30.0, host_link_gbs=0.0)
    assert make_room(0.0, "i0", urgent, 0, victim, busy, ON) == []
    cheap = dataclasses.replace(busy, gpu_second_value=1.0)
    assert [type(d) for d in make_room(0.0, "i0", urgent, 0, victim, cheap, ON)] == [Evict]


def test_a_model_switch_preempts_the_long_running_requests_that_hold_it() -> None:
    """The head's model is not active: it starts once the running batch has drained. A long
    batch request (a mega prompt) holding the drain is evicted (swapped when eviction is off);
    a short one is left."""
    head = HeadGroup("g1", 20.0, 3, 5.0, deadlines=(20.0, 22.0, 25.0), switching=True, switch_s=1.0)
    batch = [running(0, 300.0, remaining_s=60.0), running(1, 300.0, remaining_s=2.0)]
    out = make_room(0.0, "i0", head, 0, batch, COSTS, ON)
    assert [(type(d), d.request_id) for d in out] == [(Evict, "r0000")]
    swap_only = AgentConfig(evict=False, min_victim_slack_s=1.0, resume_delay_s=1.0)
    out = make_room(0.0, "i0", head, 0, batch, COSTS, swap_only)
    assert [(type(d), d.request_id) for d in out] == [(SwapOut, "r0000")]
    # The drain ends in time anyway: nothing to gain.
    short = [running(0, 300.0, remaining_s=5.0), running(1, 300.0, remaining_s=2.0)]
    assert make_room(0.0, "i0", head, 0, short, COSTS, ON) == []
    # A more urgent request holds the drain: it is not preempted, and nothing behind it helps.
    urgent = [running(0, 18.0, remaining_s=60.0), running(1, 300.0, remaining_s=50.0)]
    assert make_room(0.0, "i0", head, 0, urgent, COSTS, ON) == []


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
    swap_only = AgentConfig(evict=False, swap=True)
    assert make_room(0.0, "i0", HEAD, 1, [running(0, 300.0)], full, swap_only) == []
    off = AgentConfig(evict=False, swap=False)
    assert make_room(0.0, "i0", HEAD, 1, [running(0, 300.0)], COSTS, off) == []


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
        ("off", AgentConfig(evict=False, swap=False)),
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


def test_a_mega_prompt_is_preempted_for_urgent_short_work_of_another_model() -> None:
    """W_C in small: a mega prompt (6,000 + 2,000 tokens, batch tier) runs on an instance that
    serves two models; short interactive requests for the other model arrive. Left alone they
    wait for the mega prompt to finish before the model switch and miss; with the agents'
    operations it is evicted (swapped with eviction off), they meet their SLO, and it still meets its."""
    mega = make_request(
        0,
        model="m",
        arrival_s=0.0,
        slo=SLO(300.0),
        tier=Tier.BATCH,
        input_tokens=6000,
        replay_output_tokens=2000,
        max_tokens=2048,
    )
    urgent = [
        make_request(
            10 + i,
            model="n",
            arrival_s=5.0 + 0.2 * i,
            slo=SLO(12.0),
            tier=Tier.INTERACTIVE,
            input_tokens=200,
            replay_output_tokens=30,
            max_tokens=60,
        )
        for i in range(3)
    ]
    results = {}
    for name, agent in (
        ("off", AgentConfig(evict=False, swap=False)),
        ("on", AgentConfig()),
        ("swap", AgentConfig(evict=False)),
    ):
        config = PlannerConfig.for_simulation(2000, agent=agent, choose_concurrency=False)
        policy = QlmPolicy(LONG_OUTPUTS, config=config, measure_solve_time=False)
        sim = ClusterSimulation(
            [InstanceSpec("i0", "G", ("m", "n"))], policy, catalog=make_catalog()
        )
        results[name] = sim.run([mega, *urgent])
    for name, result in results.items():
        assert all(r.status is RequestStatus.FINISHED for r in result.records), name
        assert all(r.output_tokens == r.request.replay_output_tokens for r in result.records), name
        short = [r for r in result.records if r.request.tier is Tier.INTERACTIVE]
        assert all(r.slo_met for r in short) is (name != "off"), name
        assert all(r.slo_met for r in result.records if r.request.tier is Tier.BATCH), name
    assert sum(r.swaps + r.evictions for r in results["off"].records) == 0
    assert sum(r.evictions for r in results["on"].records) >= 1
    assert sum(r.swaps for r in results["swap"].records) >= 1
