"""Model warm start over HTTP: three ``qlm sim-engine serve --dev-mode`` processes (vLLM's API
in 0.32's shapes, sleep mode included) on one simulated GPU, listed as one instance's
``servers`` in an instances file, driven by the agents' runtime with the ``qlm`` policy exactly
as ``qlm serve`` builds it from that file (``build_engines``, ``model_weights``,
``cpu_caches``).

The servers are put to sleep before QLM attaches, as they are started for it (each asleep
before the next starts): the client learns that from each server (``/is_sleeping`` and
``vllm:engine_sleep_state``), so no request goes to a sleeping server — the emulator refuses
one with a 503 there, as a sleeping vLLM would hold it. The CPU memory for warm models holds one
of the three models, so the next model in the queue sleeps at level 1 and the one after at
level 2 (its weights dropped; woken by vLLM's level-2 recipe, which the emulator checks).
Nothing is timed: waits poll conditions with deadlines."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from builders import make_request
from prometheus_client.parser import text_string_to_metric_families
from resume_helpers import Ended

from qlm.clock import WallClock
from qlm.controller import Controller
from qlm.domain import SLO, ModelTier
from qlm.engines.base import EngineOutput, EngineRequest
from qlm.engines.colocated import ColocatedEngine
from qlm.engines.vllm import VllmEngine
from qlm.engines.vllm_launch import (
    ColocatedServer,
    VllmCommand,
    servers_entry,
    start_asleep,
    stop_all,
)
from qlm.errors import EngineError
from qlm.planner import PlannerConfig, create_policy
from qlm.rct.profile import default_profile
from qlm.service.instances import build_engines, cpu_caches, load_instances, model_weights
from qlm.service.runtime import AgentRuntime

from .test_vllm_client import free_port, qlm_executable, sim_engine

pytestmark = pytest.mark.timeout(300)

SCALE = 20.0  # loads of 1-15 s (A100 profiles) take well under a second
DEADLINE_S = 120.0
MODELS = ("llama-3-8b", "llama-2-7b", "llama-2-13b")  # weights 16.06, 13.48, 26.03 GB
CPU_GB = 20.0  # room for one warm model: the 8B or the 7B, never the 13B


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("colocated")
    with ExitStack() as stack:
        yield {
            m: stack.enter_context(sim_engine(logs / f"{m}.log", str(SCALE), model=m))
            for m in MODELS
        }


def sleep_state(url: str) -> str:
    """``awake``, ``weights_offloaded`` (level 1) or ``discard_all`` (level 2), as the server's
    ``vllm:engine_sleep_state`` says."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    on = [
        s.labels["sleep_state"]
        for f in text_string_to_metric_families(text)
        if f.name == "vllm:engine_sleep_state"
        for s in f.samples
        if s.value == 1
    ]
    assert len(on) == 1, on
    return on[0]


class Sent:
    """A server of the instance, recording the tiers it was told and any request it refused
    (the emulator refuses one while asleep: 503)."""

    def __init__(self, inner: VllmEngine, refused: list[str]) -> None:
        self.inner = inner
        self.name = inner.name
        self.refused = refused
        self.tiers: list[ModelTier] = []  # the tiers it was told, in order

    async def set_model_tier(self, model: str, tier: ModelTier) -> ModelTier:
        self.tiers.append(tier)
        return await self.inner.set_model_tier(model, tier)

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    async def submit(self, request: EngineRequest, on_chunk: Any = None) -> EngineOutput:
        try:
            return await self.inner.submit(request, on_chunk)
        except Exception as exc:
            self.refused.append(f"{request.request_id}: {exc}")
            raise


def test_the_agents_keep_one_model_awake_the_next_warm_and_the_rest_cold(
    servers: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for url in servers.values():  # started for QLM: each put to sleep before the next starts
        assert httpx.post(f"{url}/sleep", params={"level": 1}, timeout=30).status_code == 200
    instances = tmp_path / "instances.toml"
    table = ", ".join(f'"{m}" = "{u}"' for m, u in servers.items())
    instances.write_text(
        f'[[instances]]\nname = "g0"\ngpu = "A100"\nservers = {{ {table} }}\n'
        f"cpu_cache_gb = {CPU_GB}\n"
    )
    configs = load_instances(instances)
    (engine,) = build_engines(configs)
    assert isinstance(engine, ColocatedEngine)
    refused: list[str] = []
    engine.servers = {m: Sent(s, refused) for m, s in engine.servers.items()}  # type: ignore[misc]
    seen: dict[str, set[str]] = {m: set() for m in MODELS}

    async def scenario() -> AgentRuntime:
        caps = await engine.capabilities()
        assert caps.supports_sleep and caps.models == MODELS
        tiers = dict((await engine.stats()).model_tiers)
        assert tiers == dict.fromkeys(MODELS, ModelTier.WARM)  # asleep at level 1, as left
        policy = create_policy(
            "qlm", profile=default_profile(), planner=PlannerConfig.for_simulation(500)
        )
        done = Ended()
        runtime = AgentRuntime(
            Controller(policy, [c.spec for c in configs]),
            [engine],
            clock=WallClock(SCALE),
            listener=done,
            tick_s=0.02,
            health_interval_s=0.05,
            weights_gb=model_weights(configs),
            cpu_cache_gb=cpu_caches(configs),
        )
        await runtime.start()
        try:
            now = runtime.clock.now()
            for i in range(9):  # three of each model, in the queue's order of models
                model = MODELS[i // 3]
                runtime.submit(
                    make_request(i, model=model, arrival_s=now + i * 1e-3, slo=SLO(3600.0),
                                 input_tokens=64, max_tokens=64, replay_output_tokens=32)
                )  # fmt: skip
            deadline = time.monotonic() + DEADLINE_S
            while not runtime.idle or len(done.done) + len(done.errors) < 9:
                assert time.monotonic() < deadline, f"not done: {sorted(done.done)}"
                for m, url in servers.items():
                    seen[m].add(await asyncio.to_thread(sleep_state, url))
                await asyncio.sleep(0.02)
        finally:
            await runtime.stop()
            await engine.close()
        assert not done.errors, done.errors
        assert sorted(done.done) == [f"r{i:04d}" for i in range(9)]
        return runtime

    caplog.set_level(logging.WARNING, logger="qlm.service.runtime")
    runtime = asyncio.run(scenario())
    assert not refused, refused  # no request reached a server that was asleep
    # every sleep found its server drained (the emulator refuses to sleep with requests in it)
    assert not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    told = {m: s.tiers for m, s in engine.servers.items()}  # type: ignore[attr-defined]
    assert runtime.model_switches >= 3, told  # each model woken for its requests
    assert all(ModelTier.ACTIVE in t for t in told.values()), told
    # the 13B never fits in the CPU memory left: it is put to level 2 while the others are
    # served (and, served after, woken from there: the emulator refuses a bare wake-up then)
    assert ModelTier.COLD in told["llama-2-13b"] and "discard_all" in seen["llama-2-13b"]
    # a model put to sleep after serving goes to level 1 (warm) first
    assert any(ModelTier.WARM in told[m] for m in MODELS[:2]), told


def sim_server(model: str, port: int) -> ColocatedServer:
    """One of a GPU's servers as ``qlm instance launch`` starts them, here the emulator."""
    argv = (qlm_executable(), "sim-engine", "serve", "--model", model, "--gpu", "A100",
            "--port", str(port), "--time-scale", str(SCALE), "--dev-mode",
            "--scheduling-policy", "priority")  # fmt: skip
    return ColocatedServer(model, f"http://127.0.0.1:{port}", VllmCommand(argv, ()))


def test_a_gpus_servers_start_one_at_a_time_each_asleep_before_the_next(tmp_path: Path) -> None:
    """``qlm instance launch --model A --model B``: each server answers, is put to sleep and
    says so before the next starts; the ``servers`` line it prints is an instances file's, and
    QLM attaches to the servers asleep. A server that exits at start-up stops those started."""
    servers = [sim_server(m, free_port()) for m in MODELS[:2]]
    said: list[str] = []
    procs = start_asleep(servers, timeout_s=DEADLINE_S, say=said.append)
    try:
        assert all(p.poll() is None for p in procs)
        for s in servers:
            assert httpx.get(f"{s.url}/is_sleeping", timeout=30).json() == {"is_sleeping": True}
            assert sleep_state(s.url) == "weights_offloaded"
        assert [line.split(" at ")[0] for line in said] == [
            "starting llama-3-8b", "llama-3-8b", "starting llama-2-7b", "llama-2-7b",
        ]  # fmt: skip
        instances = tmp_path / "instances.toml"
        entry = servers_entry(servers)
        instances.write_text(f'[[instances]]\nname = "g0"\ngpu = "A100"\n{entry}\n')
        (engine,) = build_engines(load_instances(instances))

        async def attach() -> dict[str, ModelTier]:
            try:
                assert (await engine.capabilities()).supports_sleep
                return dict((await engine.stats()).model_tiers)
            finally:
                await engine.close()

        assert asyncio.run(attach()) == dict.fromkeys(MODELS[:2], ModelTier.WARM)
    finally:
        stop_all(procs)

    broken = sim_server("no-such-model", free_port())
    first = sim_server(MODELS[0], free_port())
    with pytest.raises(EngineError, match=r"server of no-such-model \(http.*\) exited"):
        start_asleep([first, broken], timeout_s=DEADLINE_S)
    with pytest.raises(httpx.HTTPError):  # the first was stopped
        httpx.get(f"{first.url}/health", timeout=5)
