"""What the resume-by-token-ids tests share (against ``qlm sim-engine serve`` in
tests/integration/ and against real vLLM in tests/vllm/): an engine that keeps what it was sent
and streamed, a policy that evicts one request once, a listener of how requests ended, and the
agents' runtime serving one request over one engine until it is idle."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from qlm.clock import WallClock
from qlm.controller import Controller
from qlm.domain import Decision, Evict, InstanceSpec, Pull, Request, RequestRecord
from qlm.engines.base import EngineOutput, EngineRequest, TokenChunk
from qlm.engines.vllm import VllmEngine
from qlm.planner.policy import DispatchContext, PolicyBase
from qlm.service.jobs import Job
from qlm.service.runtime import AgentRuntime, RuntimeListener


class Watched:
    """The engine, keeping every request sent and every chunk streamed, per sending."""

    def __init__(self, inner: VllmEngine) -> None:
        self.inner = inner
        self.name = inner.name
        self.sent: list[EngineRequest] = []
        self.chunks: list[list[TokenChunk]] = []

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    def written(self) -> int:
        """Token ids streamed by the first sending."""
        return sum(len(c.token_ids or ()) for c in self.chunks[0]) if self.chunks else 0

    async def submit(self, request: EngineRequest, on_chunk: Any = None) -> EngineOutput:
        self.sent.append(request)
        seen: list[TokenChunk] = []
        self.chunks.append(seen)

        def keep(chunk: TokenChunk) -> None:
            seen.append(chunk)
            if on_chunk is not None:
                on_chunk(chunk)

        return await self.inner.submit(request, keep)


class EvictOnceAt(PolicyBase):
    """Pulls everything onto ``instance``; evicts ``rid`` once, when ``ready()``."""

    name = "evict-once-at"

    def __init__(self, rid: str, instance: str, ready: Callable[[], bool]) -> None:
        self.rid = rid
        self.instance = instance
        self.ready = ready
        self.evicted = False

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        out: list[Decision] = [Pull(r.id, self.instance) for r in ctx.arrived]
        if not self.evicted and self.ready():
            self.evicted = True
            out.append(Evict(self.rid, self.instance))
        return out


class Ended(RuntimeListener):
    """How requests ended: finished (record, text) or failed (reason)."""

    def __init__(self) -> None:
        self.done: dict[str, tuple[RequestRecord, str]] = {}
        self.errors: dict[str, str] = {}

    def finished(
        self, record: RequestRecord, text: str, finish_reason: str, tool_calls: Any = ()
    ) -> None:
        self.done[record.request.id] = (record, text)

    def failed(self, request_id: str, error: str) -> None:
        self.errors[request_id] = error


async def serve_one(
    engine: Any,
    policy: PolicyBase,
    instance: InstanceSpec,
    request: Callable[[float], Request],
    job: Job,
    listener: RuntimeListener,
    *,
    deadline_s: float,
    poll_s: float = 0.02,
) -> None:
    """Run the agents' runtime over ``engine`` (the ``instance``) with ``policy``, submit the
    request ``request(now)`` with ``job`` and wait until the runtime is idle (at most
    ``deadline_s``); the runtime is stopped and the engine's client closed whatever happens."""
    runtime = AgentRuntime(
        Controller(policy, [instance]),
        [engine],
        clock=WallClock(),
        listener=listener,
        tick_s=0.01,
    )
    await runtime.start()
    try:
        runtime.submit(request(runtime.clock.now()), job)
        deadline = time.monotonic() + deadline_s
        while not runtime.idle:
            assert time.monotonic() < deadline, f"the request did not finish in {deadline_s:g} s"
            await asyncio.sleep(poll_s)
    finally:
        await runtime.stop()
        await engine.inner.close()
