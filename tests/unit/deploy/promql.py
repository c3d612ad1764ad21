"""What the files in ``deploy/`` may query, and what their queries use.

The names and labels QLM exports are read from a real scrape: ``/metrics`` of a test app whose
store, controller and counters fill every metric family (``scrape`` checks that none is left
empty, so every family's labels are known). A family becomes the series Prometheus stores —
``_total`` for a counter, ``_bucket``/``_sum``/``_count`` for a histogram — with the labels
Prometheus adds at a scrape: ``job`` and ``instance`` (the API replica), which renames QLM's own
``instance`` label (the serving instance) to ``exported_instance`` (``honor_labels: false``,
Prometheus's default and docs/operations.md's scrape configuration).

The names and labels an expression uses are found by a small lexer, enough for the
expressions written here: strings, label matchers, ranges and grouping clauses are taken out
first, then every identifier that is not a function, a keyword or a number is a metric name.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qlm.domain import RequestStatus
from tests.contract.test_store import plan_record
from tests.services import in_ci
from tests.unit.api.test_api import FakeController, api_harness, busy_snapshot

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
ADDED_AT_SCRAPE = frozenset({"job", "instance"})


def scrape() -> str:
    """``/metrics`` of a test app with every family filled."""
    now = time.time()

    async def main() -> str:
        controller = FakeController(busy_snapshot(now))
        async with api_harness(controller=controller, metrics_public=True) as h:
            rid = (await h.submit(slo_seconds=300, tier="interactive")).json()["id"]
            h.store.record_prediction(rid, predicted_at=now + 1, at_risk=False)
            h.store.mark_dispatched(rid, instance="i0", at=now + 0.1)
            h.store.mark_first_token(rid, at=now + 0.5)
            h.store.record_outcome(rid, status=RequestStatus.FINISHED, at=now + 2, slo_met=True)
            h.store.put_controller_state("c0", active=True, snapshot={})
            h.store.record_plan(plan_record(at_s=now, capacity_needed=1.5), controller="c0")
            r = await h.client.get("/metrics")
            assert r.status_code == 200, r.text
            return r.text

    return asyncio.run(main())


def exported(text: str) -> dict[str, frozenset[str]]:
    """Every series name the scrape ``text`` gives Prometheus, with its label names as stored
    (module docstring). Fails when a family has no sample: its labels would be unknown."""
    out: dict[str, frozenset[str]] = {}
    for family in text_string_to_metric_families(text):
        assert family.samples, f"the test app left {family.name} empty: fill it in scrape()"
        for sample in family.samples:
            labels = {"exported_instance" if k == "instance" else k for k in sample.labels}
            out[sample.name] = out.get(sample.name, frozenset()) | labels | ADDED_AT_SCRAPE
    return out


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)", re.IGNORECASE
)
_OFFSET = re.compile(r"\boffset\s+-?[0-9a-zA-Z]+", re.IGNORECASE)
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$[a-zA-Z_][a-zA-Z0-9_]*")
_IDENTIFIER = re.compile(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "inf", "nan"})


def _lex(expr: str) -> tuple[str, set[str]]:
    """``expr`` without strings, matchers, ranges, grouping clauses and variables, and the
    label names those named."""
    labels: set[str] = set()
    text = _STRING.sub('""', expr)
    for body in _MATCHERS.findall(text):
        labels.update(_MATCHER_LABEL.findall(body))
    text = _MATCHERS.sub(" ", text)
    for body in _GROUPING.findall(text):
        labels.update(name.strip() for name in body.split(",") if name.strip())
    text = _GROUPING.sub(" ", text)
    text = _RANGE.sub(" ", _OFFSET.sub(" ", text))
    return _VARIABLE.sub(" ", text), labels


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects."""
    text, _ = _lex(expr)
    return {
        name
        for name, call in _IDENTIFIER.findall(text)
        if not call and name.lower() not in _KEYWORDS
    }


def label_names(expr: str) -> set[str]:
    """The label names ``expr`` matches on or groups by."""
    return _lex(expr)[1]


def unknown_uses(exprs: Iterable[str], exports: dict[str, frozenset[str]]) -> list[str]:
    """What the expressions use that the scrape does not give: each a line naming it."""
    problems = []
    for expr in exprs:
        names = metric_names(expr)
        if not names:
            problems.append(f"no metric in {expr!r}")
        for name in sorted(names - exports.keys()):
            problems.append(f"{name} (not exported) in {expr!r}")
        known = set().union(*(exports.get(n, frozenset()) for n in names))
        for label in sorted(label_names(expr) - known):
            problems.append(f"label {label} (none of {sorted(names)} has it) in {expr!r}")
    return problems


def promtool() -> str:
    """The path of ``promtool`` (Debian's ``prometheus``, which ``scripts/debian-packages``
    installs); skips without it, fails under CI=true."""
    found = shutil.which("promtool")
    if found:
        return found
    message = "promtool not found (Debian package prometheus: scripts/debian-packages)"
    if in_ci():
        pytest.fail(f"{message} (CI=true: the rule checks must run)")
    pytest.skip(message)


def run_promtool(*args: str | Path) -> None:
    """``promtool ARGS``; fails with its output unless it succeeds."""
    done = subprocess.run(
        [promtool(), *map(str, args)], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, f"promtool {' '.join(map(str, args))}:\n{done.stdout}{done.stderr}"
