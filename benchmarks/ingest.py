"""API ingest: broker-confirmed submissions per second and their latency, through the whole
accept path — HTTP, auth, limits, the store (PostgreSQL, group commit) and RabbitMQ (publisher
confirms) — at a given concurrency. Prints figures; asserts nothing.

The server is ``qlm api`` in its own process (uvloop and httptools, dependencies of QLM), or with
``--workers N`` that many processes behind one port (``uvicorn --factory
qlm.api.app:app_factory --workers N``). The load comes from a second process on 127.0.0.1:
``wrk`` (Debian's package: ``apt-get install wrk``) with a Lua script posting ``POST
/v1/requests``, or, without wrk, an async httpx generator in a subprocess; that one saturates
its own core at ~200 requests/s on the development machine (it measures itself, not the API),
so use wrk for figures. Only 202s count as submissions: each one was committed to the store and
confirmed by the broker before it was answered, and the run counts the messages that landed in
the queue. No controller runs, so the queue only grows; the run's queue and PostgreSQL schema
are deleted afterwards. On Linux it also prints the CPU each party used during the measured load
(from ``/proc``).

Target: >= 2,000 submissions/s with p99 <= 100 ms at concurrency 32 on the 2-core
development machine, broker and database on the same host. Results: docs/api.md, "Ingest
throughput".

Reproduce: .venv/bin/python benchmarks/ingest.py [--duration 15] [--concurrency 32]
[--workers 1] [--database postgresql+psycopg://postgres@127.0.0.1:5432/test | sqlite]
[--client wrk|httpx]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import aio_pika
import httpx

from qlm.domain import InstanceSpec
from qlm.store import Store
from qlm.store.database import scratch_schema

AMQP_URL = os.environ.get("QLM_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
DATABASE_URL = os.environ.get(
    "QLM_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
MODEL = "llama-3-8b"
BODY = {
    "model": MODEL,
    "prompt": "Summarise the following support ticket in two sentences: " + "x" * 400,
    "max_tokens": 128,
    "temperature": 0.7,
    "slo_seconds": 30,
    "tier": "interactive",
    "labels": {"bench": "ingest"},
}

WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = [[%s]]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %s"
done = function(summary, latency, requests)
  io.write(string.format("QLM %%d %%d %%d %%d %%f %%f %%f %%f\\n",
    summary.requests, summary.duration, summary.errors.status, summary.errors.connect
      + summary.errors.read + summary.errors.write + summary.errors.timeout,
    latency:percentile(50) / 1000, latency:percentile(90) / 1000,
    latency:percentile(99) / 1000, latency.max / 1000))
end
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def qlm() -> str:
    exe = Path(sys.executable).with_name("qlm")
    return str(exe) if exe.exists() else "qlm"


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"qlm api exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    sys.exit("qlm api did not start")


WRK_MISSING = (
    "wrk is not installed: apt-get install wrk (Debian, Ubuntu), brew install wrk (macOS); "
    "or pass --client httpx (an async Python generator that saturates its own core at a few "
    "hundred requests/s: it measures itself, not the API)"
)


def run_wrk(url: str, key: str, concurrency: int, duration: int) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT % (json.dumps(BODY), key))
    out = subprocess.run(
        ["wrk", "-t", "1", "-c", str(concurrency), "-d", f"{duration}s", "--timeout", "10s",
         "-s", script.name, f"{url}/v1/requests"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    os.unlink(script.name)
    match = re.search(
        r"^QLM (\d+) (\d+) (\d+) (\d+) ([\d.]+) ([\d.]+) ([\d.]+) ([\d.]+)$", out, re.M
    )
    if match is None:
        sys.exit(f"could not read wrk's output:\n{out}")
    n, micros, non2xx, socket_errors = (int(match.group(i)) for i in range(1, 5))
    p50, p90, p99, worst = (float(match.group(i)) for i in range(5, 9))
    return {
        "requests": n,
        "accepted": n - non2xx,
        "errors": non2xx + socket_errors,
        "seconds": micros / 1e6,
        "p50_ms": p50,
        "p90_ms": p90,
        "p99_ms": p99,
        "max_ms": worst,
    }


HTTPX_LOAD = """
import asyncio, json, sys, time
import httpx
url, key, concurrency, duration = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
body = json.loads(sys.argv[5])
async def main():
    lat, codes = [], {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=10) as c:
        end = time.perf_counter() + duration
        async def worker():
            while time.perf_counter() < end:
                t = time.perf_counter()
                r = await c.post(url, json=body, headers={"Authorization": "Bearer " + key})
                lat.append(time.perf_counter() - t)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        took = time.perf_counter() - start
    lat.sort()
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1000
    print(json.dumps({"requests": len(lat), "accepted": codes.get(202, 0),
        "errors": len(lat) - codes.get(202, 0), "seconds": took, "p50_ms": q(0.5),
        "p90_ms": q(0.9), "p99_ms": q(0.99), "max_ms": lat[-1] * 1000}))
asyncio.run(main())
"""


def run_httpx(url: str, key: str, concurrency: int, duration: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", HTTPX_LOAD, f"{url}/v1/requests", key, str(concurrency),
         str(duration), json.dumps(BODY)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    result: dict[str, float] = json.loads(out)
    return result


def cpu_seconds() -> dict[str, float] | None:
    """CPU seconds used so far per party (the API, RabbitMQ, PostgreSQL, the load generator,
    the rest) and the machine's idle seconds, from ``/proc``; None off Linux."""
    if not Path("/proc/stat").exists():
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        seconds = (int(fields[11]) + int(fields[12])) / ticks
        if "qlm api" in command or "app_factory" in command or "multiprocessing" in command:
            party = "API"
        elif "beam.smp" in command:
            party = "RabbitMQ"
        elif command.startswith("postgres"):
            party = "PostgreSQL"
        elif command.startswith("wrk") or "HTTPX_LOAD" in command or "httpx.AsyncClient" in command:
            party = "load"
        else:
            party = "other"
        used[party] = used.get(party, 0.0) + seconds
    cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    used["idle"] = int(cpu[3]) / ticks
    return used


def sample_cpu(out: list[tuple[float, dict[str, float] | None]], duration: int) -> None:
    """``cpu_seconds`` one second into the load and one second before its end."""
    time.sleep(min(1.0, duration / 4))
    out.append((time.monotonic(), cpu_seconds()))
    time.sleep(max(0.5, duration - 2 * min(1.0, duration / 4)))
    out.append((time.monotonic(), cpu_seconds()))


def cpu_line(samples: list[tuple[float, dict[str, float] | None]]) -> str:
    if len(samples) < 2 or samples[0][1] is None or samples[1][1] is None:
        return "cpu: not measured (no /proc)"
    (t0, before), (t1, after) = samples[0], samples[1]
    assert before is not None and after is not None
    share = {k: 100 * (v - before.get(k, 0.0)) / (t1 - t0) for k, v in after.items()}
    cores = os.cpu_count() or 1
    parts = [
        f"{k} {share.get(k, 0):.0f}%" for k in ("API", "RabbitMQ", "PostgreSQL", "load", "other")
    ]
    return f"cpu (% of one core): {', '.join(parts)}; idle {share['idle']:.0f}% of {100 * cores}%"


async def queue_depth(queue: str) -> int:
    """Messages in ``queue``; 0 before the API declared it (no submission yet)."""
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        try:
            declared = await channel.declare_queue(queue, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return 0
        return int(declared.declaration_result.message_count or 0)


async def delete_queue(names: list[str], exchange: str) -> None:
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        for name in names:
            await channel.queue_delete(name)
        await channel.exchange_delete(exchange)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=20, help="seconds of measured load")
    parser.add_argument("--warmup", type=int, default=5, help="seconds of load before measuring")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--database", default=DATABASE_URL, help="a PostgreSQL URL, or 'sqlite'")
    parser.add_argument("--client", choices=["wrk", "httpx"], default=None)
    parser.add_argument(
        "--workers", type=int, default=1, help="API processes (uvicorn --workers) behind one port"
    )
    parser.add_argument(
        "--server",
        default=None,
        help="the command that runs the API instead of 'qlm api' (experiments); it gets the "
        "settings in the environment, the port in QLM_API__PORT",
    )
    args = parser.parse_args()
    if args.client == "wrk" and not shutil.which("wrk"):
        sys.exit(WRK_MISSING)
    client = args.client or ("wrk" if shutil.which("wrk") else "httpx")
    if client == "httpx" and args.client is None:
        print(f"note: {WRK_MISSING}; using the httpx generator", file=sys.stderr)
    load = run_wrk if client == "wrk" else run_httpx

    base = f"qlm.bench.{uuid.uuid4().hex[:10]}"
    workdir = Path(tempfile.mkdtemp(prefix="qlm-ingest-"))
    schema = contextlib.ExitStack()  # a PostgreSQL run's schema, dropped at the end
    if args.database == "sqlite":
        database = f"sqlite:///{workdir / 'qlm.db'}"
    else:
        database = schema.enter_context(scratch_schema(args.database, "qlm_bench"))
    with Store.open(database) as store:
        store.upsert_instance(InstanceSpec("bench-0", "A100", (MODEL,)))
        key = store.create_api_key("bench")
    port = free_port()
    env = {
        **os.environ,
        "QLM_BROKER_URL": AMQP_URL,
        "QLM_DATABASE_URL": database,
        "QLM_BROKER__QUEUE": base,
        "QLM_BROKER__DEAD_LETTER_EXCHANGE": f"{base}.dlx",
        "QLM_BROKER__DEAD_LETTER_QUEUE": f"{base}.dead",
        "QLM_API__PORT": str(port),
        "QLM_API__RATE_PER_S": "1000000",
        "QLM_API__RATE_BURST": "1000000",
        "QLM_API__MAX_QUEUED_PER_TENANT": "100000000",
        "QLM_LOG_LEVEL": "WARNING",
    }
    if args.server:
        command = args.server.split()
    elif args.workers > 1:
        command = [
            str(Path(sys.executable).with_name("uvicorn")), "--factory",
            "qlm.api.app:app_factory", "--workers", str(args.workers), "--host", "127.0.0.1",
            "--port", str(port), "--loop", "uvloop", "--http", "httptools", "--no-access-log",
            "--log-level", "warning",
        ]  # fmt: skip
    else:
        command = [qlm(), "api"]
    log = workdir / "api.log"
    with log.open("wb") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server, log)
        if args.warmup:
            load(url, key, args.concurrency, args.warmup)
        before = asyncio.run(queue_depth(base))
        cpu: list[tuple[float, dict[str, float] | None]] = []
        sampler = threading.Thread(target=sample_cpu, args=(cpu, args.duration), daemon=True)
        sampler.start()  # while the load runs: the load generator is gone afterwards
        result = load(url, key, args.concurrency, args.duration)
        sampler.join()
        confirmed = asyncio.run(queue_depth(base)) - before
    finally:
        server.terminate()
        server.wait(timeout=30)
        asyncio.run(delete_queue([base, f"{base}.dead"], f"{base}.dlx"))
        schema.close()
    rate = result["accepted"] / result["seconds"]
    print(
        f"ingest: {rate:,.0f} broker-confirmed submissions/s at concurrency {args.concurrency} "
        f"({result['accepted']:,.0f} accepted in {result['seconds']:.1f} s, "
        f"{result['errors']:,.0f} errors; {confirmed:,} messages landed in the queue)"
    )
    print(
        f"latency: p50 {result['p50_ms']:.1f} ms, p90 {result['p90_ms']:.1f} ms, "
        f"p99 {result['p99_ms']:.1f} ms, max {result['max_ms']:.1f} ms"
    )
    print(cpu_line(cpu))
    store_kind = "SQLite" if args.database == "sqlite" else "PostgreSQL"
    server_kind = args.server or (
        "qlm api" if args.workers == 1 else f"{args.workers} API processes (uvicorn)"
    )
    print(
        f"setup: {server_kind} ({store_kind} store, RabbitMQ), load from {client} in a second "
        f"process; {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(f"reproduce: .venv/bin/python benchmarks/ingest.py --duration {args.duration} "
          f"--concurrency {args.concurrency} --client {client}"
          + (f" --workers {args.workers}" if args.workers > 1 else "")
          + (" --database sqlite" if args.database == "sqlite" else ""))  # fmt: skip


if __name__ == "__main__":
    main()
