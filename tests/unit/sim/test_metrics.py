"""Summaries are computed from the records: attainment, percentiles, time-weighted memory."""

from __future__ import annotations

import pytest
from builders import make_request

from qlm.domain import SLO, RequestRecord, RequestStatus, Tier
from qlm.sim.metrics import MemoryTimeline, summarize


def finished(i: int, *, e2e: float, ttft: float, slo: float, **req: object) -> RequestRecord:
    r = make_request(
        i, arrival_s=10.0 * i, slo=SLO(e2e_s=slo, ttft_s=req.pop("ttft_slo", None)), **req
    )  # type: ignore[arg-type]
    return RequestRecord(
        request=r,
        instance="i0",
        dispatch_s=r.arrival_s,
        scheduled_s=r.arrival_s + ttft / 2,
        first_token_s=r.arrival_s + ttft,
        finish_s=r.arrival_s + e2e,
        output_tokens=10,
        status=RequestStatus.FINISHED,
    )


def test_slo_attainment_counts_end_to_end_and_ttft_deadlines_and_unfinished_requests() -> None:
    records = [
        finished(0, e2e=5, ttft=1, slo=10),  # met
        finished(1, e2e=15, ttft=1, slo=10),  # e2e missed
        finished(2, e2e=5, ttft=3, slo=10, ttft_slo=2.0),  # ttft missed
        RequestRecord(request=make_request(3), status=RequestStatus.FAILED),
    ]
    s = summarize(records)
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert s["finished"] == 3 and s["failed"] == 1


def test_attainment_is_broken_down_by_class_tier_and_model() -> None:
    records = [
        finished(0, e2e=5, ttft=1, slo=10, slo_class="chat", tier=Tier.INTERACTIVE),
        finished(1, e2e=50, ttft=1, slo=10, slo_class="chat", tier=Tier.INTERACTIVE),
        finished(2, e2e=50, ttft=1, slo=100, slo_class="batch", tier=Tier.BATCH, model="n"),
    ]
    s = summarize(records)
    assert s["slo_attainment_by_class"] == {
        "batch": {"requests": 1, "slo_attainment": 1.0},
        "chat": {"requests": 2, "slo_attainment": 0.5},
    }
    assert s["slo_attainment_by_tier"]["interactive"]["slo_attainment"] == 0.5
    assert s["slo_attainment_by_model"]["n"]["slo_attainment"] == 1.0


def test_latency_percentiles_and_throughput_come_from_the_records() -> None:
    records = [finished(i, e2e=float(i + 1), ttft=0.5, slo=100) for i in range(100)]
    s = summarize(records)
    assert s["e2e_s"]["p50"] == pytest.approx(50.5)
    assert s["e2e_s"]["p99"] == pytest.approx(99.01)
    assert s["queue_s"]["mean"] == pytest.approx(0.25)
    makespan = 990 + 100  # last arrival at 990 s finishes 100 s later
    assert s["makespan_s"] == pytest.approx(makespan)
    assert s["throughput_rps"] == pytest.approx(100 / makespan)


def test_memory_utilisation_is_weighted_by_time() -> None:
    tl = MemoryTimeline(["a"], bin_s=10.0)
    tl.observe(0, 0.0, 0.2)
    tl.observe(0, 5.0, 0.6)  # 0.2 for 5 s, then 0.6 for 15 s
    tl.close(20.0)
    assert tl.mean(0) == pytest.approx((0.2 * 5 + 0.6 * 15) / 20)
    assert tl.series(0) == [(0.0, pytest.approx(0.4)), (10.0, pytest.approx(0.6))]


def test_ttft_attainment_is_the_share_of_a_classs_requests_with_a_ttft_slo_that_met_it() -> None:
    records = [
        finished(0, e2e=5, ttft=1, slo=10, slo_class="chat", ttft_slo=2.0),  # met
        finished(1, e2e=50, ttft=1, slo=10, slo_class="chat", ttft_slo=2.0),  # met (e2e missed)
        finished(2, e2e=5, ttft=3, slo=10, slo_class="chat", ttft_slo=2.0),  # missed
        finished(3, e2e=5, ttft=3, slo=10, slo_class="chat"),  # no TTFT SLO: not counted
        RequestRecord(
            request=make_request(4, slo=SLO(10.0, 2.0), slo_class="chat"),
            status=RequestStatus.FAILED,
        ),  # never had a first token: missed
        finished(5, e2e=5, ttft=3, slo=10, slo_class="batch"),
    ]
    by_class = summarize(records)["slo_attainment_by_class"]
    assert by_class["chat"]["ttft_requests"] == 4
    assert by_class["chat"]["ttft_attainment"] == pytest.approx(0.5)
    assert "ttft_attainment" not in by_class["batch"]  # none of its requests has a TTFT SLO
