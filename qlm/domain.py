"""Plain data of the control plane: requests with their SLOs, hardware and model specs, decisions.

Nothing here does I/O or reads a clock. Every type is a frozen dataclass so that it can be logged,
compared, hashed and replayed — except ``RequestRecord``, which the controller fills in while it
holds the request and hands out as copies; the edges (HTTP bodies, settings, the store)
translate to and from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import IntEnum
from operator import attrgetter


class Tier(IntEnum):
    """Priority tier of a request. Lower is more urgent, as vLLM's ``priority`` field."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2

    @classmethod
    def parse(cls, value: str | int | Tier) -> Tier:
        """Accept ``Tier``, its number or its (case-insensitive) name; raise ``ValueError`` naming it."""
        if isinstance(value, Tier):
            return value
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[value.strip().upper()]
        except KeyError:
            names = ", ".join(t.name.lower() for t in cls)
            raise ValueError(f"unknown tier {value!r}; expected one of {names}") from None


class RequestStatus(IntEnum):
    """Life-cycle of a request, ordered: a request only moves forward (resumption re-queues it)."""

    QUEUED = 0
    RUNNING = 1
    FINISHED = 2
    FAILED = 3
    CANCELLED = 4

    @property
    def is_final(self) -> bool:
        return self >= RequestStatus.FINISHED


MIN_SLO_S = 0.01
"""The shortest SLO (end-to-end or time to first token) the API accepts: 10 ms. Shorter is
never meetable (an HTTP round trip alone takes longer) and makes deadline arithmetic degenerate."""

MAX_SLO_S = 1e9
"""The longest SLO the control plane handles (about 31 years): beyond it a deadline means
"none". The API accepts at most a week (``MAX_API_SLO_S``)."""

MAX_API_SLO_S = 7 * 24 * 3600.0
"""The longest SLO the API accepts, and its default SLOs may be: a week (longer is no objective
a queue can plan for)."""


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency objectives of one request, in seconds from its arrival."""

    e2e_s: float
    ttft_s: float | None = None

    def __post_init__(self) -> None:
        if not self.e2e_s > 0:
            raise ValueError(f"e2e_s must be > 0, got {self.e2e_s}")
        if self.ttft_s is not None and not 0 < self.ttft_s <= self.e2e_s:
            raise ValueError(f"ttft_s must be in (0, e2e_s={self.e2e_s}], got {self.ttft_s}")


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request as the control plane sees it.

    ``max_tokens`` is the client's cap and is all a policy may know about the output length.
    ``replay_output_tokens`` is the true output length of a replayed trace request: only engines use
    it (the simulated engine stops there, as a real model would at end-of-sequence; a real vLLM is
    sent ``ignore_eos`` with that many tokens). Policies must never read it.
    """

    id: str
    model: str
    input_tokens: int
    max_tokens: int
    arrival_s: float
    slo: SLO
    tier: Tier = Tier.STANDARD
    tenant: str = "default"
    slo_class: str = "default"
    replay_output_tokens: int | None = None
    labels: tuple[tuple[str, str], ...] = ()
    resumable: bool = True
    """False when output so far cannot be continued (a structured answer: vLLM's grammar starts
    at the answer's first token). Interrupted, it starts over, so policies do not preempt it."""

    def __post_init__(self) -> None:
        if self.input_tokens < 1:
            raise ValueError(f"input_tokens must be >= 1, got {self.input_tokens}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.replay_output_tokens is not None and self.replay_output_tokens < 1:
            raise ValueError(f"replay_output_tokens must be >= 1, got {self.replay_output_tokens}")

    @property
    def deadline_s(self) -> float:
        """Absolute end-to-end deadline on the same clock as ``arrival_s``."""
        return self.arrival_s + self.slo.e2e_s

    @property
    def output_tokens_to_generate(self) -> int:
        """What an engine generates: the replayed length when known, else up to ``max_tokens``."""
        if self.replay_output_tokens is None:
            return self.max_tokens
        return min(self.replay_output_tokens, self.max_tokens)


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator type: what the simulated engine and the estimator need of it."""

    name: str
    memory_gb: float
    memory_bandwidth_gbs: float
    fp16_tflops: float
    host_link_gbs: float  # GPU <-> CPU copy bandwidth (PCIe), one way


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One served model: size of its weights and of its KV cache per token."""

    name: str
    params_b: float
    weights_gb: float
    kv_bytes_per_token: int
    max_context: int


class ModelTier(IntEnum):
    """Where a model's weights are: active on the GPU, warm in CPU memory, or cold on disk."""

    ACTIVE = 0
    WARM = 1
    COLD = 2


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One serving instance (a vLLM server): its GPUs and the models it may serve.

    ``url`` is set for a real (HTTP) instance and empty for an in-process simulated one.
    """

    name: str
    gpu: str
    models: tuple[str, ...]
    gpu_count: int = 1
    url: str = ""

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError(f"instance {self.name!r} must serve at least one model")
        if self.gpu_count < 1:
            raise ValueError(
                f"instance {self.name!r}: gpu_count must be >= 1, got {self.gpu_count}"
            )


# --- Decisions: what a policy or an agent asks an executor to do. -----------------------------


@dataclass(frozen=True, slots=True)
class Pull:
    """Send a waiting request to an instance (request pulling / dispatch). ``overdue``: it is
    served ahead of the plan's order because it waited longer than its tier's maximum wait (the
    QLM policy's starvation guard)."""

    request_id: str
    instance: str
    overdue: bool = False


@dataclass(frozen=True, slots=True)
class Evict:
    """Abort a running request; it keeps its partial output and resumes later."""

    request_id: str
    instance: str


@dataclass(frozen=True, slots=True)
class SwapOut:
    """Move a running request's KV cache to CPU memory and pause it."""

    request_id: str
    instance: str


@dataclass(frozen=True, slots=True)
class SwapIn:
    """Bring a swapped-out request's KV cache back to the GPU and continue it."""

    request_id: str
    instance: str


@dataclass(frozen=True, slots=True)
class SetModelTier:
    """Move a model's weights on an instance to a tier (warm start, offload, drop)."""

    instance: str
    model: str
    tier: ModelTier


@dataclass(frozen=True, slots=True)
class Reject:
    """End a request failed for ``reason``: its handling raised inside a control step (poison).
    The controller emits it, never a policy; the executor reports the failure and forgets the
    request, which is never retried."""

    request_id: str
    reason: str


Decision = Pull | Evict | SwapOut | SwapIn | SetModelTier | Reject


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request, as measured by whoever served it (simulation or production).

    The controller keeps one per request it holds and fills it in as the request runs
    (``Controller.track``); what it hands out (a simulation's results, an outcome to record) is
    a ``copy``, which later steps leave alone."""

    request: Request
    instance: str = ""
    dispatch_s: float | None = None
    scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0
    preemptions: int = 0
    evictions: int = 0
    swaps: int = 0
    status: RequestStatus = RequestStatus.QUEUED
    failovers: int = 0  # times an instance running it failed (it resumed elsewhere or later)
    error: str = ""  # why it failed
    estimated_input_tokens: int = 0  # its prompt as the API estimated it, before ``prompt_scale``

    def copy(self) -> RequestRecord:
        """This record as it is now."""
        return RequestRecord(*_record_fields(self))

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.request.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.request.arrival_s

    @property
    def queue_s(self) -> float | None:
        """Time waiting before an engine first ran it: in a global queue and in the engine's."""
        return None if self.scheduled_s is None else self.scheduled_s - self.request.arrival_s

    @property
    def slo_met(self) -> bool:
        """Finished within the end-to-end deadline and, when one is set, the TTFT deadline."""
        if self.status is not RequestStatus.FINISHED or self.e2e_s is None:
            return False
        if self.e2e_s > self.request.slo.e2e_s:
            return False
        ttft_slo = self.request.slo.ttft_s
        return ttft_slo is None or (self.ttft_s is not None and self.ttft_s <= ttft_slo)


_record_fields = attrgetter(*(f.name for f in fields(RequestRecord)))
"""Every field of a ``RequestRecord``, in order: its ``copy`` (``dataclasses.replace`` costs
several times more, and a simulation copies every record)."""


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """One planning event: when and why the planner ran, and how it went (what the store keeps,
    the API and the CLI show, and a simulation summarises)."""

    at_s: float
    trigger: str
    groups: int
    status: str
    method: str
    objective: float
    edf_objective: float
    at_risk: tuple[str, ...]
    capacity_needed: float | None
    solve_s: float
    evaluations: int
    concurrency: dict[str, int] = field(default_factory=dict)
    deferred: int = 0  # groups deferred by cost-aware admission
