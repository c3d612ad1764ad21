"""Time behind a small interface: the one seam between a run on the wall clock and one in virtual
time. Core logic never reads a clock; drivers (the cluster simulator, the controller service, the
wall-clock sim-engine server) own one and pass ``now`` down."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock's own time line."""
        ...


class VirtualClock:
    """A clock that only moves when the simulator moves it, and never backwards."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"virtual clock cannot go back from {self._now} to {t}")
        self._now = t


class EpochClock:
    """Unix time (seconds since 1970): the service's clock, so that a request's arrival is its
    submission time as the API recorded it, whichever process plans it. ``scale`` > 1 runs it
    faster from the moment it is made (demos on simulated instances sped up alike); production
    uses 1."""

    def __init__(self, scale: float = 1.0) -> None:
        if scale <= 0:
            raise ValueError(f"clock scale must be > 0, got {scale}")
        self.scale = scale
        self._origin = time.time()

    def now(self) -> float:
        if self.scale == 1.0:
            return time.time()
        return self._origin + (time.time() - self._origin) * self.scale


class WallClock:
    """Monotonic wall time, optionally sped up: with ``scale=10`` ten virtual seconds pass each
    real second (for demos of a simulated instance)."""

    def __init__(self, scale: float = 1.0) -> None:
        if scale <= 0:
            raise ValueError(f"clock scale must be > 0, got {scale}")
        self.scale = scale
        self._origin = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._origin) * self.scale

    def seconds_until(self, t: float) -> float:
        """Real seconds to sleep until this clock reads ``t`` (0 if it is past)."""
        return max(0.0, (t - self.now()) / self.scale)


def work_seconds() -> float:
    """The process's monotonic seconds (``time.perf_counter``): the clock a policy times its
    own work on — a plan's budget when it is wall time, a control step's — unless it is given
    another (tests give a fake one; a simulated run's budgets are counts and read none)."""
    return time.perf_counter()
