"""Random operation sequences against the simulated engine: invariants hold after every call, and
fused decode runs give exactly the events of stepping one iteration at a time."""

from __future__ import annotations

import random

import pytest

from qlm.domain import ModelTier
from qlm.engines.base import EngineRequest
from qlm.engines.sim import SimEngine, SimEngineConfig
from qlm.errors import EngineError

from .test_sim_engine import make_perf

Op = tuple[float, str, object, object, object, object]
SCENARIOS = {
    "submit_abort": (("m",), ("submit", "abort")),
    "swaps": (("m",), ("submit", "abort", "swap_out", "swap_in")),
    "models": (("a", "b"), ("submit", "abort", "swap_out", "swap_in", "tier")),
    "models_explicit": (("a", "b"), ("submit", "abort", "swap_out", "swap_in", "tier")),
}


def script(seed: int, models: tuple[str, ...], ops: tuple[str, ...], n: int = 80) -> list[Op]:
    rng = random.Random(seed)
    t, rid, out = 0.0, 0, []
    for _ in range(n):
        t += rng.expovariate(1 / 0.3)
        op = rng.choice((*ops, "submit", "submit"))
        if op == "submit":
            out.append(
                (t, op, f"r{rid}", rng.randint(1, 1500), rng.randint(1, 200), rng.choice(models))
            )
            rid += 1
        elif op == "tier":
            out.append((t, op, rng.choice(models), rng.choice(list(ModelTier)), None, None))
        else:
            out.append((t, op, f"r{rng.randrange(max(rid, 1))}", None, None, None))
    return out


def check_invariants(e: SimEngine) -> None:
    held = sum(s.blocks for s in e.running)
    if e.active_model is not None:
        assert e._free_blocks + held == e._capacity_blocks[e.active_model], "KV blocks leaked"
    assert e._free_blocks >= 0
    assert all(s.blocks == 0 for s in (*e.waiting, *e.swapped.values())), "blocks held off-GPU"
    inside = {s.rid for s in e.running} | {s.rid for s in e.waiting} | set(e.swapped)
    assert set(e._by_id) == inside, "a request is lost or duplicated"


def replay(
    ops: list[Op], models: tuple[str, ...], fuse: bool, switching: str = "fcfs"
) -> tuple[list[tuple[object, ...]], list[object], SimEngine]:
    cfg = SimEngineConfig(
        kv_capacity_tokens=4000,
        max_num_batched_tokens=512,
        max_num_seqs=16,
        swap_space_gb=1.0,
        fuse_decode=fuse,
        model_switching=switching,  # type: ignore[arg-type]
    )
    e = SimEngine("i0", {m: make_perf(m) for m in models}, cfg)
    events, log, last = [], [], -1.0

    def advance_to(t: float) -> None:
        nonlocal last
        while (nt := e.next_event_time()) is not None and nt <= t:
            for ev in e.advance(nt):
                assert ev.time >= last - 1e-12, "event times went backwards"
                last = ev.time
                events.append(
                    (ev.kind.value, ev.request_id, round(ev.time, 9), ev.tokens, ev.model)
                )
            check_invariants(e)

    for t, op, a, b, c, d in ops:
        advance_to(t)
        try:
            if op == "submit":
                e.submit(EngineRequest(str(a), str(d), prompt_tokens=int(b), max_tokens=int(c)), t)  # type: ignore[call-overload]
                log.append("ok")
            elif op == "abort":
                log.append(e.abort(str(a), t))
            elif op == "swap_out":
                e.swap_out(str(a), t)
                log.append("ok")
            elif op == "swap_in":
                e.swap_in(str(a), t)
                log.append("ok")
            else:
                e.set_model_tier(str(a), b, t)  # type: ignore[arg-type]
                log.append("ok")
        except EngineError as exc:
            log.append(type(exc).__name__)
        check_invariants(e)
    advance_to(1e9)
    return sorted(events), log, e  # type: ignore[return-value]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("seed", range(40))
def test_random_operations_keep_invariants_and_fusion_changes_nothing(name: str, seed: int) -> None:
    models, ops = SCENARIOS[name]
    steps = script(seed, models, ops)
    switching = "explicit" if name.endswith("explicit") else "fcfs"
    fused_events, fused_log, fused = replay(steps, models, fuse=True, switching=switching)
    stepped_events, stepped_log, _ = replay(steps, models, fuse=False, switching=switching)
    assert fused_log == stepped_log
    assert fused_events == stepped_events
    left = set(fused._by_id) - set(fused.swapped)
    if switching == "fcfs":
        # Only requests a caller swapped out and never swapped back in may remain.
        assert not left, "a request was left stuck in the engine"
    else:
        # With explicit switching, only requests of a model nobody activated may wait.
        assert all(fused._by_id[r].model != fused.active_model for r in left)
