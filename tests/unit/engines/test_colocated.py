"""Several single-model servers on one GPU driven as one instance (``ColocatedEngine``): one
awake, the others asleep — model warm start over servers that each serve one model. The
servers here are simulated engines on a fast wall clock (they sleep and wake as vLLM's sleep
mode does, taking the profile's warm or cold load time)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from builders import make_catalog, make_profile, make_request

from qlm.clock import WallClock
from qlm.controller import Controller
from qlm.domain import SLO, Decision, InstanceSpec, ModelTier, SetModelTier
from qlm.engines.base import EngineCapabilities, EngineRequest
from qlm.engines.colocated import ColocatedEngine
from qlm.engines.wallclock import WallClockEngine
from qlm.errors import EngineError, UnknownRequest
from qlm.planner import PlannerConfig, create_policy
from qlm.planner.act import estimator_instance
from qlm.planner.policy import DispatchContext, InstanceLoad, PolicyBase
from qlm.service.runtime import AgentRuntime, RuntimeListener

SCALE = 50.0


def server(name: str, model: str) -> WallClockEngine:
    return WallClockEngine.from_catalog(
        name, model, "G", 1, time_scale=SCALE, catalog=make_catalog()
    )


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(scenario(), 60))


async def tiers(engine: ColocatedEngine) -> dict[str, ModelTier]:
    return dict((await engine.stats()).model_tiers)


def test_one_server_is_awake_and_activating_a_model_puts_the_other_to_sleep_warm() -> None:
    async def scenario() -> None:
        m, n = server("g0/m", "m"), server("g0/n", "n")
        engine = ColocatedEngine("g0", {"m": m, "n": n})
        caps = await engine.capabilities()  # (both start awake, as vLLM does)
        assert caps.models == ("m", "n") and caps.supports_sleep
        assert await tiers(engine) == {"m": ModelTier.ACTIVE, "n": ModelTier.WARM}
        assert n.sleep_level == 1 and m.sleep_level is None
        await engine.set_model_tier("n", ModelTier.ACTIVE)
        assert await tiers(engine) == {"m": ModelTier.WARM, "n": ModelTier.ACTIVE}
        assert (await engine.stats()).active_model == "n" and m.sleep_level == 1
        await engine.set_model_tier("m", ModelTier.COLD)
        assert m.sleep_level == 2
        await engine.close()

    run(scenario)


def test_a_request_for_a_sleeping_model_waits_until_its_model_is_woken() -> None:
    async def scenario() -> None:
        engine = ColocatedEngine("g0", {"m": server("g0/m", "m"), "n": server("g0/n", "n")})
        await engine.capabilities()
        first = EngineRequest("r-m", "m", 50, max_tokens=8, output_tokens=8)
        assert (await engine.submit(first)).tokens == 8
        waiting = asyncio.create_task(
            engine.submit(EngineRequest("r-n", "n", 50, max_tokens=8, output_tokens=8))
        )
        await asyncio.sleep(0.05)
        assert not waiting.done() and (await engine.stats()).waiting == 1
        await engine.set_model_tier("n", ModelTier.ACTIVE)
        assert (await waiting).tokens == 8
        gone = asyncio.create_task(
            engine.submit(EngineRequest("r-m2", "m", 50, max_tokens=8, output_tokens=8))
        )
        await asyncio.sleep(0.05)
        assert (await engine.abort("r-m2")).aborted  # never reached a server
        assert (await gone).aborted
        with pytest.raises(UnknownRequest):
            await engine.abort("nobody")
        await engine.close()

    run(scenario)


class Insomniac:
    """A server that cannot sleep (vLLM's CPU build, or no --enable-sleep-mode)."""

    def __init__(self, inner: WallClockEngine) -> None:
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    async def capabilities(self) -> EngineCapabilities:
        caps = await self.inner.capabilities()
        return EngineCapabilities(
            caps.models, caps.max_num_seqs, caps.kv_capacity_tokens, False, False, False
        )


def test_a_server_that_cannot_sleep_is_refused_by_name() -> None:
    async def scenario() -> None:
        engine = ColocatedEngine(
            "g0", {"m": server("g0/m", "m"), "n": Insomniac(server("g0/n", "n"))}
        )
        with pytest.raises(EngineError, match="server of 'n' cannot sleep"):
            await engine.capabilities()
        await engine.close()

    run(scenario)


def test_the_agents_switch_models_on_colocated_servers_and_serve_both() -> None:
    """The QLM policy with warm start drives one colocated instance (a server per model):
    requests of both models finish, and the instance switched models between them."""

    async def scenario() -> None:
        engine = ColocatedEngine("g0", {"m": server("g0/m", "m"), "n": server("g0/n", "n")})
        policy = create_policy(
            "qlm", profile=make_profile(), planner=PlannerConfig.for_simulation(500)
        )
        done: list[str] = []

        class Done(RuntimeListener):
            def finished(self, record: Any, text: str, *args: Any) -> None:
                done.append(record.request.id)

        runtime = AgentRuntime(
            Controller(policy, [InstanceSpec("g0", "G", ("m", "n"))]),
            [engine],
            clock=WallClock(SCALE),
            listener=Done(),
            tick_s=0.02,
            health_interval_s=0.02,
            weights_gb={"g0": (("m", 16.0), ("n", 16.0))},
            cpu_cache_gb={"g0": 64.0},
        )
        await runtime.start()
        now = runtime.clock.now()
        for i in range(6):
            model = "m" if i < 3 else "n"
            runtime.submit(
                make_request(i, model=model, arrival_s=now, slo=SLO(600.0), replay_output_tokens=20)
            )
        while not runtime.idle:
            await asyncio.sleep(0.02)
        await runtime.stop()
        await engine.close()
        assert sorted(done) == [f"r{i:04d}" for i in range(6)]
        assert runtime.model_switches >= 1

    run(scenario)


class DropsThenWarms(PolicyBase):
    """Puts ``n`` to sleep at level 2 (cold), then asks for it warm; keeps every load of the
    instance it is shown."""

    name = "drops-then-warms"

    def __init__(self) -> None:
        self.asked: list[ModelTier] = []
        self.seen: list[InstanceLoad] = []

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        loads = [i for i in ctx.instances if i.up]
        if not loads:
            return []
        self.seen += loads
        n = dict(loads[0].model_tiers).get("n")
        if not self.asked and n is ModelTier.WARM:
            self.asked.append(ModelTier.COLD)
            return [SetModelTier("g0", "n", ModelTier.COLD)]
        if self.asked == [ModelTier.COLD] and n is ModelTier.COLD:
            self.asked.append(ModelTier.WARM)
            return [SetModelTier("g0", "n", ModelTier.WARM)]
        return []


def test_a_model_asleep_at_level_2_asked_warm_stays_cold_where_the_policy_reads_it() -> None:
    """vLLM cannot bring a level-2 sleep's weights back to CPU memory without waking the
    server: asked warm, the model stays cold, and the agents' runtime reports it cold — the
    policy plans its cold load time and counts no CPU memory for its weights."""

    async def scenario() -> None:
        n = server("g0/n", "n")
        engine = ColocatedEngine("g0", {"m": server("g0/m", "m"), "n": n})
        policy = DropsThenWarms()
        runtime = AgentRuntime(
            Controller(policy, [InstanceSpec("g0", "G", ("m", "n"))]),
            [engine],
            clock=WallClock(SCALE),
            listener=RuntimeListener(),
            tick_s=0.02,
            health_interval_s=0.02,
            weights_gb={"g0": (("m", 16.0), ("n", 16.0))},
            cpu_cache_gb={"g0": 64.0},
        )
        await runtime.start()
        try:
            await until(lambda: len(policy.asked) == 2 and runtime.operations == 0)
            after = len(policy.seen)
            await until(lambda: len(policy.seen) > after)  # a step since the change
        finally:
            await runtime.stop()
            await engine.close()
        assert n.sleep_level == 2  # the server is still asleep at level 2
        (state,) = runtime.instance_states()
        assert state["tiers"] == {"m": "active", "n": "cold"}
        load = policy.seen[-1]
        assert dict(load.model_tiers) == {"m": ModelTier.ACTIVE, "n": ModelTier.COLD}
        weights = dict(load.model_weights_gb)
        warm_gb = sum(weights[m] for m, t in load.model_tiers if t is ModelTier.WARM)
        assert warm_gb == 0.0  # no CPU memory counted for weights that are not there
        assert estimator_instance(load).warm_models == frozenset()  # a cold load, not warm

    run(scenario)


async def until(check: Callable[[], bool]) -> None:
    deadline = asyncio.get_running_loop().time() + 30.0
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)
