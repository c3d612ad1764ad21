"""Per-instance agents: pure decisions that turn a virtual queue into serving operations (§5),
and the executor (``qlm.agents.executor``) that maps decisions to engine operations."""

from qlm.agents.decide import (
    AgentConfig,
    HeadGroup,
    InstanceCosts,
    RunningRequest,
    make_room,
    plan_tiers,
    prefers_swap,
)

__all__ = [
    "AgentConfig",
    "HeadGroup",
    "InstanceCosts",
    "RunningRequest",
    "make_room",
    "plan_tiers",
    "prefers_swap",
]
