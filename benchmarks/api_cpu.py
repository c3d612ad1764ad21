"""The API's own CPU per accepted ``POST /v1/requests``: the ASGI app driven in one process (no
HTTP server, no socket), on an in-memory queue and a SQLite store, with ``Submitter.submit``
replaced by one that writes the queue message and the store's row document (what the real one
encodes per submission) and answers at once. What it measures is everything the API does for a
submission but its I/O: the front door, the key, the body's parse and validation, admission,
the objects it builds, the two encodings and the 202. Prints figures; asserts nothing.

The body is ``benchmarks/ingest.py``'s (a 460-character prompt, a temperature, a tier, an SLO and
a label). CPU is the process's (``time.process_time``) over ``--chunk`` submissions at a time;
the least of ``--chunks`` chunks is the figure (the others carry the host's noise), the median
for context. ``--profile`` prints cProfile's split of one more chunk instead.

Reproduce: .venv/bin/python benchmarks/api_cpu.py [--chunks 10] [--chunk 2000] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import statistics
import sys
import time
from typing import Any

from ingest import BODY as INGEST_BODY
from ingest import MODEL

from qlm.api.app import Api, create_app
from qlm.api.submission import Accepted
from qlm.domain import InstanceSpec
from qlm.global_queue import MemoryGlobalQueue, QueuedRequest
from qlm.settings import ApiSettings, Settings
from qlm.store import NewRequest, Store
from qlm.store.ingest import _rows_document

BODY = json.dumps(INGEST_BODY).encode()  # benchmarks/ingest.py's


async def measure(args: argparse.Namespace) -> None:
    store = Store.open("sqlite://")
    store.upsert_instance(InstanceSpec("bench-0", "A100", (MODEL,)))
    key = store.create_api_key("bench")
    api = ApiSettings(rate_per_s=1e9, rate_burst=10**9, max_queued_per_tenant=10**9)
    app = create_app(Settings(api=api), queue=MemoryGlobalQueue(), store=store)
    async with app.router.lifespan_context(app):
        ctx = app.state.ctx

        async def submit(new: NewRequest, message: QueuedRequest) -> Accepted:
            message.encode()
            _rows_document([new])
            return Accepted(new, False)

        ctx.submitter.submit = submit
        if isinstance(app, Api) and app.front_door is None:
            app.open_front_door(ctx.settings.max_body_bytes)
        scope: dict[str, Any] = {
            "type": "http",
            "method": "POST",
            "path": "/v1/requests",
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"host", b"127.0.0.1"),
                (b"content-type", b"application/json"),
                (b"authorization", f"Bearer {key}".encode()),
                (b"content-length", str(len(BODY)).encode()),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
            "scheme": "http",
            "http_version": "1.1",
            "asgi": {"version": "3.0"},
        }
        request = {"type": "http.request", "body": BODY, "more_body": False}
        statuses: list[int] = []

        async def receive() -> dict[str, Any]:
            return request

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        async def chunk() -> float:
            c0 = time.process_time()
            for _ in range(args.chunk):
                await app(dict(scope), receive, send)
            return (time.process_time() - c0) / args.chunk * 1e6

        await chunk()  # warm-up
        if set(statuses) != {202}:
            sys.exit(f"the API answered {sorted(set(statuses))}, not 202")
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            await chunk()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(30)
            return
        figures = [await chunk() for _ in range(args.chunks)]
    store.close()
    print(
        f"API CPU per accepted submission, no I/O: {min(figures):.1f} µs "
        f"(least of {args.chunks} chunks of {args.chunk}; median {statistics.median(figures):.1f} µs)"
    )
    print(
        "reproduce: .venv/bin/python benchmarks/api_cpu.py "
        f"--chunks {args.chunks} --chunk {args.chunk}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=2000)
    parser.add_argument("--profile", action="store_true", help="cProfile's split of one chunk")
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:  # Windows
        asyncio.run(measure(args))
    else:
        uvloop.run(measure(args))


if __name__ == "__main__":
    main()
