"""The HTML report's charts as inline SVG, written by hand: no plotting library, no script, no
network. The same report gives the same bytes.

Every chart is one ``<svg class="chart" data-chart=NAME data-marks=N>``; each plotted value is
an element of class ``mark`` (a point or a bar) with a ``<title>`` that says it, so a reader
hovering it, a screen reader, and a test counting them see the same data. A chart with nothing
to plot says so in its frame and has no marks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from qlm.reports.report import (
    CAUSES,
    LATENCIES,
    PERCENTILES,
    Bucket,
    Percentiles,
    SloReport,
    Tally,
    day_label,
    pct,
    seconds,
    share,
    time_label,
)

WIDTH = 720
HEIGHT = 260
LEFT, RIGHT, TOP, BOTTOM = 56, 24, 20, 44
MET, MISSED, TARGET, TREND, AXIS, GRID, INK = (
    "#2e7d32", "#e65100", "#c62828", "#1565c0", "#555", "#ddd", "#222",
)  # fmt: skip
PERCENTILE_COLOURS = ("#1565c0", "#ef6c00", "#6a1b9a")


def _f(x: float) -> str:
    return f"{x:.1f}"


def _text(x: float, y: float, text: str, *, anchor: str = "middle", size: int = 11, fill: str = AXIS, halo: bool = False) -> str:  # fmt: skip
    """A label; with ``halo``, outlined in white so that it reads over the bars and lines it
    is drawn on."""
    outline = ' stroke="#fff" stroke-width="3" paint-order="stroke"' if halo else ""
    return (
        f'<text x="{_f(x)}" y="{_f(y)}" text-anchor="{anchor}" font-size="{size}" '
        f'fill="{fill}"{outline}>{escape(text)}</text>'
    )


def _line(x1: float, y1: float, x2: float, y2: float, stroke: str, *, dash: str = "", width: float = 1.0, cls: str = "") -> str:  # fmt: skip
    extra = (f' stroke-dasharray="{dash}"' if dash else "") + (f' class="{cls}"' if cls else "")
    return (
        f'<line x1="{_f(x1)}" y1="{_f(y1)}" x2="{_f(x2)}" y2="{_f(y2)}" stroke="{stroke}" '
        f'stroke-width="{width}"{extra}/>'
    )


def _svg(name: str, title: str, body: list[str], marks: int, height: int = HEIGHT) -> str:
    if marks == 0:
        body = [*body, _text(WIDTH / 2, height / 2, "nothing to plot", size=13)]
    return (
        f'<svg class="chart" data-chart="{name}" data-marks="{marks}" '
        f'xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(title)}">'
        f"<title>{escape(title)}</title>"
        f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#fff"/>'
        + "".join(body)
        + "</svg>"
    )


class _Scale:
    """Attainment (0..1) to a y coordinate, over a range that shows the values and the target
    (from a multiple of 10 % below them to 100 %)."""

    def __init__(self, values: Sequence[float], target: float, height: int = HEIGHT) -> None:
        low = min([*values, target])
        self.lo = max(0.0, math.floor(low * 10 - 0.5) / 10)
        self.top, self.bottom = TOP, height - BOTTOM

    def y(self, attainment: float) -> float:
        frac = (attainment - self.lo) / (1.0 - self.lo)
        return self.bottom - frac * (self.bottom - self.top)

    def axis(self) -> list[str]:
        out = []
        steps = round((1.0 - self.lo) * 10)
        every = 1 if steps <= 5 else 2
        for i in range(0, steps + 1, every):
            v = self.lo + i / 10
            y = self.y(v)
            out.append(_line(LEFT, y, WIDTH - RIGHT, y, GRID))
            out.append(_text(LEFT - 6, y + 4, f"{100 * v:.0f} %", anchor="end"))
        return out


def _target(scale: _Scale, target: float) -> list[str]:
    y = scale.y(target)
    return [
        _line(LEFT, y, WIDTH - RIGHT, y, TARGET, dash="6 4", width=1.5, cls="target"),
        _text(WIDTH - RIGHT, y - 4, f"target {pct(target)}", anchor="end", fill=TARGET, halo=True),
    ]


def _x_labels(starts: Sequence[str], xs: Sequence[float], height: int = HEIGHT) -> list[str]:
    """At most about a dozen labels, counted back from the latest (always labelled)."""
    every = max(1, math.ceil(len(starts) / 12))
    last = len(starts) - 1
    return [
        _text(x, height - BOTTOM + 16, label)
        for i, (label, x) in enumerate(zip(starts, xs, strict=True))
        if (last - i) % every == 0
    ]


def _bucket_title(label: str, b: Bucket) -> str:
    return f"{label}: SLO met {share(b.met, b.judged)}, {b.requests:,} requests"


def attainment_by_day(report: SloReport) -> str:
    """SLO attainment of each day before the report's end, from the store: a point per day
    with judged requests, joined where days follow each other, the target and the trend."""
    title = "SLO attainment by day"
    days = report.days
    values = [b.attainment for b in days if b.attainment is not None]
    scale = _Scale(values, report.target)
    n = len(days)
    span = WIDTH - LEFT - RIGHT
    xs = [LEFT + span * (i + 0.5) / max(n, 1) for i in range(n)]
    body = [*scale.axis(), *_target(scale, report.target)]
    body += _x_labels([day_label(b.start, b.end)[5:] for b in days], xs)
    run: list[str] = []
    segments: list[list[str]] = []
    marks = []
    for x, b in zip(xs, days, strict=True):
        if b.attainment is None:
            if run:
                segments.append(run)
            run = []
            continue
        y = scale.y(b.attainment)
        run.append(f"{_f(x)},{_f(y)}")
        colour = MET if b.attainment >= report.target else MISSED
        marks.append(
            f'<circle class="mark" cx="{_f(x)}" cy="{_f(y)}" r="4" fill="{colour}">'
            f"<title>{escape(_bucket_title(day_label(b.start, b.end), b))}</title></circle>"
        )
    if run:
        segments.append(run)
    body += [
        f'<polyline points="{" ".join(seg)}" fill="none" stroke="{INK}" stroke-width="1.5"/>'
        for seg in segments
        if len(seg) > 1
    ]
    trend = report.trend
    if trend is not None:
        index = {b.start: i for i, b in enumerate(days)}
        (x0, y0), (x1, y1) = trend.first, trend.last
        body.append(
            _line(
                xs[index[x0]],
                scale.y(min(1.0, max(scale.lo, y0))),
                xs[index[x1]],
                scale.y(min(1.0, max(scale.lo, y1))),
                TREND,
                dash="2 3",
                width=1.5,
                cls="trend",
            )
        )
        points = 100 * trend.slope_per_day
        body.append(_text(LEFT + 4, TOP + 12, f"trend {points:+.2f} points a day", anchor="start", fill=TREND, halo=True))  # fmt: skip
    return _svg("days", title, body + marks, len(marks))


def attainment_over_window(report: SloReport) -> str:
    """SLO attainment of the requests submitted in each bucket of the report's window: a bar
    per bucket with judged requests, green at or above the target."""
    title = "SLO attainment over the window"
    buckets = report.over_window
    values = [b.attainment for b in buckets if b.attainment is not None]
    scale = _Scale(values, report.target)
    n = len(buckets)
    span = WIDTH - LEFT - RIGHT
    slot = span / max(n, 1)
    xs = [LEFT + slot * (i + 0.5) for i in range(n)]
    body = [*scale.axis()]
    body += _x_labels([time_label(b.start, report.window_step) for b in buckets], xs)
    marks = []
    for x, b in zip(xs, buckets, strict=True):
        if b.attainment is None:
            continue
        y = scale.y(b.attainment)
        colour = MET if b.attainment >= report.target else MISSED
        w = max(1.0, slot * 0.7)
        label = time_label(b.start, report.window_step)
        marks.append(
            f'<rect class="mark" x="{_f(x - w / 2)}" y="{_f(y)}" width="{_f(w)}" '
            f'height="{_f(max(1.0, scale.bottom - y))}" fill="{colour}">'
            f"<title>{escape(_bucket_title(label, b))}</title></rect>"
        )
    return _svg("window", title, body + marks + _target(scale, report.target), len(marks))


CHAR_W = 6.6
"""The widest a character of the charts' 11 px labels is drawn, on average over a label (digits
and lower case in a sans-serif): what a label is given room for."""


def _shortened(label: str, room: float) -> str:
    """``label``, cut with an ellipsis to what ``room`` pixels hold."""
    most = max(4, int(room / CHAR_W))
    return label if len(label) <= most else label[: most - 1] + "…"


def _hbars(name: str, title: str, rows: Sequence[tuple[str, float, str, str]], *, limit: float, target: float | None = None) -> str:  # fmt: skip
    """Horizontal bars: (label, value in [0, limit], the value as text, colour). A label is
    cut to its room (the bar's title says it whole); the bars leave room on their right for
    the widest value."""
    row_h, label_w = 26, 150
    height = TOP + BOTTOM // 2 + row_h * max(1, len(rows))
    x0 = LEFT + label_w
    widest = max((len(text) for _, _, text, _ in rows), default=0)
    span = WIDTH - x0 - RIGHT - max(90.0, 12 + CHAR_W * widest)
    body, marks = [], []
    for i, (label, value, text, colour) in enumerate(rows):
        y = TOP + i * row_h
        body.append(_text(x0 - 8, y + 16, _shortened(label, x0 - 12), anchor="end", fill=INK))
        w = span * (value / limit) if limit > 0 else 0.0
        if value > 0:
            marks.append(
                f'<rect class="mark" x="{_f(x0)}" y="{_f(y + 4)}" width="{_f(max(1.0, w))}" '
                f'height="{row_h - 8}" fill="{colour}"><title>{escape(f"{label}: {text}")}</title></rect>'
            )
        body.append(_text(x0 + max(w, 0.0) + 6, y + 16, text, anchor="start", fill=INK))
    if target is not None and limit > 0:
        x = x0 + span * target / limit
        body.append(_line(x, TOP - 4, x, height - BOTTOM // 2 + 4, TARGET, dash="6 4", width=1.5, cls="target"))  # fmt: skip
    body.append(_line(x0, TOP - 4, x0, height - BOTTOM // 2 + 4, AXIS))
    return _svg(name, title, body + marks, len(marks), height)


def miss_causes(report: SloReport) -> str:
    """How many missed requests each cause accounts for."""
    total = sum(report.causes.values())
    rows = [(c, float(n), share(n, total), MISSED) for c, n in report.causes.items() if c in CAUSES]
    return _hbars("causes", "Why requests missed their SLO", rows, limit=float(max([1, *report.causes.values()])))  # fmt: skip


MAX_TENANTS = 12


def attainment_by_tenant(report: SloReport) -> str:
    """The tenants served worst (lowest attainment first, at most ``MAX_TENANTS``), against
    the target."""
    judged: list[tuple[str, Tally]] = [(n, t) for n, t in report.by["tenant"] if t.judged]
    judged.sort(key=lambda nt: (nt[1].attainment or 0.0, -nt[1].missed, nt[0]))
    rows = [
        (
            name,
            t.attainment or 0.0,
            share(t.met, t.judged),
            MET if (t.attainment or 0.0) >= report.target else MISSED,
        )
        for name, t in judged[:MAX_TENANTS]
    ]
    title = "SLO attainment by tenant, worst first"
    return _hbars("tenants", title, rows, limit=1.0, target=report.target)


def _requests(n: int) -> str:
    return f"{n:,} request" + ("" if n == 1 else "s")


def latency_percentiles(report: SloReport) -> str:
    """p50, p90 and p99 of each latency on one logarithmic axis of seconds: a row for all
    tiers together and, when the requests were of more than one tier, a row per tier under it;
    a point per percentile."""
    rows: list[tuple[str, str, Percentiles, bool]] = []  # (kind, label, percentiles, all tiers)
    for kind, groups in report.latency.items():
        rows.append((kind, LATENCIES[kind], dict(groups)["all"], True))
        tiers = [(name, p) for name, p in groups if name != "all"]
        if len(tiers) > 1:
            rows += [(kind, name, p, False) for name, p in tiers]
    several = any(not whole for *_, whole in rows)
    title = "Latency percentiles" + (" by tier" if several else "") + ", seconds, log scale"
    values = [v for *_, p, _ in rows for v in p.values if v > 0]
    row_h = 30 if several else 44
    label_w = 130
    gap = 10 if several else 0  # between one latency's rows and the next's
    height = TOP + BOTTOM + row_h * len(rows) + gap * (len(report.latency) - 1)
    x0, x1 = LEFT + label_w, WIDTH - RIGHT - 10
    body, marks = [], []
    if values:
        lo = math.floor(math.log10(min(values)))
        hi = max(lo + 1, math.ceil(math.log10(max(values))))

        def x(v: float) -> float:
            v = max(v, 10.0**lo)
            return x0 + (x1 - x0) * (math.log10(v) - lo) / (hi - lo)

        for e in range(lo, hi + 1):
            gx = x(10.0**e)
            body.append(_line(gx, TOP - 4, gx, height - BOTTOM + 4, GRID))
            body.append(_text(gx, height - BOTTOM + 18, f"{10.0**e:,g} s"))
        y = float(TOP)
        for i, (kind, label, p, whole) in enumerate(rows):
            if whole and i > 0:
                y += gap
            mid = y + row_h / 2
            y += row_h
            shown = _shortened(label, x0 - 12 - LEFT / 2)
            body.append(
                _text(x0 - 10, mid + 4, shown, anchor="end", fill=INK if whole else AXIS,
                      size=11 if whole else 10)
            )  # fmt: skip
            if not p.values:
                continue
            body.append(_line(x(p.values[0]), mid, x(p.values[-1]), mid, AXIS, width=2 if whole else 1))  # fmt: skip
            who = LATENCIES[kind] + ("" if whole else f", {label}")
            for pc, v, colour in zip(PERCENTILES, p.values, PERCENTILE_COLOURS, strict=True):
                marks.append(
                    f'<circle class="mark" cx="{_f(x(v))}" cy="{_f(mid)}" r="{5 if whole else 4}" fill="{colour}">'
                    f"<title>{escape(f'{who} p{pc}: {seconds(v)} ({_requests(p.count)})')}</title></circle>"
                )  # fmt: skip
        legend_x = x0
        for pc, colour in zip(PERCENTILES, PERCENTILE_COLOURS, strict=True):
            body.append(f'<circle cx="{_f(legend_x)}" cy="{height - 12}" r="5" fill="{colour}"/>')
            body.append(_text(legend_x + 9, height - 8, f"p{pc}", anchor="start", fill=INK))
            legend_x += 60
    return _svg("latency", title, body + marks, len(marks), height)


def all_charts(report: SloReport) -> list[tuple[str, str]]:
    """Every chart of the report, with the heading it goes under, in page order."""
    out = []
    if report.days:
        out.append(("Attainment by day", attainment_by_day(report)))
    out += [
        ("Attainment over the window", attainment_over_window(report)),
        ("Latency", latency_percentiles(report)),
        ("Why requests missed", miss_causes(report)),
        ("Tenants", attainment_by_tenant(report)),
    ]
    return out
