"""What the settings build, for the service and the CLI: the planner's configuration
(``QLM_PLANNER__*``), the baselines' parameters (``QLM_BASELINES__*``) and the estimator's profile (``QLM_PROFILE_FILE`` over the shipped one).
``qlm.settings`` holds the values and their validation; the objects they stand for are built here,
above the planner and the estimator."""

from __future__ import annotations

import dataclasses

from qlm.agents.decide import AgentConfig
from qlm.domain import Tier
from qlm.errors import ConfigError
from qlm.planner import BaselineConfig, PlannerConfig
from qlm.planner.config import DEFAULT_GROUPING, DEFAULT_TIER_WEIGHTS
from qlm.planner.solve import Budget
from qlm.rct.profile import RctProfile, default_profile, parse_profile
from qlm.settings import BaselineSettings, PlannerSettings, Settings


def planner_config(settings: PlannerSettings) -> PlannerConfig:
    """The ``PlannerConfig`` the planner settings stand for (unset fields: its defaults)."""
    weights = dict(DEFAULT_TIER_WEIGHTS)
    weights.update({Tier[t.upper()]: w for t, w in settings.tier_weights.items()})
    return PlannerConfig(
        delta=settings.delta,
        tier_weights=weights,
        budget=Budget(time_s=settings.budget_s),
        period_s=settings.period_s,
        min_interval_s=settings.min_interval_s,
        defer_expensive=settings.defer_expensive,
        throughput_floor=settings.throughput_floor,
        floor_window_s=settings.floor_window_s,
        overload_after_s=settings.overload_after_s,
        throughput_tolerance=settings.throughput_tolerance,
        max_utilisation=settings.max_utilisation,
        rate_window_s=settings.rate_window_s,
        choose_concurrency=settings.choose_concurrency,
        agent=AgentConfig(
            evict=settings.evict,
            swap=settings.swap,
            warm_start=settings.warm_start,
            prefill_queue_tokens=settings.prefill_queue_tokens,
        ),
        solver=settings.solver,
        grouping=dataclasses.replace(
            DEFAULT_GROUPING,
            delta=settings.group_delta,
            avg_batch_size=settings.group_batch_size,
        ),
        max_wait_s={
            Tier[t.upper()]: s for t, s in settings.max_wait_s.model_dump().items() if s is not None
        },
    )


def baseline_config(settings: BaselineSettings) -> BaselineConfig:
    """The baselines' parameters the ``QLM_BASELINES__*`` settings stand for."""
    return BaselineConfig(**settings.model_dump())


def rct_profile(settings: Settings) -> RctProfile:
    """The estimator's profile: the shipped one, with ``QLM_PROFILE_FILE``'s entries over it.
    A file that cannot be read or parsed stops with one line naming the setting."""
    shipped = default_profile()
    path = settings.profile_file
    if path is None:
        return shipped
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"setting QLM_PROFILE_FILE: cannot read {path} ({exc.strerror})"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"setting QLM_PROFILE_FILE: {path} is not UTF-8 text") from None
    try:
        return shipped.merged(parse_profile(text, str(path)))
    except ConfigError as exc:
        raise ConfigError(f"setting QLM_PROFILE_FILE: {exc}") from None
