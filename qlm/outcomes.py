"""The line each request outcome is logged with, once it is recorded.

One line per outcome recorded — by the controller: finished, failed, cancelled while running,
dead-lettered, an orphan failed by the sweep; by the API: cancelled while queued
(``Store.cancel_row``) — logged after the transaction that wrote it committed, so a write
that failed and is tried again is not logged twice. Logger ``qlm.outcomes``, at INFO. Its fields
(the record's own, a JSON log's keys): ``request_id``, ``tenant``, ``model``, ``tier``,
``status``, ``slo_met`` (a failed request missed its SLO; a cancelled one is not judged: null),
``ttft_met`` (as recorded: null when the request had no first-token deadline or no verdict),
``e2e_s``, ``ttft_s``, ``queue_s`` (from the stored timestamps, as the latency histograms measure
them: the first dispatch, the first token ever; null when it never had one), ``instance``,
``output_tokens``, ``error``. The message reads ``request ID STATUS: key=value ...``, the other
fields in that order, the null ones left out (the text format shows only the message).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from qlm.domain import RequestStatus
from qlm.store import OutcomeRow

OUTCOMES = logging.getLogger("qlm.outcomes")


def outcome_fields(outcome: OutcomeRow) -> dict[str, Any]:
    """The line's fields, in order."""

    def seconds(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    slo_met = outcome.slo_met
    if outcome.status is RequestStatus.FAILED:
        slo_met = False  # as the reports count it: a failed request missed its SLO
    elif outcome.status is RequestStatus.CANCELLED:
        slo_met = None  # not judged
    return {
        "request_id": outcome.id,
        "tenant": outcome.tenant,
        "model": outcome.model,
        "tier": outcome.tier.name.lower(),
        "status": outcome.status.name.lower(),
        "slo_met": slo_met,
        "ttft_met": outcome.ttft_met,
        "e2e_s": seconds(outcome.e2e_s),
        "ttft_s": seconds(outcome.ttft_s),
        "queue_s": seconds(outcome.queue_s),
        "instance": outcome.instance,
        "output_tokens": outcome.output_tokens,
        "error": outcome.error,
    }


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text, ensure_ascii=False)
    return text


def log_outcome(outcome: OutcomeRow) -> None:
    """Log one recorded outcome (module docstring)."""
    fields = outcome_fields(outcome)
    named = ("request_id", "status")  # in the message itself
    pairs = " ".join(
        f"{k}={_text(v)}" for k, v in fields.items() if v is not None and k not in named
    )
    OUTCOMES.info("request %s %s: %s", outcome.id, fields["status"], pairs, extra=fields)
