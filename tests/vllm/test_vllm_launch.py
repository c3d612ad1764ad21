"""``qlm instance launch --model A --model B`` (one GPU's servers for warm starts) on vLLM's CPU
build: its servers need sleep mode, which the CPU build refuses at start-up, so the launch stops
at the first server and says which (tests/integration/test_colocated_http.py runs the same
launch to the end with the emulator in vLLM's place)."""

from __future__ import annotations

from pathlib import Path

import pytest
from services import free_port

from qlm.engines.vllm_launch import colocated_servers, start_asleep
from qlm.errors import EngineError

from .conftest import SERVER_FLAGS, START_TIMEOUT_S, VllmEnv

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

REFUSED = "Sleep mode is not supported on current platform."


def test_a_gpus_servers_on_the_cpu_build_stop_at_the_first_which_cannot_sleep(
    vllm_env: VllmEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    servers = colocated_servers(
        [vllm_env.model, vllm_env.model], port=free_port(), host="127.0.0.1",
        served_model_names=("tiny-a", "tiny-b"), python=vllm_env.python, extra=SERVER_FLAGS,
    )  # fmt: skip
    assert all("--enable-sleep-mode" in s.command.argv for s in servers)
    log = tmp_path / "servers.log"
    with log.open("wb") as out, pytest.raises(EngineError) as err:
        start_asleep(servers, timeout_s=START_TIMEOUT_S, output=out)
    assert "the server of tiny-a (http://127.0.0.1:" in str(err.value)
    assert "exited with" in str(err.value)
    text = log.read_text(errors="replace")
    assert REFUSED in text, text[-4000:]
    assert "tiny-b" not in text  # the second was never started
