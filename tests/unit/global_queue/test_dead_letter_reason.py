"""Why a message is in the dead-letter queue, as ``reap_dead`` records it: QLM's own reason when
QLM parked it, else the broker's reason for the message's latest death."""

from __future__ import annotations

from qlm.global_queue.base import REASON_HEADER
from qlm.global_queue.rabbitmq import dead_letter_reason


def death(reason: str | bytes, queue: str = "qlm.requests") -> dict[str, object]:
    """One ``x-death`` entry as RabbitMQ writes it (a table per queue and reason)."""
    return {"queue": queue, "reason": reason, "count": 1, "exchange": "", "routing-keys": [queue]}


def test_qlms_reason_wins_over_the_brokers() -> None:
    headers = {REASON_HEADER: "unknown model 'x'", "x-death": [death("rejected")]}
    assert dead_letter_reason(headers) == "unknown model 'x'"
    assert dead_letter_reason({REASON_HEADER: b"malformed body"}) == "malformed body"


def test_the_broker_reason_is_its_latest_death() -> None:
    """RabbitMQ keeps ``x-death`` most recent first; ``x-first-death-reason`` is the oldest."""
    headers = {
        "x-death": [death("delivery_limit"), death(b"rejected", queue="elsewhere")],
        "x-first-death-reason": "rejected",
        "x-last-death-reason": "delivery_limit",
    }
    assert dead_letter_reason(headers) == "delivery_limit"
    assert dead_letter_reason({"x-death": [death(b"expired")]}) == "expired"


def test_a_message_without_a_reason_is_said_to_be_dead_lettered() -> None:
    assert dead_letter_reason({}) == "dead-lettered"
    assert dead_letter_reason({"x-death": []}) == "dead-lettered"
    assert dead_letter_reason({"x-death": "not a list", REASON_HEADER: 3}) == "dead-lettered"
