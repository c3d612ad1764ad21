"""The agents' CPU per streamed output token, by the engines' stream interval.

An agent reads every streamed event of every request it runs (the text, the running token
count): with vLLM's default of one event per token, a controller driving a fleet parses tens of
thousands of events a second. vLLM's ``--stream-interval N`` (``qlm instance launch
--stream-interval N``) sends one event per N tokens after the first. This starts ``--engines``
simulated vLLM servers (``qlm sim-engine serve``, real HTTP, ``--stream-interval`` each value
in turn), runs ``--requests`` requests of ``--tokens`` output tokens through one
``AgentRuntime`` with ``VllmEngine`` clients (FCFS), and prints this process's CPU seconds
(user + system: the agents, the controller and the HTTP client; the servers are other
processes) per 1,000 output tokens, and the events it read.

Reproduce: .venv/bin/python benchmarks/agent_streams.py [--intervals 1,4,16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from qlm.clock import WallClock
from qlm.controller import Controller
from qlm.domain import SLO, InstanceSpec, Request, RequestRecord
from qlm.engines.base import TokenChunk
from qlm.engines.vllm import VllmEngine
from qlm.planner import create_policy
from qlm.service.runtime import AgentRuntime, RuntimeListener

MODEL = "llama-3-8b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_servers(count: int, interval: int, time_scale: float) -> list[tuple[Any, str]]:
    exe = Path(sys.executable).with_name("qlm")
    servers = []
    for _ in range(count):
        port = free_port()
        argv = [str(exe), "sim-engine", "serve", "--model", MODEL, "--gpu", "A100"]
        argv += ["--port", str(port), "--time-scale", f"{time_scale:g}"]
        argv += ["--scheduling-policy", "priority", "--eos-lengths", "max_tokens"]
        argv += ["--stream-interval", str(interval)]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        servers.append((proc, f"http://127.0.0.1:{port}"))
    for proc, url in servers:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"simulated server {url} did not start") from None
                time.sleep(0.2)
    return servers


class Counter(RuntimeListener):
    def __init__(self) -> None:
        self.events = 0
        self.tokens = 0
        self.done = 0

    def chunk(self, request_id: str, chunk: TokenChunk) -> None:
        self.events += 1

    def finished(
        self, record: RequestRecord, text: str, finish_reason: str, tool_calls: Any = ()
    ) -> None:
        self.tokens += record.output_tokens
        self.done += 1


async def run_once(urls: list[str], requests: int, tokens: int) -> dict[str, float]:
    engines = [VllmEngine(f"e{i}", url, MODEL) for i, url in enumerate(urls)]
    specs = [InstanceSpec(e.name, "A100", (MODEL,)) for e in engines]
    listener = Counter()
    runtime = AgentRuntime(
        Controller(create_policy("fcfs"), specs),
        engines,
        clock=WallClock(1.0),
        listener=listener,
        tick_s=0.02,
        health_interval_s=1.0,
    )
    await runtime.start()
    now = runtime.clock.now()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for i in range(requests):
        runtime.submit(
            Request(
                id=f"b{i:05d}",
                model=MODEL,
                input_tokens=64,
                max_tokens=tokens,
                arrival_s=now,
                slo=SLO(e2e_s=3600.0),
                replay_output_tokens=tokens,
            )
        )
    while listener.done < requests:
        await asyncio.sleep(0.05)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    await runtime.stop()
    for engine in engines:
        await engine.close()
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "tokens": listener.tokens,
        "events": listener.events,
        "cpu_ms_per_1k_tokens": 1000.0 * cpu / max(1, listener.tokens) * 1000.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--intervals", default="1,4,16", help="stream intervals to compare")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--time-scale", type=float, default=4.0, help="simulated s per real s")
    args = parser.parse_args()
    print(
        f"{args.engines} simulated A100 servers (time x{args.time_scale:g}), {args.requests} "
        f"requests x {args.tokens} output tokens, FCFS; {platform.processor() or platform.machine()}"
        f", {os.cpu_count()} cores"
    )
    print(
        f"{'interval':>8} {'events':>8} {'tokens':>8} {'CPU s':>7} {'wall s':>7} {'CPU ms/1k tok':>14}"
    )
    for interval in (int(x) for x in args.intervals.split(",")):
        servers = start_servers(args.engines, interval, args.time_scale)
        try:
            r = asyncio.run(run_once([u for _, u in servers], args.requests, args.tokens))
        finally:
            for proc, _ in servers:
                proc.terminate()
                proc.wait(timeout=30)
        print(
            f"{interval:>8} {r['events']:>8.0f} {r['tokens']:>8.0f} {r['cpu_s']:>7.2f} "
            f"{r['wall_s']:>7.2f} {r['cpu_ms_per_1k_tokens']:>14.1f}"
        )
    print("reproduce: .venv/bin/python benchmarks/agent_streams.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
