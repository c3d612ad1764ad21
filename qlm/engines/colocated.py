"""Several single-model servers on one GPU, driven as one instance: model warm start over vLLM.

One vLLM process serves one model. To let several models share a GPU with warm starts (§5), QLM
runs one server per model on the GPU, each started in sleep mode, and keeps one awake: the
active model. ``ColocatedEngine`` is that instance as the agents see it — one ``Engine`` whose
models are its servers' — and turns the planner's model tiers into sleep levels:

- ``ACTIVE``: every other awake server is put to sleep at level 1 first (its weights go to CPU
  memory: warm), then this model's server wakes (from level 1: the weights come back from CPU
  memory; from level 2: they are loaded again — ``VllmEngine.set_model_tier``);
- ``WARM``: sleep level 1; ``COLD``: sleep level 2 (the weights are dropped). A server asleep
  at level 2 stays there when asked ``WARM`` (vLLM cannot bring the weights back to CPU memory
  without waking it), and ``set_model_tier`` says so: the model is still ``COLD``.

The GPU holds one model's weights and KV cache at a time, so every server should be started
with the GPU memory share it needs when it is the one awake. Requests go to their model's
server; one for a sleeping model waits here until its model is woken (as vLLM queues requests
while asleep, whatever the server does); aborts, parking and stats go where the request is. A server is put to
sleep only once it has drained (nothing running or waiting in it). Attached with several
servers awake (vLLM starts awake), all but the first are put to sleep at level 1. The instance
is healthy when every server answers. Every server must really sleep (``supports_sleep``): one
that cannot would keep its weights on the GPU, and the switch would be a lie."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from typing import Any

from qlm.domain import ModelTier
from qlm.engines.base import (
    ChunkCallback,
    Engine,
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
)
from qlm.errors import EngineError, UnknownRequest


class ColocatedEngine:
    """One instance made of one server per model on one GPU (module docstring)."""

    def __init__(
        self, name: str, servers: Mapping[str, Engine], *, drain_timeout_s: float = 600.0
    ) -> None:
        if len(servers) < 2:
            raise EngineError(f"{name}: colocated servers need two models or more")
        self.name = name
        self.drain_timeout_s = drain_timeout_s
        self.servers = dict(servers)
        self.models = tuple(self.servers)
        self._where: dict[str, str] = {}  # request id -> model of the server running it
        self._woken = {m: asyncio.Event() for m in self.servers}  # set while awake
        self._queued: dict[str, asyncio.Event] = {}  # waiting for their model; set: aborted

    def _server(self, model: str) -> Engine:
        server = self.servers.get(model)
        if server is None:
            raise EngineError(f"{self.name}: model {model!r} is not served here")
        return server

    def _holding(self, request_id: str) -> Engine:
        model = self._where.get(request_id)
        if model is None:
            raise UnknownRequest(f"{self.name}: no request {request_id!r} in flight")
        return self.servers[model]

    async def capabilities(self) -> EngineCapabilities:
        caps = await asyncio.gather(*(s.capabilities() for s in self.servers.values()))
        cannot = [m for m, c in zip(self.servers, caps, strict=True) if not c.supports_sleep]
        if cannot:
            raise EngineError(
                f"{self.name}: the server of {cannot[0]!r} cannot sleep, so its weights would "
                "stay on the GPU: start every colocated server in sleep mode (`qlm instance "
                "launch --sleep-mode`) on a build that supports it"
            )
        awake = await self._awake()
        for model in awake[1:]:
            await self._sleep_warm(model)
        for model, woken in self._woken.items():
            if model == (awake[0] if awake else None):
                woken.set()
            else:
                woken.clear()
        seqs = [c.max_num_seqs for c in caps if c.max_num_seqs is not None]
        kv = [c.kv_capacity_tokens for c in caps if c.kv_capacity_tokens is not None]
        return EngineCapabilities(
            models=self.models,
            max_num_seqs=min(seqs) if seqs else None,
            kv_capacity_tokens=min(kv) if kv else None,
            supports_sleep=True,
            supports_swap=all(c.supports_swap for c in caps),
            supports_abort_endpoint=all(c.supports_abort_endpoint for c in caps),
        )

    async def submit(
        self, request: EngineRequest, on_chunk: ChunkCallback | None = None
    ) -> EngineOutput:
        server = self._server(request.model)
        rid = request.request_id
        self._where[rid] = request.model
        try:
            woken = self._woken[request.model]
            if not woken.is_set():
                aborted = self._queued[rid] = asyncio.Event()
                try:
                    await _first(woken.wait(), aborted.wait())
                finally:
                    self._queued.pop(rid, None)
                if aborted.is_set():
                    return EngineOutput(rid, "", 0, "abort")
            return await server.submit(request, on_chunk)
        finally:
            if self._where.get(request.request_id) == request.model:
                del self._where[request.request_id]

    async def abort(self, request_id: str) -> EngineOutput:
        aborted = self._queued.get(request_id)
        if aborted is not None:  # still waiting for its model: it never reached a server
            aborted.set()
            return EngineOutput(request_id, "", 0, "abort")
        return await self._holding(request_id).abort(request_id)

    async def swap_out(self, request_id: str) -> None:
        await self._holding(request_id).swap_out(request_id)

    async def swap_in(self, request_id: str) -> None:
        await self._holding(request_id).swap_in(request_id)

    async def stats(self) -> EngineStats:
        """The servers' load summed; KV and tiers as each server says for its model; the
        active model the one awake (the first, should two be)."""
        stats = await asyncio.gather(*(s.stats() for s in self.servers.values()))
        tiers = tuple((m, dict(st.model_tiers).get(m, ModelTier.COLD))
                      for m, st in zip(self.servers, stats, strict=True))  # fmt: skip
        awake = [
            st
            for m, st in zip(self.servers, stats, strict=True)
            if dict(tiers)[m] is ModelTier.ACTIVE
        ]
        lead = awake[0] if awake else stats[0]
        free = [st.swap_free_gb for st in stats]
        return EngineStats(
            running=sum(st.running for st in stats),
            waiting=sum(st.waiting for st in stats) + len(self._queued),
            swapped=sum(st.swapped for st in stats),
            kv_used_tokens=sum(st.kv_used_tokens for st in stats),
            kv_capacity_tokens=lead.kv_capacity_tokens,
            active_model=next((m for m, t in tiers if t is ModelTier.ACTIVE), None),
            model_tiers=tiers,
            preemptions_total=sum(st.preemptions_total for st in stats),
            gpu_memory_used_fraction=max(st.gpu_memory_used_fraction for st in stats),
            kv_usage_fraction=lead.kv_usage_fraction,
            sleeping=not awake,
            swap_free_gb=None
            if any(f is None for f in free)
            else min(f for f in free if f is not None),
        )

    async def set_model_tier(self, model: str, tier: ModelTier) -> ModelTier:
        """The tier ``model``'s server says it is in once asked (a server asleep at level 2
        asked ``WARM`` stays ``COLD``)."""
        server = self._server(model)
        if tier is ModelTier.ACTIVE:
            for other in await self._awake():
                if other != model:
                    await self._sleep_warm(other)
        else:
            self._woken[model].clear()
            await self._drained(model)
        now = await server.set_model_tier(model, tier)
        if now is ModelTier.ACTIVE:
            self._woken[model].set()
        return now

    async def _awake(self) -> list[str]:
        """The models whose servers are awake, in the servers' order."""
        stats = await asyncio.gather(*(s.stats() for s in self.servers.values()))
        return [
            m
            for m, st in zip(self.servers, stats, strict=True)
            if dict(st.model_tiers).get(m) is ModelTier.ACTIVE
        ]

    async def _sleep_warm(self, model: str) -> None:
        self._woken[model].clear()
        await self._drained(model)
        await self.servers[model].set_model_tier(model, ModelTier.WARM)

    async def _drained(self, model: str) -> None:
        """Wait until ``model``'s server runs and holds nothing, by its gauges and by what was
        sent to it from here (the agents switch models only once the running batch is done,
        but a server's gauges lag: one sent a moment ago may not be counted yet)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        while True:
            st = await self.servers[model].stats()
            sent = [r for r, m in self._where.items() if m == model and r not in self._queued]
            if st.running == 0 and st.waiting == 0 and not sent:
                return
            if loop.time() > deadline:
                raise EngineError(
                    f"{self.name}: the server of {model!r} did not drain within "
                    f"{self.drain_timeout_s:g} s ({st.running} running, {st.waiting} waiting, "
                    f"{len(sent)} sent from here)"
                )
            await asyncio.sleep(0.05)

    async def health(self) -> bool:
        return all(await asyncio.gather(*(s.health() for s in self.servers.values())))

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.servers.values()))


async def _first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Return when the first of ``waits`` does; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
