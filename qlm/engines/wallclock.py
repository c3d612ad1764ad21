"""A simulated instance on the wall clock: a ``SimEngine`` driven in real time with asyncio.

``WallClockEngine`` implements the ``Engine`` protocol in-process. A driver task sleeps until the
simulated engine's next event (``next_event_time``), advances it to ``clock.now()`` and turns its
events into streamed output; every operation first advances the engine to ``now`` and then applies
itself there, so nothing happens out of order. With ``WallClock(scale)`` the simulated instance
runs ``scale`` times faster than real time (tests, demos).

Output text is filler: token *i* of every request is ``FILLER_TOKEN`` (``" tok"``), so a text of
*n* tokens is ``n`` whitespace-separated words and ``count_tokens`` counts it back exactly. The
same rule counts a string prompt (whitespace words), which keeps a resumed request (prompt +
partial output) consistent. A token-id prompt counts its ids. Every token has an id of a
simulated vocabulary (``tokenize``: a word's id is drawn from its CRC32), and every chunk says
the ids of its new tokens (``TokenChunk.token_ids``), so that a prompt of an earlier request's
ids + the ids it generated counts as exactly those tokens. A request with a JSON
``response_format`` gets a JSON document of its schema instead, complete within ``max_tokens``
when it fits (``qlm.structured``).

Sleep (vLLM sleep mode) is modelled here, around the ``SimEngine``: ``sleep(level)`` needs the
instance drained, refuses new requests while asleep, and ``wake_up`` takes the model's warm
(level 1) or cold (level 2) load time. With several models, ``set_model_tier`` of a model that is
not the active one is the ``SimEngine``'s own tier change (explicit model switching).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from qlm.clock import WallClock
from qlm.domain import ModelTier
from qlm.engines.base import (
    ChunkCallback,
    EngineCapabilities,
    EngineEvent,
    EngineOutput,
    EngineRequest,
    EngineStats,
    EventKind,
    FinishReason,
    TokenChunk,
    ToolCall,
)
from qlm.engines.perf_model import HardwareCatalog, default_catalog
from qlm.engines.sim import SimEngine, SimEngineConfig
from qlm.errors import EngineError, RequestRejected, UnknownRequest
from qlm.structured import (
    SchemaUnsupported,
    call_pieces,
    document_pieces,
    planned_call,
    resumable,
)

log = logging.getLogger(__name__)

FILLER_TOKEN = " tok"

VOCAB_SIZE = 32_000
"""Token ids of the simulated vocabulary are 0 .. ``VOCAB_SIZE`` - 1 (Llama 2's size)."""
BOS_ID = 1
"""The one token of an empty text (a real prompt has at least its BOS token)."""
_FIRST_WORD_ID = 100  # ids below are special tokens, as in real vocabularies


def filler_text(tokens: int) -> str:
    """The deterministic output text of ``tokens`` generated tokens."""
    return FILLER_TOKEN * tokens


def count_tokens(prompt: str | Sequence[int]) -> int:
    """Prompt length as the simulated engine counts it: whitespace-separated words of a text
    (at least 1, as every real prompt has a BOS token), or the number of token ids."""
    if isinstance(prompt, str):
        return max(1, len(prompt.split()))
    return len(prompt)


def token_id(token: str) -> int:
    """The id of one token of the simulated vocabulary: a word of a text, or one piece of a
    structured answer, by its CRC32 (the same token, the same id)."""
    return _FIRST_WORD_ID + zlib.crc32(token.encode()) % (VOCAB_SIZE - _FIRST_WORD_ID)


FILLER_TOKEN_ID = token_id(FILLER_TOKEN.strip())
"""The id of every filler output token: ``tokenize`` of generated text gives it back."""


def tokenize(text: str) -> list[int]:
    """The token ids of a text as ``count_tokens`` counts it: one per whitespace-separated word
    (an empty text: ``BOS_ID``)."""
    return [token_id(word) for word in text.split()] or [BOS_ID]


@dataclass(slots=True)
class _Flight:
    """A request between submit and its end, as the adapter streams it."""

    request: EngineRequest
    on_chunk: ChunkCallback | None
    done: asyncio.Future[EngineOutput]
    sent: int = 0
    pieces: list[str] | None = None
    """The text of each output token of a structured answer (``qlm.structured``)."""
    call: str | None = None
    """The function a tool-calling answer calls: ``pieces`` are then its arguments."""
    arrived: float = 0.0  # on the engine's clock

    def text(self, start: int, end: int) -> str:
        if self.call is not None:
            return ""
        if self.pieces is None:
            return filler_text(max(0, end - start))
        return "".join(self.pieces[start:end])

    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """The ids of output tokens ``start:end``: the filler's, or those of the pieces."""
        if self.pieces is None:
            return (FILLER_TOKEN_ID,) * max(0, end - start)
        ids = tuple(token_id(piece) for piece in self.pieces[start:end])
        return ids + (FILLER_TOKEN_ID,) * max(0, end - start - len(ids))

    def calls(self, start: int, end: int) -> tuple[ToolCall, ...]:
        """The tool-call delta of tokens ``start:end``: the call's id and name with its first
        tokens, then fragments of its arguments."""
        if self.call is None or self.pieces is None or (end <= start and start > 0):
            return ()
        delta: dict[str, Any] = {"index": 0}
        if start == 0:
            delta |= {"id": f"call_{self.request.request_id}", "type": "function"}
        fn = {"arguments": "".join(self.pieces[start:end])}
        delta["function"] = {"name": self.call, **fn} if start == 0 else fn
        return (delta,)

    def whole_call(self) -> tuple[ToolCall, ...]:
        if self.call is None or self.pieces is None:
            return ()
        args = "".join(self.pieces[: self.sent])
        call = {"name": self.call, "arguments": args}
        return ({"id": f"call_{self.request.request_id}", "type": "function", "function": call},)


LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
"""vLLM's buckets of ``vllm:e2e_request_latency_seconds`` (seconds)."""


@dataclass(slots=True)
class LatencyHistogram:
    """Cumulative counts per upper bound (``LATENCY_BUCKETS``, then +Inf), sum and count."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def append(self, seconds: float) -> None:
        self.total += seconds
        self.count += 1
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
        self.counts[-1] += 1


class WallClockEngine:
    """A ``SimEngine`` on the wall clock, behind the ``Engine`` protocol (module docstring)."""

    def __init__(self, sim: SimEngine, clock: WallClock | None = None) -> None:
        self.sim = sim
        self.name = sim.name
        self.clock = clock or WallClock()
        self._flights: dict[str, _Flight] = {}
        self._driver: asyncio.Task[None] | None = None
        self._kick: asyncio.Event | None = None
        self._last = 0.0
        self._sleep_level: int | None = None
        self._sleeping_model: str | None = None
        self._wake_lock: asyncio.Lock | None = None
        self._failed: BaseException | None = None
        self._closing = False
        self.latencies = LatencyHistogram()
        """End-to-end latency of every finished request, from its arrival to its last token on
        the engine's clock (vLLM's ``vllm:e2e_request_latency_seconds``)."""

    @classmethod
    def from_catalog(
        cls,
        name: str,
        model: str,
        gpu: str,
        gpu_count: int | None = None,
        *,
        time_scale: float = 1.0,
        max_macro_steps: int = 4,
        catalog: HardwareCatalog | None = None,
        max_num_seqs: int | None = None,
    ) -> WallClockEngine:
        """One model on ``gpu_count`` x ``gpu`` (default: fewest that fit) with vLLM's defaults
        for that GPU; decode runs are cut every ``max_macro_steps`` iterations so that tokens
        stream steadily. ``max_num_seqs``: vLLM's setting of that name, instead of its default."""
        cat = catalog or default_catalog()
        count = gpu_count if gpu_count is not None else cat.default_gpu_count(model, gpu)
        pm = cat.perf_model(model, gpu, count)
        config = SimEngineConfig.for_gpu(
            pm.gpu.memory_gb * pm.gpu_count,
            pm.gpu.name,
            max_macro_steps=max_macro_steps,
            emit_token_events=True,
            model_switching="explicit",
            **({"max_num_seqs": max_num_seqs} if max_num_seqs is not None else {}),
        )
        sim = SimEngine(name, {pm.model.name: pm}, config)
        return cls(sim, WallClock(time_scale))

    # --- the Engine protocol ---------------------------------------------------------------------

    async def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            models=tuple(self.sim.perf_models),
            max_num_seqs=self.sim.config.max_num_seqs,
            kv_capacity_tokens=self.sim.token_capacity(),
            supports_sleep=True,
            supports_swap=True,
            supports_abort_endpoint=True,
        )

    async def submit(
        self, request: EngineRequest, on_chunk: ChunkCallback | None = None
    ) -> EngineOutput:
        done = self.start_request(request, on_chunk)
        try:
            return await done
        except asyncio.CancelledError:
            # The caller gave up on the request: it must not keep running in the engine.
            if request.request_id in self._flights:
                self.abort_nowait(request.request_id)
            raise

    async def abort(self, request_id: str) -> EngineOutput:
        return self.abort_nowait(request_id)

    async def stats(self) -> EngineStats:
        return self.stats_nowait()

    async def set_model_tier(self, model: str, tier: ModelTier) -> ModelTier:
        """As vLLM's sleep mode for the model it runs (a sleep at level 2 stays at level 2
        when asked level 1: ``COLD``), as the simulated engine's tiers for its others.
        ``ACTIVE`` is said at once: the switch is under way and requests for the model wait in
        the engine until it has loaded."""
        if model not in self.sim.perf_models:
            raise EngineError(f"{self.name}: model {model!r} is not served here")
        if tier is ModelTier.ACTIVE:
            await self.wake_up()
            now = self._advance()
            self.sim.set_model_tier(model, tier, now)
            self._wake_driver()
            return tier
        if model in (self.sim.active_model, self._sleeping_model):
            self.sleep(1 if tier is ModelTier.WARM else 2)
            return ModelTier.WARM if self._sleep_level == 1 else ModelTier.COLD
        now = self._advance()
        self.sim.set_model_tier(model, tier, now)
        self._wake_driver()
        return self.sim.tiers[model]

    async def swap_out(self, request_id: str) -> None:
        now = self._advance()
        self.sim.swap_out(request_id, now)
        self._wake_driver()

    async def swap_in(self, request_id: str) -> None:
        now = self._advance()
        self.sim.swap_in(request_id, now)
        self._wake_driver()

    async def health(self) -> bool:
        return self._failed is None and (self._driver is None or not self._driver.done())

    async def close(self) -> None:
        for rid in list(self._flights):
            self.abort_nowait(rid)
        self._closing = True
        if self._driver is not None:
            self._wake_driver()
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None

    # --- synchronous verbs (usable where awaiting is not allowed, e.g. a cancelled stream) -------

    def start_request(
        self, request: EngineRequest, on_chunk: ChunkCallback | None = None
    ) -> asyncio.Future[EngineOutput]:
        """Queue ``request`` now and return the future of its output. Raises ``EngineError`` at
        once when the engine refuses it (unknown model, too long, duplicate id, asleep)."""
        self._ensure_started()
        if self._sleep_level is not None:
            raise EngineError(f"{self.name}: the instance is sleeping; wake it up first")
        pieces, call = None, None
        sampling = dict(request.sampling)
        fmt = sampling.get("response_format")
        function = planned_call(sampling, request.messages)
        # complete within max_tokens when it can: a grammar ends the answer itself
        target = min(request.tokens_to_generate, request.max_tokens - 1)
        part = "tools" if function is not None else "response_format"
        try:
            if function is not None:
                call, pieces = str(function.get("name", "")), call_pieces(function, target)
            elif isinstance(fmt, Mapping) and not resumable({"response_format": fmt}):
                pieces = document_pieces(fmt, target)
        except (SchemaUnsupported, ValueError, TypeError, RecursionError) as exc:
            # The request is at fault, not the instance (vLLM answers such a schema 400).
            raise RequestRejected(f"{self.name}: {part}: {exc}") from None
        if pieces is not None:
            request = replace(request, output_tokens=min(len(pieces), request.max_tokens))
        now = self._advance()
        self.sim.submit(request, now)
        done: asyncio.Future[EngineOutput] = asyncio.get_running_loop().create_future()
        self._flights[request.request_id] = _Flight(
            request, on_chunk, done, pieces=pieces, call=call, arrived=now
        )
        self._wake_driver()
        return done

    def in_flight(self) -> list[str]:
        """The requests it runs now (submitted, not ended)."""
        return list(self._flights)

    async def outcome(self, request_id: str) -> EngineOutput:
        """How the request in flight ends, once it has (finished or aborted)."""
        flight = self._flights.get(request_id)
        if flight is None:
            raise UnknownRequest(f"{self.name}: no request {request_id!r} in flight")
        return await flight.done

    def abort_nowait(self, request_id: str) -> EngineOutput:
        """Abort now; returns the output so far (the final output if it finished meanwhile)."""
        flight = self._flights.get(request_id)
        if flight is None:
            raise UnknownRequest(f"{self.name}: no request {request_id!r} in flight")
        now = self._advance()
        if request_id not in self._flights:  # it finished while the engine caught up
            return flight.done.result()
        generated = self.sim.abort(request_id, now)
        del self._flights[request_id]
        output = self._emit(flight, generated, "abort")
        self._wake_driver()
        return output

    def stats_nowait(self) -> EngineStats:
        now = self._advance()
        stats = self.sim.stats(now)
        if self._sleep_level is None:
            return stats
        tier = ModelTier.WARM if self._sleep_level == 1 else ModelTier.COLD
        tiers = tuple((m, tier if m == self._sleeping_model else t) for m, t in stats.model_tiers)
        return replace(
            stats,
            active_model=None,
            model_tiers=tiers,
            kv_used_tokens=0,
            gpu_memory_used_fraction=0.0,
            sleeping=True,
        )

    # --- sleep mode --------------------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level is not None

    @property
    def sleep_level(self) -> int | None:
        return self._sleep_level

    def sleep(self, level: int) -> None:
        """vLLM sleep mode: level 1 keeps the weights in CPU memory, level 2 drops them. The
        instance must be drained (QLM only sleeps an instance it has emptied)."""
        if level not in (1, 2):
            raise EngineError(f"{self.name}: sleep level must be 1 or 2, got {level}")
        self._advance()
        held = len(self.sim.queue_view())
        if held:
            raise EngineError(f"{self.name}: cannot sleep with {held} request(s) in flight")
        if self._sleep_level is None:
            if self.sim.active_model is None:
                raise EngineError(f"{self.name}: no active model to put to sleep")
            self._sleeping_model = self.sim.active_model
        self._sleep_level = max(level, self._sleep_level or 0)

    async def wake_up(self) -> None:
        """Load the sleeping model back (warm or cold load time on this clock); no-op if awake."""
        if self._wake_lock is None:
            self._wake_lock = asyncio.Lock()
        async with self._wake_lock:
            if self._sleep_level is None or self._sleeping_model is None:
                return
            pm = self.sim.perf_models[self._sleeping_model]
            load_s = pm.warm_load_s if self._sleep_level == 1 else pm.cold_load_s
            await asyncio.sleep(load_s / self.clock.scale)
            self._sleep_level = None
            self._sleeping_model = None

    # --- the driver ----------------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._failed is not None:
            raise EngineError(f"{self.name}: the simulated engine failed: {self._failed}")
        if self._driver is None:
            self._closing = False
            self._kick = asyncio.Event()
            self._driver = asyncio.get_running_loop().create_task(
                self._drive(), name=f"wallclock-{self.name}"
            )

    def _wake_driver(self) -> None:
        if self._kick is not None:
            self._kick.set()

    async def _drive(self) -> None:
        """Sleep until the engine's next event or a new operation, advance, repeat."""
        kick = self._kick
        assert kick is not None
        try:
            while not self._closing:
                self._advance()
                t = self.sim.next_event_time()
                kick.clear()
                if t is None:
                    await kick.wait()
                    continue
                delay = self.clock.seconds_until(t)
                if delay > 0:
                    # ``asyncio.timeout``, not ``wait_for``: on 3.11 ``wait_for`` can swallow a
                    # cancellation that arrives as the kick fires, and ``close`` would hang.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await kick.wait()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine is broken: fail every request, refuse new ones
            log.exception("%s: simulated engine failed", self.name)
            self._failed = exc
            for rid, flight in list(self._flights.items()):
                del self._flights[rid]
                if not flight.done.done():
                    flight.done.set_exception(
                        EngineError(f"{self.name}: the simulated engine failed: {exc}")
                    )

    def _advance(self) -> float:
        """Bring the engine to the clock's ``now`` and deliver what happened meanwhile."""
        now = max(self.clock.now(), self._last)
        self._last = now
        for event in self.sim.advance(now):
            self._dispatch(event)
        return now

    def _dispatch(self, event: EngineEvent) -> None:
        flight = self._flights.get(event.request_id)
        if flight is None:
            return
        if event.kind in (EventKind.FIRST_TOKEN, EventKind.TOKENS):
            self._emit(flight, event.tokens, None)
        elif event.kind is EventKind.FINISHED:
            del self._flights[event.request_id]
            self.latencies.append(event.time - flight.arrived)
            reason: FinishReason = "length" if event.tokens >= flight.request.max_tokens else "stop"
            named = isinstance(dict(flight.request.sampling).get("tool_choice"), Mapping)
            if reason == "stop" and flight.call is not None and not named:
                reason = "tool_calls"  # vLLM: "stop" when the caller named the function
            self._emit(flight, event.tokens, reason)

    def _emit(self, flight: _Flight, tokens: int, finish: FinishReason | None) -> EngineOutput:
        """Stream the tokens generated since the last chunk; on ``finish``, resolve the request."""
        rid = flight.request.request_id
        if tokens > flight.sent or finish is not None:
            text, calls = flight.text(flight.sent, tokens), flight.calls(flight.sent, tokens)
            ids = flight.token_ids(flight.sent, tokens)
            chunk = TokenChunk(rid, text, tokens, finish, calls=calls, token_ids=ids)
            flight.sent = max(flight.sent, tokens)
            if flight.on_chunk is not None:
                try:
                    flight.on_chunk(chunk)
                except Exception:  # a consumer's bug must not stop the engine
                    log.exception("%s: chunk callback of %s failed", self.name, rid)
        output = EngineOutput(
            rid, flight.text(0, flight.sent), flight.sent, finish or "abort", flight.whole_call()
        )
        if finish is not None and not flight.done.done():
            flight.done.set_result(output)
        return output
