"""The cluster simulation harness: dispatch, measurement, determinism, the executor."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from builders import make_catalog, make_request

from qlm.domain import (
    SLO,
    Decision,
    Evict,
    InstanceSpec,
    Pull,
    Request,
    RequestRecord,
    RequestStatus,
    SwapIn,
)
from qlm.engines.sim import SimEngine
from qlm.errors import ConfigError
from qlm.planner import DispatchContext, create_policy
from qlm.planner.policy import PolicyBase
from qlm.sim.cluster import ClusterSimulation, SimResult

TWO = [InstanceSpec("i0", "G", ("m",)), InstanceSpec("i1", "G", ("m",))]


def random_requests(n: int, seed: int, rate: float = 4.0, slo_s: float = 30.0) -> list[Request]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(
            make_request(
                i,
                arrival_s=t,
                input_tokens=rng.randint(10, 3000),
                replay_output_tokens=rng.randint(1, 500),
                slo=SLO(e2e_s=slo_s),
            )
        )
    return out


def run(requests: list[Request], policy: str = "fcfs") -> SimResult:
    return ClusterSimulation(TWO, create_policy(policy), catalog=make_catalog()).run(requests)


def test_every_request_finishes_with_ordered_timestamps_and_its_full_output() -> None:
    reqs = random_requests(300, seed=1)
    result = run(reqs)
    assert result.summary["finished"] == 300
    for rec in result.records:
        assert rec.status is RequestStatus.FINISHED
        assert rec.output_tokens == rec.request.replay_output_tokens
        assert rec.request.arrival_s <= rec.dispatch_s <= rec.scheduled_s  # type: ignore[operator]
        assert rec.scheduled_s <= rec.first_token_s <= rec.finish_s  # type: ignore[operator]


def test_round_robin_alternates_instances_in_arrival_order() -> None:
    reqs = random_requests(10, seed=2)
    result = run(reqs, policy="fcfs-rr")
    assert [r.instance for r in result.records] == ["i0", "i1"] * 5


def test_least_loaded_dispatch_sends_a_burst_to_both_instances_evenly() -> None:
    burst = [make_request(i, arrival_s=0.0) for i in range(10)]
    result = run(burst)
    per = [sum(r.instance == name for r in result.records) for name in ("i0", "i1")]
    assert per == [5, 5]


def test_the_same_requests_give_identical_records() -> None:
    a = run(random_requests(200, seed=3))
    b = run(random_requests(200, seed=3))
    c = run(random_requests(200, seed=4))
    assert a.records == b.records and a.summary == b.summary
    assert a.records != c.records


def test_overload_shows_up_as_queueing_and_missed_slos() -> None:
    light = run(random_requests(200, seed=5, rate=1.0, slo_s=8.0))
    heavy = run(random_requests(200, seed=5, rate=200.0, slo_s=8.0))
    assert heavy.summary["queue_s"]["p90"] > light.summary["queue_s"]["p90"]
    assert heavy.summary["slo_attainment"] < light.summary["slo_attainment"]


def test_a_model_no_instance_serves_is_refused_up_front() -> None:
    with pytest.raises(ConfigError, match="no instance serves model"):
        run([make_request(0, model="n")])


@dataclass
class EvictOnce(PolicyBase):
    """Dispatch to i0; evict request r0000 once, when the second request arrives."""

    name: str = "evict-once"
    evicted: bool = False
    seen: set[str] = field(default_factory=set)

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        out: list[Decision] = [Pull(r.id, "i0") for r in ctx.pending]
        new = {r.id for r in ctx.pending} - self.seen
        self.seen |= new
        if "r0001" in new and not self.evicted:
            self.evicted = True
            out.insert(0, Evict("r0000", "i0"))
        return out


@dataclass
class Prompts:
    """Observer: the prompt and cap each dispatch handed to the engine."""

    seen: list[tuple[str, int, int]] = field(default_factory=list)

    def on_dispatch(self, now: float, request: Request, engine: SimEngine) -> None:
        seq = engine._by_id[request.id]
        self.seen.append((request.id, seq.prompt, seq.target))

    def on_finish(self, record: RequestRecord) -> None:
        pass


def test_an_evicted_request_resumes_from_its_partial_output() -> None:
    reqs = [
        make_request(0, arrival_s=0.0, replay_output_tokens=400, max_tokens=400),
        make_request(1, arrival_s=1.0, replay_output_tokens=10),
    ]
    prompts = Prompts()
    sim = ClusterSimulation([TWO[0]], EvictOnce(), catalog=make_catalog(), observer=prompts)
    result = sim.run(reqs)
    first = result.records[0]
    resumed = [(p, t) for rid, p, t in prompts.seen if rid == "r0000"]
    assert len(resumed) == 2 and resumed[0] == (200, 400)
    prompt, remaining = resumed[1]
    assert prompt > 200 and prompt - 200 + remaining == 400  # prompt + partial output, rest to go
    assert first.evictions == 1
    assert first.status is RequestStatus.FINISHED
    assert first.output_tokens == 400  # tokens before the eviction + after the resumption
    assert result.summary["evictions"] == 1


@dataclass
class SwapInOnce(EvictOnce):
    """As ``EvictOnce``, but asks to swap r0000 in, which was never swapped out."""

    name: str = "swap-in-once"

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        return [
            SwapIn(d.request_id, d.instance) if isinstance(d, Evict) else d
            for d in super().decide(ctx)
        ]


def test_a_swap_the_engine_refuses_becomes_an_eviction() -> None:
    reqs = [
        make_request(0, arrival_s=0.0, replay_output_tokens=400, max_tokens=400),
        make_request(1, arrival_s=1.0, replay_output_tokens=10),
    ]
    sim = ClusterSimulation([TWO[0]], SwapInOnce(), catalog=make_catalog())
    first = sim.run(reqs).records[0]
    assert (first.evictions, first.swaps, first.output_tokens) == (1, 0, 400)
    assert first.status is RequestStatus.FINISHED
    assert (sim.executor.evictions, sim.executor.swaps) == (1, 0)
