"""Results as they happen, for whoever waits on them in the controller's process (the API of
``qlm serve`` streaming an answer): new output text of a request, then its end — announced only
once the outcome is committed to the store, so a client that reads the store next sees it too."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from qlm.domain import RequestStatus


@dataclass(frozen=True, slots=True)
class ResultEvent:
    """New output (``text``, ``tokens`` so far), or with ``done`` the request's final status.
    ``restarted``: the request went back to the queue with no output kept (a structured answer,
    which cannot be continued, or one that had none yet): text sent before is not its answer."""

    request_id: str
    text: str
    tokens: int
    done: bool = False
    status: RequestStatus | None = None
    restarted: bool = False


class ResultHub:
    """Fan-out of ``ResultEvent``s to subscribers of one request id each."""

    def __init__(self) -> None:
        self._subs: dict[str, list[asyncio.Queue[ResultEvent]]] = {}

    def subscribe(self, request_id: str) -> asyncio.Queue[ResultEvent]:
        queue: asyncio.Queue[ResultEvent] = asyncio.Queue()
        self._subs.setdefault(request_id, []).append(queue)
        return queue

    def unsubscribe(self, request_id: str, queue: asyncio.Queue[ResultEvent]) -> None:
        subs = self._subs.get(request_id, [])
        if queue in subs:
            subs.remove(queue)
        if not subs:
            self._subs.pop(request_id, None)

    def publish(self, event: ResultEvent) -> None:
        for queue in self._subs.get(event.request_id, ()):
            queue.put_nowait(event)

    def watched(self, request_id: str) -> bool:
        return request_id in self._subs
