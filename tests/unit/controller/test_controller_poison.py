"""Poison isolation in the control step: a request whose handling raises fails alone, with its
reason, and the step goes on for everyone else (qlm/controller.py, "Poison")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
from builders import make_profile, make_request

from qlm.controller import Controller, EngineReading
from qlm.domain import SLO, Decision, InstanceSpec, Pull, Reject, Request, RequestStatus
from qlm.planner import PlannerConfig, QlmPolicy
from qlm.planner.policy import DispatchContext, PolicyBase

SPEC = InstanceSpec("i0", "G", ("m",))
VIEW = EngineReading(spec=SPEC, max_running=1000, token_capacity=10**9, active_model="m")
EPOCH = 1.7e9  # the service's clock: seconds since 1970


@dataclass
class Scripted(PolicyBase):
    """Holds what it is given and pulls everything; raises while it holds a poisoned request
    (as a policy whose arithmetic breaks on one request's fields would, step after step)."""

    poison: set[str]
    name: str = "scripted"
    held: dict[str, Request] = field(default_factory=dict)
    calls: int = 0
    fail_always: bool = False

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        self.calls += 1
        for rid in ctx.cancelled:
            self.held.pop(rid, None)
        for r in ctx.arrived:
            self.held[r.id] = r
        if self.fail_always or self.poison & set(self.held):
            raise ValueError("cannot plan")
        pulls: list[Decision] = [Pull(rid, "i0") for rid in self.held]
        self.held.clear()
        return pulls


def test_a_request_the_qlm_policy_cannot_group_is_rejected_and_the_others_are_served() -> None:
    # An SLO of 1e-300 s at the service's clock: its deadline window overflows (inf -> int).
    config = PlannerConfig.for_simulation(2000)
    policy = QlmPolicy(make_profile(), config=config, measure_solve_time=False)
    controller = Controller(policy, [SPEC])
    controller.arrive(make_request(0, arrival_s=EPOCH, slo=SLO(1e-300)))
    controller.arrive(make_request(1, arrival_s=EPOCH))
    decisions = controller.step(EPOCH, [VIEW]).decisions
    rejects = [d for d in decisions if isinstance(d, Reject)]
    assert [d.request_id for d in rejects] == ["r0000"]
    assert "OverflowError" in rejects[0].reason
    assert Pull("r0001", "i0") in decisions
    track = controller.track("r0000")
    assert track.status is RequestStatus.FAILED and "could not be planned" in track.error
    # the next steps go on: a new request is served
    controller.arrive(make_request(2, arrival_s=EPOCH + 1))
    assert Pull("r0002", "i0") in controller.step(EPOCH + 1, [VIEW]).decisions


def test_every_poisoned_request_among_many_fails_alone_in_few_policy_calls() -> None:
    requests = [make_request(i) for i in range(256)]
    poison = {"r0005", "r0033", "r0200"}
    policy = Scripted(poison)
    controller = Controller(policy, [SPEC])
    for r in requests:
        controller.arrive(r)
    decisions = controller.step(0.0, [VIEW]).decisions
    assert {d.request_id for d in decisions if isinstance(d, Reject)} == poison
    pulled = {d.request_id for d in decisions if isinstance(d, Pull)}
    assert pulled == {r.id for r in requests} - poison
    # the failed step, the step without them, then per halving level (8) at most two tries and
    # a forget per poisoned request: O(k log n), not a call per request
    assert policy.calls <= 2 + 8 * 3 * len(poison) < len(requests)
    for rid in poison:
        assert controller.track(rid).status is RequestStatus.FAILED
    assert controller.pending() == []


def test_a_request_that_turns_poisonous_while_it_waits_is_found_among_the_waiting() -> None:
    policy = Scripted(set())
    controller = Controller(policy, [SPEC])
    waiting = [make_request(i) for i in range(8)]
    # the policy holds them without pulling: no instance has room
    full = dataclasses.replace(VIEW, up=False)
    policy_decide = policy.decide

    def hold(ctx: DispatchContext) -> list[Decision]:
        if not ctx.instances[0].up:
            policy.calls += 1
            for r in ctx.arrived:
                policy.held[r.id] = r
            for rid in ctx.cancelled:
                policy.held.pop(rid, None)
            if policy.poison & set(policy.held):
                raise ValueError("cannot plan")
            return []
        return policy_decide(ctx)

    policy.decide = hold  # type: ignore[method-assign]
    for r in waiting:
        controller.arrive(r)
    assert controller.step(0.0, [full]).decisions == ()
    policy.poison.add("r0003")  # no arrival in the next step: the suspects are the waiting
    decisions = controller.step(1.0, [VIEW]).decisions
    assert [d.request_id for d in decisions if isinstance(d, Reject)] == ["r0003"]
    assert {d.request_id for d in decisions if isinstance(d, Pull)} == {
        r.id for r in waiting if r.id != "r0003"
    }


def test_a_step_that_fails_with_no_request_to_blame_raises_and_keeps_its_news() -> None:
    policy = Scripted(set(), fail_always=True)
    controller = Controller(policy, [SPEC])
    controller.arrive(make_request(0))
    with pytest.raises(ValueError, match="cannot plan"):
        controller.step(0.0, [VIEW])
    assert controller.track("r0000").status is RequestStatus.QUEUED
    policy.fail_always = False
    assert controller.step(1.0, [VIEW]).decisions == (Pull("r0000", "i0"),)


def test_a_poisoned_request_a_bounded_step_left_waiting_is_named_by_the_policy() -> None:
    """With a wall-time budget the QLM policy groups only part of a backlog per step: the
    request it cannot group comes up in a later step, with no arrival to suspect. The policy
    names it (``RequestFailed``): it alone is rejected, with one extra policy call."""
    ticks = iter(float(i) for i in range(10**6))  # every read of the clock: one second later
    config = PlannerConfig.for_simulation(2000)
    config = dataclasses.replace(
        config, budget=dataclasses.replace(config.budget, time_s=0.1), step_budget_s=40.0
    )
    policy = QlmPolicy(make_profile(), config=config, clock=lambda: next(ticks))
    calls = [0]
    decide = policy.decide

    def counted(ctx: DispatchContext) -> list[Decision]:
        calls[0] += 1
        return decide(ctx)

    policy.decide = counted  # type: ignore[method-assign]
    controller = Controller(policy, [SPEC])
    backlog = [make_request(i, arrival_s=EPOCH) for i in range(60)]
    backlog[45] = make_request(45, arrival_s=EPOCH, slo=SLO(1e-300))
    for r in backlog:
        controller.arrive(r)
    rejected: list[str] = []
    for step in range(20):
        calls[0] = 0
        decisions = controller.step(EPOCH + step, [VIEW]).decisions
        rejected += [d.request_id for d in decisions if isinstance(d, Reject)]
        assert calls[0] <= 2
        if rejected:
            break
    assert step > 0 and rejected == ["r0045"]
    assert calls[0] == 2  # the failed step and the same step without it
    assert controller.track("r0045").status is RequestStatus.FAILED
