"""The REST API (ARCHITECTURE.md §2 step 1): the native submission API, OpenAI-compatible
endpoints, operator endpoints, probes and metrics. ``create_app(settings)`` builds it;
docs/api.md describes it."""

from __future__ import annotations

from qlm.api.app import create_app

__all__ = ["create_app"]
