"""The arrival rate the throughput floor keeps up with (``qlm.planner.arrivals.ArrivalRate``)."""

from __future__ import annotations

import pytest

from qlm.planner.arrivals import ArrivalRate


def test_rates_per_model_over_the_horizon_then_over_the_time_since_the_first_arrival() -> None:
    rate = ArrivalRate(horizon_s=100.0)
    assert rate.rates(0.0) == {}
    for t in range(50):  # one a second of "a", one every other second of "b", from t = 0
        rate.add(float(t), "a")
        if t % 2 == 0:
            rate.add(float(t), "b")
    # 50 s since the first arrival: 50 of "a" and 25 of "b" over 50 s (not over the horizon).
    assert rate.rates(50.0) == pytest.approx({"a": 1.0, "b": 0.5})
    # At t = 130 the arrivals before t = 30 have left the horizon: 20 of "a", 10 of "b" over 100 s.
    assert rate.rates(130.0) == pytest.approx({"a": 0.2, "b": 0.1})
    # All gone: no model has a rate.
    assert rate.rates(500.0) == {}
    # A first arrival counts over one second at least, not over no time at all.
    fresh = ArrivalRate(horizon_s=100.0)
    fresh.add(10.0, "a")
    assert fresh.rates(10.0) == {"a": 1.0}
