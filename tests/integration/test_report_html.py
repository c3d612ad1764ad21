"""The HTML SLO report in a real browser: ``qlm ops report --format html`` against a running
QLM, and a report with every kind of figure, each loaded from its file in headless Chromium
(Debian's ``chromium``, which ``scripts/debian-packages`` installs; the test skips without it and
fails under CI=true). A script the test adds measures, after layout, every chart and every mark
(point or bar) it draws: each chart is laid out with a size, and each mark with a size inside
its chart's frame. Nothing is fetched: the page has no network to use."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from services import in_ci

from qlm.reports import build, page
from tests.integration.test_ops_cli import ops, run
from tests.unit.reports.test_report import DAYS, SINCE, UNTIL, late, make_row, many_rows

MEASURE = """<script>
const charts = [...document.querySelectorAll("svg.chart")].map((svg) => {
  const box = svg.getBoundingClientRect();
  const inside = (b) => b.width > 0 && b.height > 0 && b.left >= box.left - 1 &&
    b.right <= box.right + 1 && b.top >= box.top - 1 && b.bottom <= box.bottom + 1;
  const marks = [...svg.querySelectorAll(".mark")];
  const texts = [...svg.querySelectorAll("text")];
  return {chart: svg.dataset.chart, declared: Number(svg.dataset.marks), width: box.width,
          height: box.height, marks: marks.length,
          shown: marks.filter((m) => inside(m.getBoundingClientRect())).length,
          clipped: texts.filter((t) => !inside(t.getBoundingClientRect())).map((t) => t.textContent)};
});
const out = document.createElement("pre");
out.id = "measured";
out.textContent = JSON.stringify(charts);
document.body.appendChild(out);
</script>"""


def chromium() -> str:
    """The path of ``chromium``; skips without it, fails under CI=true."""
    found = shutil.which("chromium")
    if found:
        return found
    message = "chromium not found (Debian package chromium: scripts/debian-packages)"
    if in_ci():
        pytest.fail(f"{message} (CI=true: the HTML report must be rendered)")
    pytest.skip(message)


def rendered_charts(report: Path, work: Path) -> list[dict[str, Any]]:
    """What Chromium laid out of the page's charts (``MEASURE``)."""
    text = report.read_text(encoding="utf-8")
    assert "<script" not in text  # the page itself runs nothing
    measured = work / "measured.html"
    measured.write_text(text.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    done = subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",  # root in a container has no user namespace for the sandbox
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={work / 'profile'}",
            "--window-size=1000,3000",
            "--dump-dom",
            measured.as_uri(),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r'<pre id="measured">(.*?)</pre>', done.stdout, flags=re.S)
    assert found, f"the page never ran its measurement:\n{done.stdout[-2000:]}"
    charts: list[dict[str, Any]] = json.loads(html.unescape(found[1]))
    return charts


def assert_shown(charts: list[dict[str, Any]]) -> None:
    for c in charts:
        assert c["width"] > 100 and c["height"] > 50, c
        assert c["marks"] == c["declared"] and c["shown"] == c["marks"], c
        assert c["clipped"] == [], c  # every label whole inside its chart


def test_the_report_of_a_running_qlm_shows_its_charts_in_a_browser(tmp_path: Path) -> None:
    out = tmp_path / "slo.html"

    async def scenario(url: str, admin: str, tenant: str, ids: list[str]) -> None:
        # The service's clock starts at 0: three whole days of it, the requests in the first.
        r = await ops(url, admin, "report", "--since", "3d", "--until", "259200", "--out", str(out))
        assert r.exit_code == 0, r.output

    run(scenario)
    charts = rendered_charts(out, tmp_path)
    assert_shown(charts)
    by = {c["chart"]: c for c in charts}
    assert set(by) == {"days", "window", "latency", "causes", "tenants"}
    assert by["days"]["shown"] == 1  # the one day with requests
    assert by["window"]["shown"] >= 1 and by["tenants"]["shown"] == 1
    # p50, p90, p99 of three latencies, for all tiers, interactive and batch
    assert by["latency"]["shown"] == 27


def test_every_kind_of_chart_plots_its_points_in_a_browser(tmp_path: Path) -> None:
    report = build(many_rows(), since=SINCE, until=UNTIL, target=0.9, days=DAYS)
    out = tmp_path / "slo.html"
    out.write_text(page(report), encoding="utf-8")
    charts = rendered_charts(out, tmp_path)
    assert_shown(charts)
    assert len(charts) == 5 and all(c["shown"] > 0 for c in charts)
    assert sum(c["shown"] for c in charts) == sum(c["declared"] for c in charts)


def test_long_names_and_large_counts_stay_inside_their_charts(tmp_path: Path) -> None:
    """Labels as wide as they get: a tenant with a long name, shares of thousands of requests
    at 100 %, at the target and on either side of it."""
    long_name = "a-tenant-with-a-rather-long-name-for-its-own-team-x"
    rows = [make_row(tenant=long_name, submitted_at=SINCE + i * 40.0) for i in range(1500)]
    rows += [late(tenant="acme", submitted_at=SINCE + 50 + i * 40.0) for i in range(1200)]
    report = build(rows, since=SINCE, until=UNTIL, target=0.9, days=DAYS)
    out = tmp_path / "slo.html"
    out.write_text(page(report), encoding="utf-8")
    charts = rendered_charts(out, tmp_path)
    assert_shown(charts)
    assert {c["chart"] for c in charts} == {"days", "window", "latency", "causes", "tenants"}
