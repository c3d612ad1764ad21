"""What the RCT estimator is shown: an instance as it sees it, and the requests on one."""

from __future__ import annotations

from dataclasses import dataclass

from qlm.domain import Request


@dataclass(frozen=True, slots=True)
class Queued:
    """A request on an instance, with the output tokens it has generated so far; ``running`` when
    it is in the engine's batch (its prompt is already processed)."""

    request: Request
    generated: int = 0
    running: bool = False


@dataclass(frozen=True, slots=True)
class EstimatorInstance:
    """An instance as the estimator sees it right now: its hardware, the models it holds and
    its engine's preemption counter."""

    name: str
    gpu: str
    gpu_count: int
    active_model: str | None
    warm_models: frozenset[str] = frozenset()
    # The engine's preemption counter (vLLM's ``vllm:num_preemptions_total``); None: not read.
    preemptions_total: int | None = None
