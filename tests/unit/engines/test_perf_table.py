"""Measured performance tables (``--perf-model splitwise`` or a CSV file): the interpolation
checked against hand-computed rows of Splitwise's perf_model.csv, the KV-memory rule, the errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from qlm.engines.perf_model import LinearInterp, TableStepTime
from qlm.engines.perf_table import load_catalog
from qlm.errors import ConfigError

HEADER = "model,hardware,prompt_size,batch_size,token_size,prompt_time,token_time,tensor_parallel"


def _step(model: str = "llama-2-70b", gpu: str = "H100", n: int = 8) -> TableStepTime:
    step = load_catalog("splitwise").perf_model(model, gpu, n).step
    assert isinstance(step, TableStepTime)
    return step


def prefill(step: TableStepTime, tokens: int) -> float:
    return step.step_ms(n_scheduled=1, n_tokens=tokens, decode_ctx=0, prefill_pairs=1.0)


def decode(step: TableStepTime, batch: int) -> float:
    return step.step_ms(n_scheduled=batch, n_tokens=batch, decode_ctx=batch * 100, prefill_pairs=0)


def test_a_measured_point_is_the_median_of_its_rows() -> None:
    # Llama-2-70B, DGX-H100, TP8, prompt 128 x batch 1: the five rows' prompt_time median
    # (58.18541598273441 ms) and token_time median (29.87266007185672 ms), read off the CSV.
    step = _step()
    assert prefill(step, 128) == pytest.approx(58.18541598273441)
    assert decode(step, 128) == pytest.approx(29.87266007185672)
    # 1024 batch tokens: rows (1024 x 1) and (512 x 2), ten rows, median 77.68386948737316 ms.
    assert prefill(step, 1024) == pytest.approx(77.68386948737316)


def test_between_points_is_linear_and_below_the_first_extrapolates() -> None:
    step = _step()
    # 768 tokens: halfway between 512 (53.85797604685649) and 1024 (77.68386948737316).
    assert prefill(step, 768) == pytest.approx((53.85797604685649 + 77.68386948737316) / 2)
    # A decode batch of 1 token: the line through 128 and 256 (29.8727, 28.2666) extended.
    slope = (28.266553230323336 - 29.87266007185672) / 128
    assert decode(step, 1) == pytest.approx(29.87266007185672 + slope * (1 - 128))


def test_a_mixed_iteration_is_the_prefill_time_times_1_1() -> None:
    step = _step("llama-2-70b", "A100", 2)
    # A100 TP2 prompt 2048 x 1 and 512 x 4: median 765.9 ms
    mixed = step.step_ms(n_scheduled=3, n_tokens=2048, decode_ctx=500, prefill_pairs=10.0)
    assert mixed == pytest.approx(1.1 * prefill(step, 2048))
    assert step.decode_slope_ms(64) == 0.0
    assert step.step_ms(n_scheduled=0, n_tokens=0, decode_ctx=0, prefill_pairs=0) == 0.0


def test_an_extrapolation_that_falls_to_zero_holds_the_end_point() -> None:
    f = LinearInterp((1.0, 2.0), (10.0, 1.0))
    assert f(1.5) == pytest.approx(5.5)
    assert f(3.0) == 1.0  # the line would give -8
    assert f(0.0) == pytest.approx(19.0)


def test_every_covered_gpu_count_is_offered_and_others_name_the_flag() -> None:
    cat = load_catalog("splitwise")
    assert cat.default_gpu_count("llama-2-70b", "H100") == 2
    assert cat.perf_model("llama-2-70b", "H100", 8).gpu_count == 8
    with pytest.raises(ConfigError, match=r"^--perf-model splitwise: no performance profile for "):
        cat.perf_model("llama-3-8b", "A100", 1)
    with pytest.raises(ConfigError, match=r"--perf-model splitwise: .*8xA10"):
        cat.perf_model("llama-2-70b", "A10", 8)


def test_splitwise_memory_rule() -> None:
    pm = load_catalog("splitwise", "splitwise").perf_model("llama-2-70b", "H100", 2)
    # 2 x 80 GiB - 135e9 bytes of weights, over 2 * 80 layers * 8192 * 2 bytes per token
    expected = int((2 * 80 * 1024**3 - 135e9) // (2 * 80 * 8192 * 2))
    assert pm.kv_capacity_tokens(gpu_memory_utilization=0.9, activation_gb=1.0) == expected
    # vLLM's rule on 8 GPUs: 8 x 80 GB x 0.9 - 137.95 GB - 8 GB of activations, 320 KiB a token
    vllm = load_catalog("splitwise").perf_model("llama-2-70b", "H100", 8)
    expected = int((8 * 80 * 0.9 - 137.95 - 8) * 1e9 // (2 * 80 * 8 * 128 * 2))
    assert vllm.kv_capacity_tokens(gpu_memory_utilization=0.9, activation_gb=1.0) == expected
    with pytest.raises(ConfigError, match=r"^--kv-memory splitwise: .*llama-3-8b"):
        load_catalog("default", "splitwise").perf_model("llama-3-8b", "A100", 1)
    with pytest.raises(ConfigError, match=r"^--kv-memory must be vllm or splitwise"):
        load_catalog("default", "paged")


def test_default_is_the_shipped_catalog() -> None:
    from qlm.engines.perf_model import default_catalog

    assert load_catalog() is default_catalog()


def test_a_custom_csv(tmp_path: Path) -> None:
    f = tmp_path / "mine.csv"
    f.write_text(
        HEADER
        + "\nllama-3-8b,a100-80gb,100,1,8,10,5,1\nllama-3-8b,A100,200,1,8,20,6,1\n"
        + "other,a100-80gb,100,1,8,1,1,1\n"
    )
    cat = load_catalog(str(f))
    pm = cat.perf_model("llama-3-8b", "A100", 1)
    assert isinstance(pm.step, TableStepTime)
    assert prefill(pm.step, 150) == pytest.approx(15.0)
    assert decode(pm.step, 300) == pytest.approx(7.0)
    with pytest.raises(ConfigError, match=f"^--perf-model {f}: no performance profile"):
        cat.perf_model("llama-3-8b", "H100", 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model,hardware\nx,y\n", "missing column"),
        (HEADER + "\nllama-3-8b,A100,abc,1,8,10,5,1\n", "line 2: .*integers"),
        (HEADER + "\nllama-3-8b,A100,100,1,8,-1,5,1\n", "line 2: .*> 0"),
        (HEADER + "\nllama-3-8b,A100,100,1,8,10,5,0\n", "line 2: .*>= 1"),
        (HEADER + "\nllama-3-8b,A100,100,1,8,10,5,1\n", "one batch size"),
        (HEADER + "\ngpt-9,TPU,100,1,8,10,5,1\n", "no row names a model and GPU QLM knows"),
    ],
)
def test_a_bad_csv_is_one_line_naming_the_flag(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "bad.csv"
    f.write_text(text)
    with pytest.raises(ConfigError, match=f"^--perf-model {f}.*{message}"):
        load_catalog(str(f))


def test_neither_a_name_nor_a_file() -> None:
    with pytest.raises(
        ConfigError, match=r"^--perf-model: 'nope' is neither default nor splitwise"
    ):
        load_catalog("nope")
