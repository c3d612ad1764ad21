"""Completion-time distributions: what the estimator answers and the arithmetic on it.

A completion time is carried as a normal distribution (mean and variance: independent requests
add means and variances — the central limit with many requests ahead, a moment match with few),
except for one request, whose completion is dominated by its own output length: skewed and capped
at ``max_tokens``. Then ``P(completion ≤ t)`` integrates that length distribution over a normal
decode start and a log-normal, mean-preserving factor on the time per output token
(Gauss–Hermite quadrature), and quantiles are found by bisection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from qlm.rct.output_model import OutputBelief, _phi

Z = {0.5: 0.0, 0.9: 1.2815515655446004, 0.95: 1.6448536269514722, 0.99: 2.3263478740408408}
"""Standard normal quantiles of the levels asked most (others by ``_normal_ppf``)."""


@dataclass(frozen=True, slots=True)
class CompletionDistribution:
    """A completion time on the absolute clock (seconds): its mean and variance and, for one
    request, the shape of its distribution.

    A group's completion sums many requests and is treated as normal. A single request's is
    dominated by its own output length, which is skewed (and capped at ``max_tokens``): with
    ``output`` set, ``P(completion ≤ t)`` is computed from that distribution —
    decode starts at a normal time ``start`` and takes ``O · d`` — instead of a normal
    approximation, which would be badly calibrated for one request.
    """

    mean: float
    var: float
    start_mean: float = 0.0
    start_sd: float = 0.0
    output: OutputBelief | None = None  # the request's output-length posterior
    generated: int = 0
    cap: int = 0
    per_token_s: float = 0.0
    speed_sd: float = 0.0  # spread of log(actual / predicted time per output token)

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))

    def quantile(self, q: float) -> float:
        """The ``q``-quantile: exact for a single request (bisection), normal for a group."""
        if not 0 < q < 1:
            raise ValueError(f"quantile must be in (0, 1), got {q}")
        if self.output is None:
            z = Z.get(q)
            if z is None:
                z = _normal_ppf(q)
            return self.mean + z * self.std
        lo, hi = self.start_mean - 8 * self.start_sd - 1.0, self.mean + 20 * self.std + 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if self.p_before(mid) < q:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    def p_before(self, t: float) -> float:
        """``P(completion ≤ t)``."""
        if self.output is None:
            sd = self.std
            if sd <= 0:
                return 1.0 if self.mean <= t else 0.0
            return _phi((t - self.mean) / sd)
        # Average over the normal start time and the log-normal speed (Gauss–Hermite nodes).
        starts = _GH_NODES if self.start_sd > 0 else ((0.0, 1.0),)
        speeds = _GH_NODES if self.speed_sd > 0 else ((0.0, 1.0),)
        total = 0.0
        for y, v in speeds:
            # Mean-preserving: the learnt ε already matches the mean time per token.
            per_token = self.per_token_s * math.exp(self.speed_sd * y - self.speed_sd**2 / 2)
            for x, w in starts:
                total += (
                    v
                    * w
                    * self._p_output_within(t - (self.start_mean + x * self.start_sd), per_token)
                )
        return total

    def _p_output_within(self, seconds: float, per_token_s: float) -> float:
        """``P(the remaining output decodes within seconds)`` at ``per_token_s``."""
        if seconds < 0:
            return 0.0
        if per_token_s <= 0 or self.output is None:
            return 1.0
        return self.output.p_remaining_within(
            seconds / per_token_s, cap=self.cap, generated=self.generated
        )


def _normal_ppf(q: float) -> float:
    """The standard normal ``q``-quantile, by bisection."""
    lo, hi = -10.0, 10.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if _phi(mid) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# Probabilists' Gauss–Hermite nodes and weights for E[f(Z)], Z ~ N(0, 1).
_GH_NODES = tuple(
    (x * math.sqrt(2.0), w / math.sqrt(math.pi))
    for x, w in (
        (-2.651961356835233, 0.0009717812450995192),
        (-1.673551628767471, 0.05451558281912703),
        (-0.8162878828589647, 0.4256072526101278),
        (0.0, 0.8102646175568073),
        (0.8162878828589647, 0.4256072526101278),
        (1.673551628767471, 0.05451558281912703),
        (2.651961356835233, 0.0009717812450995192),
    )
)


@dataclass(frozen=True, slots=True)
class GroupEstimate:
    """A group's completion (its last request's, Eq. 5) at ``position`` of ``instance``'s
    virtual queue, against the group's earliest deadline."""

    group_id: str
    instance: str
    position: int
    completion: CompletionDistribution
    deadline_s: float

    @property
    def p_meet_slo(self) -> float:
        return self.completion.p_before(self.deadline_s)

    @property
    def predicted_completion_s(self) -> float:
        return self.completion.mean


@dataclass(frozen=True, slots=True)
class QueueEstimates:
    """The completion of each group of ``instance``'s virtual queue, in queue order, as arrays
    (``RCTEstimator.estimate_queues``): mean and variance of its normal completion time, and its
    earliest deadline."""

    instance: str
    group_ids: tuple[str, ...]
    mean: npt.NDArray[np.float64]
    var: npt.NDArray[np.float64]
    deadline_s: npt.NDArray[np.float64]

    def groups(self) -> list[GroupEstimate]:
        """One ``GroupEstimate`` per group, in queue order."""
        return [
            GroupEstimate(gid, self.instance, k, CompletionDistribution(mean, var), deadline)
            for k, (gid, mean, var, deadline) in enumerate(
                zip(
                    self.group_ids,
                    self.mean.tolist(),
                    self.var.tolist(),
                    self.deadline_s.tolist(),
                    strict=True,
                )
            )
        ]
