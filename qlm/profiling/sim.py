"""Hardware profiling of a simulated instance (paper §6, "Offline Profiling"): batches run on a
``SimEngine`` in virtual time and measured — nothing is read from the engine's own performance
model:

1. a request alone at several prompt lengths (one output token): its TTFT gives the prefill line
   ``P(I) = a + b·I`` (least squares); a request alone decoding after a prompt of the workload's
   length and after one four times as long: its time per token alone, and what each token of
   context adds to a decode step;
2. one saturating batch — more requests of the workload's typical lengths than the instance can run
   at once, submitted together — run to completion: ``Θ`` is the output tokens per second once the
   prompt work is taken out, ``ε`` the mean time per output token over all requests divided by that
   of the requests never preempted;
3. one full batch (as many requests as fit at once), streamed: ``d`` is the median time per output
   token once every prompt is in — pure decode at the saturation batch size;
4. the model woken from CPU memory (warm) and loaded from disk (cold) on an idle engine: the
   load times per tier.

The KV bytes per token are the model's (its architecture, from the catalog), as for a vLLM
server, whose API does not export them either. The same measurements against a vLLM server:
``qlm.profiling.vllm``; the fitting: ``qlm.rct.fit``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import replace

from qlm.domain import ModelTier
from qlm.engines.base import EngineRequest, EventKind
from qlm.engines.perf_model import PerfModel
from qlm.engines.sim import SimEngine, SimEngineConfig
from qlm.errors import ConfigError
from qlm.rct.fit import PREFILL_LENGTHS, fit_line
from qlm.rct.profile import HardwareProfile


def _run(engine: SimEngine, requests: Sequence[EngineRequest]) -> dict[str, dict[str, float]]:
    """Submit ``requests`` at t=0 and run to completion; per request: first token, finish,
    preemptions. Also returns the time-weighted mean running batch under key ``""``."""
    for r in requests:
        engine.submit(r, 0.0)
    out: dict[str, dict[str, float]] = {r.request_id: {"preemptions": 0.0} for r in requests}
    ticks: list[tuple[float, str, int]] = []  # (time, request, tokens so far) when streaming
    batch_area, last_t = 0.0, 0.0
    while (t := engine.next_event_time()) is not None:
        batch_area += engine.stats().running * (t - last_t)
        last_t = t
        for ev in engine.advance(t):
            rec = out.get(ev.request_id)
            if rec is None:
                continue
            if ev.kind is EventKind.FIRST_TOKEN:
                rec["first"] = ev.time
            elif ev.kind is EventKind.FINISHED:
                rec["finish"] = ev.time
                rec["tokens"] = ev.tokens
            elif ev.kind is EventKind.PREEMPTED:
                rec["preemptions"] += 1
            if ev.kind in (EventKind.TOKENS, EventKind.FIRST_TOKEN):
                ticks.append((ev.time, ev.request_id, ev.tokens))
    out[""] = {"mean_batch": batch_area / last_t if last_t > 0 else 0.0, "makespan": last_t}
    if ticks:
        # Pure decode: from the moment every prompt is in, the time per token of each request.
        t_p = max(r["first"] for rid, r in out.items() if rid)
        start: dict[str, tuple[float, int]] = {}
        for t, rid, n in ticks:
            if t >= t_p and rid not in start:
                start[rid] = (t, n)
        per = []
        for rid, (t0, n0) in start.items():
            rec = out[rid]
            total = rec.get("tokens", 0.0)
            if total - n0 >= 8:
                per.append((rec["finish"] - t0) / (total - n0))
        out[""]["pure_decode"] = statistics.median(per) if per else 0.0
    return out


def profile_sim_hardware(
    perf: PerfModel,
    *,
    config: SimEngineConfig | None = None,
    input_tokens: int = 1024,
    output_tokens: int = 256,
    oversubscribe: float = 1.5,
) -> HardwareProfile:
    """Profile one simulated instance type (see the module docstring)."""
    name = perf.model.name
    cfg = config or SimEngineConfig.for_gpu(perf.gpu.memory_gb, perf.gpu.name)
    ctx = perf.model.max_context
    if input_tokens + output_tokens > ctx:
        raise ConfigError(f"profile lengths {input_tokens}+{output_tokens} exceed {name}'s context")

    lengths = [n for n in PREFILL_LENGTHS if n + 1 <= ctx]
    ttfts = []
    for n in lengths:
        engine = SimEngine("profile", {name: perf}, cfg)
        res = _run(engine, [EngineRequest("p", name, n, max_tokens=1)])
        ttfts.append(res["p"]["first"])
    b, a = fit_line(lengths, ttfts)

    if output_tokens < 2:
        raise ConfigError("profiling needs output_tokens >= 2 to measure decode time")
    d_alone = _decode_alone(perf, cfg, input_tokens, output_tokens)
    # The same request with a longer prompt: the slope is what a token of context adds to a
    # decode step (attention reads the whole KV cache).
    long_prompt = min(4 * input_tokens, ctx - output_tokens)
    per_ctx = 0.0
    if long_prompt > input_tokens:
        d_long = _decode_alone(perf, cfg, long_prompt, output_tokens)
        per_ctx = max(0.0, (d_long - d_alone) / (long_prompt - input_tokens))

    engine = SimEngine("profile", {name: perf}, cfg)
    capacity = engine.stats().kv_capacity_tokens
    concurrent = min(cfg.max_num_seqs, max(1, capacity // (input_tokens + output_tokens)))
    n_req = max(2, math.ceil(concurrent * oversubscribe))
    batch = [EngineRequest(f"s{i}", name, input_tokens, output_tokens) for i in range(n_req)]
    res = _run(engine, batch)
    summary = res.pop("")
    tpot = {
        rid: (r["finish"] - r["first"]) / (output_tokens - 1)
        for rid, r in res.items()
        if output_tokens > 1
    }
    clean = [tpot[rid] for rid, r in res.items() if r["preemptions"] == 0]
    d_burst = statistics.median(clean or list(tpot.values()))
    eps = statistics.fmean(tpot.values()) / d_burst

    # A full batch without oversubscription, streamed: the decode speed once all prompts are in.
    stream_cfg = replace(cfg, emit_token_events=True)
    engine = SimEngine("profile", {name: perf}, stream_cfg)
    full = [EngineRequest(f"f{i}", name, input_tokens, output_tokens) for i in range(concurrent)]
    pure = _run(engine, full)[""]
    d = pure.get("pure_decode") or d_burst
    batch_size = float(concurrent)
    total_out = n_req * output_tokens
    prompt_work = n_req * input_tokens * b
    decode_time = max(summary["makespan"] - prompt_work, 1e-9)
    return HardwareProfile(
        model=name,
        gpu=perf.gpu.name,
        gpu_count=perf.gpu_count,
        prefill_base_s=max(a, 0.0),
        prefill_per_token_s=b,
        input_token_work_s=b,
        throughput_tps=total_out / decode_time,
        decode_per_token_s=d,
        decode_alone_s=d_alone,
        inefficiency=max(eps, 1.0),
        saturation_batch=batch_size,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        decode_per_ctx_token_s=per_ctx,
        decode_ctx_tokens=input_tokens + output_tokens / 2,
        kv_bytes_per_token=perf.model.kv_bytes_per_token,
        kv_capacity_tokens=capacity,
        warm_load_s=_load_time(perf, cfg, ModelTier.WARM),
        cold_load_s=_load_time(perf, cfg, ModelTier.COLD),
        source=(
            f"simulated engine, {n_req} requests of {input_tokens}+{output_tokens} tokens "
            f"and prefill at {len(lengths)} lengths"
        ),
    )


def _load_time(perf: PerfModel, cfg: SimEngineConfig, tier: ModelTier) -> float:
    """Seconds an idle engine takes to make the model active from ``tier`` (WARM: its weights in
    CPU memory, vLLM's sleep level 1; COLD: from disk)."""
    name = perf.model.name
    engine = SimEngine("profile", {name: perf}, cfg, initial_tiers={name: tier})
    engine.set_model_tier(name, ModelTier.ACTIVE, 0.0)
    t = engine.next_event_time()
    while t is not None:
        for event in engine.advance(t):
            if event.kind is EventKind.MODEL_READY:
                return event.time
        t = engine.next_event_time()
    raise ConfigError(f"profiling: the simulated engine never made {name} active")


def _decode_alone(perf: PerfModel, cfg: SimEngineConfig, prompt: int, output: int) -> float:
    """Time per output token of one request running alone."""
    engine = SimEngine("profile", {perf.model.name: perf}, cfg)
    alone = _run(engine, [EngineRequest("d", perf.model.name, prompt, output)])["d"]
    return (alone["finish"] - alone["first"]) / (output - 1)
