"""The real-vLLM stage: vLLM servers (its CPU build, 0.32.0) with a tiny random Llama, from the
environment ``scripts/vllm-env`` builds once per machine outside the checkout.

``vllm_server`` (session) is the server most tests share — ``python -m
vllm.entrypoints.openai.api_server``, as ``qlm instance launch`` does where the ``vllm`` command
is broken — with priority scheduling and dev mode; ``one_at_a_time`` (``--max-num-seqs 1``) and
``offload_refused`` (KV offloading asked, which the CPU build refuses at start-up) are two more.
A test may kill a server (``kill``) and start it again on the same port (``start``).

**Started early.** A vLLM server takes one to two minutes to start on 2 cores (three processes,
each importing vLLM and torch, then the model's compilation), and this stage runs last. When
the session's tests use these servers, they are launched in the background, one after the
other in the order the tests first use them, beginning at the first unit test: the unit tests
keep one core busy, the start-ups take the other, instead of adding to the run (the
end-to-end tests before them run many processes: start-ups beside those would slow them as
much as they save). Their ports lie below the kernel's ephemeral range, which ``free_port`` draws from; a
fixture waits for its server (``/health``, or its exit) when a test first needs it. Without
the environment the tests skip; under ``CI=true`` they fail, as the RabbitMQ and PostgreSQL
tests do (tests/services.py): CI must never pass by skipping them.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from services import in_ci

from qlm.engines.vllm_launch import VllmCommand, vllm_serve_command

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"  # the served model name
START_TIMEOUT_S = 900.0  # start-up: ~45 s on a quiet 2-core machine; much longer when it is shared
KV_CACHE_BYTES = 16 * 2**20  # 32,768 tokens of the tiny model: its KV cache fills, so it queues
SERVER_FLAGS = ("--kv-cache-memory-bytes", str(KV_CACHE_BYTES))
ONE_AT_A_TIME_FLAGS = (
    *SERVER_FLAGS,
    "--max-num-seqs", "1", "--enable-log-requests", "--enable-prompt-tokens-details",
)  # fmt: skip
OFFLOAD_GB = 0.0625  # what ``offload_refused`` asks for (``qlm instance launch --kv-offload-gb``)


def _missing(message: str) -> None:
    if in_ci():
        pytest.fail(f"{message} (CI=true: the real-vLLM tests must run)")
    pytest.skip(message)


@dataclass(frozen=True, slots=True)
class VllmEnv:
    """Where ``scripts/vllm-env`` put things."""

    python: str
    model: str


def _find_env() -> VllmEnv | str:
    """The environment, or why there is none."""
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
        return f"the vLLM environment is not built (run scripts/vllm-env): {where}"
    return VllmEnv(where["QLM_VLLM_PYTHON_BIN"], where["QLM_VLLM_MODEL"])


def quiet_port() -> int:
    """A free port below the kernel's ephemeral range: ``free_port`` (the port the kernel picks
    for a bind to port 0) and outgoing connections never land on it while a server started
    early has not bound it yet."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(max(1025, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


ADDRESS_IN_USE = "Address already in use"


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
    launched_at: float = 0.0
    started_s: list[float] = field(default_factory=list)  # launch to healthy, each start

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
        self.launch()
        return self.wait_up()

    def launch(self) -> None:
        """Start the process; ``wait_up`` waits for it."""
        env = {
            **os.environ,
            **dict(self.serve_command().env),  # as qlm instance launch starts it
            "VLLM_SERVER_DEV_MODE": "1",  # /sleep, /server_info, /abort_requests, ...
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        self.launched_at = time.monotonic()
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.log.parent,
                start_new_session=True,  # its own process group: stopped whole
            )

    def wait_up(self) -> int | None:
        """Wait until the launched server answers ``/health`` with 200 (None) or exits (its
        exit code); fail with its log if neither happens within ``START_TIMEOUT_S`` of its
        launch."""
        assert self.proc is not None, "launch it first"
        deadline = self.launched_at + START_TIMEOUT_S
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
        self.started_s.append(time.monotonic() - self.launched_at)
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


SERVERS: dict[str, Callable[[VllmEnv, Path], VllmServer]] = {
    "vllm_server": lambda env, log: VllmServer(env, quiet_port(), log),
    "one_at_a_time": lambda env, log: VllmServer(env, quiet_port(), log, ONE_AT_A_TIME_FLAGS),
    "offload_refused": lambda env, log: VllmServer(
        env, quiet_port(), log, kv_offload_gb=OFFLOAD_GB
    ),
}
"""The servers of the stage, by the name of their fixture."""

EXTERNAL = os.environ.get("QLM_TEST_VLLM_URL", "")
"""A server already running, started as ``VllmServer.command`` does (while working on these
tests: no start-up per run). ``vllm_server`` is that one then; tests that kill it skip."""


class _Early:
    """The servers the session's tests use, launched one after the other, in the order the
    tests first use them, by a thread that begins at the first unit test (or when a fixture
    first asks), until their fixtures take them (module docstring, "Started early")."""

    def __init__(self) -> None:
        self.env: VllmEnv | str | None = None
        self.order: list[tuple[str, VllmServer]] = []  # what the thread launches
        self.servers: dict[str, VllmServer] = {}  # not taken by their fixtures yet
        self.launched: dict[str, threading.Event] = {}
        self.logs: Path | None = None
        self.trigger: str | None = None  # the node id that begins the launches
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()

    def plan(self, session: pytest.Session) -> None:
        """At collection's end: which servers, in which order, launched from which test."""
        order: list[str] = []
        first_vllm = len(session.items)
        for index, item in enumerate(session.items):
            if item.get_closest_marker("vllm") is None:
                continue
            first_vllm = min(first_vllm, index)
            for name in getattr(item, "fixturenames", ()):
                if (
                    name in SERVERS
                    and name not in order
                    and not (EXTERNAL and name == "vllm_server")
                ):
                    order.append(name)
        if not order or session.config.option.collectonly:
            return
        self.env = _find_env()
        if isinstance(self.env, str):
            return  # the fixtures say so (skip, or fail under CI=true)
        self.logs = Path(tempfile.mkdtemp(prefix="qlm-vllm-"))
        for name in order:
            self.servers[name] = SERVERS[name](self.env, self.logs / f"{name}.log")
            self.order.append((name, self.servers[name]))
            self.launched[name] = threading.Event()
        unit = [item.nodeid for item in session.items[:first_vllm] if item.nodeid.startswith(UNIT)]
        self.trigger = unit[0] if unit else None
        session.config.pluginmanager.register(self, "qlm-vllm-early")

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        if nodeid == self.trigger:
            self.begin()

    def begin(self) -> None:
        if self.thread is None and self.order:
            self.thread = threading.Thread(target=self._launch_in_turn, name="qlm-vllm-early")
            self.thread.start()

    def _launch_in_turn(self) -> None:
        try:
            self._launch_each()
        finally:  # whatever happened, no fixture waits for a launch that will not come
            for event in self.launched.values():
                event.set()

    def _launch_each(self) -> None:
        for name, server in self.order:
            if self.stopping.is_set():
                return
            server.launch()
            self.launched[name].set()
            proc, deadline = server.proc, server.launched_at + START_TIMEOUT_S
            while (
                proc is not None
                and proc.poll() is None
                and not server.healthy()
                and time.monotonic() < deadline
                and not self.stopping.wait(1.0)
            ):
                pass

    def take(self, name: str) -> VllmServer | None:
        """The server of fixture ``name``, launched (None if it is not one of them)."""
        server = self.servers.pop(name, None)
        if server is not None:
            self.begin()
            self.launched[name].wait()
            if server.proc is None:  # the thread failed before launching it
                server.launch()
        return server

    def end(self) -> None:
        """Stop the servers no fixture took (their tests did not run)."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join()
        for server in self.servers.values():
            server.stop()
        self.servers.clear()
        if self.logs is not None:
            shutil.rmtree(self.logs, ignore_errors=True)


UNIT = "tests/unit/"
"""The unit tests run on one core, before this stage: the servers start on the other."""

_early = _Early()


def _env() -> VllmEnv:
    if _early.env is None:
        _early.env = _find_env()
    if isinstance(_early.env, str):
        _missing(_early.env)
    assert isinstance(_early.env, VllmEnv)
    return _early.env


def pytest_collection_finish(session: pytest.Session) -> None:
    _early.plan(session)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _early.end()


def started(name: str, tmp_path_factory: pytest.TempPathFactory) -> VllmServer:
    """The server of fixture ``name``: the one launched early, or launched now, once it answers
    ``/health`` or exited (``proc.returncode`` then). One launched early whose port was taken
    meanwhile all the same (by a server bound outside ``free_port``'s range) is launched again
    on another port."""
    env = _env()
    server = _early.take(name)
    if server is None:
        server = SERVERS[name](env, tmp_path_factory.mktemp(name) / "vllm.log")
        server.launch()
    for _ in range(3):
        if server.wait_up() is None or ADDRESS_IN_USE not in server.tail(20_000):
            break
        server.port = quiet_port()
        server.launch()
    return server


@contextlib.contextmanager
def running(name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """``started``, healthy (failing with its log if it exited), stopped afterwards."""
    server = started(name, tmp_path_factory)
    try:
        if server.proc is not None and server.proc.returncode is not None:
            pytest.fail(f"vLLM exited with {server.proc.returncode} at start-up:\n{server.tail()}")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_env() -> VllmEnv:
    return _env()


@pytest.fixture(scope="session")
def vllm_server(
    vllm_env: VllmEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """The session's vLLM server, healthy (a test that kills it starts it again)."""
    if EXTERNAL:
        log = tmp_path_factory.mktemp("vllm") / "vllm.log"
        yield VllmServer(vllm_env, int(EXTERNAL.rsplit(":", 1)[1]), log)
        return
    with running("vllm_server", tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def one_at_a_time(
    vllm_env: VllmEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """A server of its own that runs one request at a time (``--max-num-seqs 1``): which of
    those waiting it starts next is its scheduling policy's choice. It logs each request it
    hands to its engine ("Added request") and says how much of a prompt its prefix cache held
    (``usage.prompt_tokens_details.cached_tokens``)."""
    with running("one_at_a_time", tmp_path_factory) as server:
        yield server


@pytest.fixture
def offload_refused(
    vllm_env: VllmEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """A server started as ``qlm instance launch --kv-offload-gb`` starts it, once it answered
    ``/health`` (``started_s``) or exited (``proc.returncode``)."""
    server = started("offload_refused", tmp_path_factory)
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
