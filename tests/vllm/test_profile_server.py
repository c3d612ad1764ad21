"""``qlm profile server`` against real vLLM (its CPU build, a 4,096-token vocabulary): prompts
made of the server's own token ids, and no warm or cold load time "measured" from a sleep the
server does not do."""

from __future__ import annotations

from pathlib import Path

import pytest

from qlm.rct.profile import parse_profile

from .conftest import KV_CACHE_BYTES, profile_server

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


def test_without_sleep_mode_profiling_asks_for_the_load_times_before_measuring(
    vllm_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "profile.json"
    code, text = profile_server(vllm_url, out)
    assert code == 1 and not out.exists()
    assert "no sleep mode" in text and "--warm-load-s and --cold-load-s" in text
    assert len(text.strip().splitlines()) == 1


def test_a_real_vllm_server_is_profiled_over_its_api(tiny_profile: Path) -> None:
    (hw,) = parse_profile(tiny_profile.read_text(encoding="utf-8")).hardware.values()
    assert (hw.model, hw.gpu) == ("tiny", "cpu")
    assert hw.kv_capacity_tokens == KV_CACHE_BYTES // 512  # 128-token blocks, as vLLM says
    assert (hw.warm_load_s, hw.cold_load_s) == (2.0, 10.0)  # given, not measured
    assert hw.prefill_per_token_s > 0 and hw.decode_per_token_s > 0 and hw.throughput_tps > 0
    assert hw.saturation_batch > 1
