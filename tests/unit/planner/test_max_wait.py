"""The starvation guard: a request that waited its tier's maximum is served at the next free slot,
whatever the plan's order, and the simulation summary counts the requests it promoted."""

from __future__ import annotations

import dataclasses

from builders import make_catalog, make_profile, make_request

from qlm.domain import SLO, InstanceSpec, Pull, Request, RequestStatus, Tier
from qlm.planner import PlannerConfig, QlmPolicy
from qlm.planner.policy import DispatchContext, InstanceLoad
from qlm.sim.cluster import ClusterSimulation
from qlm.sim.run import Simulation

PROFILE = make_profile()


def policy(**max_wait: float) -> QlmPolicy:
    config = PlannerConfig.for_simulation(
        2000, max_wait_s={Tier[t.upper()]: s for t, s in max_wait.items()}
    )
    return QlmPolicy(PROFILE, config=config, measure_solve_time=False)


def batch_behind_a_stream(qlm: QlmPolicy, steps: int) -> list[list[Pull]]:
    """A batch request at 0 s, then one interactive request a second; the instance has one free
    slot at every step. The pulls of each step."""
    slot = InstanceLoad("i0", ("m",), gpu="G", max_running=1)
    batch = make_request(0, arrival_s=0.0, slo=SLO(600.0), tier=Tier.BATCH)
    out: list[list[Pull]] = []
    for t in range(steps):
        chat = make_request(100 + t, arrival_s=float(t), slo=SLO(20.0), tier=Tier.INTERACTIVE)
        arrived: tuple[Request, ...] = (batch, chat) if t == 0 else (chat,)
        decisions = qlm.decide(DispatchContext(float(t), arrived, (slot,)))
        out.append([d for d in decisions if isinstance(d, Pull)])
    return out


def test_without_a_maximum_wait_the_plan_keeps_a_batch_request_behind_urgent_work() -> None:
    pulls = batch_behind_a_stream(policy(), 10)
    assert all(p == [Pull(f"r{100 + t:04d}", "i0")] for t, p in enumerate(pulls))


def test_a_request_that_waited_its_tiers_maximum_is_pulled_first_and_marked_overdue() -> None:
    pulls = batch_behind_a_stream(policy(batch=5.0), 10)
    assert all(p == [Pull(f"r{100 + t:04d}", "i0")] for t, p in enumerate(pulls[:5]))
    assert pulls[5] == [Pull("r0000", "i0", overdue=True)]  # at 5 s, ahead of the plan's head
    assert all(not p or not p[0].overdue for p in pulls[6:])


def test_a_maximum_wait_of_another_tier_changes_nothing() -> None:
    assert batch_behind_a_stream(policy(interactive=5.0, standard=1.0), 10) == (
        batch_behind_a_stream(policy(), 10)
    )


def test_an_overdue_request_the_plan_serves_next_anyway_is_not_counted_as_promoted() -> None:
    qlm = policy(batch=1.0)
    busy = InstanceLoad(
        "i0", ("m",), gpu="G", max_running=1, outstanding_requests=1, outstanding_tokens=200
    )
    lone = make_request(0, arrival_s=0.0, slo=SLO(600.0), tier=Tier.BATCH)
    assert qlm.decide(DispatchContext(0.0, (lone,), (busy,))) == []
    free = dataclasses.replace(busy, outstanding_requests=0, outstanding_tokens=0)
    assert qlm.decide(DispatchContext(3.0, (), (free,))) == [Pull("r0000", "i0")]


def run(max_wait: dict[str, float]) -> dict[str, object]:
    """One request at a time; a batch request arrives just after the first of a stream of
    interactive ones (more than the instance serves)."""
    reqs = [make_request(0, arrival_s=0.05, slo=SLO(600.0), tier=Tier.BATCH)] + [
        make_request(
            i,
            arrival_s=0.1 * (i - 1),
            slo=SLO(20.0),
            tier=Tier.INTERACTIVE,
            replay_output_tokens=40,
        )
        for i in range(1, 60)
    ]
    qlm = policy(**max_wait)
    specs = [InstanceSpec("i0", "G", ("m",))]
    sim = ClusterSimulation(specs, qlm, catalog=make_catalog(), engine_config={"max_num_seqs": 1})
    result = sim.run(reqs)
    assert all(r.status is RequestStatus.FINISHED for r in result.records)
    wait = next(r for r in result.records if r.request.id == "r0000").queue_s
    summary = dict(result.summary)
    summary["batch_wait_s"] = wait
    summary["promoted"] = result.overdue_pulls
    return summary


def test_the_simulation_counts_the_requests_the_guard_promoted() -> None:
    free = run({})
    guarded = run({"batch": 2.0})
    assert free["promoted"] == 0
    assert guarded["promoted"] == 1
    # Served at the first free slot after 2 s, instead of behind the whole stream.
    assert isinstance(guarded["batch_wait_s"], float) and 2.0 <= guarded["batch_wait_s"] < 3.0
    assert isinstance(free["batch_wait_s"], float) and free["batch_wait_s"] > 20.0


def test_the_summary_reports_promotions_when_a_maximum_wait_is_set() -> None:
    reqs = [
        make_request(i, arrival_s=0.2 * i, slo=SLO(600.0 if i == 0 else 20.0)) for i in range(20)
    ]
    specs = [InstanceSpec("i0", "G", ("m",))]
    for max_wait, key in (({}, False), ({"batch": 1.0}, True)):
        qlm = policy(**max_wait)
        sim = Simulation(reqs, specs, qlm, max_wait=bool(max_wait))
        sim_result = _run_on_test_catalog(sim)
        assert ("max_wait_promoted" in sim_result["planner"]) is key  # type: ignore[operator]


def _run_on_test_catalog(sim: Simulation) -> dict[str, object]:
    from qlm.sim.run import with_planner_summary

    result = ClusterSimulation(list(sim.instances), sim.policy, catalog=make_catalog()).run(
        sim.requests
    )
    return with_planner_summary(result, max_wait=sim.max_wait).summary
