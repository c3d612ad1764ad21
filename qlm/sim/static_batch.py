"""Run one static batch on a simulated engine and measure it, the way AIConfigurator and a
hardware-profiling run see a batch: B requests of the same input length submitted together, each
generating the same number of tokens.

With ``whole_batch=True`` the engine gets room for the whole batch in one iteration and unbounded
KV (AIConfigurator's static-batch assumptions); otherwise it runs with its own configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from qlm.engines.base import EngineRequest, EventKind
from qlm.engines.perf_model import PerfModel
from qlm.engines.sim import SimEngine, SimEngineConfig


@dataclass(frozen=True, slots=True)
class BatchLatency:
    ttft_s: float  # until the last request of the batch has its first token
    tpot_s: float  # mean time per output token after the first, over the batch
    latency_s: float  # until the last request finishes


def run_static_batch(
    perf: PerfModel,
    *,
    batch: int,
    input_tokens: int,
    output_tokens: int,
    whole_batch: bool = True,
    config: SimEngineConfig | None = None,
) -> BatchLatency:
    if whole_batch:
        config = SimEngineConfig(
            max_num_seqs=batch,
            max_num_batched_tokens=batch * input_tokens,
            kv_capacity_tokens=batch * (input_tokens + output_tokens) + 16 * batch,
        )
    engine = SimEngine("static", {perf.model.name: perf}, config)
    for i in range(batch):
        engine.submit(
            EngineRequest(f"b{i}", perf.model.name, input_tokens, max_tokens=output_tokens), 0.0
        )
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    while (t := engine.next_event_time()) is not None:
        for ev in engine.advance(t):
            if ev.kind is EventKind.FIRST_TOKEN:
                first[ev.request_id] = ev.time
            elif ev.kind is EventKind.FINISHED:
                finish[ev.request_id] = ev.time
    per_token = (
        [(finish[r] - first[r]) / (output_tokens - 1) for r in finish] if output_tokens > 1 else [0]
    )
    return BatchLatency(
        ttft_s=max(first.values()),
        tpot_s=sum(per_token) / len(per_token),
        latency_s=max(finish.values()),
    )
