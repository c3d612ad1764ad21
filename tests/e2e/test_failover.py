"""Kill the active controller, then an engine, in the middle of a run: nothing accepted is lost
and nothing ends twice (ARCHITECTURE.md §4 rule 5).

Two ``qlm controller`` processes share a RabbitMQ quorum queue (one leads, one stands by) and a
PostgreSQL schema; three ``qlm sim-engine serve`` processes serve over vLLM's HTTP API. The test
publishes 2,000 requests, ``kill -9``s the active controller once some have finished, then an
engine while it is serving once the standby has finished some, and checks that every request ends exactly once in the store as
finished with its full output. Waits poll with deadlines; nothing asserts on timing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import aio_pika
import pytest
from services import (
    broker_names,
    output,
    postgres_schema,
    start_process,
    start_sim_engine,
    stop,
)

from qlm.domain import RequestStatus
from qlm.global_queue import QueuedRequest
from qlm.global_queue.rabbitmq import RabbitGlobalQueue
from qlm.store import Store

pytestmark = [
    pytest.mark.slow,
    pytest.mark.rabbitmq,
    pytest.mark.postgres,
    pytest.mark.timeout(900),  # ~55 s alone on 2 cores; slower when the machine is shared
]

REQUESTS = 2000
OUTPUT_TOKENS = 96  # with real-time engines: a few seconds per wave, so each kill lands mid-run
ENGINE_TIME_SCALE = 1.0
DEADLINE_S = 600.0


@pytest.fixture
def schema_url(postgres_url: str) -> Iterator[str]:
    with postgres_schema(postgres_url) as url:
        yield url


@pytest.fixture
def names(amqp_url: str) -> Iterator[dict[str, str]]:
    with broker_names(amqp_url) as names:
        yield names


def wait_until(check: Callable[[], bool], what: str, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        if time.monotonic() > deadline:
            logs = "\n---\n".join(output(p) for p in procs)
            pytest.fail(f"timed out waiting until {what}\n{logs}")
        time.sleep(0.2)


def running_on(url: str) -> int:
    """Requests in the engine's running batch, from its vLLM-style ``/metrics``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )
    )


def test_killing_the_active_controller_and_an_engine_loses_and_duplicates_nothing(
    amqp_url: str, schema_url: str, names: dict[str, str], tmp_path: Path
) -> None:
    engines = [start_sim_engine(time_scale=ENGINE_TIME_SCALE) for _ in range(3)]
    procs = [p for p, _ in engines]
    controllers: list[subprocess.Popen[bytes]] = []
    try:
        instances = tmp_path / "instances.toml"
        instances.write_text(
            "".join(
                f'[[instances]]\nname = "e{i}"\nurl = "{url}"\ngpu = "A100"\n'
                f'models = ["llama-3-8b"]\n\n'
                for i, (_, url) in enumerate(engines)
            )
        )
        env = {
            "QLM_BROKER_URL": amqp_url,
            "QLM_BROKER__QUEUE": names["queue"],
            "QLM_BROKER__DEAD_LETTER_EXCHANGE": names["dead_letter_exchange"],
            "QLM_BROKER__DEAD_LETTER_QUEUE": names["dead_letter_queue"],
            "QLM_BROKER__DELIVERY_LIMIT": "20",
            "QLM_DATABASE_URL": schema_url,
            "QLM_INSTANCES_FILE": str(instances),
        }
        store = Store.open(schema_url)

        def controller(name: str) -> subprocess.Popen[bytes]:
            proc = start_process(["controller"], {**env, "QLM_CONTROLLER__NAME": name})
            controllers.append(proc)
            procs.append(proc)
            wait_until(
                lambda: any(s.name == name for s in store.controller_states()),
                f"controller {name} publishes its state",
                procs,
            )
            return proc

        active = controller("first")  # the first consumer is the active one
        controller("standby")

        ids = [f"f{i:05d}" for i in range(REQUESTS)]

        async def publish() -> None:
            queue = RabbitGlobalQueue(amqp_url, **names, delivery_limit=20)
            now = time.time()
            for start in range(0, REQUESTS, 100):
                await asyncio.gather(
                    *(
                        queue.publish(
                            QueuedRequest(
                                id=rid,
                                model="llama-3-8b",
                                prompt_tokens=64,
                                max_tokens=OUTPUT_TOKENS,
                                slo_e2e_s=600.0,
                                submitted_at=now,
                                prompt=" ".join(["word"] * 64),
                                tier=i % 3,
                                replay_output_tokens=OUTPUT_TOKENS,
                            )
                        )
                        for i, rid in enumerate(ids[start : start + 100], start=start)
                    )
                )
            await queue.close()

        asyncio.run(publish())

        def finished() -> int:
            return len(store.final_ids(ids))

        # A twentieth, not more: on 2 shared cores the controller is CPU-bound (every token of
        # 2,000 streams), the count climbs slowly at first (~50 a second), then most of the run
        # lands in one or two commits (seen: 384, then 1,376, then 2,000; once 3xx straight to
        # 2,000, when the test waited for a fifth and the kill came after the end).
        wait_until(lambda: finished() >= REQUESTS // 20, "a twentieth has finished", procs)
        os.kill(active.pid, signal.SIGKILL)
        active.wait()
        at_controller_kill = finished()
        assert at_controller_kill < REQUESTS, "the run was over before the controller was killed"
        # Once the standby has recorded outcomes of its own, kill an engine while it serves.
        # Any engine: on a loaded machine the standby records completions in bursts (its writes
        # queue behind the intake of everything redelivered), and waiting for one given engine
        # to be busy at the moment a count is reached could miss every such moment.
        serving: list[tuple[subprocess.Popen[bytes], str]] = []

        def standby_progressed_and_an_engine_serves() -> bool:
            done = finished()
            if done == REQUESTS:
                pytest.fail("the run was over before an engine could be killed")
            if done <= at_controller_kill:
                return False
            serving[:] = [(p, url) for p, url in engines if running_on(url) > 0]
            return bool(serving)

        wait_until(
            standby_progressed_and_an_engine_serves,
            "the standby has finished requests and an engine is serving",
            procs,
        )
        victim, _ = serving[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        assert finished() < REQUESTS, "the run was over before the engine was killed"
        wait_until(lambda: finished() == REQUESTS, "every request is final", procs)

        rows = [store.get(rid) for rid in ids]
        assert all(r is not None for r in rows)
        statuses = {r.status for r in rows if r is not None}
        assert statuses == {RequestStatus.FINISHED}, [r for r in rows if r and r.error][:3]
        assert all(r is not None and r.output_tokens == OUTPUT_TOKENS for r in rows)
        assert len(store.list_requests(limit=REQUESTS + 10)[0]) == REQUESTS  # nothing extra
        moved = [r for r in rows if r is not None and r.attempts > 1]
        assert moved  # some were running on the killed controller or engine and ran again
        states = {s.name: s.snapshot["counters"] for s in store.controller_states()}
        assert states["standby"]["received"] > 0

        async def leftovers() -> tuple[int, int]:
            connection = await aio_pika.connect(amqp_url)
            async with connection:
                channel = await connection.channel()
                q = await channel.get_queue(names["queue"])
                d = await channel.get_queue(names["dead_letter_queue"])
                return q.declaration_result.message_count or 0, (
                    d.declaration_result.message_count or 0
                )

        # The standby acks each delivery once its outcome is committed: give it a moment.
        deadline = time.monotonic() + 30.0
        while asyncio.run(leftovers()) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        ready, dead = asyncio.run(leftovers())
        assert (ready, dead) == (0, 0)
        store.close()
    finally:
        for proc in controllers + [p for p, _ in engines]:
            stop(proc)
