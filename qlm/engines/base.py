"""The engine seam: what an engine is asked to run, what it reports back, and the ``Engine``
protocol the production agents drive (docs/engines.md).

Two families sit behind it. ``SimEngine`` (``sim.py``) is synchronous and runs on a clock its
caller owns: the cluster simulator drives it in virtual time. The asynchronous ``Engine``
protocol is what an agent talks to on the wall clock: ``VllmEngine`` (``vllm.py``, HTTP client of
``vllm serve``) and ``WallClockEngine`` (``wallclock.py``, a ``SimEngine`` driven in real time).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Literal, Protocol, runtime_checkable

from qlm.domain import ModelTier
from qlm.errors import EngineError

CHAT_ONLY_PARAMETERS = frozenset(
    {
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "mm_processor_kwargs",
    }
)
"""Parameters of the chat endpoint that a chat resumed from its token ids (sent as a completion)
leaves out:
templating, tools and structure (such a chat is not resumed), and ``logprobs``, a flag there and
a count on the completions endpoint."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation as an engine sees it.

    ``output_tokens`` is set when replaying a trace: the engine generates exactly
    ``min(output_tokens, max_tokens)`` tokens, as vLLM does with ``ignore_eos``. Without it the
    simulated engine generates ``max_tokens``.
    """

    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    priority: int = 0
    output_tokens: int | None = None
    prompt: str | tuple[int, ...] | None = None
    """What an HTTP engine sends as the prompt. ``None``: ``prompt_tokens`` filler token ids, so a
    replayed request has exactly its recorded prompt length. The simulated engine ignores it."""
    sampling: tuple[tuple[str, Any], ...] = field(default=(), hash=False)
    """Sampling parameters passed through to an HTTP engine (temperature, top_p, stop, seed,
    response_format, ...); the fields the agent owns (model, prompt, messages, max_tokens,
    priority, stream) are never overridden. Left out of the hash: a response format is a JSON
    object."""
    messages: tuple[Mapping[str, Any], ...] | None = field(default=None, hash=False)
    """A chat request's messages (OpenAI's ``{"role", "content"}`` objects, as submitted). Set,
    an HTTP engine sends them to the chat endpoint, so the server applies the model's own chat
    template; ``prompt`` then holds QLM's rendering of them, for engines without one. Left out
    of the hash: messages hold JSON objects."""
    continue_final_message: bool = False
    resumed_tokens: int = 0
    """Output tokens the prompt carries back (an evicted request sent again): re-tokenized they
    may count a few more, so an HTTP engine may lower ``max_tokens`` to what the context has
    left rather than fail a request QLM itself interrupted."""
    """The last of ``messages`` is the assistant's answer so far (a resumed request): the engine
    continues it instead of starting a new turn (vLLM's ``continue_final_message``)."""

    @property
    def tokens_to_generate(self) -> int:
        if self.output_tokens is None:
            return self.max_tokens
        return min(self.output_tokens, self.max_tokens)


def continued_from_ids(request: EngineRequest, ids: tuple[int, ...]) -> EngineRequest:
    """``request`` sent as a completion of exactly ``ids`` (its prompt's token ids and those it
    wrote so far): a chat too, without the chat endpoint's own parameters
    (``CHAT_ONLY_PARAMETERS``). The caller sets what is left to write."""
    return replace(
        request,
        prompt=ids,
        prompt_tokens=len(ids),
        messages=None,
        continue_final_message=False,
        sampling=tuple((k, v) for k, v in request.sampling if k not in CHAT_ONLY_PARAMETERS),
    )


class EventKind(Enum):
    SCHEDULED = "scheduled"  # first admitted into the running batch
    FIRST_TOKEN = "first_token"
    TOKENS = "tokens"
    FINISHED = "finished"
    PREEMPTED = "preempted"
    SWAPPED_OUT = "swapped_out"
    SWAPPED_IN = "swapped_in"
    MODEL_READY = "model_ready"


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """Something an engine did at ``time``.

    ``tokens`` is the number of output tokens the request has generated so far (for ``FINISHED``:
    all of them). ``TOKENS`` events are only emitted when the engine is asked to stream.
    """

    kind: EventKind
    time: float
    request_id: str = ""
    tokens: int = 0
    model: str = ""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Load of an engine at one instant, as an agent or a metrics scraper reads it."""

    running: int
    waiting: int
    swapped: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    active_model: str | None
    model_tiers: tuple[tuple[str, ModelTier], ...]
    preemptions_total: int
    gpu_memory_used_fraction: float
    kv_usage_fraction: float | None = None
    """KV usage as the engine reports it (vLLM's ``vllm:kv_cache_usage_perc``), when it reports a
    fraction rather than tokens; ``kv_usage`` prefers it."""
    sleeping: bool = False
    swap_free_gb: float | None = None
    """CPU memory the engine can still park KV caches in (KV swap); None: it cannot swap."""

    @property
    def kv_usage(self) -> float:
        if self.kv_usage_fraction is not None:
            return self.kv_usage_fraction
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0


class UnsupportedOperation(EngineError):
    """The engine cannot do this at all (e.g. per-request KV swap on vLLM); the message says why."""


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What an engine can do, read once when an agent attaches to it.

    ``None`` means unknown (e.g. ``max_num_seqs`` of a vLLM server is not exported by its API).
    """

    models: tuple[str, ...]
    max_num_seqs: int | None
    kv_capacity_tokens: int | None
    supports_sleep: bool
    supports_swap: bool
    supports_abort_endpoint: bool


FinishReason = Literal["length", "stop", "abort", "tool_calls"]

ToolCall = Mapping[str, Any]
"""One tool call as OpenAI spells it: ``{"id", "type": "function", "function": {"name",
"arguments"}}`` (``arguments``: JSON text). In a stream, a delta of one: ``{"index", ...}`` with
the name once and the arguments in fragments."""


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """New output of a streaming request: ``text`` is the delta, ``tokens`` the total so far.
    ``finish_reason`` is set on a request's last chunk (whose text may be empty). ``calls``:
    tool-call deltas of this chunk (a chat with tools)."""

    request_id: str
    text: str
    tokens: int
    finish_reason: FinishReason | None = None
    prompt_tokens: int | None = None
    """The prompt's length as the engine's tokenizer counted it (vLLM's ``usage``), if said."""
    calls: tuple[ToolCall, ...] = field(default=(), hash=False)
    token_ids: tuple[int, ...] | None = field(default=None, hash=False)
    """The ids of this chunk's new tokens, when the engine says them (vLLM's
    ``return_token_ids``): an interrupted request then resumes from exactly these tokens."""
    prompt_token_ids: tuple[int, ...] | None = field(default=None, hash=False)
    """The prompt as the engine's tokenizer made it (a chat's with its template applied), on a
    request's first chunk, when the engine says it."""


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """How a request left the engine: finished (``length``: hit ``max_tokens``; ``stop``: ended
    earlier, e.g. at end-of-sequence; ``tool_calls``: ended by calling tools, which
    ``tool_calls`` holds) or aborted with its partial output."""

    request_id: str
    text: str
    tokens: int
    finish_reason: FinishReason
    tool_calls: tuple[ToolCall, ...] = field(default=(), hash=False)

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"


ChunkCallback = Callable[[TokenChunk], None]


@runtime_checkable
class Engine(Protocol):
    """One serving instance as an agent drives it, on the wall clock (asyncio).

    Failures raise ``EngineError`` naming the instance; an unknown request id raises
    ``UnknownRequest``; an operation the engine cannot do raises ``UnsupportedOperation``.
    """

    name: str

    async def capabilities(self) -> EngineCapabilities:
        """What the instance serves and supports; called when an agent attaches."""
        ...

    async def submit(
        self, request: EngineRequest, on_chunk: ChunkCallback | None = None
    ) -> EngineOutput:
        """Run ``request`` to the end. ``on_chunk`` is called with every new piece of output as it
        streams. Returns the final output, or the partial one when the request is aborted meanwhile
        (``finish_reason == "abort"``). The caller usually runs it as a task."""
        ...

    async def abort(self, request_id: str) -> EngineOutput:
        """Stop a request now; returns its output so far (the agent resumes it later as prompt +
        partial output). Its ``submit`` returns the same output."""
        ...

    async def stats(self) -> EngineStats:
        """Load now: running, waiting, KV usage, preemptions. HTTP engines read gauges that lag."""
        ...

    async def set_model_tier(self, model: str, tier: ModelTier) -> ModelTier:
        """``ACTIVE``: wake up / load; ``WARM``: sleep level 1 (weights to CPU memory);
        ``COLD``: sleep level 2 (weights dropped). Returns once the change is made, with the
        tier ``model`` is in then: ``tier``, or the one it stays in when the engine cannot
        make that change alone (vLLM: a model asleep at level 2 asked ``WARM`` stays ``COLD``,
        its weights gone until it is woken). The caller records that tier, not the one it
        asked for."""
        ...

    async def swap_out(self, request_id: str) -> None:
        """Move a running request's KV cache to CPU memory, where supported."""
        ...

    async def swap_in(self, request_id: str) -> None:
        """Bring a swapped-out request back, where supported."""
        ...

    async def health(self) -> bool:
        """True when the instance answers and is serving; False when it answers that it is not,
        or cannot be reached (its process is gone). Raises ``EngineTimeout`` when it does not
        answer in time (slow, not known dead), and nothing else."""
        ...

    async def close(self) -> None:
        """Release connections and background tasks; in-flight requests are aborted."""
        ...
