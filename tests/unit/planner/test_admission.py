"""Cost-aware admission: the fractional knapsack over the arriving stream, and its pacing."""

from __future__ import annotations

import numpy as np
import pytest

from qlm.planner.admission import Admission, TokenBucket, admit


def test_everything_is_admitted_when_it_fits() -> None:
    values = np.array([1.0, 2.0, 1.0])
    costs = np.array([0.1, 0.1, 0.2])
    weights = np.full(3, 1.0)  # one request per second each: 0.4 GPU-s per s
    a = admit(values, costs, weights, max_utilisation=0.95)
    assert a.threshold == 0.0
    assert a.value == pytest.approx(4.0)
    assert a.spare == pytest.approx(0.6)
    assert not a.defers(0.0)


def test_the_costliest_work_per_unit_of_value_is_deferred_first() -> None:
    # Same value, different prompt cost: the knapsack keeps the cheap ones.
    values = np.array([1.0, 1.0, 1.0, 1.0])
    costs = np.array([0.2, 0.6, 0.2, 0.2])
    weights = np.ones(4)  # 1.2 GPU-s per s offered
    a = admit(values, costs, weights, max_utilisation=0.95)
    # The three cheap ones (0.6 GPU-s per s), and 0.35 GPU-s per s of the fourth.
    assert a.value == pytest.approx(3.0 + 0.35 / 0.6)
    assert a.threshold == pytest.approx(1.0 / 0.6)  # the first that does not fit
    assert a.defers(1.0 / 0.6)
    assert not a.defers(1.0 / 0.2)
    assert a.spare == pytest.approx(0.4)


def test_value_outweighs_cost_when_it_is_denser() -> None:
    values = np.array([4.0, 1.0])  # an urgent, expensive request against a cheap, cheap one
    costs = np.array([0.8, 0.4])
    a = admit(values, costs, np.ones(2), max_utilisation=0.95)
    assert a.value == pytest.approx(4.0 + 0.15 * 2.5)
    assert a.threshold == pytest.approx(2.5)
    assert a.defers(2.5)  # the cheap one waits
    assert a.spare == pytest.approx(0.2)


def test_work_that_can_meet_no_slo_is_deferred_even_when_capacity_is_short() -> None:
    a = admit(np.array([1.0, 0.0]), np.array([0.5, 0.6]), np.ones(2), max_utilisation=0.95)
    assert a.defers(0.0)
    assert not a.defers(2.0)


def test_a_class_that_fits_only_in_part_is_deferred_whole() -> None:
    # Ten identical requests, room for about six: none is admitted over the others; all are
    # served by the spare capacity (the whole instance here).
    a = admit(np.ones(10), np.full(10, 0.15), np.ones(10), max_utilisation=0.95)
    assert a.defers(1.0 / 0.15)
    assert a.value == pytest.approx(0.95 / 0.15) and a.spare == 1.0
    b = admit(np.ones(3), np.array([0.1, 0.15, 0.15]), np.array([1.0, 4.0, 4.0]), 0.95)
    assert not b.defers(10.0) and b.defers(1.0 / 0.15)  # the cheap one stays admitted
    assert b.spare == pytest.approx(0.9)


def test_an_empty_stream_defers_nothing() -> None:
    a = admit(np.zeros(0), np.zeros(0), np.zeros(0), max_utilisation=0.95)
    assert a == Admission(0.0, 0.0, 1.0)


def test_shapes_must_agree() -> None:
    with pytest.raises(ValueError):
        admit(np.ones(2), np.ones(3), np.ones(2), max_utilisation=0.9)


def test_the_bucket_paces_deferred_work_at_the_spare_rate() -> None:
    bucket = TokenBucket(burst_s=10.0)
    bucket.refill(0.0, rate=0.1)
    assert not bucket.take(0.3)  # nothing accumulated yet
    bucket.refill(2.0, rate=0.1)  # 0.2 GPU-s
    assert not bucket.take(0.3)
    bucket.refill(4.0, rate=0.1)  # 0.4
    assert bucket.take(0.3)
    assert bucket.level == pytest.approx(0.1)
    bucket.refill(1000.0, rate=0.1)  # a long lull: capped at the burst
    assert bucket.level == pytest.approx(1.0)
    assert bucket.take(5.0)  # full: one request larger than the burst still passes ...
    assert not bucket.take(0.01)  # ... and is paid back before the next


@pytest.mark.parametrize("seed", range(20))
def test_merging_alike_requests_into_one_weighted_row_changes_nothing(seed: int) -> None:
    # The planner passes one row per (class, prompt length) with the arrivals as its weight;
    # the verdict must be the one over every request.
    rng = np.random.default_rng(seed)
    kinds = 6
    values = rng.uniform(0.0, 2.0, kinds)
    costs = rng.uniform(0.05, 0.5, kinds)
    counts = rng.integers(1, 8, kinds)
    per_request = 1.0 / rng.uniform(5.0, 40.0)  # one arrival in the window, per second
    row = np.repeat(np.arange(kinds), counts)
    rng.shuffle(row)
    each = admit(values[row], costs[row], np.full(len(row), per_request), 0.9)
    merged = admit(values, costs, counts * per_request, 0.9)
    assert merged.value == pytest.approx(each.value)
    assert merged.threshold == pytest.approx(each.threshold)
    assert merged.spare == pytest.approx(each.spare)


def test_densities_of_many_groups_are_each_groups_density_to_the_last_bit() -> None:
    from qlm.domain import SLO
    from qlm.planner.arrivals import class_of
    from qlm.planner.concurrency import Fluid, PromptRows
    from tests.builders import make_request

    rng = np.random.default_rng(3)
    groups = []
    for g in range(30):
        e2e = (30.0, 60.0)[g % 2]
        requests = tuple(
            make_request(
                100 * g + j,
                input_tokens=int(rng.integers(1, 5000)),
                # (a group of two classes now and then: each request its own class's output)
                slo=SLO(e2e_s=60.0 if g % 7 == 0 and j == 1 else e2e),
            )
            for j in range(int(rng.integers(1, 33)))
        )
        groups.append((f"g{g}", requests))
    key = class_of(groups[0][1][0])
    other = class_of(groups[1][1][0])
    fluid = Fluid(
        Admission(1.0, 2.0, 0.1),
        {key: 1.5, other: 0.7},
        {key: 321.7},  # (the other class has no recent output: the group's own is used)
        {"m": 3.3e-4},
        {"m": 7.1e-5},
    )
    outputs = [float(rng.uniform(10, 900)) for _ in groups]
    prompts = PromptRows()
    for _ in range(2):  # computed, then from the rows kept
        densities = fluid.densities(groups, outputs, prompts)
        assert densities == [
            fluid.density(requests, out) for (_, requests), out in zip(groups, outputs, strict=True)
        ]
    assert fluid.densities([], [], prompts) == []
