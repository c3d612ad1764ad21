"""Operators configure the planner through ``QLM_PLANNER__*``; a bad value is one line naming
the setting, and the defaults are the planner's own."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from qlm.cli import app
from qlm.domain import Tier
from qlm.errors import ConfigError
from qlm.planner import PlannerConfig
from qlm.service import build_controller
from qlm.settings import PlannerSettings, Settings, get_settings
from qlm.wiring import planner_config
from tests.builders import make_request


def test_unset_planner_settings_are_the_planners_defaults() -> None:
    assert planner_config(PlannerSettings()) == PlannerConfig()


def test_planner_settings_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QLM_PLANNER__TIER_WEIGHTS", json.dumps({"interactive": 1, "batch": 0.5}))
    monkeypatch.setenv("QLM_PLANNER__DEFER_EXPENSIVE", "false")
    monkeypatch.setenv("QLM_PLANNER__DELTA", "0.8")
    monkeypatch.setenv("QLM_PLANNER__EVICT", "true")
    monkeypatch.setenv("QLM_PLANNER__SOLVER", "cbc")
    config = planner_config(get_settings().planner)
    assert config.tier_weights == {Tier.INTERACTIVE: 1.0, Tier.STANDARD: 1.5, Tier.BATCH: 0.5}
    assert not config.defer_expensive and config.delta == 0.8 and config.agent.evict
    expected = dataclasses.replace(
        PlannerConfig(),
        tier_weights=config.tier_weights,
        defer_expensive=False,
        delta=0.8,
        agent=dataclasses.replace(PlannerConfig().agent, evict=True),
        solver="cbc",
    )
    assert config == expected  # nothing else moved


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("QLM_PLANNER__DELTA", "1.5"),
        ("QLM_PLANNER__TIER_WEIGHTS", '{"vip": 3}'),
        ("QLM_PLANNER__TIER_WEIGHTS", '{"batch": 0}'),
        ("QLM_PLANNER__BUDGET_S", "0"),
        ("QLM_PLANNER__MAX_UTILISATION", "1.2"),
        ("QLM_PLANNER__SOLVER", "gurobi"),
        ("QLM_PLANNER__GROUP_DELTA", "0"),
        ("QLM_PLANNER__GROUP_DELTA", "inf"),
        ("QLM_PLANNER__GROUP_BATCH_SIZE", "0.5"),
        ("QLM_PLANNER__MAX_WAIT_S__BATCH", "0"),
        ("QLM_PLANNER__MAX_WAIT_S__STANDARD", "soon"),
    ],
)
def test_a_bad_planner_setting_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"^setting {name}"):
        get_settings()


def test_the_controller_and_the_simulator_run_the_configured_planner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = Settings(planner=PlannerSettings(defer_expensive=False, period_s=3.0))
    service = build_controller(settings)
    config = service.runtime.controller.policy.config  # type: ignore[attr-defined]
    assert not config.defer_expensive and config.period_s == 3.0

    monkeypatch.setenv("QLM_PLANNER__DELTA", "2")
    args = ["simulate", "--duration", "20", "--policy", "qlm", "--json"]
    bad = CliRunner().invoke(app, args)
    assert bad.exit_code == 1 and "QLM_PLANNER__DELTA" in bad.stderr


def test_the_group_size_bound_is_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    assert planner_config(PlannerSettings()).grouping.max_group_size == 32  # the policy's default
    monkeypatch.setenv("QLM_PLANNER__GROUP_DELTA", "2")
    monkeypatch.setenv("QLM_PLANNER__GROUP_BATCH_SIZE", "3")
    settings = get_settings()
    service = build_controller(settings)
    grouper = service.runtime.controller.policy.grouper  # type: ignore[attr-defined]
    requests = [make_request(i, arrival_s=0.0, model="llama-3-8b") for i in range(20)]
    for request in requests:
        grouper.add(request, 0.0)
    sizes = [len(g.requests) for g in grouper.groups()]
    assert max(sizes) == 6 and sum(sizes) == 20  # delta x batch size = 6 per group


@pytest.mark.parametrize(
    ("name", "value", "named"),
    [
        ("QLM_API__DEFAULT_MAX_TOKENS", "100000", "default_max_tokens=100000 exceeds"),
        ("QLM_API__INTERACTIVE_SLO_S", "0.001", "QLM_API__INTERACTIVE_SLO_S"),
        ("QLM_API__BATCH_SLO_S", "1e9", "QLM_API__BATCH_SLO_S"),
        ("QLM_API__CONTROLLER_GONE_S", "5", "controller_gone_s=5.0 is below"),
    ],
)
def test_api_defaults_the_api_itself_would_refuse_stop_start_up(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, named: str
) -> None:
    """A default ``max_tokens`` over the limit would make every OpenAI call without one a 422,
    and a default SLO outside what a request may ask for is no SLO the API accepts."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=named):
        get_settings()


def test_the_maximum_wait_is_set_per_tier_and_unset_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert PlannerConfig().max_wait_s == {}
    monkeypatch.setenv("QLM_PLANNER__MAX_WAIT_S__BATCH", "600")
    monkeypatch.setenv("QLM_PLANNER__MAX_WAIT_S__STANDARD", "120.5")
    config = planner_config(get_settings().planner)
    assert config.max_wait_s == {Tier.BATCH: 600.0, Tier.STANDARD: 120.5}
    with pytest.raises(ConfigError, match=r"planner\.max_wait_s\.batch"):
        PlannerConfig(max_wait_s={Tier.BATCH: 0.0})


def test_the_policy_setting_names_every_policy_the_planner_makes_and_only_those() -> None:
    from typing import get_args

    from qlm.cli.simulate import POLICIES as CLI_POLICIES
    from qlm.planner import POLICIES
    from qlm.settings import PolicyName

    assert get_args(PolicyName) == POLICIES == CLI_POLICIES
