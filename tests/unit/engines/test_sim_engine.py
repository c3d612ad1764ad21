"""Behaviour of the simulated vLLM instance, on a hand-made performance model so that every
expected number can be worked out by hand."""

from __future__ import annotations

import random

import pytest

from qlm.domain import GpuSpec, ModelSpec, ModelTier
from qlm.engines.base import EngineEvent, EngineRequest, EventKind
from qlm.engines.perf_model import PerfModel, StepTimeModel, prefill_pairs
from qlm.engines.sim import SimEngine, SimEngineConfig
from qlm.errors import EngineError, UnknownRequest

GPU = GpuSpec("G", memory_gb=80, memory_bandwidth_gbs=2000, fp16_tflops=300, host_link_gbs=20)
STEP = StepTimeModel(
    base_ms=10.0,
    per_seq_ms=0.05,
    compute_base_ms=5.0,
    per_token_ms=0.06,
    per_ctx_token_ms=1e-4,
    per_prefill_pair_ms=1e-6,
)


def make_perf(name: str = "m", *, weights_gb: float = 16.0, kv: int = 131072) -> PerfModel:
    model = ModelSpec(
        name, params_b=8, weights_gb=weights_gb, kv_bytes_per_token=kv, max_context=8192
    )
    return PerfModel(model, GPU, 1, STEP, "test", disk_load_gbs=2.0, load_overhead_s=0.5)


def make_engine(*models: str, **config: object) -> SimEngine:
    names = models or ("m",)
    perf = {m: make_perf(m) for m in names}
    return SimEngine("i0", perf, SimEngineConfig(**config))  # type: ignore[arg-type]


def req(rid: str, prompt: int = 100, out: int = 10, model: str = "m") -> EngineRequest:
    return EngineRequest(rid, model, prompt_tokens=prompt, max_tokens=out)


def run_to_end(engine: SimEngine, until: float = 1e9) -> list[EngineEvent]:
    events: list[EngineEvent] = []
    while (t := engine.next_event_time()) is not None and t <= until:
        events.extend(engine.advance(t))
    return events


def times(events: list[EngineEvent], kind: EventKind) -> dict[str, float]:
    return {e.request_id: e.time for e in events if e.kind is kind}


def test_lone_request_latency_is_one_prefill_plus_its_decode_steps() -> None:
    engine = make_engine(max_num_batched_tokens=2048)
    engine.submit(req("a", prompt=100, out=10), now=1.0)
    events = run_to_end(engine)

    prefill_ms = STEP.step_ms(
        n_scheduled=1, n_tokens=100, decode_ctx=0, prefill_pairs=prefill_pairs(100, 0)
    )
    decode_ms = sum(
        STEP.step_ms(n_scheduled=1, n_tokens=1, decode_ctx=100 + i + 1, prefill_pairs=0)
        for i in range(9)
    )
    assert times(events, EventKind.FIRST_TOKEN)["a"] == pytest.approx(1.0 + prefill_ms / 1000)
    finished = [e for e in events if e.kind is EventKind.FINISHED]
    assert finished[0].tokens == 10
    assert finished[0].time == pytest.approx(1.0 + (prefill_ms + decode_ms) / 1000)


def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    engine = make_engine(max_num_batched_tokens=512)
    engine.submit(req("a", prompt=1200, out=2), now=0.0)
    events = run_to_end(engine)
    chunks = [(512, 0), (512, 512), (176, 1024)]
    expected = sum(
        STEP.step_ms(n_scheduled=1, n_tokens=c, decode_ctx=0, prefill_pairs=prefill_pairs(c, b))
        for c, b in chunks
    )
    assert times(events, EventKind.FIRST_TOKEN)["a"] == pytest.approx(expected / 1000)
    assert engine.steps_total == 4


def test_batch_is_bounded_by_max_num_seqs() -> None:
    engine = make_engine(max_num_seqs=2)
    for rid in "abc":
        engine.submit(req(rid, out=5), now=0.0)
    events = run_to_end(engine)
    sched = times(events, EventKind.SCHEDULED)
    fin = times(events, EventKind.FINISHED)
    # Submitted together, "a" and "b" fill the batch; "c" waits for a free slot.
    assert sched["a"] == sched["b"] == 0.0
    assert sched["c"] == pytest.approx(min(fin["a"], fin["b"]))


def test_kv_exhaustion_preempts_the_newest_request_which_recomputes_later() -> None:
    # 20 blocks of 16 tokens = 320 tokens of KV: two requests of 100 + 100 tokens cannot both finish.
    engine = make_engine(kv_capacity_tokens=320, block_size=16)
    engine.submit(req("old", prompt=100, out=100), now=0.0)
    engine.submit(req("new", prompt=100, out=100), now=0.0)
    events = run_to_end(engine)
    preempted = [e for e in events if e.kind is EventKind.PREEMPTED]
    assert [e.request_id for e in preempted] == ["new"]
    fin = {e.request_id: e for e in events if e.kind is EventKind.FINISHED}
    assert fin["old"].tokens == fin["new"].tokens == 100
    assert fin["old"].time < fin["new"].time
    assert engine.preemptions_total == 1
    # Recompute: once "old" is done, "new" prefills its prompt and what it had generated again.
    generated = preempted[0].tokens
    assert generated > 0
    recompute_s = (
        STEP.step_ms(
            n_scheduled=1,
            n_tokens=100 + generated,
            decode_ctx=0,
            prefill_pairs=prefill_pairs(100 + generated, 0),
        )
        / 1000
    )
    assert fin["new"].time - fin["old"].time >= recompute_s
    assert engine.stats().kv_used_tokens == 0


def test_abort_returns_the_tokens_generated_so_far_and_frees_the_cache() -> None:
    engine = make_engine()
    engine.submit(req("a", prompt=100, out=1000), now=0.0)
    engine.advance(0.0)
    first = engine.next_event_time()
    assert first is not None
    engine.advance(first)  # the prefill step: one token
    engine.advance(first + 0.1)  # decode for a while, inside one fused step
    partial = engine.abort("a", now=first + 0.1)
    step_ms = STEP.step_ms(n_scheduled=1, n_tokens=1, decode_ctx=102, prefill_pairs=0)
    # About 0.1 s / ~10 ms of decode iterations, plus the first token.
    assert 1 + int(100 / step_ms) - 1 <= partial <= 1 + int(100 / step_ms)
    assert not engine.has_request("a")
    assert engine.stats().kv_used_tokens == 0
    assert run_to_end(engine) == []
    with pytest.raises(UnknownRequest):
        engine.abort("a", now=1.0)


def test_fused_decode_steps_give_the_same_results_as_stepping_one_by_one() -> None:
    rng = random.Random(7)
    arrivals = sorted(
        (rng.uniform(0, 20), f"r{i}", rng.randint(20, 1500), rng.randint(1, 300))
        for i in range(120)
    )

    def replay(max_macro_steps: int | None) -> list[tuple[str, str, float]]:
        engine = make_engine(kv_capacity_tokens=6000, max_macro_steps=max_macro_steps)
        out: list[EngineEvent] = []
        for t, rid, prompt, n in arrivals:
            while (nt := engine.next_event_time()) is not None and nt <= t:
                out.extend(engine.advance(nt))
            engine.submit(req(rid, prompt=prompt, out=n), now=t)
        out.extend(run_to_end(engine))
        return [(e.kind.value, e.request_id, round(e.time, 9)) for e in out]

    fused, stepped = replay(None), replay(1)
    assert sorted(fused) == sorted(stepped)
    assert any(kind == "preempted" for kind, _, _ in stepped)


def test_swap_out_pauses_a_request_and_swap_in_resumes_it_without_recompute() -> None:
    engine = make_engine()
    engine.submit(req("a", prompt=1000, out=50), now=0.0)
    engine.advance(0.0)  # the scheduler starts the prefill
    t = engine.next_event_time()
    assert t is not None
    engine.advance(t)
    engine.swap_out("a", now=t)
    events = engine.advance(engine.next_event_time() or t)
    assert [e.kind for e in events] == [EventKind.SWAPPED_OUT]
    assert engine.stats().swapped == 1 and engine.stats().kv_used_tokens == 0
    [(_, generated, _)] = engine.queue_view()
    assert run_to_end(engine, until=5.0) == []  # nothing happens while it is swapped out
    engine.swap_in("a", now=5.0)
    events = run_to_end(engine)
    kinds = [e.kind for e in events]
    assert EventKind.SWAPPED_IN in kinds and EventKind.PREEMPTED not in kinds
    fin = [e for e in events if e.kind is EventKind.FINISHED]
    assert fin[0].tokens == 50
    # Exactly the copy back plus the remaining decode steps: no second prefill of 1000 tokens.
    computed = 1000 + generated - 1
    expected = (
        5.0
        + make_perf().kv_transfer_s(computed)
        + sum(
            STEP.step_ms(n_scheduled=1, n_tokens=1, decode_ctx=computed + 1 + i, prefill_pairs=0)
            for i in range(50 - generated)
        )
        / 1000
    )
    assert fin[0].time == pytest.approx(expected)


def test_swap_in_before_the_swap_out_happened_cancels_it() -> None:
    engine = make_engine()
    engine.submit(req("a", prompt=1000, out=50), now=0.0)
    engine.advance(0.0)
    t = engine.next_event_time()
    assert t is not None
    engine.advance(t)
    engine.swap_out("a", now=t)
    engine.swap_in("a", now=t)  # the agent changed its mind before the iteration boundary
    events = run_to_end(engine)
    kinds = [e.kind for e in events]
    assert EventKind.SWAPPED_OUT not in kinds and EventKind.SWAPPED_IN not in kinds
    assert [e.tokens for e in events if e.kind is EventKind.FINISHED] == [50]


def test_swap_in_of_a_request_that_was_never_swapped_out_is_an_error() -> None:
    engine = make_engine()
    engine.submit(req("a", prompt=100, out=50), now=0.0)
    engine.advance(0.0)
    with pytest.raises(EngineError, match="not swapped out"):
        engine.swap_in("a", now=0.0)


def test_model_switch_costs_the_warm_or_cold_load_time() -> None:
    perf = {"a": make_perf("a"), "b": make_perf("b"), "c": make_perf("c")}
    tiers = {"a": ModelTier.ACTIVE, "b": ModelTier.WARM, "c": ModelTier.COLD}
    engine = SimEngine("i0", perf, SimEngineConfig(), initial_tiers=tiers)
    engine.submit(req("x", model="b", out=1), now=0.0)
    engine.advance(0.0)
    assert engine.next_event_time() == pytest.approx(perf["b"].warm_load_s)
    events = run_to_end(engine)
    ready = [e for e in events if e.kind is EventKind.MODEL_READY]
    assert ready[0].model == "b" and ready[0].time == pytest.approx(perf["b"].warm_load_s)
    assert engine.tiers["a"] is ModelTier.WARM  # the old model went to sleep in CPU memory
    t0 = events[-1].time
    engine.submit(req("y", model="c", out=1), now=t0)
    engine.advance(t0)
    assert engine.next_event_time() == pytest.approx(t0 + perf["c"].cold_load_s)
    assert perf["c"].cold_load_s > perf["c"].warm_load_s
    assert engine.model_switches == 2


def test_requests_of_another_model_wait_for_the_running_batch_to_drain() -> None:
    engine = make_engine("a", "b")
    engine.submit(req("a1", model="a", out=20), now=0.0)
    engine.submit(req("b1", model="b", out=1), now=0.0)
    engine.submit(req("a2", model="a", out=1), now=0.0)
    events = run_to_end(engine)
    fin = times(events, EventKind.FINISHED)
    ready = [e for e in events if e.kind is EventKind.MODEL_READY]
    # FCFS across models: b1 is older than a2, so the engine drains a1 and switches, then back.
    assert fin["a1"] <= ready[0].time < fin["b1"] < fin["a2"]
    assert engine.model_switches == 2


def test_bad_submissions_are_refused_with_the_reason() -> None:
    engine = make_engine()
    with pytest.raises(EngineError, match="not served"):
        engine.submit(req("a", model="other"), now=0.0)
    with pytest.raises(EngineError, match="max context"):
        engine.submit(req("a", prompt=8000, out=500), now=0.0)
    engine.submit(req("a"), now=0.0)
    with pytest.raises(EngineError, match="already"):
        engine.submit(req("a"), now=0.0)


def test_with_explicit_switching_the_engine_serves_the_active_model_and_waits_for_orders() -> None:
    engine = make_engine("a", "b", model_switching="explicit")
    engine.submit(req("b1", model="b", out=1), now=0.0)
    engine.submit(req("a1", model="a", out=5), now=0.0)
    events = run_to_end(engine)
    assert [e.request_id for e in events if e.kind is EventKind.FINISHED] == ["a1"]
    assert engine.model_switches == 0 and engine.has_request("b1")
    t = events[-1].time
    engine.set_model_tier("b", ModelTier.ACTIVE, now=t)
    events = run_to_end(engine)
    assert [e.request_id for e in events if e.kind is EventKind.FINISHED] == ["b1"]
    assert engine.model_switches == 1


def test_operations_refuse_to_run_behind_the_engines_clock() -> None:
    engine = make_engine()
    engine.submit(req("a"), now=0.0)
    with pytest.raises(EngineError, match="advance"):
        engine.submit(req("b"), now=1.0)
