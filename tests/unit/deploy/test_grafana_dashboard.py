"""``deploy/grafana/qlm-dashboard.json``: Grafana's JSON model of a dashboard over QLM's
``/metrics``. Its queries may use only what QLM exports (names and labels, from a real scrape:
``promql``), every exported family has a panel, and, with promtool, every query parses."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.deploy.promql import DEPLOY, exported, run_promtool, scrape, unknown_uses

DASHBOARD = DEPLOY / "grafana" / "qlm-dashboard.json"
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$")
# What Grafana puts in a query before Prometheus sees it, for promtool.
_GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    '"$job"': '".*"',
    '"$tier"': '".*"',
}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    model: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return model


@pytest.fixture(scope="module")
def exports() -> dict[str, frozenset[str]]:
    return exported(scrape())


def panels(model: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in model["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(model: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(model) for t in p.get("targets", [])]


def variable_queries(model: dict[str, Any]) -> list[tuple[str, str]]:
    """``label_values(EXPR, LABEL)`` of the query variables, as (EXPR, LABEL)."""
    out = []
    for variable in model["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        found = _LABEL_VALUES.match(text)
        assert found, f"variable {variable['name']}: {text!r} is not label_values(EXPR, LABEL)"
        out.append((found[1], found[2]))
    return out


def test_the_dashboard_queries_only_what_qlm_exports(
    dashboard: dict[str, Any], exports: dict[str, frozenset[str]]
) -> None:
    exprs = queries(dashboard)
    assert len(exprs) > 30
    variables = variable_queries(dashboard)
    assert {label for _, label in variables} == {"job", "tier"}
    with_labels = [f"sum by ({label}) ({expr})" for expr, label in variables]
    assert unknown_uses([*exprs, *with_labels], exports) == []


def test_every_exported_family_has_a_panel(
    dashboard: dict[str, Any], exports: dict[str, frozenset[str]]
) -> None:
    """A metric added to /metrics needs a panel here (or this test says which)."""
    text = "\n".join(queries(dashboard))
    families = {re.sub(r"_(bucket|sum|count|total)$", "", name) for name in exports}
    assert sorted(f for f in families if f not in text) == []


def test_latency_histograms_are_shown_as_quantiles_per_tier(dashboard: dict[str, Any]) -> None:
    exprs = queries(dashboard)
    for name in (
        "qlm_request_ttft_seconds",
        "qlm_request_e2e_seconds",
        "qlm_request_queue_seconds",
    ):
        quantiles = [e for e in exprs if e.startswith("histogram_quantile(") and name in e]
        assert {e.split(",")[0] for e in quantiles} == {
            "histogram_quantile(0.5",
            "histogram_quantile(0.9",
            "histogram_quantile(0.99",
        }, name
        assert all("sum by (le, tier)" in e for e in quantiles), name


def test_every_query_goes_to_the_chosen_prometheus(dashboard: dict[str, Any]) -> None:
    """One datasource variable, and no panel tied to a datasource of the machine it was made on."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    chosen = {"type": "prometheus", "uid": "${datasource}"}
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == chosen, panel["title"]
        assert all(t["datasource"] == chosen for t in panel["targets"]), panel["title"]
    assert all(variables[n]["datasource"] == chosen for n in ("job", "tier"))


def test_panels_have_distinct_ids_and_do_not_overlap(dashboard: dict[str, Any]) -> None:
    every = list(panels(dashboard))
    assert len({p["id"] for p in every}) == len(every)
    cells: dict[tuple[int, int], str] = {}
    for panel in every:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_every_query_parses(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """promtool parses each query (Grafana's variables replaced as Grafana does) as the
    expression of a recording rule."""
    rules = []
    for i, expr in enumerate(queries(dashboard)):
        for variable, value in _GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        rules.append({"record": f"qlm_dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run_promtool("check", "rules", path)


def test_attainment_panels_mark_the_target_the_alert_fires_below(
    dashboard: dict[str, Any],
) -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    [rule] = [r for g in rules for r in g["rules"] if r["alert"] == "QLMSloAttainmentLow"]
    found = re.search(r"<\s*([0-9.]+)\s*$", rule["expr"])
    assert found, rule["expr"]
    target = float(found[1])
    attainment = [
        p for p in panels(dashboard)
        if any("qlm_slo_attainment" in t["expr"] for t in p.get("targets", []))
    ]  # fmt: skip
    assert {p["type"] for p in attainment} == {"stat", "timeseries"}
    for panel in attainment:
        defaults = panel["fieldConfig"]["defaults"]
        steps = [s["value"] for s in defaults["thresholds"]["steps"]]
        assert target in steps, panel["title"]
        if panel["type"] == "timeseries":  # drawn as a line across the graph
            assert defaults["custom"]["thresholdsStyle"]["mode"] in ("dashed", "line"), panel[
                "title"
            ]
