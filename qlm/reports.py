"""The SLO-attainment report of a set of requests (as ``GET /v1/requests`` lists them): overall
and by tier, tenant and model, as table rows and as Markdown. ``qlm ops report`` prints it; a
nightly job keeps it (docs/operations.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FINAL = ("finished", "failed", "cancelled")
"""Request states that do not change any more."""


@dataclass(slots=True)
class _Tally:
    total: int = 0
    final: int = 0
    failed: int = 0
    cancelled: int = 0
    met: int = 0
    ttft_judged: int = 0
    ttft_met: int = 0

    def add(self, r: Mapping[str, Any]) -> None:
        self.total += 1
        if r["status"] not in FINAL:
            return
        self.final += 1
        self.failed += r["status"] == "failed"
        self.cancelled += r["status"] == "cancelled"
        self.met += bool(r.get("slo_met"))
        if r.get("ttft_met") is not None:
            self.ttft_judged += 1
            self.ttft_met += bool(r["ttft_met"])

    def row(self, name: str) -> list[str]:
        judged = self.final - self.cancelled

        def pct(k: int, n: int) -> str:
            return "-" if n == 0 else f"{100.0 * k / n:.1f} %"

        return [
            name,
            str(self.total),
            str(self.total - self.final),
            str(self.failed),
            str(self.cancelled),
            pct(self.met, judged),
            pct(self.ttft_met, self.ttft_judged),
        ]


REPORT_COLUMNS = ("", "requests", "not final", "failed", "cancelled", "SLO met", "TTFT met")


def slo_report(requests: Sequence[Mapping[str, Any]]) -> dict[str, list[list[str]]]:
    """SLO attainment overall and by tier, tenant and model: a request meets its SLO when it
    finished within every deadline; failed requests count as missed, cancelled ones are left out,
    requests not final yet are counted but not judged."""
    by: dict[str, dict[str, _Tally]] = {k: defaultdict(_Tally) for k in ("tier", "tenant", "model")}
    overall = _Tally()
    for r in requests:
        overall.add(r)
        for k, tallies in by.items():
            tallies[str(r[k])].add(r)
    out = {"all": [overall.row("all")]}
    for k, tallies in by.items():
        out[k] = [tallies[name].row(name) for name in sorted(tallies)]
    return out


def markdown(title: str, sections: Mapping[str, list[list[str]]]) -> str:
    """The report as a Markdown document: a title, then a table per section."""
    lines = [f"# {title}", ""]
    for name, rows in sections.items():
        lines += [f"## {'Overall' if name == 'all' else 'By ' + name}", ""]
        head = [name if name != "all" else "", *REPORT_COLUMNS[1:]]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    return "\n".join(lines)
