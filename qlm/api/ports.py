"""What the API needs of a controller running in the same process (``qlm serve``), as protocols:
``qlm.service.controller.ControllerService`` satisfies them, and tests pass fakes. An API process
of its own has no controller: it reads the controller's published state from the store and polls
the store for results.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

from qlm.domain import RequestStatus


class ResultEventLike(Protocol):
    """``qlm.service.hub.ResultEvent``: new output ``text``, the output starting over
    (``restarted``), or the final event (``done``) sent only once the outcome is committed to
    the store."""

    @property
    def request_id(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def tokens(self) -> int: ...
    @property
    def done(self) -> bool: ...
    @property
    def restarted(self) -> bool: ...
    @property
    def status(self) -> RequestStatus | None: ...


class ResultHubLike(Protocol):
    """``qlm.service.hub.ResultHub``: per-request subscriptions to its result events."""

    def subscribe(self, request_id: str) -> asyncio.Queue[Any]: ...
    def unsubscribe(self, request_id: str, queue: asyncio.Queue[Any]) -> None: ...


class LocalController(Protocol):
    """The controller service sharing this process and event loop."""

    @property
    def hub(self) -> ResultHubLike: ...

    @property
    def active(self) -> bool:
        """Serving the global queue (else another controller does: a standby, or one that lost
        the lead, knows nothing of the requests and publishes nothing worth reading)."""
        ...

    async def cancel(self, request_id: str) -> bool:
        """Abort or dequeue at once (the store's cancel flag would reach it on its next poll)."""
        ...

    def snapshot(self) -> Mapping[str, Any]:
        """The state it publishes to the store every second (docs/operations.md)."""
        ...
