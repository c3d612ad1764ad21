"""The OpenAI-compatible answers say how the request fared — its id, deadline, whether it met
its SLOs, how long it waited in the queue — in ``x-qlm-*`` headers and a ``qlm`` body object,
and a stream in its last chunk (its headers, sent before the request is served, carry only
the id and deadline). The in-process queue and SQLite; the test records each outcome in the
store as a controller would."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from qlm.domain import RequestStatus
from qlm.store import RequestRow
from tests.unit.api.test_api import Harness, run

ASK = [{"role": "user", "content": "How long did I wait?"}]


async def served(
    h: Harness,
    path: str,
    body: dict[str, Any],
    *,
    queue_s: float | None,
    ttft_s: float | None,
    e2e_s: float,
    slo_met: bool,
    ttft_met: bool | None = None,
    **headers: str,
) -> tuple[httpx.Response, RequestRow]:
    """POST ``body`` to ``path`` and serve its request through the store: dispatched
    ``queue_s`` after submission, first token at ``ttft_s``, finished at ``e2e_s``."""
    before = {r.id for r in h.store.list_requests()[0]}
    post = asyncio.create_task(h.client.post(path, json=body, headers=h.auth(**headers)))
    while not (new := [r for r in h.store.list_requests()[0] if r.id not in before]):
        await asyncio.sleep(0.01)
    row = new[0]
    t0 = row.submitted_at
    if queue_s is not None:
        h.store.mark_dispatched(row.id, instance="i0", at=t0 + queue_s)
    if ttft_s is not None:
        h.store.mark_first_token(row.id, at=t0 + ttft_s)
    h.store.record_outcome(
        row.id,
        status=RequestStatus.FINISHED,
        at=t0 + e2e_s,
        output_text="four words of answer",
        output_tokens=4,
        slo_met=slo_met,
        ttft_met=ttft_met,
    )
    response = await post
    assert response.status_code == 200, response.text
    return response, row


def test_a_completion_says_it_met_its_slo_and_how_long_it_waited() -> None:
    async def scenario(h: Harness) -> None:
        body = {"model": "m", "prompt": "Hello", "max_tokens": 16, "slo_seconds": 60}
        r, row = await served(
            h, "/v1/completions", body, queue_s=0.25, ttft_s=0.5, e2e_s=3.0, slo_met=True
        )
        assert r.json()["qlm"] == {
            "request_id": row.id,
            "deadline_at": row.submitted_at + 60,
            "slo_met": True,
            "ttft_met": None,  # no TTFT SLO
            "queue_seconds": 0.25,
        }
        assert r.headers["x-qlm-request-id"] == row.id
        assert float(r.headers["x-qlm-deadline-at"]) == row.submitted_at + 60
        assert r.headers["x-qlm-slo-met"] == "true"
        assert "x-qlm-ttft-met" not in r.headers
        assert float(r.headers["x-qlm-queue-seconds"]) == 0.25
        assert r.json()["choices"][0]["text"] == "four words of answer"  # OpenAI's part as ever

    run(scenario, poll_interval_s=0.02)


def test_a_chat_completion_says_it_missed_its_ttft() -> None:
    async def scenario(h: Harness) -> None:
        body = {"model": "m", "messages": ASK, "slo_seconds": 30}
        r, row = await served(
            h,
            "/v1/chat/completions",
            body,
            queue_s=4.0,
            ttft_s=4.5,
            e2e_s=9.0,
            slo_met=False,
            ttft_met=False,
            **{"x-qlm-ttft-slo-seconds": "2"},
        )
        qlm = r.json()["qlm"]
        assert (qlm["request_id"], qlm["slo_met"], qlm["ttft_met"]) == (row.id, False, False)
        assert qlm["queue_seconds"] == 4.0 and qlm["deadline_at"] == row.submitted_at + 30
        assert r.headers["x-qlm-slo-met"] == "false" and r.headers["x-qlm-ttft-met"] == "false"
        assert r.headers["x-qlm-queue-seconds"] == "4.0"

    run(scenario, poll_interval_s=0.02)


def test_a_request_never_dispatched_has_no_queue_wait() -> None:
    """Finished without a dispatch of its own (its whole output was written before its
    controller died): the wait is unknown, not zero."""

    async def scenario(h: Harness) -> None:
        body = {"model": "m", "prompt": "Hello", "slo_seconds": 60}
        r, _ = await served(
            h, "/v1/completions", body, queue_s=None, ttft_s=None, e2e_s=1.0, slo_met=True
        )
        assert r.json()["qlm"]["queue_seconds"] is None
        assert "x-qlm-queue-seconds" not in r.headers

    run(scenario, poll_interval_s=0.02)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_says_its_deadline_first_and_its_outcome_last(
    path: str, include_usage: bool
) -> None:
    async def scenario(h: Harness) -> None:
        prompt: dict[str, Any] = {"prompt": "Hello"} if "chat" not in path else {"messages": ASK}
        body = {"model": "m", **prompt, "stream": True, "slo_seconds": 120}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        r, row = await served(
            h,
            path,
            body,
            queue_s=1.5,
            ttft_s=2.0,
            e2e_s=5.0,
            slo_met=True,
            ttft_met=True,
            **{"x-qlm-ttft-slo-seconds": "3"},
        )
        # Sent before the request was served: what was known then, nothing of the outcome.
        assert r.headers["x-qlm-request-id"] == row.id
        assert float(r.headers["x-qlm-deadline-at"]) == row.submitted_at + 120
        assert not {"x-qlm-slo-met", "x-qlm-ttft-met", "x-qlm-queue-seconds"} & set(r.headers)
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        *before, last = chunks
        assert last["qlm"] == {
            "request_id": row.id,
            "deadline_at": row.submitted_at + 120,
            "slo_met": True,
            "ttft_met": True,
            "queue_seconds": 1.5,
        }
        assert not any("qlm" in c for c in before)  # only the last chunk carries it
        assert (last["choices"] == []) is include_usage  # the usage chunk, when asked for

    run(scenario, poll_interval_s=0.02)
