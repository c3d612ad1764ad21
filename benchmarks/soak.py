"""Does a long-running controller hold on to what it served? A soak of the production path.

Replays successive windows of the Azure conversation trace (W_B's SLO classes and tiers) through
the controller service as ``qlm serve --replay`` does — the in-process global queue, the store
(an SQLite file), groups, estimator, planner and agents on simulated instances, on a clock
``--time-scale`` times faster than real time — and after each window, once every request of it is
final in the store, counts what the process still holds: Python objects (after a full garbage
collection), the resident memory, and the controller's per-request tables. A service that
forgets what it finished holds about as much after the tenth window as after the second; one that
leaks grows with every request served. Prints the growth per 1,000 requests between the second
window and the last (the first warms caches, compiles, fills pools); asserts nothing.

    .venv/bin/python benchmarks/soak.py [--windows 8] [--window-s 300] [--rate 3]
        [--time-scale 20] [--policy qlm] [--database sqlite|URL] [--tracemalloc N] [--trim]

Results: docs/operations.md, "Memory over time".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import logging
import re
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from qlm.global_queue import MemoryGlobalQueue
from qlm.planner import QlmPolicy
from qlm.service import build_controller
from qlm.service.replay import replay
from qlm.settings import Settings
from qlm.sim.traces import load_trace, scale_rate, window
from qlm.sim.workload import create_workload
from qlm.store import Store
from qlm.store.database import scratch_schema

TRACE_START_S = 600.0  # the trace's first ten minutes ramp up


def rss_mb() -> tuple[float, float]:
    """Resident memory now (not the peak), anonymous (the heap) and file-backed, from Linux's
    /proc (zeros elsewhere)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0.0, 0.0
    kib = {
        k: float(v.split()[0]) for k, v in re.findall(r"^(RssAnon|RssFile):\s+(.*)$", status, re.M)
    }
    return kib.get("RssAnon", 0.0) / 1024, kib.get("RssFile", 0.0) / 1024


def trim_heap() -> bool:
    """Ask glibc to give the free memory at the top of its heaps back to the system
    (``malloc_trim(0)``); False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


def sqlite_mb() -> float | None:
    """What SQLite's own allocator holds now, in every connection of the process
    (``sqlite3_memory_used``; native memory Python's tracemalloc does not see), or None where the
    library cannot be asked."""
    name = ctypes.util.find_library("sqlite3")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
        used = lib.sqlite3_memory_used
    except (OSError, AttributeError):
        return None
    used.restype = ctypes.c_int64
    return float(used()) / 2**20


def held(service: object) -> dict[str, int]:
    """Sizes of the per-request tables a finished request must leave."""
    runtime = service.runtime  # type: ignore[attr-defined]
    controller = runtime.controller
    sizes = {
        "tracks": sum(1 for _ in controller.tracks()),
        "deliveries held": len(service._held),  # type: ignore[attr-defined]
        "jobs": len(runtime._jobs),
    }
    policy = controller.policy
    if isinstance(policy, QlmPolicy):  # its own tables, read for the probe
        estimator = policy.estimator
        sizes["estimator predictions"] = len(estimator._pending) + len(estimator.beliefs.inflight)
        sizes["grouped"] = policy.grouper.num_requests
    return sizes


async def main(args: argparse.Namespace) -> None:
    settings = Settings.model_validate(
        {"controller": {"policy": args.policy, "sim_time_scale": args.time_scale}}
    )
    with contextlib.ExitStack() as scratch:
        if args.database == "sqlite":
            database = f"sqlite:///{Path(tempfile.mkdtemp()) / 'soak.db'}"
        else:  # a schema of its own, dropped at the end
            database = scratch.enter_context(scratch_schema(args.database, "qlm_soak"))
        await soak(args, settings, Store.open(database))


async def soak(args: argparse.Namespace, settings: Settings, store: Store) -> None:
    queue = MemoryGlobalQueue()
    service = build_controller(settings, queue=queue, store=store)
    await service.start()
    trace = scale_rate(load_trace("azure-conv", seed=0), args.rate)
    first, end = TRACE_START_S / args.rate, float(trace.arrival_s[-1])
    if args.window_s > end - first:
        raise SystemExit(f"--window-s: at most {end - first:.0f} s of this trace at --rate")
    served = 0
    rows: list[tuple[int, float, int]] = []
    trimmed: list[float] = []
    print(
        f"{'window':>6} {'requests':>9} {'met SLO':>8} {'wall s':>7} {'objects':>10} "
        f"{'RSS MB':>7} {'of heap':>7}{' trimmed' if args.trim else ''}  per-request tables"
    )
    t0 = time.monotonic()
    if args.tracemalloc:
        tracemalloc.start(1)
    baseline: tracemalloc.Snapshot | None = None
    for k in range(args.windows):
        # Successive windows, from the trace's start again (new ids and SLOs) past its end.
        lo = first + (k * args.window_s) % (end - first - args.window_s)
        requests = create_workload("wb", window(trace, lo, lo + args.window_s), seed=k)
        result = await replay(
            requests, queue, store, service.runtime.clock, time_scale=args.time_scale
        )
        await service.wait_idle()
        served += result.requests
        gc.collect()
        objects, (anon, mapped) = len(gc.get_objects()), rss_mb()
        rss = anon + mapped
        rows.append((served, rss, objects))
        after = ""
        if args.trim and trim_heap():
            trimmed.append(rss_mb()[0])
            after = f" {trimmed[-1]:>8.1f}"
        native = sqlite_mb()
        if native is not None:
            after += f", SQLite {native:.1f} MB"
        if args.tracemalloc:
            after += f", Python {tracemalloc.get_traced_memory()[0] / 2**20:.1f} MB"
        tables = ", ".join(f"{n} {v}" for n, v in held(service).items())
        print(
            f"{k + 1:>6} {served:>9,} {result.attainment:>8.1%} {result.wall_s:>7.1f} "
            f"{objects:>10,} {rss:>7.1f} {anon:>7.1f}{after};  {tables}",
            flush=True,
        )
        if args.tracemalloc and k == 1:
            baseline = tracemalloc.take_snapshot()
    if baseline is not None:
        grown = tracemalloc.take_snapshot().compare_to(baseline, "traceback")
        print(f"where Python's allocations grew since window 2 (top {args.tracemalloc}):")
        for stat in grown[: args.tracemalloc]:
            print(f"  {stat.size_diff / 1024:+10.1f} KiB {stat.count_diff:+8d} blocks")
            for line in stat.traceback.format()[-6:]:
                print("      " + line.strip())
    await service.stop()
    store.close()
    if len(rows) >= 3:
        (n0, rss0, obj0), (n1, rss1, obj1) = rows[1], rows[-1]
        per = (n1 - n0) / 1000
        print(
            f"from window 2 to {len(rows)} ({n1 - n0:,} requests): "
            f"{(obj1 - obj0) / per:+,.0f} objects and {(rss1 - rss0) / per:+.2f} MB RSS "
            f"per 1,000 requests served"
        )
        if len(trimmed) == len(rows):
            print(
                f"heap after malloc_trim: {(trimmed[-1] - trimmed[1]) / per:+.2f} MB "
                f"per 1,000 requests"
            )
    print(f"{served:,} requests in {time.monotonic() - t0:.0f} s")
    print("reproduce: .venv/bin/python " + " ".join(sys.argv))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window-s", type=float, default=300.0, help="trace seconds per window")
    parser.add_argument("--rate", type=float, default=3.0, help="× the trace's arrival rate")
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--policy", default="qlm")
    parser.add_argument(
        "--database", default="sqlite", help="sqlite (a file) or a postgresql+psycopg:// URL"
    )
    parser.add_argument(
        "--tracemalloc",
        type=int,
        default=0,
        metavar="N",
        help="trace Python's allocations (slower) and print the N sites that grew most",
    )
    parser.add_argument(
        "--trim",
        action="store_true",
        help="after each window also measure the heap after glibc's malloc_trim(0) (free "
        "memory the allocator kept is given back; what stays is held)",
    )
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(parser.parse_args()))
