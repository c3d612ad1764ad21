"""Global-queue throughput on RabbitMQ: confirmed publishes per second at a given concurrency (the
API's view: each HTTP request awaits its own confirm) and deliveries consumed and acked per second
(the controller's view). Prints figures; asserts nothing.

The ingest target of the API is ≥ 2,000 requests/s with p99 ≤ 100 ms, at concurrency 32, on the
2-core development machine with the broker on the same host. Each round publishes ``--messages``
``QueuedRequest`` bodies (a ``--prompt-chars`` prompt) from ``--concurrency`` tasks sharing one
``RabbitGlobalQueue`` (one connection, one channel, pipelined confirms) into a fresh quorum queue,
after a warm-up of 500; then one consumer drains and acks them. The queue is deleted afterwards.

The CPU column is this process's CPU time per message while publishing (the publisher, the
client's own work included: compare it between runs, not with the API's).

Reproduce: .venv/bin/python benchmarks/global_queue.py [--url amqp://...] [--messages N]
[--concurrency N] [--rounds N] [--prompt-chars N] [--batch N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
import uuid

import aio_pika
import numpy as np

from qlm.global_queue import Delivery, QueuedRequest
from qlm.global_queue.rabbitmq import RabbitGlobalQueue

DEFAULT_URL = os.environ.get("QLM_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
WARM_UP = 500


def make_message(i: int, prompt_chars: int) -> QueuedRequest:
    return QueuedRequest(
        id=f"bench-{i}",
        model="llama-3-8b",
        prompt="x" * prompt_chars,
        prompt_tokens=max(1, prompt_chars // 4),
        max_tokens=256,
        sampling={"temperature": 0.7},
        slo_e2e_s=30.0,
        slo_ttft_s=2.0,
        submitted_at=time.time(),
    )


async def publish_all(
    queue: RabbitGlobalQueue,
    first: int,
    count: int,
    concurrency: int,
    prompt_chars: int,
    batch: int = 1,
) -> list[float]:
    """Publish ``count`` messages from ``concurrency`` tasks, each ``batch`` at a time (one:
    ``publish``; more: ``publish_many``, one write and pipelined confirms as the API's group
    commit publishes); each publish's latency in seconds, once per message."""
    latencies: list[float] = []
    ids = iter(range(first, first + count, batch))

    async def worker() -> None:
        for i in ids:
            if batch == 1:
                message = make_message(i, prompt_chars)
                start = time.perf_counter()
                await queue.publish(message)
                latencies.append(time.perf_counter() - start)
                continue
            messages = [
                make_message(j, prompt_chars) for j in range(i, min(i + batch, first + count))
            ]
            start = time.perf_counter()
            errors = [e for e in await queue.publish_many(messages) if e is not None]
            if errors:
                raise errors[0]
            latencies.extend([time.perf_counter() - start] * len(messages))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


async def drain(queue: RabbitGlobalQueue, count: int) -> float:
    """Consume and ack ``count`` deliveries; the seconds it took from subscribing."""
    done = asyncio.Event()
    acked = 0

    async def handler(delivery: Delivery) -> None:
        nonlocal acked
        await queue.ack(delivery)
        acked += 1
        if acked >= count:
            done.set()

    start = time.perf_counter()
    await queue.consume(handler)
    await asyncio.wait_for(done.wait(), 600)
    return time.perf_counter() - start


async def one_round(args: argparse.Namespace) -> tuple[float, list[float], float, float]:
    base = f"qlm.bench.{uuid.uuid4().hex[:12]}"
    names = {
        "queue": base,
        "dead_letter_exchange": f"{base}.dlx",
        "dead_letter_queue": f"{base}.dead",
    }
    publisher = RabbitGlobalQueue(args.url, **names)
    consumer = RabbitGlobalQueue(args.url, **names)
    try:
        await publish_all(publisher, 0, WARM_UP, args.concurrency, args.prompt_chars, args.batch)
        start, cpu = time.perf_counter(), time.process_time()
        latencies = await publish_all(
            publisher, WARM_UP, args.messages, args.concurrency, args.prompt_chars, args.batch
        )
        publish_s = time.perf_counter() - start
        cpu_us = (time.process_time() - cpu) / args.messages * 1e6
        drain_s = await drain(consumer, WARM_UP + args.messages)
    finally:
        await consumer.close()
        await publisher.close()
        connection = await aio_pika.connect(args.url)
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(names["queue"])
            await channel.queue_delete(names["dead_letter_queue"])
            await channel.exchange_delete(names["dead_letter_exchange"])
    return args.messages / publish_s, latencies, cpu_us, (WARM_UP + args.messages) / drain_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-chars", type=int, default=1000)
    parser.add_argument(
        "--batch", type=int, default=1, help="messages per publish (>1: publish_many)"
    )
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")

    body = len(make_message(0, args.prompt_chars).encode())
    print(
        f"RabbitMQ global queue at {args.url.split('@')[-1]}: {args.messages} messages of "
        f"{body} B per round, concurrency {args.concurrency}, {args.batch} per publish, "
        f"{args.rounds} rounds "
        f"(python {platform.python_version()}, aio-pika {aio_pika.__version__}, "
        f"{os.cpu_count()} CPUs)"
    )
    print(
        f"{'round':>5}  {'publish/s':>10}  {'p50 ms':>7}  {'p99 ms':>7}  {'max ms':>7}  "
        f"{'CPU µs/msg':>10}  {'drain/s':>8}"
    )
    for n in range(1, args.rounds + 1):
        rate, latencies, cpu_us, drain_rate = asyncio.run(one_round(args))
        ms = np.array(latencies) * 1e3
        p50, p99 = np.percentile(ms, [50, 99])
        print(
            f"{n:>5}  {rate:>10.0f}  {p50:>7.1f}  {p99:>7.1f}  {ms.max():>7.1f}  "
            f"{cpu_us:>10.1f}  {drain_rate:>8.0f}"
        )
    print("target: publish/s ≥ 2000 with p99 ≤ 100 ms")
    print("reproduce: .venv/bin/python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
