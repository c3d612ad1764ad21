"""The SLO report's figures: what counts as met, missed and judged, the causes of misses, the
percentiles, the buckets over the window and across days, the worst-served tenants; and the
same report as Markdown, JSON and a self-contained HTML page whose SVG charts plot its data."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from qlm.reports import build, markdown, page, tables
from qlm.reports.report import Bucket, Percentiles, Trend, miss_cause, slo_class, window_step

UNTIL = 1_700_000_000.0
SINCE = UNTIL - 86400.0


def make_row(**overrides: Any) -> dict[str, Any]:
    """A request as GET /v1/requests lists it: dispatched 1 s after submission, finished in
    5 s of a 30 s SLO, by default."""
    at = overrides.get("submitted_at", SINCE + 100.0)
    row: dict[str, Any] = {
        "id": "r",
        "tenant": "acme",
        "model": "m",
        "tier": "standard",
        "labels": {},
        "slo_seconds": 30.0,
        "ttft_slo_seconds": None,
        "status": "finished",
        "submitted_at": at,
        "dispatched_at": at + 1.0,
        "first_token_at": at + 1.5,
        "finished_at": at + 5.0,
        "evictions": 0,
        "attempts": 1,
        "slo_met": True,
        "ttft_met": None,
        "error": None,
    }
    row.update(overrides)
    return row


def late(**overrides: Any) -> dict[str, Any]:
    """A request that finished after its deadline: 40 s of a 30 s SLO."""
    at = overrides.get("submitted_at", SINCE + 100.0)
    return make_row(**({"finished_at": at + 40.0, "slo_met": False} | overrides))


def test_failures_are_misses_cancelled_are_left_out_and_pending_ones_are_not_judged() -> None:
    rows = [
        make_row(tier="batch"),
        late(tier="batch"),
        make_row(status="failed", slo_met=False, tier="interactive", error="boom: x"),
        make_row(status="cancelled", slo_met=None, tier="interactive"),
        make_row(status="queued", slo_met=None, tier="interactive"),
        make_row(ttft_slo_seconds=1.0, ttft_met=False, slo_met=False, tier="interactive"),
    ]
    report = build(rows, since=SINCE, until=UNTIL, target=0.9)
    o = report.overall
    assert (o.requests, o.pending, o.failed, o.cancelled, o.judged, o.met) == (6, 1, 1, 1, 4, 1)
    assert (o.ttft_judged, o.ttft_met) == (1, 0)
    tiers = dict(report.by["tier"])
    assert list(tiers) == ["interactive", "batch"]  # most urgent first
    assert (tiers["batch"].met, tiers["batch"].judged) == (1, 2)
    [overall] = next(t for t in tables(report) if t.key == "overall").rows
    assert overall[-2:] == ["25.0 % (1 of 4)", "0.0 % (0 of 1)"]  # every share says its count


@pytest.mark.parametrize(
    ("row", "cause"),
    [
        (make_row(), None),
        (make_row(status="cancelled", slo_met=None), None),
        (make_row(status="failed", slo_met=False), "failed"),
        (late(attempts=2), "instance down"),
        (late(attempts=3, evictions=1), "instance down"),
        (late(attempts=2, evictions=1), "evicted"),
        # Dispatched 20 s after submission, ran 20 s: the run fit in 30 s, the wait did not.
        (late(dispatched_at=SINCE + 120.0), "queued too long"),
        # Dispatched at once, ran 40 s: the run alone was longer than the deadline.
        (late(), "slow on its instance"),
        (late(dispatched_at=None), "queued too long"),
        # Only the first-token deadline missed: 3 s of a 1 s TTFT SLO, 2.5 s of it waiting.
        (
            make_row(
                ttft_slo_seconds=1.0,
                ttft_met=False,
                slo_met=False,
                dispatched_at=SINCE + 102.5,
                first_token_at=SINCE + 103.0,
            ),
            "queued too long",
        ),
        (
            make_row(
                ttft_slo_seconds=1.0, ttft_met=False, slo_met=False, first_token_at=SINCE + 103.0
            ),
            "slow on its instance",
        ),
    ],
)
def test_a_missed_request_has_the_first_cause_that_holds(row: dict[str, Any], cause: str) -> None:
    assert miss_cause(row) == cause


def test_causes_and_failure_reasons_are_counted_and_the_worst_tenants_named() -> None:
    rows = [
        *(make_row(tenant="good") for _ in range(10)),
        *(make_row(tenant="meh") for _ in range(8)),
        *(late(tenant="meh", attempts=2) for _ in range(2)),
        make_row(tenant="bad"),
        *(late(tenant="bad", dispatched_at=SINCE + 120.0) for _ in range(2)),
        make_row(tenant="bad", status="failed", slo_met=False, error="dead-lettered: no model x"),
        make_row(tenant="bad", status="failed", slo_met=False, error="dead-lettered: no model y"),
    ]
    report = build(rows, since=SINCE, until=UNTIL, target=0.9)
    assert report.causes == {
        "failed": 2,
        "instance down": 2,
        "evicted": 0,
        "queued too long": 2,
        "slow on its instance": 0,
    }
    assert report.failures == [("dead-lettered", 2)]
    # Below 90 %: bad (1 of 5), then meh (8 of 10); good (10 of 10) is not named.
    assert [(w.name, w.tally.met, w.tally.judged) for w in report.worst_tenants] == [
        ("bad", 1, 5),
        ("meh", 8, 10),
    ]
    assert report.worst_tenants[0].causes == {"queued too long": 2, "failed": 2}


def test_percentiles_are_nearest_rank_over_the_requests_that_reached_each_latency() -> None:
    p = Percentiles.of(float(i) for i in range(1, 101))
    assert (p.count, p.values, p.max) == (100, (50.0, 90.0, 99.0), 100.0)
    assert Percentiles.of([7.0]).values == (7.0, 7.0, 7.0)
    rows = [make_row(), make_row(status="queued", dispatched_at=None, first_token_at=None,
                                 finished_at=None, slo_met=None)]  # fmt: skip
    report = build(rows, since=SINCE, until=UNTIL, target=0.9)
    latency = {kind: dict(groups)["all"] for kind, groups in report.latency.items()}
    assert latency["ttft"].values[0] == pytest.approx(1.5)
    assert latency["e2e"].values[0] == pytest.approx(5.0)
    assert latency["queue"].values[0] == pytest.approx(1.0)
    assert {p.count for p in latency.values()} == {1}  # the queued request reached none


def test_a_class_is_the_class_label_else_the_deadlines() -> None:
    assert slo_class(make_row(labels={"class": "chat"})) == "chat"
    assert slo_class(make_row()) == "30 s"
    assert slo_class(make_row(slo_seconds=20.0, ttft_slo_seconds=2.5)) == "20 s, TTFT 2.5 s"


def test_the_window_is_cut_into_at_most_48_buckets_and_days_give_a_trend() -> None:
    assert [window_step(s) for s in (1800.0, 86400.0, 2 * 86400.0, 7 * 86400.0)] == [
        60.0, 1800.0, 3600.0, 6 * 3600.0,
    ]  # fmt: skip
    rows = [make_row(submitted_at=SINCE + 10.0), late(submitted_at=UNTIL - 10.0)]
    report = build(rows, since=SINCE, until=UNTIL, target=0.9)
    assert len(report.over_window) == 48 and report.over_window[-1].end == UNTIL
    assert (report.over_window[0].met, report.over_window[-1].met) == (1, 0)
    assert sum(b.requests for b in report.over_window) == 2
    # Attainment rising by 2 points a day, a day without judged requests in between.
    days = [Bucket(i * 86400.0, (i + 1) * 86400.0, 100, 100, 80 + 2 * i) for i in range(5)]
    days[2] = Bucket(2 * 86400.0, 3 * 86400.0, 0, 0, 0)
    trend = Trend.of(days)
    assert trend is not None and trend.slope_per_day == pytest.approx(0.02)
    assert Trend.of(days[:1]) is None


def many_rows() -> list[dict[str, Any]]:
    rows = []
    for i in range(60):
        tenant = ("acme", "globex", "<b>evil</b>")[i % 3]
        at = SINCE + i * 1400.0
        if i % 4 == 0:
            rows.append(late(tenant=tenant, submitted_at=at))
        else:
            rows.append(make_row(tenant=tenant, submitted_at=at))
    return rows


DAYS = [
    {"start": UNTIL - (7 - d) * 86400.0, "end": UNTIL - (6 - d) * 86400.0, "requests": 50,
     "finished": 48 if d != 3 else 0, "failed": 2 if d != 3 else 0, "cancelled": 0,
     "pending": 0, "slo_met": 40 + d if d != 3 else 0}
    for d in range(7)
]  # fmt: skip


def test_the_html_page_has_a_chart_per_figure_plotting_its_data_and_nothing_else() -> None:
    report = build(many_rows(), since=SINCE, until=UNTIL, target=0.9, days=DAYS)
    html = page(report)
    assert html == page(build(many_rows(), since=SINCE, until=UNTIL, target=0.9, days=DAYS))
    charts = dict(re.findall(r'<svg class="chart" data-chart="(\w+)" data-marks="(\d+)"', html))
    assert set(charts) == {"days", "window", "latency", "causes", "tenants"}
    svgs = re.findall(r'<svg class="chart".*?</svg>', html, flags=re.S)
    for svg in svgs:  # each says how many marks it draws, and draws them
        assert int(re.search(r'data-marks="(\d+)"', svg)[1]) == svg.count('class="mark"')  # type: ignore[index]
    assert charts["days"] == "6"  # one point per day with judged requests (day 3 had none)
    judged_buckets = sum(b.judged > 0 for b in report.over_window)
    assert charts["window"] == str(judged_buckets) and judged_buckets > 0
    assert charts["latency"] == "9"  # p50, p90, p99 of three latencies
    assert charts["causes"] == "1"  # only "slow on its instance"
    assert charts["tenants"] == "3"
    assert 'class="target"' in html and 'class="trend"' in html
    assert "<b>evil</b>" not in html and "&lt;b&gt;evil&lt;/b&gt;" in html
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "<script" not in html


def test_the_latency_chart_has_a_row_per_tier_when_there_are_several() -> None:
    fast = make_row(tier="interactive", submitted_at=SINCE + 10.0, finished_at=SINCE + 12.0)
    rows = [*many_rows(), fast]
    html = page(build(rows, since=SINCE, until=UNTIL, target=0.9))
    [svg] = re.findall(r'<svg class="chart" data-chart="latency".*?</svg>', html, flags=re.S)
    assert 'data-marks="27"' in svg  # 3 percentiles x 3 latencies x (all, interactive, standard)
    assert "Latency percentiles by tier" in svg
    assert "time to first token, interactive p50: 1.50 s (1 request)" in svg
    labels = re.findall(r'<text [^>]*text-anchor="end"[^>]*>([^<]+)</text>', svg)
    assert labels == ["time to first token", "interactive", "standard", "end to end",
                      "interactive", "standard", "queue wait", "interactive", "standard"]  # fmt: skip


def test_an_empty_report_says_there_is_nothing_to_plot() -> None:
    html = page(build([], since=SINCE, until=UNTIL, target=0.9))
    assert 'data-chart="days"' not in html  # no days asked for
    assert html.count('class="mark"') == 0 and "nothing to plot" in html


def test_markdown_and_json_carry_the_same_figures() -> None:
    report = build(many_rows(), since=SINCE, until=UNTIL, target=0.95, days=DAYS, tenant="acme")
    text = markdown(report)
    met, judged = report.overall.met, report.overall.judged
    assert f"{100 * met / judged:.1f} % ({met} of {judged})" in text
    for heading in ("## By tier", "## By SLO class", "## By tenant", "## By model",
                    "## Latency percentiles", "## Why requests missed their SLO",
                    "## Worst-served tenants", "## Attainment by day"):  # fmt: skip
        assert heading in text
    assert (
        "\\<b>evil\\</b>" not in text and "<b>evil</b>" in text
    )  # pipes are what Markdown escapes
    doc = json.loads(json.dumps(report.as_dict()))
    assert doc["overall"]["slo_met"] == met and doc["overall"]["judged"] == judged
    assert doc["target"] == 0.95 and doc["tenant"] == "acme"
    assert [d["slo_met"] for d in doc["days"]] == [d["slo_met"] for d in DAYS]
    assert doc["miss_causes"]["slow on its instance"] == report.overall.missed
    assert doc["trend_per_day"] == pytest.approx(report.trend.slope_per_day)  # type: ignore[union-attr]
