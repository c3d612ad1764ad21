"""Policies that decide which instance serves a request and in what order.

One factory, ``create_policy(name)``, so that every experiment compares policies on the same
harness, trace and seed. Each policy is pure: ``decide(ctx)`` returns decisions and reads no clock.
"""

from __future__ import annotations

from qlm.errors import ConfigError
from qlm.planner.baselines import FcfsDispatch
from qlm.planner.policy import Completion, DispatchContext, InstanceLoad, Policy

__all__ = ["POLICIES", "Completion", "DispatchContext", "InstanceLoad", "Policy", "create_policy"]

POLICIES = ("fcfs", "fcfs-rr")


def create_policy(name: str) -> Policy:
    """``fcfs``: vLLM as it serves requests, least-loaded dispatch; ``fcfs-rr``: round-robin."""
    if name == "fcfs":
        return FcfsDispatch(dispatch="least-loaded")
    if name == "fcfs-rr":
        return FcfsDispatch(dispatch="round-robin")
    raise ConfigError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
