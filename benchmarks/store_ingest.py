"""The store's side of an API submission: how long ``Store.add_requests_async`` takes to record
a batch (the API's group commit) when nothing else runs, one batch at a time on one connection.
Prints figures; asserts nothing.

This is the commit's service time without the load: under ``benchmarks/ingest.py`` the same
commit also waits for the two cores the API, the broker and the load generator share. Each
round records ``--batches`` batches of ``--batch`` requests (a ``--prompt-chars`` prompt, a
temperature, an SLO and ``--labels`` labels each, as ``benchmarks/ingest.py`` submits them) into
a fresh PostgreSQL schema (or a SQLite file), after a warm-up of 20 batches; the schema is
dropped afterwards. Compare ``--labels 0`` with ``--labels 1``: a request's labels are rows of
a second table, written by the same statement.

Reproduce: .venv/bin/python benchmarks/store_ingest.py [--database URL | sqlite] [--batch 14]
[--batches 300] [--rounds 3] [--labels 1] [--prompt-chars 460]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from qlm.store import NewRequest, Store
from qlm.store.database import scratch_schema

DATABASE_URL = os.environ.get(
    "QLM_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
WARM_UP = 20


def batch(size: int, prompt_chars: int, labels: int) -> list[NewRequest]:
    return [
        NewRequest(
            id=uuid.uuid4().hex[:24],
            tenant="bench",
            model="llama-3-8b",
            prompt_tokens=max(1, prompt_chars // 4),
            max_tokens=256,
            slo_e2e_s=30.0,
            slo_ttft_s=2.0,
            submitted_at=time.time(),
            prompt="x" * prompt_chars,
            sampling={"temperature": 0.7},
            labels=tuple((f"key{k}", "value") for k in range(labels)),
        )
        for _ in range(size)
    ]


async def one_round(store: Store, args: argparse.Namespace) -> list[float]:
    """Seconds per batch recorded, ``args.batches`` of them, after the warm-up."""
    seconds: list[float] = []
    for n in range(WARM_UP + args.batches):
        news = batch(args.batch, args.prompt_chars, args.labels)
        start = time.perf_counter()
        created = await store.add_requests_async(news)
        took = time.perf_counter() - start
        if len(created) != len(news):
            sys.exit(f"recorded {len(created)} of {len(news)} requests")
        if n >= WARM_UP:
            seconds.append(took)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--database", default=DATABASE_URL, help="a PostgreSQL URL, or 'sqlite'")
    parser.add_argument("--batch", type=int, default=14, help="requests per batch")
    parser.add_argument("--batches", type=int, default=300, help="batches per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--labels", type=int, default=1, help="labels per request")
    parser.add_argument("--prompt-chars", type=int, default=460)
    args = parser.parse_args()
    for name in ("batch", "batches", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.labels < 0:
        parser.error(f"--labels must be >= 0, got {args.labels}")

    with tempfile.TemporaryDirectory(prefix="qlm-store-ingest-") as workdir:
        if args.database == "sqlite":
            url, kind = f"sqlite:///{Path(workdir) / 'qlm.db'}", "SQLite file"
            rounds = asyncio.run(run_rounds(url, args))
        else:
            kind = "PostgreSQL"
            with scratch_schema(args.database, "qlm_bench") as url:
                rounds = asyncio.run(run_rounds(url, args))
    print(
        f"store ingest ({kind}): batches of {args.batch} requests, {args.labels} label(s) and "
        f"a {args.prompt_chars}-character prompt each, one at a time on one connection "
        f"(Python {platform.python_version()}, {os.cpu_count()} CPUs)"
    )
    print(f"{'round':>5}  {'median ms':>9}  {'p90 ms':>7}  {'mean ms':>7}  {'µs/request':>10}")
    for n, seconds in enumerate(rounds, 1):
        ms = sorted(s * 1e3 for s in seconds)
        p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
        mean = statistics.mean(ms)
        print(
            f"{n:>5}  {statistics.median(ms):>9.2f}  {p90:>7.2f}  {mean:>7.2f}  "
            f"{mean * 1e3 / args.batch:>10.0f}"
        )
    print("reproduce: .venv/bin/python benchmarks/store_ingest.py " + " ".join(sys.argv[1:]))


async def run_rounds(url: str, args: argparse.Namespace) -> list[list[float]]:
    with Store.open(url) as store:
        return [await one_round(store, args) for _ in range(args.rounds)]


if __name__ == "__main__":
    main()
