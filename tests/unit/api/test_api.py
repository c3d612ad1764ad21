"""The native API in process (httpx over ASGI): in-memory global queue, in-memory SQLite, no
controller (results, where needed, are recorded in the store by the test). Also the harness the
other ``test_api_*`` modules use."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from qlm.api import create_app
from qlm.api.ports import LocalController
from qlm.domain import InstanceSpec, PlanRecord, RequestStatus
from qlm.global_queue import GlobalQueue, MemoryGlobalQueue, QueuedRequest, QueueUnavailable
from qlm.service.hub import ResultEvent, ResultHub
from qlm.settings import ApiSettings, Settings
from qlm.store import InstanceState, NewRequest, Store


@dataclass
class Harness:
    store: Store
    queue: GlobalQueue
    client: httpx.AsyncClient
    keys: dict[str, str]
    app: FastAPI

    def auth(self, who: str = "acme", **headers: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}", **headers}

    async def submit(self, who: str = "acme", **body: Any) -> httpx.Response:
        fields: dict[str, Any] = {"model": "m", "prompt": "hello there", "max_tokens": 16}
        headers = body.pop("headers", {})
        return await self.client.post(
            "/v1/requests", json=fields | body, headers=self.auth(who, **headers)
        )


@contextlib.asynccontextmanager
async def api_harness(
    *,
    store: Store | None = None,
    queue: GlobalQueue | None = None,
    controller: LocalController | None = None,
    clock: Callable[[], float] | None = None,
    instances: bool = True,
    **api: Any,
) -> AsyncIterator[Harness]:
    """The app on a fresh (or given) store and queue, with keys for tenants acme and globex and
    an admin, and one instance serving model ``m``."""
    own = store is None
    the_store = store if store is not None else Store.open("sqlite://")
    the_queue = queue if queue is not None else MemoryGlobalQueue()
    if instances:
        the_store.upsert_instance(InstanceSpec("i0", "G", ("m",)))
    keys = {
        "acme": the_store.create_api_key("acme"),
        "globex": the_store.create_api_key("globex"),
        "admin": the_store.create_api_key("ops", admin=True),
    }
    settings = Settings(api=ApiSettings(**api))
    kwargs: dict[str, Any] = {"clock": clock} if clock is not None else {}
    app = create_app(settings, queue=the_queue, store=the_store, controller=controller, **kwargs)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qlm") as client:
                yield Harness(the_store, the_queue, client, keys, app)
    finally:
        if own:
            the_store.close()


def run(scenario: Callable[[Harness], Awaitable[None]], **kwargs: Any) -> None:
    async def main() -> None:
        async with api_harness(**kwargs) as h:
            await scenario(h)

    asyncio.run(main())


def published(queue: GlobalQueue) -> list[QueuedRequest]:
    assert isinstance(queue, MemoryGlobalQueue)
    return [QueuedRequest.decode(s.raw) for s in sorted(queue.broker._ready)]


def error(response: httpx.Response) -> Mapping[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    err: Mapping[str, Any] = body["error"]
    assert err["message"] and err["type"], err
    return err


# --- submit, read, list, cancel ------------------------------------------------------------------


def test_a_submission_is_stored_published_and_readable() -> None:
    async def scenario(h: Harness) -> None:
        r = await h.submit(
            prompt="Summarise the QLM paper.",
            max_tokens=64,
            temperature=0.2,
            stop=["\n\n"],
            slo_seconds=20,
            ttft_slo_seconds=2,
            tier="interactive",
            labels={"team": "search"},
        )
        assert r.status_code == 202, r.text
        body = r.json()
        rid = body["id"]
        assert r.headers["location"] == f"/v1/requests/{rid}"
        assert body["status"] == "queued" and body["replayed"] is False
        assert body["deadline_at"] == pytest.approx(body["submitted_at"] + 20)
        [message] = published(h.queue)
        assert message.id == rid and message.tenant == "acme" and message.model == "m"
        assert message.prompt == "Summarise the QLM paper." and message.max_tokens == 64
        assert message.prompt_tokens == 6  # ceil(24 / 4)
        assert (message.slo_e2e_s, message.slo_ttft_s, message.tier) == (20.0, 2.0, 0)
        assert message.sampling == {"temperature": 0.2, "stop": ["\n\n"]}
        assert message.labels == {"team": "search"}
        got = await h.client.get(f"/v1/requests/{rid}", headers=h.auth())
        assert got.status_code == 200
        view = got.json()
        assert view["status"] == "queued" and view["tier"] == "interactive"
        assert view["labels"] == {"team": "search"} and view["output"] is None
        assert view["slo_seconds"] == 20 and view["ttft_slo_seconds"] == 2

    run(scenario)


def test_without_max_tokens_a_submission_gets_the_default_the_openai_endpoints_use() -> None:
    async def scenario(h: Harness) -> None:
        native = await h.client.post(
            "/v1/requests", json={"model": "m", "prompt": "hello"}, headers=h.auth()
        )
        assert native.status_code == 202, native.text
        nulled = await h.client.post(
            "/v1/requests",
            json={"model": "m", "prompt": "hello", "max_tokens": None},
            headers=h.auth(),
        )
        assert nulled.status_code == 202, nulled.text
        assert [m.max_tokens for m in published(h.queue)] == [48, 48]
        got = await h.client.get(f"/v1/requests/{native.json()['id']}", headers=h.auth())
        assert got.json()["max_tokens"] == 48
        schema = (await h.client.get("/openapi.json")).json()["components"]["schemas"]
        assert "max_tokens" not in schema["SubmitIn"].get("required", [])

    run(scenario, default_max_tokens=48)


def test_a_request_past_its_deadline_reads_as_missed_while_it_waits_and_once_final() -> None:
    now = [1000.0]

    async def scenario(h: Harness) -> None:
        late, met = [(await h.submit(slo_seconds=s)).json()["id"] for s in (10, 100)]

        async def missed() -> list[bool]:
            got = [await h.client.get(f"/v1/requests/{i}", headers=h.auth()) for i in (late, met)]
            listed = (await h.client.get("/v1/requests", headers=h.auth())).json()["data"]
            assert {r["id"]: r["missed"] for r in listed} == {
                r.json()["id"]: r.json()["missed"] for r in got
            }
            return [r.json()["missed"] for r in got]

        assert await missed() == [False, False]
        now[0] = 1050.0  # past the first one's deadline, before the second's
        assert await missed() == [True, False]
        h.store.record_outcome(met, status=RequestStatus.FINISHED, at=1050.0, slo_met=True)
        now[0] = 2000.0
        assert await missed() == [True, False]  # (met: final within its deadline)

    run(scenario, clock=lambda: now[0])


def test_chat_messages_are_kept_and_rendered_for_the_engine() -> None:
    async def scenario(h: Harness) -> None:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        r = await h.submit(prompt=None, messages=messages)
        assert r.status_code == 202, r.text
        [message] = published(h.queue)
        assert message.messages == messages
        assert message.prompt == (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        row = h.store.get(r.json()["id"])
        assert row is not None and row.messages == messages

    run(scenario)


def test_the_output_and_slo_verdict_appear_once_final() -> None:
    async def scenario(h: Harness) -> None:
        rid = (await h.submit()).json()["id"]
        h.store.mark_dispatched(rid, instance="i0", at=1.0)
        h.store.record_outcome(
            rid, status=RequestStatus.FINISHED, at=2.0, output_text="hi!", output_tokens=2,
            slo_met=True,
        )  # fmt: skip
        view = (await h.client.get(f"/v1/requests/{rid}", headers=h.auth())).json()
        assert view["status"] == "finished"
        assert view["output"] == {"text": "hi!", "tokens": 2, "tool_calls": None}
        assert view["slo_met"] is True and view["instance"] == "i0"

    run(scenario)


def test_a_long_poll_returns_when_the_request_ends() -> None:
    async def scenario(h: Harness) -> None:
        rid = (await h.submit()).json()["id"]

        async def finish_soon() -> None:
            await asyncio.sleep(0.2)
            await asyncio.to_thread(
                h.store.record_outcome, rid, status=RequestStatus.FINISHED, at=3.0,
                output_text="done", output_tokens=1,
            )  # fmt: skip

        task = asyncio.create_task(finish_soon())
        got = await h.client.get(f"/v1/requests/{rid}", params={"wait": 30}, headers=h.auth())
        await task
        assert got.json()["status"] == "finished" and got.json()["output"]["text"] == "done"
        # A wait that runs out answers the request as it stands.
        other = (await h.submit()).json()["id"]
        got = await h.client.get(f"/v1/requests/{other}", params={"wait": 0.1}, headers=h.auth())
        assert got.status_code == 200 and got.json()["status"] == "queued"

    run(scenario, poll_interval_s=0.02)


def test_events_stream_ends_with_the_final_request() -> None:
    async def scenario(h: Harness) -> None:
        rid = (await h.submit()).json()["id"]

        async def finish_soon() -> None:
            await asyncio.sleep(0.1)
            await asyncio.to_thread(
                h.store.record_outcome, rid, status=RequestStatus.FINISHED, at=3.0,
                output_text="streamed", output_tokens=1,
            )  # fmt: skip

        task = asyncio.create_task(finish_soon())
        got = await h.client.get(f"/v1/requests/{rid}/events", headers=h.auth())
        await task
        assert got.status_code == 200
        assert got.headers["content-type"].startswith("text/event-stream")
        # Read from the store, the output comes as one token event, then the request.
        token, done = got.text.split("\n\n")[:2]
        assert token == 'event: token\ndata: {"text":"streamed","tokens":1}'
        assert done.startswith("event: done\ndata: {") and '"text":"streamed"' in done

    run(scenario, poll_interval_s=0.02)


def test_listing_filters_and_pages_within_the_tenant() -> None:
    async def scenario(h: Harness) -> None:
        ids = [(await h.submit(labels={"n": str(i % 2)})).json()["id"] for i in range(5)]
        await h.submit("globex")
        page = await h.client.get("/v1/requests", params={"limit": 3}, headers=h.auth())
        body = page.json()
        assert len(body["data"]) == 3 and body["next_cursor"]
        rest = await h.client.get(
            "/v1/requests", params={"limit": 3, "cursor": body["next_cursor"]}, headers=h.auth()
        )
        seen = [r["id"] for r in body["data"] + rest.json()["data"]]
        assert sorted(seen) == sorted(ids) and rest.json()["next_cursor"] is None
        labelled = await h.client.get("/v1/requests", params={"label": "n=0"}, headers=h.auth())
        assert len(labelled.json()["data"]) == 3
        everyone = await h.client.get("/v1/requests", headers=h.auth("admin"))
        assert len(everyone.json()["data"]) == 6
        forbidden = await h.client.get(
            "/v1/requests", params={"tenant": "globex"}, headers=h.auth()
        )
        assert forbidden.status_code == 403 and error(forbidden)["param"] == "tenant"
        bad = await h.client.get("/v1/requests", params={"cursor": "nope"}, headers=h.auth())
        assert bad.status_code == 422 and error(bad)["param"] == "cursor"
        bad = await h.client.get("/v1/requests", params={"label": "novalue"}, headers=h.auth())
        assert bad.status_code == 422 and error(bad)["param"] == "label"

    run(scenario)


def test_cancel_removes_a_queued_request_and_refuses_a_finished_one() -> None:
    async def scenario(h: Harness) -> None:
        queued = (await h.submit()).json()["id"]
        r = await h.client.delete(f"/v1/requests/{queued}", headers=h.auth())
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        again = await h.client.delete(f"/v1/requests/{queued}", headers=h.auth())
        assert again.status_code == 200  # idempotent
        running = (await h.submit()).json()["id"]
        h.store.mark_dispatched(running, instance="i0", at=1.0)
        r = await h.client.delete(f"/v1/requests/{running}", headers=h.auth())
        assert r.status_code == 202
        assert r.json()["status"] == "running" and r.json()["cancel_requested"] is True
        done = (await h.submit()).json()["id"]
        h.store.record_outcome(done, status=RequestStatus.FINISHED, at=1.0)
        r = await h.client.delete(f"/v1/requests/{done}", headers=h.auth())
        assert r.status_code == 409 and error(r)["code"] == "already_final"

    run(scenario)


def test_a_tenant_never_sees_another_tenants_requests() -> None:
    async def scenario(h: Harness) -> None:
        rid = (await h.submit("acme")).json()["id"]
        for call in (
            h.client.get(f"/v1/requests/{rid}", headers=h.auth("globex")),
            h.client.get(f"/v1/requests/{rid}/events", headers=h.auth("globex")),
            h.client.delete(f"/v1/requests/{rid}", headers=h.auth("globex")),
        ):
            r = await call
            assert r.status_code == 404 and error(r)["type"] == "not_found_error"
        assert h.store.get(rid) is not None and h.store.get(rid).status is RequestStatus.QUEUED  # type: ignore[union-attr]
        listing = await h.client.get("/v1/requests", headers=h.auth("globex"))
        assert listing.json()["data"] == []
        admin = await h.client.get(f"/v1/requests/{rid}", headers=h.auth("admin"))
        assert admin.status_code == 200 and admin.json()["tenant"] == "acme"

    run(scenario)


# --- idempotency ---------------------------------------------------------------------------------


def test_the_same_idempotency_key_returns_the_first_request() -> None:
    async def scenario(h: Harness) -> None:
        first = await h.submit(headers={"Idempotency-Key": "order-7"})
        again = await h.submit(headers={"Idempotency-Key": "order-7"})
        assert first.status_code == again.status_code == 202
        assert again.json()["id"] == first.json()["id"] and again.json()["replayed"] is True
        assert again.headers["idempotent-replayed"] == "true"
        # Still queued and never dispatched: published again, in case the first API died
        # between its commit and its confirm (the controller keys requests by id).
        assert [m.id for m in published(h.queue)] == [first.json()["id"]] * 2
        other_tenant = await h.submit("globex", headers={"Idempotency-Key": "order-7"})
        assert other_tenant.json()["id"] != first.json()["id"]
        different = await h.submit(prompt="another", headers={"Idempotency-Key": "order-7"})
        assert different.status_code == 409
        assert error(different)["param"] == "Idempotency-Key"
        h.store.mark_dispatched(first.json()["id"], instance="i0", at=1.0)
        await h.submit(headers={"Idempotency-Key": "order-7"})
        assert len(published(h.queue)) == 3  # dispatched: not published again

    run(scenario)


def test_concurrent_submissions_with_one_key_make_one_request() -> None:
    async def scenario(h: Harness) -> None:
        rs = await asyncio.gather(
            *(h.submit(headers={"Idempotency-Key": "same"}) for _ in range(20))
        )
        assert {r.status_code for r in rs} == {202}
        assert len({r.json()["id"] for r in rs}) == 1
        assert sum(not r.json()["replayed"] for r in rs) == 1
        assert len(h.store.list_requests()[0]) == 1

    run(scenario)


# --- nothing half-accepted -------------------------------------------------------------------------


class FailingQueue(MemoryGlobalQueue):
    """Refuses every publish whose prompt says so (a broker that did not confirm)."""

    async def publish(self, message: QueuedRequest) -> None:
        if message.prompt and "refuse" in message.prompt:
            raise QueueUnavailable("RabbitMQ at amqp://***@broker: not confirmed")
        await super().publish(message)


def test_a_request_the_broker_refused_leaves_nothing_behind() -> None:
    async def scenario(h: Harness) -> None:
        rs = await asyncio.gather(
            h.submit(prompt="please refuse this", labels={"a": "b"}),
            h.submit(prompt="take this"),
            h.submit(prompt="refuse again", headers={"Idempotency-Key": "k"}),
        )
        assert [r.status_code for r in rs] == [503, 202, 503]
        assert error(rs[0])["code"] == "broker_unavailable" and rs[0].headers["retry-after"]
        assert "not confirmed" in error(rs[0])["message"]
        rows, _ = h.store.list_requests()
        assert [r.id for r in rows] == [rs[1].json()["id"]]
        # The key is free again: a retry once the broker is back makes the request.
        h.queue.publish = MemoryGlobalQueue.publish.__get__(h.queue)  # type: ignore[method-assign]
        retry = await h.submit(prompt="refuse again", headers={"Idempotency-Key": "k"})
        assert retry.status_code == 202 and retry.json()["replayed"] is False

    run(scenario, queue=FailingQueue())


def test_a_store_that_is_down_refuses_with_503() -> None:
    async def scenario(h: Harness) -> None:
        h.store.close()
        h.store._engine.dispose()

        def broken(*_a: Any, **_k: Any) -> Any:
            from qlm.store import StoreError

            raise StoreError("cannot record 1 requests (sqlite://): database is gone")

        h.store.ensure_requests = broken  # type: ignore[method-assign]
        r = await h.submit()
        assert r.status_code == 503 and error(r)["code"] == "store_unavailable"
        assert published(h.queue) == []

    run(scenario)


# --- auth and limits ------------------------------------------------------------------------------


def test_calls_without_a_valid_key_are_refused() -> None:
    async def scenario(h: Harness) -> None:
        r = await h.client.post("/v1/requests", json={"model": "m", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and error(r)["param"] == "Authorization"
        assert r.headers["www-authenticate"] == "Bearer"
        bad = {"Authorization": "Bearer qlm_" + "x" * 43}
        r = await h.client.get("/v1/requests", headers=bad)
        assert r.status_code == 401 and error(r)["code"] == "invalid_api_key"
        r = await h.client.get("/v1/admin/queues", headers=h.auth())
        assert r.status_code == 403 and error(r)["code"] == "admin_required"
        key_id = next(k.id for k in h.store.api_keys(tenant="globex"))
        h.store.revoke_api_key(key_id)
        r = await h.client.get("/v1/requests", headers=h.auth("globex"))
        assert r.status_code == 401  # key_cache_s=0: revocation is immediate

    run(scenario, key_cache_s=0)


def test_without_required_keys_calls_act_as_the_default_tenant() -> None:
    async def scenario(h: Harness) -> None:
        r = await h.client.post("/v1/requests", json={"model": "m", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 202
        assert h.store.get(r.json()["id"]).tenant == "demo"  # type: ignore[union-attr]

    run(scenario, require_keys=False, default_tenant="demo")


def test_the_rate_limit_answers_429_with_retry_after() -> None:
    async def scenario(h: Harness) -> None:
        codes = [(await h.submit()).status_code for _ in range(4)]
        assert codes == [202, 202, 202, 429]
        r = await h.submit()
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert error(r)["code"] == "rate_limit" and "QLM_API__RATE_PER_S" in error(r)["message"]
        assert (await h.submit("globex")).status_code == 202  # per tenant

    run(scenario, rate_per_s=0.01, rate_burst=3)


def test_the_queued_limit_answers_429_until_requests_leave_the_queue() -> None:
    async def scenario(h: Harness) -> None:
        first = (await h.submit()).json()["id"]
        assert (await h.submit()).status_code == 202
        r = await h.submit()
        assert r.status_code == 429 and error(r)["code"] == "max_queued_per_tenant"
        assert r.headers["retry-after"] == "1"
        h.store.cancel(first)
        assert (await h.submit()).status_code == 202

    run(scenario, max_queued_per_tenant=2, queued_count_ttl_s=0)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"max_tokens": 5000}, "max_tokens", "max_tokens_limit"),
        ({"prompt": "x" * 4100}, "prompt", "max_prompt_tokens"),
        ({"labels": {str(i): "v" for i in range(3)}}, "labels", "max_labels"),
        ({"slo_seconds": 5, "ttft_slo_seconds": 6}, "ttft_slo_seconds", "ttft_after_deadline"),
        ({"max_tokens": 0}, "max_tokens", "greater_than_equal"),
        ({"tier": "urgent"}, "tier", "literal_error"),
        ({"prompt": "a\u0000b"}, "prompt", "value_error"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages", "both_inputs"),
        ({"prompt": None}, "prompt", "missing_input"),
        ({"model": "gpt-9"}, "model", "model_not_found"),
        ({"colour": "red"}, "colour", "extra_forbidden"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "value_error"),
        ({"slo_seconds": -1}, "slo_seconds", "greater_than_equal"),
    ],
)
def test_invalid_submissions_name_the_field_or_limit(
    body: dict[str, Any], param: str, code: str
) -> None:
    async def scenario(h: Harness) -> None:
        r = await h.submit(**body)
        assert r.status_code in (404, 422), r.text
        err = error(r)
        assert (err["param"], err["code"]) == (param, code), err
        assert published(h.queue) == [] and h.store.list_requests()[0] == []

    run(scenario, max_tokens_limit=4096, max_prompt_tokens=1000, max_labels=2)


def test_bodies_over_the_limit_answer_413_naming_it() -> None:
    async def scenario(h: Harness) -> None:
        r = await h.submit(prompt="x" * 5000)
        assert r.status_code == 413
        err = error(r)
        assert err["code"] == "max_body_bytes" and "QLM_API__MAX_BODY_BYTES" in err["message"]

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
            yield b'{"model": "m", "max_tokens": 1, "prompt": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'

        r = await h.client.post(
            "/v1/requests",
            content=chunks(),
            headers=h.auth(**{"content-type": "application/json"}),
        )
        assert r.status_code == 413 and error(r)["code"] == "max_body_bytes"
        bad_json = await h.client.post(
            "/v1/requests", content=b"{nope", headers=h.auth(**{"content-type": "application/json"})
        )
        assert bad_json.status_code == 422 and error(bad_json)["param"] == "body"

    run(scenario, max_body_bytes=4096)


def test_a_model_no_instance_serves_is_404_and_no_instances_at_all_is_503() -> None:
    async def scenario(h: Harness) -> None:
        r = await h.submit()
        assert r.status_code == 503 and error(r)["code"] == "no_instances"

    run(scenario, instances=False)


# --- admission ------------------------------------------------------------------------------------


class FakeController:
    """What ``qlm serve`` gives the API of its controller: a snapshot, cancel, a hub."""

    def __init__(self, snapshot: dict[str, Any]) -> None:
        self._snapshot = snapshot
        self.cancelled: list[str] = []
        self.hub = ResultHub()
        self.active = True

    def snapshot(self) -> dict[str, Any]:
        return self._snapshot

    async def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return True


def busy_snapshot(now: float) -> dict[str, Any]:
    """One instance whose queue holds work due soon that completes in 100 s."""
    group = {
        "id": "g1",
        "model": "m",
        "size": 40,
        "tier": "interactive",
        "earliest_deadline_at": now + 5,
        "predicted_completion_at": now + 100,
        "p_meet_slo": 0.1,
        "at_risk": True,
    }
    return {
        "controller": "c0",
        "at": now,
        "policy": "qlm",
        "queues": [{"instance": "i0", "predicted_drain_at": now + 100, "groups": [group]}],
        "instances": [
            {
                "name": "i0",
                "url": "",
                "gpu": "G",
                "models": ["m"],
                "up": True,
                "draining": False,
                "active_model": "m",
                "tiers": {"m": "active"},
                "outstanding": 7,
                "max_running": 64,
            }
        ],
        "counters": {
            "received": 50,
            "settled": 10,
            "evictions": 3,
            "swaps": 1,
            "model_switches": 2,
            "plans": 4,
        },
        "plan": None,
    }


def test_admission_rejects_what_the_plan_cannot_serve_in_time_when_configured() -> None:
    now = 1000.0
    controller = FakeController(busy_snapshot(now))

    async def scenario(h: Harness) -> None:
        r = await h.submit(slo_seconds=30)
        assert r.status_code == 503 and error(r)["code"] == "slo_infeasible"
        assert "i0" in error(r)["message"] and r.headers["retry-after"]
        assert published(h.queue) == []
        ok = await h.submit(slo_seconds=300)  # due after the queued work: feasible
        assert ok.status_code == 202 and ok.json()["at_risk"] is False

    run(scenario, controller=controller, clock=lambda: now, admission="reject")


def test_admission_accepts_and_flags_at_risk_by_default() -> None:
    now = 1000.0

    async def scenario(h: Harness) -> None:
        r = await h.submit(slo_seconds=30)
        assert r.status_code == 202 and r.json()["at_risk"] is True
        rid = r.json()["id"]
        await h.app.state.ctx.at_risk.flushed()
        row = h.store.get(rid)
        assert row is not None and row.at_risk and row.predicted_completion_at == now + 100

    run(scenario, controller=FakeController(busy_snapshot(now)), clock=lambda: now)


def test_cancel_tells_an_in_process_controller_at_once() -> None:
    controller = FakeController(busy_snapshot(1000.0))

    async def scenario(h: Harness) -> None:
        rid = (await h.submit(slo_seconds=300)).json()["id"]
        await h.client.delete(f"/v1/requests/{rid}", headers=h.auth())
        assert controller.cancelled == [rid]

    run(scenario, controller=controller, clock=lambda: 1000.0)


def test_a_stream_whose_request_another_controller_answered_differently_ends_in_an_error() -> None:
    """A ``qlm serve`` stream: this process's controller streamed part of the answer, then
    stepped down; the leader served the request again and stored another answer."""
    controller = FakeController(busy_snapshot(1000.0))
    taken = asyncio.Event()  # the stream took the first text from the hub

    class Watched(asyncio.Queue[ResultEvent]):
        async def get(self) -> ResultEvent:
            event = await super().get()
            taken.set()
            return event

    class Hub(ResultHub):
        def subscribe(self, request_id: str) -> asyncio.Queue[ResultEvent]:
            queue = Watched()
            self._subs.setdefault(request_id, []).append(queue)
            return queue

    controller.hub = Hub()

    async def scenario(h: Harness) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "A story"}]}
        post = asyncio.create_task(
            h.client.post(
                "/v1/chat/completions",
                json=body | {"stream": True, "slo_seconds": 3600},
                headers=h.auth(),
            )
        )
        while not (rows := h.store.list_requests()[0]):
            await asyncio.sleep(0.01)
        rid = rows[0].id
        while not controller.hub.watched(rid):
            await asyncio.sleep(0.01)
        controller.hub.publish(ResultEvent(rid, "Once upon a", 3))
        await taken.wait()  # streamed before the other answer is stored (else it is never sent)
        h.store.record_outcome(
            rid, status=RequestStatus.FINISHED, at=1000.0, output_text="In a land", output_tokens=3
        )
        controller.hub.publish(ResultEvent(rid, "", 0, done=True, status=RequestStatus.FINISHED))
        r = await post
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "stream_restarted" and rid in error["message"]
        texts = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-2]]
        assert "".join(t for t in texts if t) == "Once upon a"  # nothing else was added

    run(scenario, controller=controller, clock=lambda: 1000.0)


# --- operators -------------------------------------------------------------------------------------


def test_operators_see_queues_groups_instances_and_plans() -> None:
    now = 1000.0

    async def scenario(h: Harness) -> None:
        admin = h.auth("admin")
        queues = (await h.client.get("/v1/admin/queues", headers=admin)).json()
        assert queues["controller"] == "c0" and queues["policy"] == "qlm"
        [queue] = queues["queues"]
        assert (queue["instance"], queue["size"], queue["at_risk_requests"]) == ("i0", 40, 40)
        assert queue["groups"][0]["p_meet_slo"] == 0.1 and queue["groups"][0]["position"] == 0
        groups = (await h.client.get("/v1/admin/groups", headers=admin)).json()["data"]
        assert [g["id"] for g in groups] == ["g1"] and groups[0]["instance"] == "i0"
        safe = await h.client.get("/v1/admin/groups", params={"at_risk": False}, headers=admin)
        assert safe.json()["data"] == []
        [inst] = (await h.client.get("/v1/admin/instances", headers=admin)).json()["data"]
        assert inst["name"] == "i0" and inst["tiers"] == {"m": "active"}
        assert (inst["outstanding"], inst["max_running"], inst["state"]) == (7, 64, "up")
        none = await h.client.get("/v1/admin/plans/latest", headers=admin)
        assert none.status_code == 404
        h.store.record_plan(
            PlanRecord(
                at_s=now, trigger="violation", groups=3, status="optimal", method="milp",
                objective=1.0, edf_objective=2.0, at_risk=("g1",), capacity_needed=1.5,
                solve_s=0.1, evaluations=9, concurrency={"i0": 64}, deferred=4,
            ),
            controller="c0",
        )  # fmt: skip
        plan = (await h.client.get("/v1/admin/plans/latest", headers=admin)).json()
        assert plan["trigger"] == "violation" and plan["at_risk"] == ["g1"]
        assert plan["edf_objective"] == 2.0 and plan["capacity_needed"] == 1.5
        assert plan["deferred"] == 4
        history = (await h.client.get("/v1/admin/plans", headers=admin)).json()["data"]
        assert [p["id"] for p in history] == [plan["id"]]

    run(scenario, controller=FakeController(busy_snapshot(now)), clock=lambda: now)


def test_operators_see_one_group_s_requests_and_what_each_instance_runs() -> None:
    now = 1000.0
    snapshot = busy_snapshot(now)
    [group] = snapshot["queues"][0]["groups"]
    group |= {"size": 3, "missed": 1, "tenants": {"acme": 2, "globex": 1}}
    group["request_ids"] = ["r2", "r0", "r1"]
    snapshot["instances"][0] |= {"running": ["r3"], "tokens": {"r3": 17}}

    async def scenario(h: Harness) -> None:
        for i, (tenant, slo) in enumerate((("acme", 900.0), ("acme", 10.0), ("globex", 900.0))):
            h.store.add_request(
                NewRequest(
                    id=f"r{i}", tenant=tenant, model="m", prompt_tokens=10, max_tokens=10,
                    slo_e2e_s=slo, submitted_at=now - 100,
                )
            )  # fmt: skip
        h.store.add_request(
            NewRequest(
                id="r3", tenant="acme", model="m", prompt_tokens=10, max_tokens=10,
                slo_e2e_s=60.0, submitted_at=now - 100,
            )
        )  # fmt: skip
        h.store.mark_dispatched("r3", instance="i0", at=now - 50)
        admin = h.auth("admin")
        r = await h.client.get("/v1/admin/groups/g1", headers=admin)
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["group"]["tenants"] == {"acme": 2, "globex": 1} and doc["listed"] == 3
        assert [m["id"] for m in doc["requests"]] == ["r2", "r0", "r1"]  # as the group holds them
        assert [m["missed"] for m in doc["requests"]] == [False, False, True]
        assert "request_ids" not in doc["group"]
        listed = (await h.client.get("/v1/admin/groups", headers=admin)).json()["data"]
        assert "request_ids" not in listed[0] and listed[0]["missed"] == 1
        queue = (await h.client.get("/v1/admin/queues", headers=admin)).json()["queues"][0]
        assert (queue["at_risk_requests"], queue["missed_requests"]) == (3, 1)
        r = await h.client.get("/v1/admin/groups/g9", headers=admin)
        assert r.status_code == 404 and "'g9'" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "group_id"

        [i0] = (await h.client.get("/v1/admin/running", headers=admin)).json()["data"]
        assert (i0["instance"], i0["max_running"]) == ("i0", 64)
        [running] = i0["requests"]
        assert (running["id"], running["status"], running["instance"]) == ("r3", "running", "i0")
        assert running["dispatched_at"] == now - 50 and running["missed"] is True
        assert running["tokens"] == 17  # as the controller counts them (the store: when it ends)
        r = await h.client.get("/v1/admin/running", params={"instance": "i9"}, headers=admin)
        assert r.status_code == 404 and "'i9'" in r.json()["error"]["message"]
        r = await h.client.get("/v1/admin/running", headers=h.auth())
        assert r.status_code == 403

    run(scenario, controller=FakeController(snapshot), clock=lambda: now)


def test_drain_and_undrain_go_through_the_store() -> None:
    async def scenario(h: Harness) -> None:
        admin = h.auth("admin")
        r = await h.client.post("/v1/admin/instances/i0/drain", headers=admin)
        assert r.status_code == 200 and r.json()["state"] == "draining"
        assert h.store.instances()[0].state is InstanceState.DRAINING
        r = await h.client.post("/v1/admin/instances/i0/undrain", headers=admin)
        assert r.json()["state"] == "up"
        r = await h.client.post("/v1/admin/instances/nope/drain", headers=admin)
        assert r.status_code == 404 and error(r)["param"] == "name"
        r = await h.client.post("/v1/admin/instances/i0/drain", headers=h.auth())
        assert r.status_code == 403

    run(scenario)


def test_models_list_what_the_instances_serve() -> None:
    async def scenario(h: Harness) -> None:
        h.store.upsert_instance(InstanceSpec("i1", "G", ("m", "org/big-model")))
        r = await h.client.get("/v1/models", headers=h.auth())
        assert [m["id"] for m in r.json()["data"]] == ["m", "org/big-model"]
        assert (await h.client.get("/v1/models/org/big-model", headers=h.auth())).status_code == 200
        assert (await h.client.get("/v1/models/none", headers=h.auth())).status_code == 404

    run(scenario)


# --- probes and metrics -----------------------------------------------------------------------------


def test_readiness_names_what_is_down() -> None:
    async def scenario(h: Harness) -> None:
        assert (await h.client.get("/healthz")).json() == {"status": "ok"}
        r = await h.client.get("/readyz")
        assert r.status_code == 503
        checks = r.json()["checks"]
        assert checks["broker"]["ok"] and checks["store"]["ok"]
        assert checks["controller"] == {
            "ok": False,
            "detail": "no controller has published its state",
        }
        h.store.put_controller_state("c0", active=True, snapshot={})
        assert (await h.client.get("/readyz")).status_code == 200
        await h.queue.close()
        r = await h.client.get("/readyz")
        assert r.status_code == 503 and r.json()["checks"]["broker"]["ok"] is False

    run(scenario)


def test_a_stale_controller_is_not_ready() -> None:
    async def scenario(h: Harness) -> None:
        h.store._clock = lambda: 0.0  # published long ago
        h.store.put_controller_state("c0", active=True, snapshot={})
        r = await h.client.get("/readyz")
        assert r.status_code == 503
        assert "QLM_API__CONTROLLER_STALE_S" in r.json()["checks"]["controller"]["detail"]

    run(scenario)


def test_metrics_export_queues_slo_attainment_plans_and_tenant_counts() -> None:
    now = 1000.0

    async def scenario(h: Harness) -> None:
        assert (await h.client.get("/metrics", headers=h.auth())).status_code == 403
        rid = (await h.submit(slo_seconds=300)).json()["id"]
        h.store.record_prediction(rid, predicted_at=now + 10, at_risk=False)
        h.store.record_outcome(rid, status=RequestStatus.FINISHED, at=now + 12, slo_met=True)
        await h.submit("globex", slo_seconds=300)
        h.store.put_controller_state("c0", active=True, snapshot={})
        h.store.record_plan(
            PlanRecord(
                at_s=now, trigger="period", groups=9, status="heuristic", method="local",
                objective=1.0, edf_objective=2.0, at_risk=("g1", "g2"), capacity_needed=None,
                solve_s=0.1, evaluations=9, concurrency={"i0": 64}, deferred=5,
            ),
            controller="c0",
        )  # fmt: skip
        r = await h.client.get("/metrics", headers=h.auth("admin"))
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        text = r.text
        for line in (
            'qlm_queue_depth{instance="i0"} 40.0',
            'qlm_queue_at_risk_requests{instance="i0"} 40.0',
            'qlm_instance_outstanding{instance="i0"} 7.0',
            'qlm_controller_evictions_total{controller="c0"} 3.0',
            'qlm_controller_model_switches_total{controller="c0"} 2.0',
            'qlm_slo_attainment{tier="standard"} 1.0',
            'qlm_slo_attainment_by_tenant{tenant="acme"} 1.0',
            'qlm_requests{status="finished",tenant="acme"} 1.0',
            'qlm_requests{status="queued",tenant="globex"} 1.0',
            'qlm_api_submissions_total{outcome="accepted",tenant="acme"} 1.0',
            'qlm_completion_estimate_error_seconds{quantile="0.5"} 2.0',
            "qlm_plan_groups_at_risk 2.0",
            "qlm_plan_groups_deferred 5.0",
        ):
            assert line in text, line

    run(scenario, controller=FakeController(busy_snapshot(now)), clock=lambda: now)


def test_metrics_export_latency_histograms_every_replica_alike() -> None:
    """TTFT, end-to-end and queue-wait histograms of finished requests per tier and model, as
    Prometheus wants them (cumulative buckets up to +Inf, _sum, _count): the same from every
    API on the store, and never lowered by retention."""

    async def scenario() -> None:
        store = Store.open("sqlite://")
        async with (
            api_harness(store=store, metrics_public=True) as a,
            api_harness(store=store, metrics_public=True, instances=False) as b,
        ):
            ids = []
            for tier, slo in (("interactive", 30), ("interactive", 30), ("batch", 3600)):
                r = await a.submit(tier=tier, slo_seconds=slo)
                ids.append((r.json()["id"], r.json()["submitted_at"]))
            for (rid, t0), (queue, ttft, e2e) in zip(
                ids, ((0.02, 0.3, 2.0), (0.4, 0.9, 7.0), (200.0, 201.0, 900.0)), strict=True
            ):
                store.mark_dispatched(rid, instance="i0", at=t0 + queue)
                store.mark_first_token(rid, at=t0 + ttft)
                store.record_outcome(rid, status=RequestStatus.FINISHED, at=t0 + e2e)
            waiting = (await a.submit(tier="interactive")).json()["id"]
            store.mark_dispatched(waiting, instance="i0", at=time.time())  # not finished

            def samples(text: str) -> dict[tuple[str, str, str, str], float]:
                return {
                    (s.name, s.labels["tier"], s.labels["model"], s.labels.get("le", "")): s.value
                    for f in text_string_to_metric_families(text)
                    if f.name.startswith("qlm_request_") and f.type == "histogram"
                    for s in f.samples
                }

            got = samples((await a.client.get("/metrics")).text)
            assert samples((await b.client.get("/metrics")).text) == got
            ttft = "qlm_request_ttft_seconds"
            assert got[(f"{ttft}_bucket", "interactive", "m", "0.25")] == 0
            assert got[(f"{ttft}_bucket", "interactive", "m", "0.5")] == 1
            assert got[(f"{ttft}_bucket", "interactive", "m", "1.0")] == 2
            assert got[(f"{ttft}_bucket", "interactive", "m", "+Inf")] == 2
            assert got[(f"{ttft}_count", "interactive", "m", "")] == 2
            assert got[(f"{ttft}_sum", "interactive", "m", "")] == pytest.approx(1.2, abs=1e-3)
            e2e = "qlm_request_e2e_seconds"
            assert got[(f"{e2e}_bucket", "batch", "m", "600.0")] == 0
            assert got[(f"{e2e}_bucket", "batch", "m", "1800.0")] == 1
            assert got[(f"{e2e}_sum", "batch", "m", "")] == pytest.approx(900.0, abs=1e-3)
            queue = "qlm_request_queue_seconds"
            assert got[(f"{queue}_bucket", "interactive", "m", "0.05")] == 1
            assert got[(f"{queue}_count", "interactive", "m", "")] == 2  # not the waiting one
            assert got[(f"{queue}_bucket", "batch", "m", "120.0")] == 0
            assert got[(f"{queue}_bucket", "batch", "m", "300.0")] == 1
            assert not any(k[1] == "standard" for k in got)
            store.prune_requests(time.time() + 10_000)  # retention takes the finished ones
            assert samples((await b.client.get("/metrics")).text) == got
        store.close()

    asyncio.run(scenario())


def test_metrics_report_controllers_until_they_are_gone() -> None:
    """A staleness alert on a controller must end once it is gone — stopped cleanly, or
    silent for ``QLM_API__CONTROLLER_GONE_S`` — not fire forever; a silent one that is not
    gone yet is reported with its growing age."""

    async def scenario(h: Harness) -> None:
        now = time.time()
        for name, ago, stopped in (
            ("live", 0.0, False),
            ("silent", 60.0, False),  # stale, not gone: the alert fires
            ("stopped", 1.0, True),  # said so as it stopped
            ("dead", 1000.0, False),  # killed long ago
        ):
            h.store._clock = lambda ago=ago: now - ago
            h.store.put_controller_state(name, active=False, snapshot={}, stopped=stopped)
        text = (await h.client.get("/metrics")).text
        ages = {
            s.labels["controller"]: s.value
            for f in text_string_to_metric_families(text)
            if f.name == "qlm_controller_state_age_seconds"
            for s in f.samples
        }
        assert set(ages) == {"live", "silent"}
        assert ages["silent"] >= 60.0
        admin = (await h.client.get("/v1/admin/controllers", headers=h.auth("admin"))).json()
        listed = {c["name"]: c["stopped_at"] for c in admin["data"]}
        assert set(listed) == {"live", "silent", "stopped", "dead"}  # the store keeps them all
        assert listed["stopped"] == pytest.approx(now - 1.0) and listed["dead"] is None

    run(scenario, metrics_public=True, controller_gone_s=900)


def test_controllers_say_each_ones_role_as_it_published_it() -> None:
    """A controller taking the leader lock is starting, not standby; a state without a role
    (an older controller's) reads standby unless active or stopped; one whose state is older
    than QLM_API__CONTROLLER_STALE_S is silent (a killed leader's last state says active)."""

    async def scenario(h: Harness) -> None:
        put = h.store.put_controller_state
        put("taking", active=False, snapshot={"role": "starting"})
        put("behind", active=False, snapshot={"role": "standby"})
        put("leads", active=True, snapshot={"role": "active"})
        put("left", active=False, snapshot={"role": "stopping"}, stopped=True)
        put("older", active=False, snapshot={})
        admin = (await h.client.get("/v1/admin/controllers", headers=h.auth("admin"))).json()
        roles = {c["name"]: c["role"] for c in admin["data"]}
        assert roles == {
            "taking": "starting",
            "behind": "standby",
            "leads": "active",
            "left": "stopped",
            "older": "standby",
        }
        assert not any(c["silent"] for c in admin["data"])
        h.store._clock = lambda: time.time() - 60.0  # past QLM_API__CONTROLLER_STALE_S
        put("killed", active=True, snapshot={"role": "active"})
        put("left", active=False, snapshot={"role": "stopping"}, stopped=True)
        admin = (await h.client.get("/v1/admin/controllers", headers=h.auth("admin"))).json()
        silent = {c["name"] for c in admin["data"] if c["silent"]}
        assert silent == {"killed"}  # (one that said it stopped is not silent: it is gone)

    run(scenario, controller_stale_s=10.0)


def test_metrics_say_which_of_broker_and_store_is_down() -> None:
    """An alert must be able to name the part that is down: a store that does not answer
    leaves the scrape standing, with ``qlm_store_up`` 0 and nothing the store would give."""

    def values(text: str) -> dict[str, float]:
        return {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if not s.labels
        }

    async def scenario(h: Harness) -> None:
        h.store.put_controller_state("c0", active=True, snapshot={})
        text = (await h.client.get("/metrics")).text
        got = values(text)
        assert got["qlm_broker_up"] == 1.0 and got["qlm_store_up"] == 1.0
        assert 'qlm_controller_state_age_seconds{controller="c0"}' in text

        def down(*_a: Any, **_k: Any) -> Any:
            from qlm.store import StoreError

            raise StoreError("cannot read controller states (sqlite://): database is gone")

        h.store.controller_states = down  # type: ignore[method-assign]
        h.store.counts = down  # type: ignore[method-assign]
        await asyncio.sleep(0.01)  # past the snapshot cache (QLM_API__SNAPSHOT_TTL_S)
        r = await h.client.get("/metrics")
        assert r.status_code == 200
        got = values(r.text)
        assert got["qlm_broker_up"] == 1.0 and got["qlm_store_up"] == 0.0
        assert 'qlm_controller_state_age_seconds{controller="c0"}' not in r.text
        await h.queue.close()
        assert values((await h.client.get("/metrics")).text)["qlm_broker_up"] == 0.0

    run(scenario, metrics_public=True, snapshot_ttl_s=0)


def test_two_apps_in_one_process_share_no_metrics() -> None:
    async def main() -> None:
        async with api_harness() as a, api_harness(metrics_public=True) as b:
            await a.submit()
            text_b = (await b.client.get("/metrics")).text
            assert "qlm_api_submissions_total{" not in text_b

    asyncio.run(main())


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", COMPLETION | {"n": 2}, "n"),
        ("/v1/completions", COMPLETION | {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", COMPLETION | {"logprobs": 0}, "logprobs"),  # 0 asks too
        ("/v1/completions", COMPLETION | {"echo": True}, "echo"),
        ("/v1/completions", COMPLETION | {"suffix": "!"}, "suffix"),
        ("/v1/completions", COMPLETION | {"best_of": 3}, "best_of"),
        ("/v1/completions", COMPLETION | {"logit_bias": {"50256": -100}}, "logit_bias"),
        ("/v1/completions", COMPLETION | {"min_tokens": 5}, "min_tokens"),
        ("/v1/completions", COMPLETION | {"min_p": 0.1}, "min_p"),
        ("/v1/completions", COMPLETION | {"ignore_eos": True}, "ignore_eos"),
        ("/v1/completions", COMPLETION | {"guided_regex": "a+"}, "guided_regex"),
        ("/v1/completions", COMPLETION | {"prompt": [1, 2, 3]}, "prompt"),  # token ids
        ("/v1/chat/completions", CHAT | {"logprobs": True}, "logprobs"),
        ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", CHAT | {"logit_bias": {"1": 5}}, "logit_bias"),
        ("/v1/chat/completions", CHAT | {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", CHAT | {"function_call": "auto"}, "function_call"),
        ("/v1/chat/completions", CHAT | {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", CHAT | {"audio": {"voice": "alloy"}}, "audio"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
        ),
    ],
)
def test_openai_fields_qlm_cannot_honour_are_refused_naming_them(
    path: str, body: dict[str, Any], param: str
) -> None:
    async def scenario(h: Harness) -> None:
        r = await h.client.post(path, json=body, headers=h.auth())
        assert r.status_code == 422, r.text
        assert error(r)["param"] == param
        assert published(h.queue) == [] and h.store.list_requests()[0] == []

    run(scenario, wait_timeout_s=0.05)  # (were one accepted, the test would not wait long)


@pytest.mark.parametrize(
    "extra",
    [
        {"logit_bias": {}},
        {"modalities": ["text"]},
        {"min_tokens": 0},
        {"ignore_eos": False},
        {"store": False, "metadata": {"a": "b"}, "parallel_tool_calls": True},
    ],
)
def test_openai_fields_at_their_defaults_are_accepted(extra: dict[str, Any]) -> None:
    async def scenario(h: Harness) -> None:
        r = await h.client.post("/v1/chat/completions", json=CHAT | extra, headers=h.auth())
        assert r.status_code == 504, r.text  # accepted and queued: nothing serves it here
        assert len(published(h.queue)) == 1 and len(h.store.list_requests()[0]) == 1

    run(scenario, wait_timeout_s=0.05)


def test_attainment_series_counts_each_bucket_for_admins_only() -> None:
    async def scenario(h: Harness) -> None:
        for tenant, n, at, met in (("acme", 1, 100.0, True), ("acme", 2, 150.0, False),
                                   ("globex", 3, 250.0, True)):  # fmt: skip
            h.store.add_request(
                NewRequest(f"r{n}", tenant, "m", 10, 10, slo_e2e_s=30.0, submitted_at=at)
            )
            h.store.record_outcome(f"r{n}", status=RequestStatus.FINISHED, at=at + 1, slo_met=met)
        params = {"since": 100, "until": 400, "step": 100}
        r = await h.client.get("/v1/admin/attainment", params=params, headers=h.auth("admin"))
        assert r.status_code == 200, r.text
        got = [(b["start"], b["requests"], b["slo_met"], b["attainment"]) for b in r.json()["data"]]
        assert got == [(100.0, 2, 1, 0.5), (200.0, 1, 1, 1.0), (300.0, 0, 0, None)]
        r = await h.client.get(
            "/v1/admin/attainment", params=params | {"tenant": "globex"}, headers=h.auth("admin")
        )
        assert [b["requests"] for b in r.json()["data"]] == [0, 1, 0]
        r = await h.client.get("/v1/admin/attainment", params=params, headers=h.auth("acme"))
        assert r.status_code == 403
        for bad, param in (({"until": 50}, "until"), ({"step": 0.1}, "step"),
                           ({"until": 1e9}, "step")):  # fmt: skip
            r = await h.client.get(
                "/v1/admin/attainment", params=params | bad, headers=h.auth("admin")
            )
            assert r.status_code == 422 and error(r)["param"] == param, r.text

    run(scenario)
