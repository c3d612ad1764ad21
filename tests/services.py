"""The real servers integration tests talk to: RabbitMQ and PostgreSQL on 127.0.0.1.

Addresses come from ``QLM_TEST_AMQP_URL`` and ``QLM_TEST_DATABASE_URL`` (defaults: the machine's
guest/guest broker and the trust-auth ``test`` database). Without a server a test skips on a
laptop and fails under ``CI=true``: CI must never pass by skipping what it was meant to check.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

AMQP_URL = os.environ.get("QLM_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
DATABASE_URL = os.environ.get(
    "QLM_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def reachable(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or default_port), 2
        ):
            return True
    except OSError:
        return False


def require(url: str, default_port: int, what: str) -> str:
    """``url`` when its server answers; otherwise skip (fail under CI=true)."""
    if reachable(url, default_port):
        return url
    message = f"{what} not reachable at {url}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: integration tests must run)")
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def qlm_executable() -> str:
    exe = Path(sys.executable).with_name("qlm")
    return str(exe) if exe.exists() else "qlm"


def start_process(
    args: list[str], env: dict[str, str] | None = None, log_path: Path | None = None
) -> subprocess.Popen[bytes]:
    """A ``qlm`` subprocess with its output in a temporary file, or in ``log_path`` (kept for
    after the test; appended to, so a restarted process continues its log). Read it on failure
    with ``output``."""
    # The process owns the file; ``output`` reads it.
    log = tempfile.TemporaryFile() if log_path is None else log_path.open("a+b")  # noqa: SIM115
    proc = subprocess.Popen(
        [qlm_executable(), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    proc.qlm_log = log  # type: ignore[attr-defined]
    return proc


def output(proc: subprocess.Popen[bytes]) -> str:
    log = getattr(proc, "qlm_log", None)
    if log is None:
        return ""
    log.seek(0)
    return log.read().decode(errors="replace")[-4000:]


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


START_S = 300.0
"""How long a service process may take to start: seconds on a quiet host, minutes on a saturated
one (a deadline for a condition, not a wait)."""


def wait_healthy(
    proc: subprocess.Popen[bytes], url: str, what: str, timeout_s: float = START_S
) -> None:
    """Wait until ``url`` answers 200; fail (stopping ``proc``) if it exits or never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{output(proc)}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop(proc)
            pytest.fail(f"{what} did not answer 200 at {url} within {timeout_s:g} s")
        time.sleep(0.1)


def start_sim_engine(
    model: str = "llama-3-8b",
    gpu: str = "A100",
    time_scale: float = 10.0,
    extra: tuple[str, ...] = (),
    port: int | None = None,
    log_path: Path | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """A ``qlm sim-engine serve`` process on ``port`` (default: a free one), healthy; returns it
    and its URL. It schedules by priority, as QLM's vLLM servers do (``extra`` may say
    otherwise: the last ``--scheduling-policy`` wins)."""
    port = free_port() if port is None else port
    args = ["sim-engine", "serve", "--model", model, "--gpu", gpu, "--port", str(port)]
    args += ["--time-scale", str(time_scale), "--dev-mode", "--scheduling-policy", "priority"]
    proc = start_process([*args, *extra], log_path=log_path)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, f"{url}/health", "qlm sim-engine serve")
    return proc, url


def start_api(
    env: dict[str, str], port: int | None = None, log_path: Path | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """A ``qlm api`` process on ``port`` (default: a free one) configured by ``env``, live
    (``/healthz``); returns it and its URL."""
    port = free_port() if port is None else port
    api_env = {**env, "QLM_API__HOST": "127.0.0.1", "QLM_API__PORT": str(port)}
    proc = start_process(["api"], api_env, log_path=log_path)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, f"{url}/healthz", "qlm api")
    return proc, url


def rabbitmqctl() -> list[str]:
    """The command that manages the test broker: ``QLM_TEST_RABBITMQCTL`` (e.g. with ``-n node``
    for a private node), else ``rabbitmqctl``. Skip without it (fail under CI=true)."""
    command = shlex.split(os.environ.get("QLM_TEST_RABBITMQCTL", "rabbitmqctl"))
    if not command or shutil.which(command[0]) is None:
        if in_ci():
            pytest.fail(f"{command[:1]} not found (CI=true: broker tests must run)")
        pytest.skip(f"{command[:1]} not found")
    return command


_CONNECTION_NAME = re.compile(r'\{"connection_name","([^"]*)"\}')


def broker_connections(ctl: list[str]) -> list[tuple[str, str]]:
    """Every connection the broker has, as (its broker-side pid, the name the client gave it;
    "" for none). QLM's are ``qlm-<role> <queue> (pid N)``."""
    listed = subprocess.run(
        [*ctl, "-q", "list_connections", "pid", "client_properties"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    connections = []
    for line in listed.splitlines():
        pid, _, properties = line.partition("\t")
        if not pid.startswith("<"):
            continue  # a header
        named = _CONNECTION_NAME.search(properties)
        connections.append((pid, named.group(1) if named else ""))
    return connections


def close_connections(ctl: list[str], pids: list[str], reason: str) -> int:
    """Close these connections from the broker's side; how many it closed (one may have gone
    meanwhile)."""
    closed = 0
    for pid in pids:
        done = subprocess.run(
            [*ctl, "-q", "close_connection", pid, reason],
            capture_output=True,
            text=True,
            timeout=60,
        )
        closed += done.returncode == 0
    return closed


def queue_messages(ctl: list[str], queues: list[str]) -> dict[str, tuple[int, int]]:
    """Messages ready and un-acked in each of ``queues``, from ``rabbitmqctl list_queues``."""
    listed = subprocess.run(
        [*ctl, "-q", "list_queues", "name", "messages_ready", "messages_unacknowledged"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    counts = {}
    for line in listed.splitlines():
        name, ready, unacked = [*line.split("\t"), "0", "0"][:3]
        if name in queues:
            counts[name] = (int(ready), int(unacked))
    return counts


MAX_TEST_SHARDS = 8


@contextlib.contextmanager
def broker_names(amqp_url: str) -> Iterator[dict[str, str]]:
    """Unique queue and exchange names for one test, deleted from the broker afterwards (with
    up to ``MAX_TEST_SHARDS`` shards of the queue; the leader lock goes with its connection)."""
    from qlm.global_queue.rabbitmq import shard_names

    base = f"qlm.test.{uuid.uuid4().hex[:12]}"
    names = {
        "queue": base,
        "dead_letter_exchange": f"{base}.dlx",
        "dead_letter_queue": f"{base}.dead",
    }
    try:
        yield names
    finally:

        async def delete() -> None:
            import aio_pika

            connection = await aio_pika.connect(amqp_url)
            async with connection:
                channel = await connection.channel()
                for shard in shard_names(names["queue"], MAX_TEST_SHARDS):
                    await channel.queue_delete(shard)
                await channel.queue_delete(names["dead_letter_queue"])
                await channel.exchange_delete(names["dead_letter_exchange"])

        asyncio.run(delete())


@contextlib.contextmanager
def postgres_schema(postgres_url: str) -> Iterator[str]:
    """The URL of a fresh PostgreSQL schema of its own (``qlm_test_<hex>``, selected through the
    connection's ``search_path``), dropped with everything in it afterwards."""
    from qlm.store.database import scratch_schema

    with scratch_schema(postgres_url, "qlm_test") as url:
        yield url
