from __future__ import annotations

import pytest

from qlm.errors import ConfigError
from qlm.rct.distribution import CompletionDistribution, GroupEstimate
from qlm.rct.trigger import violations


def est(gid: str, mean: float, sd: float, deadline: float) -> GroupEstimate:
    return GroupEstimate(gid, "i0", 0, CompletionDistribution(mean, sd * sd), deadline)


def test_only_groups_likely_to_miss_trigger_and_the_worst_comes_first() -> None:
    found = violations(
        [
            est("safe", mean=10, sd=1, deadline=20),  # P(meet) ~ 1
            est("risky", mean=20, sd=5, deadline=22),  # P(meet) ~ 0.66
            est("late", mean=40, sd=5, deadline=30),  # P(meet) ~ 0.02
        ],
        delta=0.9,
    )
    assert [v.group_id for v in found] == ["late", "risky"]
    assert found[0].p_meet_slo < 0.05


def test_a_looser_target_triggers_less() -> None:
    estimates = [est("risky", mean=20, sd=5, deadline=22)]
    assert violations(estimates, delta=0.9) and not violations(estimates, delta=0.5)


def test_delta_one_asks_for_every_scenario() -> None:
    nearly = [est("nearly", mean=10, sd=2, deadline=14)]  # P(meet) ~ 0.977
    assert [v.group_id for v in violations(nearly, delta=1.0)] == ["nearly"]


@pytest.mark.parametrize("delta", [0.0, 1.5])
def test_delta_outside_the_unit_interval_is_refused(delta: float) -> None:
    with pytest.raises(ConfigError, match="delta"):
        violations([], delta=delta)
