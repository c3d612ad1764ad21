"""The control plane as a long-running service: ``qlm controller`` and ``qlm serve``.

``build_controller(settings)`` wires the parts the settings name — the global queue
(``QLM_BROKER_URL``; in-process without it), the store (``QLM_DATABASE_URL``; SQLite without it),
the instances (``QLM_INSTANCES_FILE``; simulated in-process without it) and the policy — into a
``ControllerService``. With no settings at all it runs on embedded defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from qlm.clock import EpochClock
from qlm.controller import Controller
from qlm.engines.perf_model import HardwareCatalog
from qlm.engines.perf_table import load_catalog
from qlm.errors import ConfigError
from qlm.global_queue import GlobalQueue, open_global_queue
from qlm.planner import PROFILED, create_policy
from qlm.profiling import profile_fleet
from qlm.rct.profile import RctProfile
from qlm.service.controller import ControllerService
from qlm.service.instances import (
    InstanceConfig,
    build_engines,
    cpu_caches,
    default_instances,
    host_links,
    load_instances,
    model_weights,
)
from qlm.service.runtime import AgentRuntime
from qlm.settings import Settings
from qlm.store import Store
from qlm.wiring import baseline_config, planner_config, rct_profile

__all__ = [
    "ControllerService",
    "build_controller",
    "check_profiled",
    "instance_configs",
    "run_controller",
]

log = logging.getLogger(__name__)

DEFAULT_DATABASE_URL = "sqlite:///qlm.db"


def sim_catalog(settings: Settings) -> HardwareCatalog | None:
    """The performance models the in-process simulated instances run on (``QLM_SIM__*``, as in
    ``qlm simulate``); None for the shipped ones."""
    sim = settings.sim
    if sim.perf_model == "default" and sim.kv_memory == "vllm":
        return None
    try:
        return load_catalog(sim.perf_model, sim.kv_memory)
    except ConfigError as exc:
        raise named_setting("QLM_SIM__PERF_MODEL", "--perf-model", exc) from None


def named_setting(setting: str, flag: str, exc: Exception) -> ConfigError:
    """An error in a value the commands share with ``qlm simulate``, whose message names its
    flag, as one naming the setting the service read it from."""
    message = str(exc)
    for prefix in (f"{flag}: ", f"{flag} "):
        if message.startswith(prefix):
            message = message[len(prefix) :]
            break
    return ConfigError(f"setting {setting}: {message}")


def instance_configs(settings: Settings) -> list[InstanceConfig]:
    return _configs(settings, sim_catalog(settings))


def _configs(settings: Settings, catalog: HardwareCatalog | None) -> list[InstanceConfig]:
    if settings.instances_file is not None:
        return load_instances(settings.instances_file, catalog)
    try:
        return default_instances(settings.controller.sim_instances, catalog)
    except ConfigError as exc:
        raise named_setting("QLM_CONTROLLER__SIM_INSTANCES", "--instances", exc) from None


def simulated_profile(
    profile: RctProfile, configs: list[InstanceConfig], catalog: HardwareCatalog | None
) -> RctProfile:
    """``profile`` with the in-process simulated instances profiled on ``catalog``'s
    performance models when they are not the shipped ones (``qlm simulate`` does the same)."""
    simulated = [c.spec for c in configs if not (c.remote or c.servers)]
    if catalog is None or not simulated:
        return profile
    return profile.merged(profile_fleet(simulated, catalog))


def open_store(settings: Settings) -> Store:
    return Store.open(settings.database_url or DEFAULT_DATABASE_URL)


def open_queue(settings: Settings) -> GlobalQueue:
    return open_global_queue(settings.broker_url, **settings.broker.queue_options())


def check_profiled(policy: str, profile: RctProfile, configs: list[InstanceConfig]) -> None:
    """Under a policy that estimates every instance's service, stop at start naming an
    instance that ``profile`` does not cover, and the command that profiles it."""
    if policy not in PROFILED:
        return
    for config in configs:
        spec = config.spec
        for model in spec.models:
            try:
                profile.hardware_for(model, spec.gpu, spec.gpu_count)
            except ConfigError:
                raise ConfigError(_unprofiled(config, model, profile)) from None


def _unprofiled(config: InstanceConfig, model: str, profile: RctProfile) -> str:
    """The one line for an instance without a profile: a server (``url``) is measured over
    its HTTP API (``qlm profile server``), a simulated instance by the simulator that runs it
    (``qlm profile hardware``); either writes a file that ``QLM_PROFILE_FILE`` then names."""
    spec = config.spec
    where = f"--model {model} --gpu {spec.gpu} --gpus {spec.gpu_count}"
    if spec.url:
        url = dict(config.servers).get(model, spec.url)  # one server per model: that model's
        seqs = config.max_num_seqs or "N"
        command = f"qlm profile server --url {url} {where} --max-num-seqs {seqs} --out profile.json"
        what = "profile the server"
    else:
        command = f"qlm profile hardware {where} --out profile.json"
        what = "profile the simulated instance"
    have = ", ".join(f"{m}@{c}x{g}" for m, g, c in sorted(profile.hardware))
    return (
        f"instance {spec.name!r}: no RCT hardware profile for {model} on "
        f"{spec.gpu_count}x{spec.gpu}; {what} (`{command}`) and set "
        f"QLM_PROFILE_FILE=profile.json (profiled: {have})"
    )


def build_controller(
    settings: Settings,
    *,
    queue: GlobalQueue | None = None,
    store: Store | None = None,
    configs: list[InstanceConfig] | None = None,
) -> ControllerService:
    """A controller service from the settings (``queue``/``store``/``configs`` override them:
    ``qlm serve`` shares one in-process queue between the API and the controller)."""
    cs = settings.controller
    catalog = sim_catalog(settings)  # (read once: the instances and their engines)
    configs = configs if configs is not None else _configs(settings, catalog)
    specs = [c.spec for c in configs]
    profile = simulated_profile(rct_profile(settings), configs, catalog)
    check_profiled(cs.policy, profile, configs)
    policy = create_policy(
        cs.policy,
        profile=profile,
        planner=planner_config(settings.planner),
        baselines=baseline_config(settings.baselines),
    )
    runtime = AgentRuntime(
        Controller(policy, specs),
        build_engines(configs, time_scale=cs.sim_time_scale, catalog=catalog),
        clock=EpochClock(cs.sim_time_scale),
        tick_s=cs.tick_s,
        health_interval_s=cs.health_interval_s,
        down_after_health_timeouts=cs.down_after_health_timeouts,
        max_running={c.spec.name: c.max_num_seqs for c in configs if c.max_num_seqs},
        host_link_gbs=host_links(configs, catalog),
        weights_gb=model_weights(configs, catalog),
        cpu_cache_gb=cpu_caches(configs, catalog),
    )
    return ControllerService(
        queue if queue is not None else open_queue(settings),
        store if store is not None else open_store(settings),
        runtime,
        name=cs.name,
        history_outputs=cs.history_outputs,
        retain_s=cs.retain_days * 86400.0,
        retain_plans=cs.retain_plans,
        orphan_after_s=cs.orphan_after_s,
    )


async def run_controller(settings: Settings) -> None:
    """``qlm controller``: run until SIGINT/SIGTERM, then stop gracefully.

    It starts in the order that writes nothing before it knows it can run: the broker
    (reached), the instances and the profile (read and checked), then the store (opened:
    connected and migrated, which creates an SQLite file). Each failure is one line; without
    ``QLM_BROKER_URL`` it does not start (no other process could hand it a request)."""
    settings.require_broker("`qlm controller`")
    queue = open_queue(settings)
    await queue.reach()
    try:
        service = build_controller(settings, queue=queue)
    except BaseException:
        await queue.close()
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    log.info("controller %s starting (standby until the queue makes it active)", service.name)
    await service.start()
    log.info("controller %s consuming", service.name)
    await stop.wait()
    await service.stop()
    await asyncio.to_thread(service.store.close)
