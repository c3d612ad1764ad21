"""API ingest: broker-confirmed submissions per second, their latency and the API's CPU per
accepted submission, through the whole accept path — HTTP, auth, limits, the store (PostgreSQL,
group commit) and RabbitMQ (publisher confirms) — at a given concurrency, against a bare FastAPI
app taking the same POST in the same run. Prints figures; asserts nothing.

The server is ``qlm api`` in its own process (uvloop and httptools, dependencies of QLM), or with
``--workers N`` that many processes behind one port (``uvicorn --factory
qlm.api.app:app_factory --workers N``). The reference is a FastAPI app with one route, ``POST
/v1/requests`` taking the JSON body as a ``dict`` and answering 202 with a small JSON document
(no auth, no store, no broker), on the same uvicorn, uvloop and httptools, one process
(``--no-bare``: skip it). The load comes from a second process on 127.0.0.1: ``wrk`` (Debian's
package: ``apt-get install wrk``) with a Lua script posting ``POST /v1/requests``, or, without
wrk, an async httpx generator in a subprocess; that one saturates its own core at ~200
requests/s on the development machine (it measures itself, not the API), so use wrk for
figures. Only 202s count as submissions: each one was committed to the store and confirmed by
the broker before it was answered, and the run counts the messages that landed in the queue. No
controller runs, so the queue only grows; the run's queue and PostgreSQL schema are deleted
afterwards.

CPU (Linux, from ``/proc``): the CPU of the processes this run started — the server and its
children (uvicorn's workers) — during the measured load, divided by the 202s; for context, the
share of RabbitMQ, PostgreSQL, the load generator and everything else on the host. The server is
ready when ``/readyz`` says the broker and the store are (no controller runs);
``--startup-timeout`` bounds the wait, and a server that exits or is not ready by then stops the
run with its log. ``--py-spy FILE`` records the API processes with py-spy during the measured
load (collapsed stacks, ``--format raw``; ``pip install py-spy``).

Targets (docs/api.md, "Ingest throughput"): the API's CPU per accepted submission <= 1.5x the
bare app's, and, with the workers docs/api.md recommends, confirmed submissions/s at concurrency
32 >= 0.7x the bare app's rate with p99 <= 50 ms; broker and database on the same host.

Reproduce: .venv/bin/python benchmarks/ingest.py [--duration 15] [--concurrency 32]
[--workers 1] [--database postgresql+psycopg://postgres@127.0.0.1:5432/test | sqlite]
[--client wrk|httpx] [--no-bare] [--py-spy FILE] [--rounds N]

The host's speed can drift by tens of percent over minutes (a shared virtual machine), and the
ratios compare two servers loaded one after the other: ``--rounds N`` loads the bare app and
then ``qlm api`` N times, alternated, prints each round's ratios, their median and spread, and
the details of the median round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
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


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> float:
    """Seconds until ``/readyz`` says the broker and the store are ready (the controller check
    fails: none runs), or ``/healthz`` answers for the bare app; exits with the server's log when
    it stopped or is not ready within ``timeout_s``."""
    t0 = time.monotonic()
    last = "no answer"
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            sys.exit(f"the server exited with code {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            answer = httpx.get(f"{url}/readyz", timeout=1)
            if answer.status_code == 404:  # the bare app has no readiness probe
                return time.monotonic() - t0
            checks = answer.json().get("checks", {})
            if all(checks.get(name, {}).get("ok") for name in ("broker", "store")):
                return time.monotonic() - t0
            last = f"/readyz {answer.status_code}: {answer.text[:300]}"
        except (httpx.HTTPError, ValueError) as exc:
            last = repr(exc)
        time.sleep(0.1)
    sys.exit(
        f"the server at {url} was not ready within {timeout_s:g} s (--startup-timeout); "
        f"last: {last}\nits log:\n{log.read_text()[-2000:]}"
    )


WRK_MISSING = (
    "wrk is not installed: scripts/debian-packages bench (Debian, Ubuntu), brew install wrk "
    "(macOS); "
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


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants (uvicorn's workers), from ``/proc``; [] off Linux."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        tasks = Path(f"/proc/{pid}/task")
        if not tasks.exists():
            continue
        out.append(pid)
        for task in tasks.iterdir():
            with contextlib.suppress(OSError):
                todo += [int(child) for child in (task / "children").read_text().split()]
    return out


def _cpu_of(pid: int | str) -> float:
    """CPU seconds (user + system) process ``pid`` used so far; 0 when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu(root: int) -> float | None:
    """CPU seconds the server and its children used so far; None off Linux."""
    if not Path("/proc/stat").exists():
        return None
    return sum(_cpu_of(pid) for pid in process_tree(root))


def host_cpu(server: int) -> dict[int, tuple[str, float]] | None:
    """Per process, its party — the server this run started and its children ("API"),
    RabbitMQ, PostgreSQL, the load generator, the rest — and the CPU seconds it used so far;
    the machine's idle seconds as pid 0; None off Linux."""
    if not Path("/proc/stat").exists():
        return None
    ours = set(process_tree(server))
    used: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(entry.name) in ours:
            party = "API"
        elif "beam.smp" in command:
            party = "RabbitMQ"
        elif command.startswith("postgres"):
            party = "PostgreSQL"
        elif command.startswith("wrk") or "HTTPX_LOAD" in command or "httpx.AsyncClient" in command:
            party = "load"
        else:
            party = "other"
        used[int(entry.name)] = (party, _cpu_of(entry.name))
    cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    used[0] = ("idle", int(cpu[3]) / os.sysconf("SC_CLK_TCK"))
    return used


Samples = list[tuple[float, dict[int, tuple[str, float]] | None]]


def sample_cpu(out: Samples, server: int, duration: int) -> None:
    """``host_cpu`` one second into the load and one second before its end (the load
    generator's CPU counts only while it runs)."""
    time.sleep(min(1.0, duration / 4))
    out.append((time.monotonic(), host_cpu(server)))
    time.sleep(max(0.5, duration - 2 * min(1.0, duration / 4)))
    out.append((time.monotonic(), host_cpu(server)))


def cpu_line(samples: Samples) -> str:
    """Each party's share of a core between the two samples (a process that ended in between
    is left out: its CPU is not known any more)."""
    if len(samples) < 2 or samples[0][1] is None or samples[1][1] is None:
        return "not measured (no /proc)"
    (t0, before), (t1, after) = samples[0], samples[1]
    share: dict[str, float] = {}
    for pid, (party, seconds) in after.items():
        used = seconds - before.get(pid, (party, 0.0))[1]
        share[party] = share.get(party, 0.0) + 100 * used / (t1 - t0)
    cores = os.cpu_count() or 1
    parts = [
        f"{k} {share.get(k, 0):.0f}%" for k in ("API", "RabbitMQ", "PostgreSQL", "load", "other")
    ]
    return f"{', '.join(parts)}; idle {share['idle']:.0f}% of {100 * cores}% (% of one core)"


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


BARE_APP = """
import sys, uvicorn
from typing import Any
from fastapi import Body, FastAPI
app = FastAPI()
@app.post("/v1/requests", status_code=202)
async def submit(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
    return {"id": "req_0", "object": "request", "status": "queued", "model": body.get("model")}
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools",
            log_level="warning", access_log=False)
"""


@dataclasses.dataclass
class Run:
    """One server under load: what the load generator saw, and the server's CPU."""

    load: dict[str, float]
    cpu_s: float | None  # the server's processes, over the measured load
    samples: Samples
    ready_s: float

    @property
    def rate(self) -> float:
        return self.load["accepted"] / self.load["seconds"]

    @property
    def cpu_ms(self) -> float | None:
        """The server's CPU per accepted submission, in ms."""
        if self.cpu_s is None or not self.load["accepted"]:
            return None
        return 1000 * self.cpu_s / self.load["accepted"]


def run_server(
    command: list[str],
    env: dict[str, str],
    port: int,
    log: Path,
    load: Callable[[str, str, int, int], dict[str, float]],
    key: str,
    args: argparse.Namespace,
    *,
    between: Callable[[], None] = lambda: None,
    profile: Path | None = None,
) -> Run:
    """Start ``command``, wait until it is ready, warm it up, load it for ``args.duration`` s
    (``between``: after the warm-up), stop it."""
    with log.open("wb") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        ready_s = wait_ready(url, server, log, args.startup_timeout)
        if args.warmup:
            load(url, key, args.concurrency, args.warmup)
        between()
        samples: Samples = []
        sampler = threading.Thread(
            target=sample_cpu, args=(samples, server.pid, args.duration), daemon=True
        )
        spies = py_spy(api_processes(server.pid), args.duration, profile) if profile else []
        cpu0 = server_cpu(server.pid)
        sampler.start()  # while the load runs: the load generator is gone afterwards
        result = load(url, key, args.concurrency, args.duration)
        cpu1 = server_cpu(server.pid)
        sampler.join()
        for spy in spies:
            spy.wait(timeout=60)
    finally:
        server.terminate()
        server.wait(timeout=30)
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    return Run(result, cpu, samples, ready_s)


PY_SPY = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


def py_spy(pids: list[int], duration: int, out: Path) -> list[subprocess.Popen[bytes]]:
    """py-spy recording each of ``pids`` for ``duration`` s into ``out`` (``out.1``, ...):
    collapsed stacks, sampled without pausing the process."""
    spies = []
    for n, pid in enumerate(pids):
        target = out.with_name(f"{out.name}.{n}") if n else out
        command = [PY_SPY or "py-spy", "record", "--rate", "200", "--format", "raw", "--nonblocking",
                   "--pid", str(pid), "--duration", str(duration), "--output", str(target)]  # fmt: skip
        spies.append(
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
    return spies


def api_processes(root: int) -> list[int]:
    """The processes that serve requests: uvicorn's workers, or the server itself."""
    tree = process_tree(root)
    return tree[1:] or tree


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
    parser.add_argument(
        "--no-bare", action="store_true", help="skip the bare FastAPI app (the reference)"
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=20.0, help="seconds a server has to be ready"
    )
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        metavar="FILE",
        help="record the API processes with py-spy during the measured load (FILE, FILE.1, ...)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="load the bare app and then qlm api this many times, alternated, and give each "
        "round's ratios and their median (the host's speed drifts: compare neighbours)",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.client == "wrk" and not shutil.which("wrk"):
        sys.exit(WRK_MISSING)
    if args.py_spy is not None and PY_SPY is None:
        sys.exit("py-spy is not installed: pip install py-spy")
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
    depth: list[int] = []
    rounds: list[tuple[Run, Run | None, int]] = []  # qlm api, the bare app, messages landed
    try:
        for number in range(args.rounds):
            bare: Run | None = None
            if not args.no_bare:
                bare_port = free_port()
                bare = run_server(
                    [sys.executable, "-c", BARE_APP, str(bare_port)], dict(os.environ),
                    bare_port, workdir / "bare.log", load, key, args,
                )  # fmt: skip
            api = run_server(
                command, env, port, workdir / "api.log", load, key, args,
                between=lambda: depth.append(asyncio.run(queue_depth(base))),
                profile=args.py_spy if number == 0 else None,
            )  # fmt: skip
            rounds.append((api, bare, asyncio.run(queue_depth(base)) - depth[-1]))
            if args.rounds > 1:
                print(f"round {number + 1}: {round_line(api, bare)}", flush=True)
    finally:
        asyncio.run(delete_queue([base, f"{base}.dead"], f"{base}.dlx"))
        schema.close()
    if args.rounds > 1:
        summarize(rounds)
    api, bare, confirmed = rounds[-1] if args.rounds == 1 else median_round(rounds)
    result = api.load
    print(
        f"ingest: {api.rate:,.0f} broker-confirmed submissions/s at concurrency "
        f"{args.concurrency} ({result['accepted']:,.0f} accepted in {result['seconds']:.1f} s, "
        f"{result['errors']:,.0f} errors; {confirmed:,} messages landed in the queue)"
        + (" (the round of the median rate ratio)" if args.rounds > 1 else "")
    )
    print(
        f"latency: p50 {result['p50_ms']:.1f} ms, p90 {result['p90_ms']:.1f} ms, "
        f"p99 {result['p99_ms']:.1f} ms, max {result['max_ms']:.1f} ms"
    )
    print(f"API CPU per accepted submission: {_ms(api.cpu_ms)}; cpu: {cpu_line(api.samples)}")
    if bare is not None:
        print(
            f"bare FastAPI app, same run: {bare.rate:,.0f}/s, p99 {bare.load['p99_ms']:.1f} ms, "
            f"CPU per answer {_ms(bare.cpu_ms)}; cpu: {cpu_line(bare.samples)}"
        )
        ratio = (
            f"{api.cpu_ms / bare.cpu_ms:.2f}x the bare app's (target <= 1.5x)"
            if api.cpu_ms is not None and bare.cpu_ms
            else "not measured"
        )
        print(
            f"ratios: API CPU per accepted submission {ratio}; confirmed submissions/s "
            f"{api.rate / bare.rate:.2f}x the bare app's rate (target >= 0.7x, p99 <= 50 ms)"
        )
    store_kind = "SQLite" if args.database == "sqlite" else "PostgreSQL"
    server_kind = args.server or (
        "qlm api" if args.workers == 1 else f"{args.workers} API processes (uvicorn)"
    )
    print(
        f"setup: {server_kind} ({store_kind} store, RabbitMQ; ready in {api.ready_s:.1f} s), "
        f"load from {client} in a second process; {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
        + (f"; py-spy profile in {args.py_spy}" if args.py_spy else "")
    )
    print(f"reproduce: .venv/bin/python benchmarks/ingest.py --duration {args.duration} "
          f"--concurrency {args.concurrency} --client {client}"
          + (f" --workers {args.workers}" if args.workers > 1 else "")
          + (" --database sqlite" if args.database == "sqlite" else "")
          + (" --no-bare" if args.no_bare else "")
          + (f" --rounds {args.rounds}" if args.rounds > 1 else "")
          + (f" --server {shlex.quote(args.server)}" if args.server else ""))  # fmt: skip


def round_line(api: Run, bare: Run | None) -> str:
    """One round in a line: qlm api's rate, p99 and CPU per 202, the bare app's, the ratios."""
    line = f"qlm api {api.rate:,.0f}/s, p99 {api.load['p99_ms']:.1f} ms, {_ms(api.cpu_ms)} CPU"
    if bare is None:
        return line
    cpu = f"{api.cpu_ms / bare.cpu_ms:.2f}x" if api.cpu_ms is not None and bare.cpu_ms else "?"
    return (
        f"{line}; bare app {bare.rate:,.0f}/s, {_ms(bare.cpu_ms)} CPU; "
        f"rate {api.rate / bare.rate:.2f}x, CPU per 202 {cpu}"
    )


def median_round(rounds: list[tuple[Run, Run | None, int]]) -> tuple[Run, Run | None, int]:
    """The round whose rate ratio (or, without the bare app, rate) is the median (the lower
    of the two middle ones for an even count)."""
    ranked = sorted(rounds, key=lambda r: r[0].rate / r[1].rate if r[1] else r[0].rate)
    return ranked[(len(ranked) - 1) // 2]


def summarize(rounds: list[tuple[Run, Run | None, int]]) -> None:
    """The ratios of every round: median, least and most."""
    rates = sorted(api.rate / bare.rate for api, bare, _ in rounds if bare is not None)
    cpus = sorted(
        api.cpu_ms / bare.cpu_ms
        for api, bare, _ in rounds
        if bare is not None and api.cpu_ms is not None and bare.cpu_ms
    )
    if rates:
        print(
            f"over {len(rounds)} rounds: rate {statistics.median(rates):.2f}x the bare app's "
            f"(median; {rates[0]:.2f}-{rates[-1]:.2f}x, {sum(r >= 0.7 for r in rates)} of "
            f"{len(rates)} rounds >= 0.7x)"
            + (
                f", CPU per 202 {statistics.median(cpus):.2f}x (median; "
                f"{cpus[0]:.2f}-{cpus[-1]:.2f}x)"
                if cpus
                else ""
            )
        )


def _ms(value: float | None) -> str:
    return "not measured (no /proc)" if value is None else f"{value:.3f} ms"


if __name__ == "__main__":
    main()
