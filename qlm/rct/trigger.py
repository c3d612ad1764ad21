"""The violation trigger (paper §4 "Handling New Incoming Requests", §7): which groups are
predicted to miss their SLO with probability above ``1 − Δ`` — the event that calls the planner.

The QLM policy asks it with each group's ``P(meet SLO)`` over the planner's own scenarios
(``QlmPolicy._predicts_violation``), so that what triggers a plan is what the plan's chance
constraint counts; ``GroupEstimate``s (the estimator's normal approximation) answer it too."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from qlm.errors import ConfigError
from qlm.rct.distribution import GroupEstimate


class GroupRisk(Protocol):
    """What the trigger needs of a group where it is queued."""

    @property
    def group_id(self) -> str: ...
    @property
    def instance(self) -> str: ...
    @property
    def position(self) -> int: ...
    @property
    def p_meet_slo(self) -> float: ...
    @property
    def predicted_completion_s(self) -> float: ...
    @property
    def deadline_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Violation:
    """A group's risk where it is queued (``violations`` returns those that trigger)."""

    group_id: str
    instance: str
    position: int
    p_meet_slo: float
    predicted_completion_s: float
    deadline_s: float


def violations(estimates: Iterable[GroupRisk | GroupEstimate], delta: float) -> list[Violation]:
    """Groups whose ``P(completion ≤ deadline) < Δ`` (i.e. a miss is more likely than ``1 − Δ``),
    most at risk first. ``Δ`` is the SLO preservation target of the chance constraint."""
    if not 0 < delta <= 1:
        raise ConfigError(f"delta must be in (0, 1], got {delta}")
    out = [
        Violation(
            group_id=e.group_id,
            instance=e.instance,
            position=e.position,
            p_meet_slo=e.p_meet_slo,
            predicted_completion_s=e.predicted_completion_s,
            deadline_s=e.deadline_s,
        )
        for e in estimates
        if e.p_meet_slo < delta
    ]
    out.sort(key=lambda v: (v.p_meet_slo, v.deadline_s, v.group_id))
    return out
