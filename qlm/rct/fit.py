"""Fitting the estimator's parameters from measurements (paper §6, "Offline Profiling"): the
prefill line from prompt lengths and their times to first token, and a workload's output-length
prior from a sample of its output lengths. The measurements are taken by ``qlm.profiling`` (on a
simulated instance or a vLLM server)."""

from __future__ import annotations

from collections.abc import Sequence

from qlm.rct.output_model import NIG

PREFILL_LENGTHS = (128, 256, 512, 1024, 2048, 4096)
"""The prompt lengths the prefill line ``P(I) = a + b·I`` is measured at (those that fit the
model's context)."""


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return slope, my - slope * mx


def profile_workload(outputs: Sequence[int], *, strength: float = 20.0) -> NIG:
    """The output-length prior of a workload from a sample of its output lengths."""
    return NIG.fit(list(outputs), strength=strength)
