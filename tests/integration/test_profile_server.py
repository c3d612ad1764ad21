"""End to end: ``qlm profile server`` profiles a vLLM server over its HTTP API — here a
``qlm sim-engine serve`` process, whose hardware the in-process profiler of the simulated engine
measures directly, so the two must agree. The server runs 16 requests at once, in real time.
Each run is timed by the server itself (``vllm:e2e_request_latency_seconds``, on its engine's
clock), so neither round trips nor a busy host count; the saturating batch, timed by the
client, runs long enough in real time that a busy host's delays stay small against it (a
server sped up 5x made them 5x larger: throughput 20 % off beside four CPU burners). The noisy
context slope is not compared. No assertion is about how long anything took."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from services import start_sim_engine, stop
from typer.testing import CliRunner

from qlm.cli import app
from qlm.engines.perf_model import default_catalog
from qlm.engines.sim import SimEngineConfig
from qlm.profiling.sim import profile_sim_hardware
from qlm.rct.profile import parse_profile

MODEL = "llama-3-8b"
SEQS = 16
SCALE = 1.0
LENGTHS = ("--input-tokens", "512", "--output-tokens", "256")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc, url = start_sim_engine(MODEL, time_scale=SCALE, extra=("--max-num-seqs", str(SEQS)))
    try:
        yield url
    finally:
        stop(proc)


def profile(url: str, out: Path, *extra: str) -> tuple[int, str]:
    # "a100": written as the catalog names it, "A100" (what the instances file looks it up by).
    args = ["profile", "server", "--url", url, "--model", MODEL, "--gpu", "a100"]
    args += ["--out", str(out), "--time-scale", str(SCALE), *LENGTHS, *extra]
    result = CliRunner().invoke(app, args)
    return result.exit_code, result.output


def test_a_server_profiled_over_http_matches_the_engine_profiled_directly(
    server: str, tmp_path: Path
) -> None:
    out = tmp_path / "profile.json"
    code, text = profile(
        server, out, "--max-num-seqs", str(SEQS), "--max-num-batched-tokens", "2048", "--json"
    )
    assert code == 0, text
    (hw,) = parse_profile(out.read_text(encoding="utf-8")).hardware.values()
    assert json.loads(text)["hardware"] == json.loads(out.read_text())["hardware"]
    config = SimEngineConfig.for_gpu(80, "A100", max_num_seqs=SEQS)
    perf = default_catalog().perf_model(MODEL, "A100", 1)
    ref = profile_sim_hardware(perf, config=config, input_tokens=512, output_tokens=256)
    assert (hw.model, hw.gpu, hw.gpu_count) == (MODEL, "A100", 1)
    assert hw.kv_capacity_tokens == ref.kv_capacity_tokens  # from vllm:cache_config_info
    assert (hw.max_num_seqs, hw.max_num_batched_tokens) == (SEQS, 2048)
    assert hw.saturation_batch == ref.saturation_batch == SEQS
    for field in (
        "prefill_per_token_s",
        "decode_alone_s",
        "decode_per_token_s",
        "throughput_tps",
        "warm_load_s",
        "cold_load_s",
    ):
        assert getattr(hw, field) == pytest.approx(getattr(ref, field), rel=0.15), field
    assert hw.inefficiency == 1.0  # nothing preempted: 24 requests of 768 tokens fit the cache
    assert hw.kv_bytes_per_token == perf.model.kv_bytes_per_token  # the catalog knows the model
    assert "over its HTTP API" in hw.source


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (("--max-num-seqs", "0"), "--max-num-seqs"),
        (("--max-num-seqs", "16", "--time-scale", "0"), "--time-scale"),
        (("--max-num-seqs", "16", "--output-tokens", "2"), "--output-tokens"),
    ],
)
def test_bad_settings_are_refused_in_one_line_and_write_nothing(
    server: str, tmp_path: Path, extra: tuple[str, ...], named: str
) -> None:
    out = tmp_path / "profile.json"
    code, text = profile(server, out, *extra)
    assert code != 0
    assert named in text and len(text.strip().splitlines()) == 1, text
    assert not out.exists()


def test_a_model_the_server_does_not_serve_is_named(server: str, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    args = ["profile", "server", "--url", server, "--model", "llama-2-7b", "--gpu", "A100"]
    result = CliRunner().invoke(app, [*args, "--max-num-seqs", "16", "--out", str(out)])
    assert result.exit_code != 0
    assert "llama-2-7b" in result.output
    assert not out.exists()
