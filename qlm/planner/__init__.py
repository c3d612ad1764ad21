"""Policies that decide which instance serves a request and in what order.

One factory, ``create_policy(name)``, so that every experiment compares policies on the same
harness, trace and seed. Each policy is pure: ``decide(ctx)`` returns decisions and reads no clock.
"""

from __future__ import annotations

import dataclasses

from qlm.errors import ConfigError
from qlm.planner.baselines import BaselineConfig, create_baseline
from qlm.planner.config import PlannerConfig
from qlm.planner.policy import Completion, DispatchContext, InstanceLoad, Policy
from qlm.planner.qlm_policy import QlmPolicy
from qlm.rct.profile import RctProfile

__all__ = [
    "POLICIES",
    "PROFILED",
    "BaselineConfig",
    "Completion",
    "DispatchContext",
    "InstanceLoad",
    "PlannerConfig",
    "Policy",
    "QlmPolicy",
    "create_policy",
]

POLICIES = ("fcfs", "fcfs-rr", "edf", "sedf", "priority", "proserve", "shepherd", "qlm", "qlm-rr")
PROFILED = ("sedf", "proserve", "shepherd", "qlm", "qlm-rr")
"""The policies that estimate service times with the RCT profile (the others need none)."""


def create_policy(
    name: str,
    *,
    profile: RctProfile | None = None,
    planner: PlannerConfig | None = None,
    baselines: BaselineConfig | None = None,
) -> Policy:
    """A policy by name (``POLICIES``). ``profile``: the RCT profile policies that estimate use
    (default: the shipped one); ``planner``: settings of ``qlm``; ``baselines``: the baselines'
    parameters.

    ``fcfs``/``fcfs-rr``: vLLM as it serves requests (dispatch on arrival, least-loaded or
    round-robin); ``edf``, ``sedf`` (FlowPrefill), ``priority`` (QLLM), ``proserve`` (PROSERVE),
    ``shepherd`` (SHEPHERD as the QLM paper describes it): ``qlm.planner.baselines``; ``qlm``: groups,
    RCT estimator and the stochastic planner (``qlm.planner.qlm_policy``); ``qlm-rr``: the same
    ordering inside each instance behind round-robin placement (``PlannerConfig.placement``)."""
    if name == "qlm":
        return QlmPolicy(profile, config=planner)
    if name == "qlm-rr":
        config = dataclasses.replace(planner or PlannerConfig(), placement="round-robin")
        return QlmPolicy(profile, config=config)
    policy = create_baseline(name, profile=profile, config=baselines)
    if policy is not None:
        return policy
    raise ConfigError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
