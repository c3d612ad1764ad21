"""``experiments/rct_accuracy.py --azure-mix real-time``: the arrivals stay, the lengths come
from the trace near each request's replay time on the trace's own clock."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from qlm.sim.traces import Trace, window

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "experiments"))

import rct_accuracy as ra


def trace_with_lengths_by_time() -> Trace:
    # One request a second for an hour; each request's lengths encode its arrival second.
    arrival = np.arange(3600, dtype=float)
    return Trace("clocked", arrival, (arrival + 1).astype(np.int64), (arrival + 1).astype(np.int64))


def test_lengths_come_from_near_the_replay_time_and_arrivals_stay() -> None:
    trace = trace_with_lengths_by_time()
    part = window(trace, 1500.0, 2400.0)  # 900 trace seconds, replayed in 40 s at x22.5
    mixed = ra._real_time_mix(trace, part, 1500.0, 22.5, seed=3)
    assert np.array_equal(mixed.arrival_s, part.arrival_s)
    source = mixed.output_tokens - 1  # the trace second each length was drawn from
    replay_time = part.arrival_s / 22.5
    assert np.all(np.abs(source - (1500.0 + replay_time)) <= ra.MIX_HALF_S + 1)
    # Compressed, the window's lengths span its 900 s; drawn at real time, about 340 s.
    assert source.max() - source.min() < 2 * ra.MIX_HALF_S + 40 + 2
    assert np.array_equal(mixed.input_tokens, mixed.output_tokens)  # drawn as pairs


def test_never_drawn_from_the_prior_minutes() -> None:
    trace = trace_with_lengths_by_time()
    part = window(trace, 600.0, 700.0)
    mixed = ra._real_time_mix(trace, part, 600.0, 10.0, seed=0)
    assert (mixed.output_tokens - 1).min() >= 600
