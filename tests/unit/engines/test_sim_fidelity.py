"""The simulated instance against AIConfigurator's static-batch estimates (Llama-3.1-8B on H100 and
A100): TTFT and TPOT within 15 % over the whole grid of batch sizes and input lengths. The same
comparison, with its table of errors, is ``experiments/validate_sim.py``."""

from __future__ import annotations

import csv
from importlib import resources

import pytest

from qlm.engines.perf_model import default_catalog
from qlm.sim.static_batch import run_static_batch

SYSTEMS = {"h100_sxm": "H100", "a100_sxm": "A100"}


def aic_rows(system: str) -> list[dict[str, str]]:
    path = resources.files("qlm").joinpath("data/profiles/aiconfigurator/aic_static_vllm.csv")
    rows = list(csv.DictReader(path.read_text(encoding="utf-8").splitlines()))
    return [r for r in rows if r["model"].endswith("Llama-3.1-8B") and r["system"] == system]


@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_simulated_static_batches_match_aiconfigurator_within_15_percent(system: str) -> None:
    perf = default_catalog().perf_model("llama-3-8b", SYSTEMS[system], 1)
    rows = aic_rows(system)
    assert len(rows) >= 40  # the whole grid: batch 1-256 x input 128-4096
    worst: list[tuple[float, str]] = []
    for r in rows:
        b, isl, osl = int(r["batch"]), int(r["isl"]), int(r["osl"])
        sim = run_static_batch(perf, batch=b, input_tokens=isl, output_tokens=osl)
        ttft_err = abs(sim.ttft_s * 1000 / float(r["ttft_ms"]) - 1)
        tpot_err = abs(sim.tpot_s * 1000 / float(r["tpot_ms"]) - 1)
        worst.append(
            (
                max(ttft_err, tpot_err),
                f"batch {b} input {isl}: ttft {ttft_err:.1%} tpot {tpot_err:.1%}",
            )
        )
    err, where = max(worst)
    assert err <= 0.15, where


def test_a_chunked_real_configuration_is_slower_than_the_ideal_static_batch() -> None:
    # With vLLM's real token budget the batch is prefilled in chunks, so its TTFT can only grow.
    perf = default_catalog().perf_model("llama-3-8b", "A100", 1)
    ideal = run_static_batch(perf, batch=64, input_tokens=2048, output_tokens=128)
    real = run_static_batch(perf, batch=64, input_tokens=2048, output_tokens=128, whole_batch=False)
    assert real.ttft_s > ideal.ttft_s
