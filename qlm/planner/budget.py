"""How long one plan may think: the budget (a setting) and the deadline of one plan (its meter).

A ``Budget`` says what a plan may spend: seconds of compute (production) and/or a count of
candidate orders scored (simulation: the count makes a simulated run the same on any machine and
under any load). ``Budget.start(clock)`` opens one plan's ``Deadline``, which every searching part
of the plan consults between units of work — each insertion of the warm start, each move of the
local search (and each batch of its swaps), the MILP's time limit, each EDF plan the capacity
signal tries — and which stops them when it is spent; the EDF plan itself, linear and the floor of
every other, is always built. The planner's code never reads a clock itself: the deadline reads
the one it was given, and a test drives it with a fake clock or a fake deadline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from qlm.clock import work_seconds
from qlm.errors import check_setting

Clock = Callable[[], float]
"""Seconds, monotonic (``qlm.clock.work_seconds`` in production)."""


@dataclass(frozen=True, slots=True)
class Budget:
    """How long the planner may think: seconds of compute and/or candidate orders scored.
    ``milp_max_groups``: solve the MILP only up to this many groups (0 disables it);
    ``max_positions``: insertion positions tried per queue (all of them for shorter queues)."""

    time_s: float | None = 0.1
    evaluations: int | None = None
    milp_max_groups: int = 8
    max_positions: int = 48

    def __post_init__(self) -> None:
        ok = self.time_s is None or self.time_s > 0
        check_setting(ok, "planner.budget.time_s", "> 0 or unset", self.time_s)
        ok = self.evaluations is None or self.evaluations >= 1
        check_setting(ok, "planner.budget.evaluations", ">= 1 or unset", self.evaluations)

    def start(self, clock: Clock = work_seconds) -> Deadline:
        """One plan's deadline, from now on ``clock``."""
        return Deadline(self, clock)


class Deadline:
    """One plan's budget as it is spent: the candidate orders scored (``charge``) and the time
    gone on its clock. ``spent()`` is what every part of a plan asks between units of work."""

    def __init__(self, budget: Budget, clock: Clock) -> None:
        self.budget = budget
        self.clock = clock
        self.count = 0
        self.started_s = clock()

    def part(self, share: float) -> Deadline:
        """A deadline on the same clock, from the same start, spent when ``share`` of this one's
        time is gone; it counts its own scored orders, up to the same number."""
        check_setting(0 < share <= 1, "deadline share", "in (0, 1]", share)
        t = self.budget.time_s
        out = Deadline(replace(self.budget, time_s=None if t is None else t * share), self.clock)
        out.started_s = self.started_s
        return out

    def charge(self, orders: int) -> None:
        """``orders`` candidate orders were scored."""
        self.count += orders

    def elapsed_s(self) -> float:
        return self.clock() - self.started_s

    def left_s(self) -> float:
        """Seconds left (``inf`` when the budget has no time limit)."""
        if self.budget.time_s is None:
            return math.inf
        return self.budget.time_s - self.elapsed_s()

    def spent(self) -> bool:
        """The budget is used up: no more work that can be left undone."""
        b = self.budget
        if b.evaluations is not None and self.count >= b.evaluations:
            return True
        return b.time_s is not None and self.elapsed_s() >= b.time_s
