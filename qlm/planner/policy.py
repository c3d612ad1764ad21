"""The one interface every scheduling policy implements, and what it is told at each step.

A policy is pure: ``decide(ctx)`` gets the time, the requests that arrived (or came back after an
eviction) since the last call, the completions since the last call and the state of every instance,
and returns decisions (``Pull``, ``Evict``, ...). The harness (simulation) or the controller
(production) applies them; the policy never reads a clock or touches an engine.

Policies that hold requests back keep them in their own queues and *pull* them onto an instance
while it has room (``has_room``): the agent counts what it sent itself, because an engine's gauges
lag (vLLM's ``num_requests_running`` is sampled once per iteration).

Besides ``decide``, a policy answers what the controller, the service and the simulator read of
it (``Policy``): the plans it made since it was last asked (handed over once), its virtual queues
with their predictions, whether the agents switch models themselves, and the output lengths it
learns from completions it did not see. ``PolicyBase`` answers them for a policy that plans
nothing, holds no virtual queues and learns nothing: every baseline builds on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from qlm.domain import Decision, ModelTier, PlanRecord, Request

if TYPE_CHECKING:
    from qlm.virtual_queues import VirtualQueuesSnapshot

ModelSwitching = Literal["fcfs", "explicit"]
"""How the simulated engines switch models: on their own as vLLM does (``fcfs``), or only when a
decision tells them (``explicit``: the policy's agents warm-start models)."""


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """What a policy knows of one instance: its models and the work it has been given.

    ``outstanding_*`` count what was dispatched to it and has not finished (counted by the
    executor, not read from the engine); ``outstanding_tokens`` is their prompt tokens (including
    the output an evicted request resumes from). ``max_running`` is the engine's ``max_num_seqs``
    and ``token_capacity`` its KV cache in tokens.
    """

    name: str
    models: tuple[str, ...]
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    max_running: int = 256
    token_capacity: int = 1 << 30
    gpu: str = ""
    gpu_count: int = 1
    active_model: str | None = None
    up: bool = True
    host_link_gbs: float = 0.0  # GPU <-> CPU copy bandwidth, one way; 0: no KV swap
    swap_free_gb: float = 0.0  # CPU swap space left for KV caches
    model_tiers: tuple[tuple[str, ModelTier], ...] = ()  # where each model's weights are
    model_weights_gb: tuple[tuple[str, float], ...] = ()
    cpu_cache_gb: float = 0.0  # CPU memory for warm models' weights
    # The engine's count of its own preemptions (vLLM's ``vllm:num_preemptions_total``: KV cache
    # full, the newest request's blocks freed and recomputed later); None when not read.
    preemptions_total: int | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """A request that finished since the last step, with what was measured."""

    request: Request
    instance: str
    output_tokens: int
    scheduled_s: float | None
    first_token_s: float | None
    finish_s: float


@dataclass(frozen=True, slots=True)
class DispatchContext:
    """Input of one decision.

    ``arrived``: requests handed to the policy since the last call — new arrivals and evicted
    requests coming back (``generated`` says how many output tokens they keep). Every request the
    policy is given must eventually be pulled, unless it is ``cancelled`` first. ``pending`` is kept for dispatch-on-arrival policies
    and equals ``arrived``.
    """

    now: float
    arrived: tuple[Request, ...]
    instances: tuple[InstanceLoad, ...]
    finished: tuple[Completion, ...] = ()
    generated: tuple[tuple[str, int], ...] = ()
    started: tuple[str, ...] = ()  # requests an engine began running since the last call
    cancelled: tuple[str, ...] = ()
    """Requests to forget wherever the policy holds them (waiting in its queues, or sent to an
    instance: the executor has aborted those). They never come back."""

    @property
    def pending(self) -> tuple[Request, ...]:
        return self.arrived


class Policy(Protocol):
    """What the controller, the service and the simulator need of a scheduling policy."""

    @property
    def name(self) -> str:
        """The name it is selected by (``qlm.planner.POLICIES``)."""
        ...

    @property
    def model_switching(self) -> ModelSwitching | None:
        """How simulated engines must switch models under this policy (None: their default)."""
        ...

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        """Called whenever something changed (arrival, completion, tick); returns what to do."""
        ...

    def take_plans(self) -> list[PlanRecord]:
        """The plans made since the last call, oldest first; each is handed over once."""
        ...

    def snapshot(self, now: float) -> VirtualQueuesSnapshot | None:
        """The virtual queues now, with what the planner's model predicts of each group; None
        for a policy without virtual queues. Costly under a large backlog: asked for on demand,
        never by a step."""
        ...

    def learn_output(self, request: Request, output_tokens: int) -> bool:
        """``request`` finished with ``output_tokens`` before this policy started (the store's
        completions, when a controller starts or takes over): learn its output length (nothing
        about any instance: the policy did not predict it). Returns whether it learns from
        it (False: the policy keeps no output-length belief)."""
        ...


class PolicyBase:
    """``Policy``'s answers for a policy that plans nothing, holds no virtual queues and learns
    no output lengths; a policy overrides what it does."""

    model_switching: ModelSwitching | None = None

    def take_plans(self) -> list[PlanRecord]:
        return []

    def snapshot(self, now: float) -> VirtualQueuesSnapshot | None:
        return None

    def learn_output(self, request: Request, output_tokens: int) -> bool:
        return False


def prompt_tokens(request: Request, generated: int = 0) -> int:
    """Tokens an instance must hold for ``request`` when it starts (a resumed request re-reads
    its earlier output as prompt)."""
    return request.input_tokens + generated


def has_room(load: InstanceLoad, requests: int, tokens: int, request_tokens: int) -> bool:
    """May one more request of ``request_tokens`` prompt tokens be pulled onto ``load``, given
    ``requests``/``tokens`` already pulled in this step? Room means fewer running than
    ``max_num_seqs`` and the prompts within the KV cache; output growth beyond that is the engine's
    to handle (it preempts, as vLLM does). An idle instance always takes one request."""
    if not load.up:
        return False
    running = load.outstanding_requests + requests
    if running >= load.max_running:
        return False
    return running == 0 or load.outstanding_tokens + tokens + request_tokens <= load.token_capacity
