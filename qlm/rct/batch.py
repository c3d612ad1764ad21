"""The batch an instance runs, from its hardware profile and the mix of requests on it: how
many requests it holds at once, their KV footprint, the batch its token budget sustains, and
what an output token costs in that batch against the profile's throughput. Pure functions the
RCT estimator (``qlm.rct.estimator``) builds its model from."""

from __future__ import annotations

import math

from qlm.rct.profile import HardwareProfile


def slots_for(hw: HardwareProfile, mean_tokens: float) -> int:
    """How many requests of ``mean_tokens`` (prompt + output) the instance runs at once."""
    by_kv = hw.kv_capacity_tokens / max(mean_tokens, 1.0)
    return max(1, int(min(hw.max_num_seqs, by_kv)))


def context_tokens(hw: HardwareProfile, batch: int, slots: int, per_request: float) -> float:
    """KV footprint (tokens) of a batch of ``batch`` requests of ``per_request`` tokens each. A
    batch the KV cache limits is a full cache: the engine admits until it is, and preempts to
    keep it so as outputs grow."""
    if batch >= slots and slots < hw.max_num_seqs:
        return float(hw.kv_capacity_tokens)
    return min(float(hw.kv_capacity_tokens), batch * per_request)


def output_work_scale(hw: HardwareProfile, slots: int, per_request: float) -> float:
    """GPU time of an output token in the batch this mix fills, relative to the profile's ``1 / Θ``
    (measured in a batch of the profile's requests): a saturated instance decodes ``B`` tokens
    per step of ``d(B, K)``, and a mix of long requests fills its KV cache with fewer of them.
    (ShareGPT's 2,340 + 439-token requests: 151 to an A100's cache, each output token 1.9× the
    profile's GPU time; Azure conversation's: 1.05×.)"""
    sat = hw.saturation_batch
    if sat <= 0:
        return 1.0
    ref_ctx = sat * hw.decode_ctx_tokens if hw.decode_ctx_tokens > 0 else None
    ref = hw.decode_s(sat, ref_ctx) / sat
    cur = hw.decode_s(slots, context_tokens(hw, slots, slots, per_request)) / slots
    return cur / ref if ref > 0 else 1.0


def sustained_batch(hw: HardwareProfile, refill: float) -> float:
    """Requests a busy instance keeps running under its token budget per step ``T``: each
    step decodes one token of each of ``B`` requests and prefills the prompts of those that
    replace the finished ones, ``B · Ī / Ō`` tokens, so ``B (1 + Ī / Ō) ≤ T``. (Azure conv's
    1,155-token prompts and 211-token answers on an A100's 2,048: 316, above its 256 slots; in a
    stretch of longer prompts and shorter answers the batch stays near 200.) Unbounded when the
    budget is unknown."""
    budget = hw.max_num_batched_tokens
    if budget <= 0 or hw.input_token_work_s <= 0:
        return math.inf
    return max(1.0, budget / (1.0 + refill / hw.input_token_work_s))
