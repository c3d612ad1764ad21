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
from qlm.errors import ConfigError
from qlm.global_queue import GlobalQueue, open_global_queue
from qlm.planner import PROFILED, create_policy
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

__all__ = ["ControllerService", "build_controller", "instance_configs", "run_controller"]

log = logging.getLogger(__name__)

DEFAULT_DATABASE_URL = "sqlite:///qlm.db"


def instance_configs(settings: Settings) -> list[InstanceConfig]:
    if settings.instances_file is not None:
        return load_instances(settings.instances_file)
    return default_instances(settings.controller.sim_instances)


def open_store(settings: Settings) -> Store:
    return Store.open(settings.database_url or DEFAULT_DATABASE_URL)


def open_queue(settings: Settings) -> GlobalQueue:
    return open_global_queue(settings.broker_url, **settings.broker.queue_options())


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
    configs = configs if configs is not None else instance_configs(settings)
    specs = [c.spec for c in configs]
    profile = rct_profile(settings)
    if cs.policy in PROFILED:  # it estimates every instance's service: say now what is missing
        for spec in specs:
            for model in spec.models:
                try:
                    profile.hardware_for(model, spec.gpu, spec.gpu_count)
                except ConfigError as exc:
                    fix = (
                        f"; profile the server (`qlm profile server --url {spec.url} --model "
                        f"{model} --gpu {spec.gpu} --gpus {spec.gpu_count} --max-num-seqs N "
                        "--out FILE`) and set QLM_PROFILE_FILE"
                        if spec.url
                        else ""
                    )
                    raise ConfigError(f"instance {spec.name!r}: {exc}{fix}") from None
    policy = create_policy(
        cs.policy,
        profile=profile,
        planner=planner_config(settings.planner),
        baselines=baseline_config(settings.baselines),
    )
    runtime = AgentRuntime(
        Controller(policy, specs),
        build_engines(configs, time_scale=cs.sim_time_scale),
        clock=EpochClock(cs.sim_time_scale),
        tick_s=cs.tick_s,
        health_interval_s=cs.health_interval_s,
        max_running={c.spec.name: c.max_num_seqs for c in configs if c.max_num_seqs},
        host_link_gbs=host_links(configs),
        weights_gb=model_weights(configs),
        cpu_cache_gb=cpu_caches(configs),
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
    """``qlm controller``: run until SIGINT/SIGTERM, then stop gracefully."""
    service = build_controller(settings)
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
