"""The SLO report as Markdown: a summary line, then each of its tables (``tables``)."""

from __future__ import annotations

import time

from qlm.reports.report import SloReport, pct, share, tables, trend_text


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(report: SloReport) -> str:
    """The whole document."""
    fmt = "%Y-%m-%d %H:%M"
    o = report.overall
    window = (
        f"{time.strftime(fmt, time.localtime(report.since))} – "
        f"{time.strftime(fmt, time.localtime(report.until))}"
    )
    summary = (
        f"Requests submitted {window}"
        + (f", tenant {report.tenant}" if report.tenant else "")
        + f": SLO met {share(o.met, o.judged)} against a target of {pct(report.target)}"
        + ("" if report.trend is None else f"; trend {trend_text(report.trend)}")
        + "."
    )
    lines = [f"# {report.title}", "", summary, ""]
    for t in tables(report):
        lines += [f"## {t.title}", ""]
        lines += ["| " + " | ".join(map(_cell, t.columns)) + " |", "|" + "---|" * len(t.columns)]
        lines += ["| " + " | ".join(map(_cell, row)) + " |" for row in t.rows]
        if not t.rows:
            lines.append("| none |" + " |" * (len(t.columns) - 1))
        if t.note:
            lines += ["", t.note]
        lines.append("")
    return "\n".join(lines)
