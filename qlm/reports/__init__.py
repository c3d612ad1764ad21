"""The nightly SLO report (``qlm ops report``): its figures (``report``), and the same report as
Markdown (``markdown``), a self-contained HTML page (``page``) with inline SVG charts
(``charts``), or JSON (``SloReport.as_dict``)."""

from __future__ import annotations

from qlm.reports.markdown import markdown
from qlm.reports.page import page
from qlm.reports.report import SloReport, Table, build, tables

FORMATS = ("text", "md", "html", "json")
"""What ``qlm ops report --format`` writes: tables for a terminal, Markdown, HTML, JSON."""

__all__ = ["FORMATS", "SloReport", "Table", "build", "markdown", "page", "tables"]
