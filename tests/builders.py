"""Builders with overrides for tests: small, hand-checkable hardware and requests."""

from __future__ import annotations

from typing import Any

import httpx

from qlm.domain import SLO, Request, Tier
from qlm.engines.perf_model import HardwareCatalog, parse_catalog
from qlm.engines.server import SchedulingPolicy, create_app
from qlm.engines.vllm import VllmEngine
from qlm.engines.wallclock import WallClockEngine
from qlm.rct.output_model import NIG
from qlm.rct.profile import HardwareProfile, RctProfile

STEP = {
    "base_ms": 10.0,
    "per_seq_ms": 0.05,
    "compute_base_ms": 5.0,
    "per_token_ms": 0.06,
    "per_ctx_token_ms": 1e-4,
    "per_prefill_pair_ms": 1e-6,
}


def make_catalog(**step_overrides: float) -> HardwareCatalog:
    """One GPU type ``G`` (80 GB) and two 8B-class models ``m`` and ``n`` with the same profile."""
    model = {"params_b": 8, "weights_gb": 16.0, "kv_bytes_per_token": 131072, "max_context": 8192}
    step = STEP | step_overrides
    return parse_catalog(
        {
            "gpus": {
                "G": {
                    "memory_gb": 80,
                    "memory_bandwidth_gbs": 2000,
                    "fp16_tflops": 300,
                    "host_link_gbs": 20,
                }
            },
            "models": {"m": model, "n": model},
            "perf_models": [
                {"model": "m", "gpu": "G", "gpu_count": 1, **step},
                {"model": "n", "gpu": "G", "gpu_count": 1, **step},
            ],
            "model_load": {"disk_load_gbs": 2.0, "load_overhead_s": 0.5},
        }
    )


def make_request(i: int = 0, **overrides: Any) -> Request:
    fields: dict[str, Any] = {
        "id": f"r{i:04d}",
        "model": "m",
        "input_tokens": 200,
        "max_tokens": 1000,
        "arrival_s": float(i),
        "slo": SLO(e2e_s=30.0),
        "tier": Tier.STANDARD,
        "replay_output_tokens": 50,
    }
    fields.update(overrides)
    return Request(**fields)


def make_hardware(model: str = "m", **overrides: Any) -> HardwareProfile:
    """A hand-made RCT profile of ``model`` on one GPU ``G``: round numbers, every term distinct."""
    fields: dict[str, Any] = {
        "model": model,
        "gpu": "G",
        "gpu_count": 1,
        "prefill_base_s": 0.02,
        "prefill_per_token_s": 1e-4,
        "input_token_work_s": 5e-5,
        "throughput_tps": 2000.0,
        "decode_per_token_s": 0.03,
        "decode_alone_s": 0.01,
        "inefficiency": 1.0,
        "saturation_batch": 8.0,
        "max_num_seqs": 8,
        "kv_bytes_per_token": 131072,
        "kv_capacity_tokens": 100_000,
        "warm_load_s": 1.5,
        "cold_load_s": 12.0,
    }
    fields.update(overrides)
    return HardwareProfile(**fields)


def make_profile(**overrides: Any) -> RctProfile:
    """An RCT profile for models ``m`` and ``n`` on GPU ``G`` (the test catalog), outputs of ~70
    tokens."""
    hw, second = make_hardware("m", **overrides), make_hardware("n", **overrides)
    return RctProfile(
        hardware={hw.key: hw, second.key: second},
        output_priors={"default": NIG(mu=4.0, kappa=20.0, alpha=11.0, beta=5.0)},
    )


def simulated_vllm(
    name: str = "s0", *, scheduling_policy: SchedulingPolicy = "priority"
) -> tuple[VllmEngine, WallClockEngine]:
    """The real vLLM client of a simulated instance (model ``m`` on ``G``, 50x) served in process:
    ``VllmEngine`` over HTTP to ``qlm sim-engine serve``'s app, through ``httpx.ASGITransport``
    (no socket; a stream is handed over once it ends). Close both."""
    engine = WallClockEngine.from_catalog(name, "m", "G", 1, time_scale=50, catalog=make_catalog())
    app = create_app(engine, scheduling_policy=scheduling_policy)
    transport = httpx.ASGITransport(app)
    return VllmEngine(name, f"http://{name}", "m", transport=transport), engine
