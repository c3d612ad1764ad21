"""The least an accept path with QLM's guarantee must do, as a server for ``benchmarks/ingest.py``.

QLM answers 202 only once a submission is committed to the store and confirmed by the broker
(docs/api.md, "Guarantees"). This app does that and nothing else: the same uvicorn, uvloop and
httptools as the bare app, but a plain ASGI callable instead of FastAPI (the body read and
parsed with ``json.loads``, a fixed answer: less CPU per request than the bare app), then the
submissions waiting are group-committed (one ``INSERT ... SELECT FROM json_populate_recordset``
per batch on a psycopg ``AsyncConnection``, up to three batches in flight, as QLM's writer) and
**at the same time** published through QLM's own publisher (``GlobalQueue.publish_many``: the
global queue's topology, persistent messages, confirms pipelined on one channel): the two round
trips overlap, which QLM's order (commit first, then publish) does not. No validation,
authentication, rate limits, idempotency or metrics.

Its rate is therefore a ceiling for any implementation of QLM's accept path on the host it runs
on: ``ingest.py`` loads it beside the bare app in one run and prints both rates::

    .venv/bin/python benchmarks/ingest.py --duration 10 --warmup 3 --client wrk \\
        --server ".venv/bin/python benchmarks/durable_floor.py"

``FLOOR_ORDER=serial`` in the environment commits first and publishes after, as QLM does, to
show what the overlap is worth. It reads the settings ``qlm api`` reads: ``QLM_API__PORT``, ``QLM_DATABASE_URL`` (PostgreSQL),
``QLM_BROKER_URL``, ``QLM_BROKER__QUEUE``, ``QLM_BROKER__DEAD_LETTER_EXCHANGE``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import Any

import psycopg
import uvicorn
from sqlalchemy.engine import make_url

from qlm.global_queue import QueuedRequest, open_global_queue
from qlm.settings import Settings

WRITERS = 3  # batches in flight, as QLM's writer on PostgreSQL
MAX_BATCH = 512
SERIAL = os.environ.get("FLOOR_ORDER", "overlap") == "serial"

INSERT = (
    "INSERT INTO floor_requests (id, body) "
    "SELECT id, body FROM json_populate_recordset(NULL::floor_requests, %s)"
)


def libpq_url(url: str) -> str:
    """A SQLAlchemy PostgreSQL URL as libpq reads it (no driver name, options kept)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class Floor:
    """Group commit and publish, overlapped; ``accept`` returns once both are done."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, dict[str, Any], asyncio.Future[None]]] = []
        self.wake = asyncio.Event()
        self.free = asyncio.Semaphore(WRITERS)
        self.connections: asyncio.Queue[psycopg.AsyncConnection[Any]] = asyncio.Queue()
        settings = Settings()
        self.queue = open_global_queue(settings.broker_url, **settings.broker.queue_options())
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        database = libpq_url(os.environ["QLM_DATABASE_URL"])
        for n in range(WRITERS):
            connection = await psycopg.AsyncConnection.connect(database, autocommit=True)
            if n == 0:
                await connection.execute(
                    "CREATE TABLE IF NOT EXISTS floor_requests (id text PRIMARY KEY, body jsonb)"
                )
            self.connections.put_nowait(connection)
        self.tasks.add(asyncio.create_task(self.write_forever()))

    async def accept(self, body: dict[str, Any]) -> str:
        request_id = f"req_{uuid.uuid4().hex}"
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending.append((request_id, body, done))
        self.wake.set()
        await done
        return request_id

    async def write_forever(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.pending:
                await self.free.acquire()
                batch = self.pending[:MAX_BATCH]
                del self.pending[:MAX_BATCH]
                task = asyncio.create_task(self.write(batch))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def write(self, batch: list[tuple[str, dict[str, Any], asyncio.Future[None]]]) -> None:
        try:
            rows = json.dumps([{"id": i, "body": body} for i, body, _ in batch])
            messages = [message(i, body) for i, body, _ in batch]
            if SERIAL:
                await self.commit(rows)
                await self.publish(messages)
            else:
                await asyncio.gather(self.commit(rows), self.publish(messages))
        except Exception as exc:
            for _, _, done in batch:
                if not done.done():
                    done.set_exception(exc)
        else:
            for _, _, done in batch:
                if not done.done():
                    done.set_result(None)
        finally:
            self.free.release()

    async def commit(self, rows: str) -> None:
        connection = await self.connections.get()
        try:
            await connection.execute(INSERT, (rows,))
        finally:
            self.connections.put_nowait(connection)

    async def publish(self, messages: list[QueuedRequest]) -> None:
        for error in await self.queue.publish_many(messages):
            if error is not None:
                raise error


def message(request_id: str, body: dict[str, Any]) -> QueuedRequest:
    """The queue message of a body as the benchmark sends it (no checks)."""
    return QueuedRequest(
        id=request_id,
        model=body["model"],
        prompt_tokens=len(body["prompt"]) // 4,
        max_tokens=body["max_tokens"],
        slo_e2e_s=body["slo_seconds"],
        submitted_at=time.time(),
        prompt=body["prompt"],
        sampling={"temperature": body["temperature"]},
        labels=body["labels"],
    )


floor = Floor()
ANSWER_HEADERS = [(b"content-type", b"application/json")]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``POST /v1/requests`` (any other path gets 404); start-up through the lifespan."""
    if scope["type"] == "lifespan":
        while True:
            event = await receive()
            if event["type"] == "lifespan.startup":
                await floor.start()
                await send({"type": "lifespan.startup.complete"})
            elif event["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["path"] != "/v1/requests" or scope["method"] != "POST":
        await send({"type": "http.response.start", "status": 404, "headers": ANSWER_HEADERS})
        await send({"type": "http.response.body", "body": b"{}"})
        return
    chunks = []
    more = True
    while more:
        event = await receive()
        chunks.append(event.get("body", b""))
        more = event.get("more_body", False)
    body = json.loads(b"".join(chunks))
    request_id = await floor.accept(body)
    answer = json.dumps(
        {"id": request_id, "object": "request", "status": "queued", "model": body.get("model")}
    ).encode()
    await send({"type": "http.response.start", "status": 202, "headers": ANSWER_HEADERS})
    await send({"type": "http.response.body", "body": answer})


if __name__ == "__main__":
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(os.environ["QLM_API__PORT"]),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )
