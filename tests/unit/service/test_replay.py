"""A replayed trace request as the service records it: under the replay tenant, labelled with
its run and its SLO class (the simulator's per-class tenants are not the service's clients); a
replay's progress, as ``qlm serve --replay`` logs it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from types import SimpleNamespace

import pytest

from qlm.clock import VirtualClock
from qlm.domain import SLO, Request, RequestStatus, Tier
from qlm.global_queue import QueuedRequest
from qlm.service.replay import REPLAY_TENANT, ReplayProgress, replay, to_message
from qlm.service.serve import ProgressLog
from tests.builders import make_request


def test_a_replayed_request_lands_in_the_replay_tenant_with_its_class_as_a_label() -> None:
    request = Request(
        id="r000001",
        model="m",
        input_tokens=100,
        max_tokens=50,
        arrival_s=3.0,
        slo=SLO(e2e_s=20.0, ttft_s=2.0),
        tier=Tier.INTERACTIVE,
        tenant="chat",
        slo_class="chat",
        labels=(("kind", "mega"),),
    )
    msg = to_message(request, 1000.0, "run1")
    assert msg.tenant == REPLAY_TENANT == "replay"
    assert msg.labels == {"replay": "run1", "class": "chat", "kind": "mega"}
    assert (msg.id, msg.submitted_at, msg.slo_e2e_s, msg.slo_ttft_s, msg.tier) == (
        "run1-r000001", 1000.0, 20.0, 2.0, int(Tier.INTERACTIVE),
    )  # fmt: skip


class HeldQueue:
    """A global queue whose publish of each request waits until the replay has reported the
    ones before it: every count of submitted requests is then reported, whatever the timing."""

    def __init__(self) -> None:
        self.published: list[QueuedRequest] = []
        self.reported = asyncio.Condition()
        self.reports: list[ReplayProgress] = []

    def report(self, p: ReplayProgress) -> None:
        self.reports.append(p)

    async def publish(self, message: QueuedRequest) -> None:
        while not any(r.submitted == len(self.published) for r in self.reports):
            await asyncio.sleep(0)
        self.published.append(message)


class InstantStore:
    """A store in which every published request is at once final, its SLO met."""

    def final_ids(self, ids: Iterable[str]) -> set[str]:
        return set(ids)

    def get(self, request_id: str) -> SimpleNamespace:
        return SimpleNamespace(status=RequestStatus.FINISHED, slo_met=True)


def test_a_replay_reports_its_progress_while_it_submits_and_once_every_request_is_done() -> None:
    queue = HeldQueue()
    requests = [make_request(i, arrival_s=0.0) for i in range(3)]
    replayed = replay(
        requests,
        queue,  # type: ignore[arg-type]
        InstantStore(),  # type: ignore[arg-type]
        VirtualClock(100.0),
        progress=queue.report,
        poll_s=0.001,
    )
    # (A replay that reported nothing while it submitted would hold the queue for ever.)
    result = asyncio.run(asyncio.wait_for(replayed, timeout=60))
    assert [m.submitted_at for m in queue.published] == [100.0] * 3
    seen = [(r.submitted, r.total) for r in queue.reports]
    assert sorted(set(seen)) == [(0, 3), (1, 3), (2, 3), (3, 3)]
    last = queue.reports[-1]
    assert (last.submitted, last.final, last.total) == (3, 3, 3)
    assert (result.requests, result.finished, result.slo_met, result.failed) == (3, 3, 3, 0)


def test_serve_logs_a_replays_first_report_then_one_every_interval_and_its_last(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logged = ProgressLog(every_s=5.0)
    with caplog.at_level(logging.INFO, logger="qlm.service.serve"):
        for submitted, final, wall_s in [(1, 0, 0.5), (4, 1, 3.0), (8, 5, 5.6), (9, 8, 6.0)]:
            logged(ReplayProgress(submitted, final, 10, wall_s))
        logged(ReplayProgress(10, 10, 10, 7.0))
    assert [r.getMessage() for r in caplog.records] == [
        "replay: 1 of 10 requests submitted, 0 of them done, after 0 s",
        "replay: 8 of 10 requests submitted, 5 of them done, after 6 s",
        "replay: 10 of 10 requests submitted, 10 of them done, after 7 s",
    ]
    assert caplog.records[-1].__dict__["done"] == 10
