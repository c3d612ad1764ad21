"""The planner's window of recent arrivals: counts per class and prompt length, and a sample."""

from __future__ import annotations

from dataclasses import replace

from builders import make_request

from qlm.domain import Tier
from qlm.planner.arrivals import ArrivalWindow, class_of


def test_alike_arrivals_are_counted_together_and_age_out() -> None:
    window = ArrivalWindow(sample=3)
    a = make_request(0, input_tokens=100)
    b = make_request(1, input_tokens=100)
    c = make_request(2, input_tokens=250)
    other = replace(make_request(3, input_tokens=100), tier=Tier.BATCH)
    for t, req in enumerate((a, b, c, other)):
        window.add(float(t), req)
    assert window.first_s == 0.0 and len(window) == 4
    key = class_of(a)
    assert window.classes() == [key, class_of(other)]
    assert window.counts(key) == {100: 2, 250: 1}
    assert list(window.recent(key)) == [a, b, c]
    window.expire(1.0)  # a arrived at 0
    assert window.counts(key) == {100: 1, 250: 1}
    assert list(window.recent(key)) == [b, c]
    window.expire(3.5)  # only nothing of key is left
    assert window.classes() == []
    assert len(window) == 0
    assert window.first_s == 0.0  # the first arrival ever, not the window's


def test_the_sample_keeps_the_latest_and_expiry_skips_what_it_let_go() -> None:
    window = ArrivalWindow(sample=2)
    reqs = [make_request(i, input_tokens=10 * (i + 1)) for i in range(4)]
    for t, req in enumerate(reqs):
        window.add(float(t), req)
    key = class_of(reqs[0])
    assert list(window.recent(key)) == reqs[2:]
    window.expire(2.0)  # reqs 0 and 1 leave the window; the sample had already dropped them
    assert list(window.recent(key)) == reqs[2:]
    assert window.counts(key) == {30: 1, 40: 1}
    window.expire(3.0)
    assert list(window.recent(key)) == reqs[3:]
