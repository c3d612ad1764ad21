"""What an engine is asked to run and what it reports back.

These are the plain data crossing the engine seam; the ``Engine`` protocol itself (shared by the
simulated engine and the vLLM HTTP client) grows with the agents that drive it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from qlm.domain import ModelTier


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

    @property
    def tokens_to_generate(self) -> int:
        if self.output_tokens is None:
            return self.max_tokens
        return min(self.output_tokens, self.max_tokens)


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

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0
