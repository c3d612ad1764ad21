"""The shipped hardware catalog (qlm/data/hardware.json) and the step-time model that reads it.

The AIConfigurator check re-implements the simulator's semantics of a static batch here, on purpose
independently of experiments/fit_profiles.py, so that a wrong fit or a wrong reading of the data fails.
"""

from __future__ import annotations

import copy
import csv
import io
import json
from dataclasses import replace
from importlib import resources
from itertools import pairwise
from typing import Any

import pytest

from qlm.engines.perf_model import (
    HardwareCatalog,
    PerfModel,
    StepTimeModel,
    default_catalog,
    parse_catalog,
    prefill_pairs,
)
from qlm.errors import ConfigError

UTIL, ACTIVATION_GB = 0.9, 1.0
AIC_TOLERANCE = 0.15

# Combinations the simulator must be able to run (brief: tp=1 wherever a model fits, 70B on 2/4)
REQUIRED = {
    ("llama-3-8b", "A10", 1),
    ("llama-3-8b", "A100", 1),
    ("llama-3-8b", "H100", 1),
    ("llama-2-7b", "A10", 1),
    ("llama-2-7b", "A100", 1),
    ("llama-2-7b", "H100", 1),
    ("llama-2-13b", "A10", 2),
    ("llama-2-13b", "A100", 1),
    ("llama-2-13b", "H100", 1),
    ("llama-2-70b", "A10", 8),
    ("llama-2-70b", "A100", 2),
    ("llama-2-70b", "A100", 4),
    ("llama-2-70b", "H100", 2),
    ("llama-2-70b", "H100", 4),
}


def _hardware_doc() -> dict[str, Any]:
    text = resources.files("qlm").joinpath("data/hardware.json").read_text(encoding="utf-8")
    doc: dict[str, Any] = json.loads(text)
    return doc


def _all_models(cat: HardwareCatalog) -> list[PerfModel]:
    return [cat.perf_model(m, g, n) for (m, g, n) in sorted(cat.perf)]


def test_default_catalog_loads_with_every_required_combination() -> None:
    cat = default_catalog()
    assert set(cat.gpus) == {"A10", "A100", "H100"}
    assert set(cat.models) == {"llama-3-8b", "llama-2-7b", "llama-2-13b", "llama-2-70b"}
    assert set(cat.perf) >= REQUIRED
    for pm in _all_models(cat):
        assert pm.source, f"{pm.model.name} on {pm.gpu.name} has no source"
    assert cat.default_gpu_count("llama-2-70b", "A100") == 2
    assert cat.default_gpu_count("llama-2-13b", "a10") == 2  # names are case-insensitive


def test_model_sizes_follow_from_the_architecture() -> None:
    # K and V, FP16: 2 * layers * kv_heads * head_dim * 2 bytes
    expected_kv = {
        "llama-3-8b": 2 * 32 * 8 * 128 * 2,  # 128 KiB
        "llama-2-7b": 2 * 32 * 32 * 128 * 2,  # 512 KiB
        "llama-2-13b": 2 * 40 * 40 * 128 * 2,  # 800 KiB
        "llama-2-70b": 2 * 80 * 8 * 128 * 2,  # 320 KiB (GQA, 8 KV heads)
    }
    cat = default_catalog()
    for name, kv in expected_kv.items():
        m = cat.model(name)
        assert m.kv_bytes_per_token == kv
        assert m.weights_gb == pytest.approx(2 * m.params_b, rel=1e-3)  # FP16: 2 bytes a parameter


def test_every_entry_has_kv_room_and_70b_does_not_fit_one_gpu() -> None:
    cat = default_catalog()
    for pm in _all_models(cat):
        tokens = pm.kv_capacity_tokens(gpu_memory_utilization=UTIL, activation_gb=ACTIVATION_GB)
        # room for at least one full-length request beside the weights
        assert tokens >= pm.model.max_context, (pm.model.name, pm.gpu.name, pm.gpu_count, tokens)
    for gpu in ("A10", "A100", "H100"):
        seventy = cat.perf_model("llama-2-70b", gpu, cat.default_gpu_count("llama-2-70b", gpu))
        with pytest.raises(ConfigError):
            replace(seventy, gpu_count=1).kv_capacity_tokens(
                gpu_memory_utilization=UTIL, activation_gb=ACTIVATION_GB
            )
    with pytest.raises(ConfigError):
        cat.perf_model("llama-2-70b", "A100", 1)  # no such profile either


def test_step_time_is_monotone_in_batch_and_context() -> None:
    for pm in _all_models(default_catalog()):
        s = pm.step
        decode = [
            s.step_ms(n_scheduled=b, n_tokens=b, decode_ctx=b * 1024, prefill_pairs=0)
            for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)
        ]
        assert all(a < b for a, b in pairwise(decode)), pm.source
        ctx = [
            s.step_ms(n_scheduled=8, n_tokens=8, decode_ctx=8 * c, prefill_pairs=0)
            for c in (128, 512, 2048, 4096)
        ]
        assert all(a < b for a, b in pairwise(ctx)), pm.source
        prefill = [
            s.step_ms(n_scheduled=1, n_tokens=n, decode_ctx=0, prefill_pairs=prefill_pairs(n, 0))
            for n in (128, 512, 2048, 4096)
        ]
        assert all(a < b for a, b in pairwise(prefill)), pm.source
        assert s.step_ms(n_scheduled=0, n_tokens=0, decode_ctx=0, prefill_pairs=0) == 0.0


def test_faster_gpus_and_smaller_models_are_faster() -> None:
    cat = default_catalog()

    def decode(model: str, gpu: str, n: int) -> float:
        s = cat.perf_model(model, gpu, n).step
        return s.step_ms(n_scheduled=16, n_tokens=16, decode_ctx=16 * 1024, prefill_pairs=0)

    for model in ("llama-3-8b", "llama-2-7b"):
        assert decode(model, "H100", 1) < decode(model, "A100", 1) < decode(model, "A10", 1)
    assert decode("llama-2-7b", "A100", 1) < decode("llama-2-13b", "A100", 1)
    assert decode("llama-2-13b", "A100", 1) < decode("llama-2-70b", "A100", 2)
    assert decode("llama-2-70b", "A100", 4) < decode("llama-2-70b", "A100", 2)


def test_cold_load_is_slower_than_warm_load() -> None:
    for pm in _all_models(default_catalog()):
        assert 0 < pm.warm_load_s < pm.cold_load_s
        assert pm.kv_transfer_s(1000) > 0


def _aic_rows(model: str, system: str) -> list[dict[str, str]]:
    text = (
        resources.files("qlm")
        .joinpath("data/profiles/aiconfigurator/aic_static_vllm.csv")
        .read_text(encoding="utf-8")
    )
    rows = [
        r for r in csv.DictReader(io.StringIO(text)) if (r["model"], r["system"]) == (model, system)
    ]
    assert len(rows) == 45  # 9 batches x 5 input lengths
    return rows


def _ttft_ms(s: StepTimeModel, batch: int, isl: int) -> float:
    # one pure-prefill iteration over the whole static batch
    return s.step_ms(
        n_scheduled=batch,
        n_tokens=batch * isl,
        decode_ctx=0,
        prefill_pairs=batch * prefill_pairs(isl, 0),
    )


def _tpot_ms(s: StepTimeModel, batch: int, isl: int, osl: int) -> float:
    # mean of the osl-1 decode iterations; decode i attends to isl+i tokens
    steps = [
        s.step_ms(n_scheduled=batch, n_tokens=batch, decode_ctx=batch * ctx, prefill_pairs=0)
        for ctx in range(isl + 1, isl + osl)
    ]
    return sum(steps) / len(steps)


@pytest.mark.parametrize("gpu,system", [("A100", "a100_sxm"), ("H100", "h100_sxm")])
def test_llama3_8b_reproduces_aiconfigurator_grid(gpu: str, system: str) -> None:
    step = default_catalog().perf_model("llama-3-8b", gpu, 1).step
    worst: list[tuple[float, str]] = []
    for r in _aic_rows("meta-llama/Meta-Llama-3.1-8B", system):
        b, isl, osl = int(r["batch"]), int(r["isl"]), int(r["osl"])
        ttft = _ttft_ms(step, b, isl) / float(r["ttft_ms"]) - 1
        tpot = _tpot_ms(step, b, isl, osl) / float(r["tpot_ms"]) - 1
        worst += [(abs(ttft), f"TTFT B={b} L={isl}"), (abs(tpot), f"TPOT B={b} L={isl}")]
    err, where = max(worst)
    assert err <= AIC_TOLERANCE, f"{gpu}: {where} off by {err:.1%}"


def test_catalog_json_is_canonical_and_parses_as_shipped() -> None:
    doc = _hardware_doc()
    text = resources.files("qlm").joinpath("data/hardware.json").read_text(encoding="utf-8")
    # written with sorted keys and indent 2, so regenerating it gives a clean diff
    assert text == json.dumps(doc, indent=2, sort_keys=True) + "\n"
    assert any(k.startswith("_") for k in doc)  # documentation keys are ignored by the parser
    cat = parse_catalog(doc)
    assert cat.perf == default_catalog().perf


def test_parse_catalog_rejects_bad_entries() -> None:
    doc = _hardware_doc()
    bad = copy.deepcopy(doc)
    bad["perf_models"][0]["per_token_ms"] = -1.0
    with pytest.raises(ConfigError):
        parse_catalog(bad)
    bad = copy.deepcopy(doc)
    bad["perf_models"][0]["gpu"] = "TPU"
    with pytest.raises(ConfigError):
        parse_catalog(bad)
    with pytest.raises(ConfigError):
        default_catalog().model("gpt-5")
    bad = copy.deepcopy(doc)
    bad["gpus"]["A100"]["nvlink_gbs"] = 600.0  # GpuSpec has no such field
    with pytest.raises(ConfigError):
        parse_catalog(bad)
