"""``qlm ops`` tables from the API's answers (pure formatting, no server): requests past their
deadline read "missed", apart from "at risk"; every number carries its unit; a group lists its
tenants and its requests; ``--json`` and the key are taken where an operator puts them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from rich.console import Console, RenderableType
from typer.testing import CliRunner

from qlm.cli import app, ops


def text(views: RenderableType | list[RenderableType]) -> str:
    console = Console(width=200, record=True)
    for view in views if isinstance(views, list) else [views]:
        console.print(view)
    return console.export_text()


def grp(**kw: Any) -> dict[str, Any]:
    g: dict[str, Any] = {
        "id": "g1",
        "model": "m",
        "tier": "standard",
        "size": 4,
        "earliest_deadline_at": 90.0,
        "predicted_completion_at": 130.0,
        "p_meet_slo": 0.25,
        "at_risk": True,
        "missed": 0,
        "instance": "i0",
        "position": 0,
    }
    return g | kw


def test_requests_past_their_deadline_are_missed_not_at_risk() -> None:
    assert ops.risk(grp()) == "at risk"
    assert ops.risk(grp(missed=3, p_meet_slo=0.0)) == "3 missed"
    assert ops.risk(grp(at_risk=False)) == ""
    queue = {
        "instance": "i0",
        "size": 6,
        "at_risk_requests": 6,
        "missed_requests": 3,
        "predicted_drain_at": 160.0,
        "groups": [grp(missed=3, p_meet_slo=0.0), grp(id="g2", size=2, position=1)],
    }
    # g1's 4 requests are at risk, 3 of them already missed: 1 + g2's 2 are at risk, in the
    # two groups at risk; each count says what it counts.
    assert ops.queue_title(queue, 100.0) == (
        "i0: 6 requests in 2 groups; at risk now: 2 groups (0 deferred), 3 requests; "
        "missed: 3 requests; drained in 60 s"
    )
    out = text(ops.queues_view({"controller": "c0", "at": 100.0, "queues": [queue]}))
    assert "3 missed" in out and "10 s ago" in out and "in 30 s" in out and "25 %" in out


def test_queues_mark_deferred_groups_and_say_how_their_count_differs_from_a_plans() -> None:
    """Under overload a plan counts few groups at risk (the planned ones) while the queues
    count many requests at risk (every group, the deferred ones too): two notions, and each
    view says which it shows, so that an operator does not read them as disagreeing."""
    assert ops.risk(grp(deferred=True)) == "at risk, deferred"
    assert ops.risk(grp(missed=2, deferred=True)) == "2 missed, deferred"
    assert ops.risk(grp(at_risk=False, deferred=True)) == "deferred"
    queue = {
        "instance": "i0",
        "size": 10,
        "at_risk_requests": 10,
        "missed_requests": 0,
        "predicted_drain_at": 160.0,
        "groups": [grp(size=6, deferred=True), grp(id="g2", position=1, deferred=False)],
    }
    assert "at risk now: 2 groups (1 deferred), 10 requests;" in ops.queue_title(queue, 100.0)
    out = " ".join(
        text(ops.queues_view({"controller": "c0", "at": 100.0, "queues": [queue]})).split()
    )
    assert "at risk, deferred" in out
    assert "every group in the queue counts, deferred and not yet planned ones too" in out
    assert "qlm ops plans counts groups instead" in out


def test_plans_show_the_violation_in_seconds_and_say_what_deferred_means() -> None:
    plan = {
        "id": 7, "at": 90.0, "controller": "c0", "trigger": "violation", "groups": 12,
        "method": "local", "status": "feasible", "objective": 40412.3456,
        "edf_objective": 52000.0, "solve_s": 0.0421, "at_risk": ["g1", "g2"], "deferred": 3,
    }  # fmt: skip
    out = text(ops.plans_view({"data": [plan]}, now=100.0))
    assert "violation (s)" in out and "40,412.3" in out and "4.04e+04" not in out
    assert "10 s" in out and "42 ms" in out
    assert "deferred (groups)" in out and "groups cost-aware admission" in out


def test_plans_say_their_at_risk_counts_planned_groups_not_the_queues_requests() -> None:
    plan = {
        "id": 7, "at": 90.0, "controller": "c0", "trigger": "violation", "groups": 12,
        "method": "edf", "status": "fallback", "objective": 1.0, "edf_objective": 1.0,
        "solve_s": 0.001, "at_risk": [], "deferred": 40,
    }  # fmt: skip
    out = " ".join(text(ops.plans_view({"data": [plan]}, now=100.0)).split())
    assert "groups (planned)" in out and "at risk (planned groups)" in out
    assert "at risk (groups)" not in out
    assert "not counted at risk whatever their chance" in out
    assert "qlm ops queues counts at risk otherwise: requests, now" in out


def test_controllers_show_a_controller_taking_the_lead_as_starting_not_standby() -> None:
    doc = {
        "data": [
            {"name": "c0", "role": "starting", "active": False, "age_s": 0.2},
            {"name": "c1", "role": "standby", "active": False, "age_s": 0.4},
            {"name": "c2", "role": "stopped", "active": False, "age_s": 9.0, "stopped_at": 1.0},
        ]
    }
    out = text(ops.controllers_view(doc))
    assert "c0   │ starting (taking the lead)" in out
    assert "c1   │ standby" in out and "c2   │ stopped" in out
    assert "starting: taking the global queue's leader lock" in out
    # an API that says only whether it is active
    assert ops.controller_role({"active": True}) == "active"
    assert ops.controller_role({"active": False, "stopped_at": 5.0}) == "stopped"
    assert ops.controller_role({"active": False}) == "standby"
    # a killed leader's last state said active: the API says it went silent
    assert ops.controller_role({"role": "active", "active": True, "silent": True}) == (
        "active, silent"
    )
    assert text(ops.controllers_view({"data": []})).startswith("no controller has published")


def test_a_group_lists_its_tenants_deadlines_and_requests_and_says_when_only_some_are_listed() -> (
    None
):
    def req(i: int, tenant: str, deadline: float, missed: bool) -> dict[str, Any]:
        return {
            "id": f"req_{i}", "tenant": tenant, "status": "queued", "submitted_at": 10.0 * i,
            "deadline_at": deadline, "dispatched_at": None, "predicted_completion_at": None,
            "at_risk": True, "missed": missed, "tokens": 0,
        }  # fmt: skip

    doc = {
        "controller": "c0",
        "at": 100.0,
        "group": grp(size=32, tenants={"acme": 30, "globex": 2}, latest_deadline_at=400.0),
        "requests": [req(0, "acme", 90.0, True), req(1, "globex", 150.0, False)],
        "listed": 2,
    }
    out = text(ops.group_view(doc))
    assert "32 of 2 tenants" in out and "10 s ago (earliest), in 300 s (latest)" in out
    assert "acme" in out and "30" in out and "globex" in out
    assert "req_0" in out and "missed" in out and "100.0" in out  # waited 100 s
    assert "the first 2 of 32" in out
    doc |= {"listed": 32}
    assert "the first" not in text(ops.group_view(doc))


def test_running_requests_show_how_long_they_ran_and_their_tokens() -> None:
    doc = {
        "controller": "c0",
        "at": 100.0,
        "data": [
            {"instance": "i0", "max_running": 8, "requests": [{
                "id": "req_a", "tenant": "acme", "status": "running", "submitted_at": 10.0,
                "dispatched_at": 40.0, "deadline_at": 130.0, "predicted_completion_at": 120.0,
                "at_risk": False, "missed": False, "tokens": 1234,
            }]},
            {"instance": "i1", "max_running": 8, "requests": []},
        ],
    }  # fmt: skip
    out = text(ops.running_view(doc))
    assert "i0: 1 request running of 8" in out and "i1: 0 requests running of 8" in out
    assert "60.0" in out and "in 30 s" in out and "in 20 s" in out and "1,234" in out


def test_a_waiting_request_predicted_past_its_deadline_says_so() -> None:
    doc = {
        "id": "req_a", "status": "queued", "tenant": "acme", "model": "m", "tier": "batch",
        "slo_seconds": 60.0, "ttft_slo_seconds": None, "submitted_at": 1000.0,
        "deadline_at": 1060.0, "predicted_completion_at": 1090.0, "at_risk": True,
        "evictions": 0, "swaps": 0, "attempts": 0, "slo_met": None,
    }  # fmt: skip
    out = text(ops.request_view(doc))
    assert "+60.00 s" in out and "+90.00 s (past its deadline)" in out
    assert "missed" not in out and "NO" not in out  # (its deadline is still ahead)


def test_a_waiting_request_past_its_deadline_is_missed_not_only_at_risk() -> None:
    doc = {
        "id": "req_a", "status": "queued", "tenant": "acme", "model": "m", "tier": "batch",
        "slo_seconds": 60.0, "ttft_slo_seconds": None, "submitted_at": 1000.0,
        "deadline_at": 1060.0, "predicted_completion_at": 1200.0, "at_risk": True,
        "missed": True, "evictions": 0, "swaps": 0, "attempts": 0, "slo_met": None,
    }  # fmt: skip
    out = text(ops.request_view(doc))
    assert "queued, missed: its deadline passed" in out
    assert "NO (its deadline passed)" in out


@pytest.mark.parametrize(
    "args",
    [["ops", "--json", "queues"], ["ops", "queues", "--json"]],
)
def test_json_is_taken_before_or_after_the_command_and_the_key_from_qlm_key(
    args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[ops.Target, str]] = []

    def call(target: ops.Target, method: str, path: str, params: Any = None) -> Any:
        seen.append((target, path))
        return {"controller": "c0", "at": 1.0, "policy": "qlm", "queues": []}

    monkeypatch.setattr(ops, "_call", call)
    result = CliRunner().invoke(app, args, env={"QLM_KEY": "k1", "QLM_API_KEY": ""})
    assert result.exit_code == 0, result.output
    [(target, path)] = seen
    assert (target.raw, target.key, path) == (True, "k1", "/v1/admin/queues")
    assert result.stdout.lstrip().startswith("{") and '"policy": "qlm"' in result.stdout


def test_the_older_key_variable_still_works_and_watch_draws_count_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys: list[str | None] = []

    def call(target: ops.Target, method: str, path: str, params: Any = None) -> Any:
        keys.append(target.key)
        return {"controller": "c0", "at": 1.0, "policy": "qlm", "queues": []}

    monkeypatch.setattr(ops, "_call", call)
    monkeypatch.setattr(ops.time, "sleep", lambda s: None)
    args = ["ops", "queues", "--watch", "--count", "3", "--interval", "0.5"]
    result = CliRunner().invoke(app, args, env={"QLM_KEY": "", "QLM_API_KEY": "old"})
    assert result.exit_code == 0, result.output
    assert keys == ["old"] * 3 and result.stdout.count("every 0.5 s (Ctrl-C to stop)") == 3


@pytest.mark.parametrize(
    ("command", "path", "doc"),
    [
        (["groups", "--at-risk"], "/v1/admin/groups", {"at": 1.0, "controller": "c0", "data": []}),
        (
            ["running", "--instance", "i0"],
            "/v1/admin/running",
            {"at": 1.0, "controller": "c0", "data": [
                {"instance": "i0", "max_running": 4, "requests": []}]},
        ),
    ],
)  # fmt: skip
def test_groups_and_running_redraw_too(
    command: list[str], path: str, doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, Any]] = []

    def call(target: ops.Target, method: str, path: str, params: Any = None) -> Any:
        calls.append((path, params))
        return doc

    monkeypatch.setattr(ops, "_call", call)
    monkeypatch.setattr(ops.time, "sleep", lambda s: None)
    args = ["ops", *command, "--watch", "--count", "2", "--interval", "0.5"]
    result = CliRunner().invoke(app, args, env={"QLM_KEY": "k", "QLM_API_KEY": ""})
    assert result.exit_code == 0, result.output
    assert [p for p, _ in calls] == [path, path] and calls[0][1]  # (its filter, each time)
    assert result.stdout.count("every 0.5 s (Ctrl-C to stop)") == 2
    lines = CliRunner().invoke(app, [*args, "--json"], env={"QLM_KEY": "k", "QLM_API_KEY": ""})
    assert [json.loads(line) for line in lines.stdout.splitlines()] == [doc, doc]
