"""The real-vLLM stage: a vLLM server (its CPU build, 0.32.0) with a tiny random Llama, from the
environment ``scripts/vllm-env`` builds once per machine outside the checkout.

``vllm_server`` (session) starts it on a free port — ``python -m
vllm.entrypoints.openai.api_server``, as ``qlm instance launch`` does where the ``vllm`` command
is broken — with priority scheduling and dev mode, waits on ``/health`` (minutes on 2 busy
cores), and stops it at the end. A test may kill it (``kill``) and start it again on the same
port (``start``). Without the environment the tests skip; under ``CI=true`` they fail, as the
RabbitMQ and PostgreSQL tests do (tests/services.py): CI must never pass by skipping them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from services import free_port, in_ci

from qlm.engines.vllm_launch import VllmCommand, vllm_serve_command

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"  # the served model name
START_TIMEOUT_S = 900.0  # start-up: ~45 s on a quiet 2-core machine; much longer when it is shared
KV_CACHE_BYTES = 16 * 2**20  # 32,768 tokens of the tiny model: its KV cache fills, so it queues
SERVER_FLAGS = ("--kv-cache-memory-bytes", str(KV_CACHE_BYTES))


def _missing(message: str) -> None:
    if in_ci():
        pytest.fail(f"{message} (CI=true: the real-vLLM tests must run)")
    pytest.skip(message)


@dataclass(frozen=True, slots=True)
class VllmEnv:
    """Where ``scripts/vllm-env`` put things."""

    python: str
    model: str


def _env() -> VllmEnv:
    done = subprocess.run(
        [str(REPO / "scripts" / "vllm-env"), "--print"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    where = dict(
        line.split("=", 1) for line in done.stdout.splitlines() if "=" in line and line[0] != " "
    )
    if done.returncode != 0 or "QLM_VLLM_PYTHON_BIN" not in where:
        _missing(f"the vLLM environment is not built (run scripts/vllm-env): {where}")
    return VllmEnv(where["QLM_VLLM_PYTHON_BIN"], where["QLM_VLLM_MODEL"])


@dataclass
class VllmServer:
    """One vLLM server process (with its engine-core and worker children, in a process group
    of their own) on ``port``; its output goes to ``log``."""

    env: VllmEnv
    port: int
    log: Path
    extra: tuple[str, ...] = SERVER_FLAGS
    kv_offload_gb: float | None = None  # CPU KV offloading, as `qlm instance launch` asks it
    proc: subprocess.Popen[bytes] | None = None
    started_s: list[float] = field(default_factory=list)  # how long each start took

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return list(self.serve_command().argv)

    def serve_command(self) -> VllmCommand:
        return vllm_serve_command(
            self.env.model,
            port=self.port,
            host="127.0.0.1",
            served_model_name=MODEL,
            python=self.env.python,
            kv_offload_gb=self.kv_offload_gb,
            extra=self.extra,
        )

    def start(self) -> None:
        """Start it and wait until ``/health`` answers 200 (failing with its log if it exits
        or never does)."""
        code = self.start_or_exit()
        if code is not None:
            pytest.fail(f"vLLM exited with {code} at start-up:\n{self.tail()}")

    def start_or_exit(self) -> int | None:
        """Start it and wait until ``/health`` answers 200 (None) or it exits (its exit
        code); failing with its log if neither happens in time."""
        env = {
            **os.environ,
            **dict(self.serve_command().env),  # as qlm instance launch starts it
            "VLLM_SERVER_DEV_MODE": "1",  # /sleep, /server_info, /abort_requests, ...
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        t0 = time.monotonic()
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.log.parent,
                start_new_session=True,  # its own process group: stopped whole
            )
        deadline = t0 + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                return self.proc.returncode
            if self.healthy():
                break
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(
                    f"vLLM did not answer /health within {START_TIMEOUT_S:g} s:\n{self.tail()}"
                )
            time.sleep(1.0)
        self.started_s.append(time.monotonic() - t0)
        return None

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """``kill -9`` of the server and its engine processes (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, chars: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@pytest.fixture(scope="session")
def vllm_env() -> VllmEnv:
    return _env()


EXTERNAL = os.environ.get("QLM_TEST_VLLM_URL", "")
"""A server already running, started as ``VllmServer.command`` does (while working on these
tests: no start-up per run). Tests that kill the server skip with it."""


@pytest.fixture(scope="session")
def vllm_server(
    vllm_env: VllmEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """The session's vLLM server, healthy (a test that kills it starts it again)."""
    server = VllmServer(vllm_env, free_port(), tmp_path_factory.mktemp("vllm") / "vllm.log")
    if EXTERNAL:
        server.port = int(EXTERNAL.rsplit(":", 1)[1])
        yield server
        return
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def vllm_url(vllm_server: VllmServer) -> str:
    """The server's URL, healthy (started again if a test before left it down)."""
    if not EXTERNAL and (vllm_server.proc is None or vllm_server.proc.poll() is not None):
        vllm_server.start()
    return vllm_server.url


PROFILE_ARGS = (
    "--model", MODEL, "--gpu", "cpu", "--max-num-seqs", "128", "--max-context", "2048",
    "--input-tokens", "256", "--output-tokens", "64",
)  # fmt: skip
"""``qlm profile server`` of the tiny model (a few seconds on the CPU build)."""
LOAD_TIMES = ("--warm-load-s", "2", "--cold-load-s", "10")
"""Given, as they must be: the CPU build does not sleep, so there is nothing to measure."""


def profile_server(url: str, out: Path, *extra: str) -> tuple[int, str]:
    from typer.testing import CliRunner

    from qlm.cli import app

    args = ["profile", "server", "--url", url, *PROFILE_ARGS, "--out", str(out), *extra]
    result = CliRunner().invoke(app, args)
    return result.exit_code, result.output


@pytest.fixture(scope="session")
def tiny_profile(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's hardware profile on this machine (``QLM_PROFILE_FILE`` for the ``qlm``
    policy), measured over vLLM's API."""
    if not EXTERNAL and (vllm_server.proc is None or vllm_server.proc.poll() is not None):
        vllm_server.start()
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    code, text = profile_server(vllm_server.url, out, *LOAD_TIMES)
    assert code == 0, text
    return out
