"""``deploy/prometheus/alerts.yml``: alert rules over QLM's ``/metrics``. They may use only what
QLM exports (names and labels, from a real scrape: ``promql``), each says how urgent it is and
what to do, docs/operations.md lists each, and promtool checks them and runs their unit tests
(``alerts.test.yml``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.deploy.promql import (
    DEPLOY,
    exported,
    label_names,
    run_promtool,
    scrape,
    unknown_uses,
)

RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts.test.yml"
OPERATIONS = Path(__file__).resolve().parents[3] / "docs" / "operations.md"


@pytest.fixture(scope="module")
def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules: list[dict[str, Any]] = [rule for group in groups for rule in group["rules"]]
    return rules


def test_the_alerts_query_only_what_qlm_exports(alerts: list[dict[str, Any]]) -> None:
    assert unknown_uses([a["expr"] for a in alerts], exported(scrape())) == []


def test_the_alerts_cover_attainment_risk_instances_controllers_broker_and_store(
    alerts: list[dict[str, Any]],
) -> None:
    uses = {a["alert"]: a["expr"] for a in alerts}
    for metric in (
        "qlm_slo_attainment",
        "qlm_queue_at_risk_requests",
        "qlm_instance_up",
        "qlm_controller_state_age_seconds",
        "qlm_broker_up",
        "qlm_store_up",
    ):
        assert any(metric in expr for expr in uses.values()), metric


def test_each_alert_waits_says_how_urgent_and_what_to_do(alerts: list[dict[str, Any]]) -> None:
    names = [a["alert"] for a in alerts]
    assert len(set(names)) == len(names)
    for alert in alerts:
        name = alert["alert"]
        assert re.fullmatch(r"\d+[smh]", alert["for"]), name
        assert alert["labels"]["severity"] in ("warning", "critical"), name
        annotations = alert["annotations"]
        assert set(annotations) == {"summary", "description"}, name
        assert "docs/operations.md" in annotations["description"], name


def test_the_annotations_name_only_labels_their_alert_keeps(
    alerts: list[dict[str, Any]],
) -> None:
    """``{{ $labels.X }}`` renders empty when the expression aggregated X away."""
    for alert in alerts:
        text = " ".join(alert["annotations"].values())
        used = set(re.findall(r"\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)", text))
        assert used <= label_names(alert["expr"]), alert["alert"]


def test_operations_lists_every_alert(alerts: list[dict[str, Any]]) -> None:
    docs = OPERATIONS.read_text()
    assert [a["alert"] for a in alerts if f"`{a['alert']}`" not in docs] == []


def test_promtool_checks_the_rules() -> None:
    run_promtool("check", "rules", RULES)


def test_promtool_runs_the_rules_unit_tests() -> None:
    run_promtool("test", "rules", RULE_TESTS)


def test_every_alert_has_a_unit_test_where_it_fires_and_one_where_it_does_not(
    alerts: list[dict[str, Any]],
) -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {a["alert"] for a in alerts}
    assert sorted(names - fires) == [] and sorted(names - quiet) == []
