"""The API with a controller service in the same process (what ``qlm serve`` runs): in-memory
global queue, SQLite, simulated instances at 50x. Results stream from the controller's hub;
an app given no controller polls the store instead. Waits poll with deadlines; no timing asserts."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from qlm.domain import RequestStatus
from qlm.engines.wallclock import count_tokens
from qlm.global_queue import MemoryBroker, MemoryGlobalQueue
from qlm.service import ControllerService
from qlm.store import Store
from tests.unit.api.test_api import Harness, api_harness
from tests.unit.service.test_agent_runtime import Seen
from tests.unit.service.test_controller_service import eventually, make_service


@contextlib.asynccontextmanager
async def served(
    *, in_process: bool = True, max_running: int | None = None, **api: Any
) -> AsyncIterator[tuple[Harness, ControllerService]]:
    store = Store.open("sqlite://")
    broker = MemoryBroker()
    service = make_service(store, broker, policy="edf", max_running=max_running)
    await service.start()
    try:
        async with api_harness(
            store=store,
            queue=MemoryGlobalQueue(broker=broker),
            controller=service if in_process else None,
            clock=service.runtime.clock.now,
            instances=False,  # the controller registered its own
            poll_interval_s=0.02,
            **api,
        ) as h:
            yield h, service
    finally:
        await service.stop()
        store.close()


def run(scenario: Callable[[Harness, ControllerService], Awaitable[None]], **kw: Any) -> None:
    async def main() -> None:
        async with served(**kw) as (h, service):
            await scenario(h, service)

    asyncio.run(main())


def sse_data(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_a_submitted_request_is_served_and_its_result_read_by_long_poll() -> None:
    async def scenario(h: Harness, _service: ControllerService) -> None:
        r = await h.submit(max_tokens=12, slo_seconds=600, labels={"run": "x"})
        assert r.status_code == 202, r.text
        rid = r.json()["id"]
        got = await h.client.get(f"/v1/requests/{rid}", params={"wait": 60}, headers=h.auth())
        view = got.json()
        assert view["status"] == "finished", view
        assert view["output"]["tokens"] == 12 == count_tokens(view["output"]["text"])
        assert view["slo_met"] is True and view["instance"] in ("i0", "i1")
        assert view["dispatched_at"] <= view["first_token_at"] <= view["finished_at"]

    run(scenario)


def sse_events(text: str) -> list[tuple[str, Any]]:
    """``(name, data)`` of each event of a stream."""
    names = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    return list(zip(names, [json.loads(d) for d in sse_data(text)], strict=True))


async def set_draining(h: Harness, service: ControllerService, draining: bool) -> None:
    """Drain or undrain both instances through the API, and wait until the controller did."""
    action = "drain" if draining else "undrain"
    for name in ("i0", "i1"):
        r = await h.client.post(f"/v1/admin/instances/{name}/{action}", headers=h.auth("admin"))
        assert r.status_code == 200, r.text
    await eventually(
        lambda: all(i["draining"] is draining for i in service.snapshot()["instances"]),
        f"the controller {action}s the instances",
    )


def test_events_stream_tokens_as_they_are_generated_then_the_result() -> None:
    async def scenario(h: Harness, service: ControllerService) -> None:
        await set_draining(h, service, True)  # the request waits until the stream is open
        rid = (await h.submit(max_tokens=200, slo_seconds=600)).json()["id"]
        stream = asyncio.create_task(h.client.get(f"/v1/requests/{rid}/events", headers=h.auth()))
        await eventually(lambda: service.hub.watched(rid), "the stream subscribes")
        await set_draining(h, service, False)
        events = sse_events((await stream).text)
        assert [name for name, _ in events[-1:]] == ["done"]
        tokens = [data for name, data in events if name == "token"]
        assert len(tokens) > 1  # as generated, not in one piece at the end
        output = events[-1][1]["output"]
        assert "".join(t["text"] for t in tokens) == output["text"]
        assert tokens[-1]["tokens"] == output["tokens"] == 200

    run(scenario)


def test_a_stream_opened_after_the_request_ended_replays_its_output_then_the_result() -> None:
    async def scenario(h: Harness, _service: ControllerService) -> None:
        rid = (await h.submit(max_tokens=50, slo_seconds=600)).json()["id"]
        done = await h.client.get(f"/v1/requests/{rid}", params={"wait": 60}, headers=h.auth())
        assert done.json()["status"] == "finished", done.text
        got = await h.client.get(f"/v1/requests/{rid}/events", headers=h.auth())
        events = sse_events(got.text)
        assert [name for name, _ in events] == ["token", "done"]
        output = done.json()["output"]
        assert events[0][1] == {"text": output["text"], "tokens": 50}
        assert events[1][1]["output"] == output

    run(scenario)


def test_events_from_the_store_carry_the_output_as_a_token_event() -> None:
    """Without the controller in process there is no token stream: the text comes whole."""

    async def scenario(h: Harness, _service: ControllerService) -> None:
        rid = (await h.submit(max_tokens=20, slo_seconds=600)).json()["id"]
        got = await h.client.get(f"/v1/requests/{rid}/events", headers=h.auth())
        events = sse_events(got.text)
        assert [name for name, _ in events] == ["token", "done"]
        assert events[0][1]["text"] == events[1][1]["output"]["text"]
        assert count_tokens(events[0][1]["text"]) == 20

    run(scenario, in_process=False)


def test_openai_completion_and_chat_wait_behind_the_queue() -> None:
    async def scenario(h: Harness, service: ControllerService) -> None:
        seen = []
        for inst in service.runtime._instances.values():
            engine = Seen(inst.engine)
            inst.engine = engine  # type: ignore[assignment]
            seen.append(engine)
        r = await h.client.post(
            "/v1/completions",
            json={"model": "m", "prompt": "Once upon a time", "max_tokens": 9},
            headers=h.auth(**{"x-qlm-slo-seconds": "600", "x-qlm-tier": "batch"}),
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert (
            body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
        )
        assert count_tokens(body["choices"][0]["text"]) == 9
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}
        row = h.store.get(r.headers["x-qlm-request-id"])
        assert row is not None and row.slo_e2e_s == 600 and row.tier.name == "BATCH"
        r = await h.client.post(
            "/v1/chat/completions",
            json={
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                "max_completion_tokens": 5,
                "slo_seconds": 500,
            },
            headers=h.auth(**{"x-llm-d-slo-ttft-ms": "400000"}),
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (
            choice["message"]["role"] == "assistant"
            and count_tokens(choice["message"]["content"]) == 5
        )
        rid = r.headers["x-qlm-request-id"]
        row = h.store.get(rid)
        assert row is not None and (row.slo_e2e_s, row.slo_ttft_s) == (500, 400)
        # The engine is given the messages (an HTTP engine sends them to vLLM's chat endpoint).
        [sent] = [q for e in seen for q in e.requests if q.request_id == rid]
        assert sent.messages == ({"role": "user", "content": [{"type": "text", "text": "Hi"}]},)
        assert not sent.continue_final_message

    run(scenario)


def test_openai_streams_chunks_then_finish_reason_usage_and_done() -> None:
    async def scenario(h: Harness, _service: ControllerService) -> None:
        r = await h.client.post(
            "/v1/chat/completions",
            json={
                "model": "m",
                "messages": [{"role": "user", "content": "Tell me a story"}],
                "max_tokens": 150,
                "stream": True,
                "stream_options": {"include_usage": True},
                "slo_seconds": 600,
            },
            headers=h.auth(),
        )
        assert r.status_code == 200
        data = sse_data(r.text)
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert count_tokens(text) == 150
        assert (
            len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) > 1
        )
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 150

    run(scenario)


async def two_running_one_waiting(h: Harness) -> tuple[list[str], str]:
    """Three long requests on the harness's two instances: the ids of the two that run (once
    both have started) and of the one that waits."""
    long = {"max_tokens": 8000, "slo_seconds": 86400}
    running = [(await h.submit(**long)).json()["id"] for _ in range(2)]
    waiting = (await h.submit(**long)).json()["id"]

    def started() -> bool:
        rows = [h.store.get(rid) for rid in running]
        return all(r is not None and r.first_token_at is not None for r in rows)

    await eventually(started, "both instances run one request")
    return running, waiting


def test_cancel_dequeues_a_waiting_request_and_aborts_a_running_one() -> None:
    async def scenario(h: Harness, _service: ControllerService) -> None:
        running, waiting = await two_running_one_waiting(h)
        r = await h.client.delete(f"/v1/requests/{waiting}", headers=h.auth())
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        r = await h.client.delete(f"/v1/requests/{running[0]}", headers=h.auth())
        assert r.status_code in (200, 202)
        await eventually(
            lambda: h.store.get(running[0]).status is RequestStatus.CANCELLED,  # type: ignore[union-attr]
            "the running request is aborted",
        )
        row = h.store.get(running[0])
        assert row is not None and 0 < row.output_tokens < 8000 and row.output_text
        assert h.store.get(waiting).dispatched_at is None  # type: ignore[union-attr]
        await h.client.delete(f"/v1/requests/{running[1]}", headers=h.auth())

    run(scenario, max_running=1)


def test_without_a_controller_in_process_results_come_from_the_store() -> None:
    async def scenario(h: Harness, _service: ControllerService) -> None:
        r = await h.client.post(
            "/v1/completions",
            json={
                "model": "m",
                "prompt": "x",
                "max_tokens": 40,
                "stream": True,
                "slo_seconds": 600,
            },
            headers=h.auth(),
        )
        data = sse_data(r.text)
        assert data[-1] == "[DONE]"
        texts = [json.loads(d)["choices"][0]["text"] for d in data[:-1]]
        assert count_tokens(texts[0]) == 40 and texts[1:] == [""]  # the text in one piece
        plain = await h.client.post(
            "/v1/completions",
            json={"model": "m", "prompt": "x", "max_tokens": 3, "slo_seconds": 600},
            headers=h.auth(),
        )
        assert count_tokens(plain.json()["choices"][0]["text"]) == 3

    run(scenario, in_process=False)


def test_a_wait_that_runs_out_answers_504_with_the_id_and_no_retry() -> None:
    async def scenario(h: Harness, _service: ControllerService) -> None:
        r = await h.client.post(
            "/v1/completions",
            json={"model": "m", "prompt": "x", "max_tokens": 8000, "slo_seconds": 86400},
            headers=h.auth(),
        )
        assert r.status_code == 504 and r.headers["x-should-retry"] == "false"
        rid = r.headers["x-qlm-request-id"]
        assert rid in r.json()["error"]["message"]
        row = h.store.get(rid)
        assert row is not None and not row.is_final  # it goes on
        await h.client.delete(f"/v1/requests/{rid}", headers=h.auth())

    run(scenario, wait_timeout_s=0.3)


def test_results_reach_the_client_when_another_controller_serves_the_request() -> None:
    """``qlm serve`` whose own controller stands by (another process leads the broker's queue):
    its hub never hears of the request, so the end comes from the store."""

    async def main() -> None:
        store = Store.open("sqlite://")
        broker = MemoryBroker()
        leader, standby = (make_service(store, broker, name=n) for n in ("c0", "c1"))
        await leader.start()
        await standby.start()
        try:
            async with api_harness(
                store=store,
                queue=MemoryGlobalQueue(broker=broker),
                controller=standby,
                clock=standby.runtime.clock.now,
                instances=False,
                poll_interval_s=0.02,
                wait_timeout_s=30,
                snapshot_ttl_s=0,
            ) as h:
                body = {"model": "m", "prompt": "x", "max_tokens": 30, "slo_seconds": 600}
                r = await h.client.post(
                    "/v1/completions", json=body | {"stream": True}, headers=h.auth()
                )
                data = sse_data(r.text)
                assert data[-1] == "[DONE]", r.text
                texts = [json.loads(d)["choices"][0]["text"] for d in data[:-1]]
                assert count_tokens("".join(texts)) == 30
                plain = await h.client.post("/v1/completions", json=body, headers=h.auth())
                assert plain.status_code == 200, plain.text
                assert count_tokens(plain.json()["choices"][0]["text"]) == 30
                assert leader.settled == 2 and standby.received == 0
                # What it shows of the control plane is the leader's (published in the store).
                await eventually(
                    lambda: any(r.active for r in store.controller_states()), "c0 publishes"
                )
                queues = await h.client.get("/v1/admin/queues", headers=h.auth("admin"))
                assert queues.json()["controller"] == "c0", queues.text
        finally:
            await standby.stop()
            await leader.stop()
            store.close()

    asyncio.run(main())
