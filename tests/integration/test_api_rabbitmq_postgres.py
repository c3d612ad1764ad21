"""The API over the real parts: RabbitMQ (queue names of this run), PostgreSQL (a schema of this
run) and two ``qlm sim-engine serve`` processes behind vLLM's HTTP API, driven by a controller
service in this test's process. The API is the production split: its own store and broker
connections and no controller in process, so results come from polling the store.

Waits poll with deadlines; nothing asserts on timing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from services import broker_names, postgres_schema, start_sim_engine, stop

from qlm.api import create_app
from qlm.domain import InstanceSpec, RequestStatus
from qlm.engines.wallclock import count_tokens
from qlm.service import ControllerService, build_controller
from qlm.service.instances import InstanceConfig
from qlm.settings import ApiSettings, BrokerSettings, ControllerSettings, Settings
from qlm.store import Store

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.timeout(300)]

MODEL = "llama-3-8b"
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def schema_url(postgres_url: str) -> Iterator[str]:
    with postgres_schema(postgres_url) as url:
        yield url


@pytest.fixture(scope="module")
def broker(amqp_url: str) -> Iterator[BrokerSettings]:
    with broker_names(amqp_url) as names:
        yield BrokerSettings(**names)


def start_engine() -> tuple[subprocess.Popen[bytes], str]:
    """A simulated vLLM server that generates ``max_tokens`` (no early end of sequence), so a
    long request is still running when the test cancels it."""
    return start_sim_engine(MODEL, time_scale=20.0, extra=("--eos-lengths", "max_tokens"))


@pytest.fixture(scope="module")
def engines() -> Iterator[list[str]]:
    started = [start_engine() for _ in range(2)]
    try:
        yield [url for _, url in started]
    finally:
        for proc, _ in started:
            stop(proc)


@pytest.fixture
def settings(amqp_url: str, schema_url: str, broker: BrokerSettings) -> Settings:
    return Settings(
        broker_url=amqp_url,
        database_url=schema_url,
        broker=broker,
        controller=ControllerSettings(
            policy="edf", name=f"it-{uuid.uuid4().hex[:6]}", tick_s=0.05, health_interval_s=0.25
        ),
        api=ApiSettings(poll_interval_s=0.05, wait_timeout_s=DEADLINE_S),
    )


@dataclass
class Stack:
    store: Store
    client: httpx.AsyncClient
    service: ControllerService | None
    keys: dict[str, str]

    def auth(self, who: str = "acme", **headers: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}", **headers}

    async def submit(self, who: str = "acme", **body: Any) -> httpx.Response:
        fields: dict[str, Any] = {
            "model": MODEL,
            "prompt": "Tell me about queues.",
            "max_tokens": 16,
            "slo_seconds": 600,
        }
        headers = body.pop("headers", {})
        return await self.client.post(
            "/v1/requests", json=fields | body, headers=self.auth(who, **headers)
        )

    async def row(self, rid: str) -> Any:
        return await asyncio.to_thread(self.store.get, rid)


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def stack(
    settings: Settings, engine_urls: list[str], *, controller: bool = True
) -> AsyncIterator[Stack]:
    store = await asyncio.to_thread(Store.open, settings.database_url)
    service = None
    if controller:
        configs = [
            InstanceConfig(InstanceSpec(f"sim-{i}", "A100", (MODEL,), url=url))
            for i, url in enumerate(engine_urls)
        ]
        service = build_controller(settings, store=store, configs=configs)
        await service.start()
    keys = {
        "acme": store.create_api_key("acme"),
        "globex": store.create_api_key("globex"),
        "admin": store.create_api_key("ops", admin=True),
    }
    app = create_app(settings)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://qlm", timeout=DEADLINE_S
            ) as client:
                yield Stack(store, client, service, keys)
    finally:
        if service is not None:
            await service.stop()
        await asyncio.to_thread(store.close)


def test_submitted_requests_are_served_by_the_vllm_servers_and_read_back(
    settings: Settings, engines: list[str]
) -> None:
    async def main() -> None:
        async with stack(settings, engines) as s:
            ids = []
            for i in range(12):
                r = await s.submit(max_tokens=8 + i, labels={"batch": "a"})
                assert r.status_code == 202, r.text
                ids.append(r.json()["id"])
            views = [
                (await s.client.get(f"/v1/requests/{rid}", params={"wait": 60}, headers=s.auth()))
                for rid in ids
            ]
            for i, view in enumerate(v.json() for v in views):
                assert view["status"] == "finished", view
                assert view["output"]["tokens"] == 8 + i
                assert view["instance"] in ("sim-0", "sim-1") and view["slo_met"] is True
            completion = await s.client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 6,
                },
                headers=s.auth(**{"x-qlm-slo-seconds": "300", "x-qlm-tier": "interactive"}),
            )
            assert completion.status_code == 200, completion.text
            assert completion.json()["usage"]["completion_tokens"] == 6
            row = await s.row(completion.headers["x-qlm-request-id"])
            assert row.status is RequestStatus.FINISHED and row.tier.name == "INTERACTIVE"
            listing = await s.client.get(
                "/v1/requests", params={"label": "batch=a", "status": "finished"}, headers=s.auth()
            )
            assert len(listing.json()["data"]) == 12

    asyncio.run(main())


async def drained(s: Stack, names: list[str], draining: bool) -> None:
    """Drain or undrain through the API, and wait until the controller applied it."""
    action = "drain" if draining else "undrain"
    for name in names:
        r = await s.client.post(f"/v1/admin/instances/{name}/{action}", headers=s.auth("admin"))
        assert r.status_code == 200, r.text

    async def applied() -> bool:
        assert s.service is not None
        states = {i["name"]: i["draining"] for i in s.service.snapshot()["instances"]}
        return all(states.get(n) is draining for n in names)

    await eventually(applied, f"the controller {action}s {names}")


def test_cancel_removes_a_queued_request_and_aborts_a_running_one(
    settings: Settings, engines: list[str]
) -> None:
    async def main() -> None:
        async with stack(settings, engines) as s:
            await drained(s, ["sim-0", "sim-1"], True)
            queued = (await s.submit()).json()["id"]
            await asyncio.sleep(0.5)  # it stays queued: every instance is draining
            assert (await s.row(queued)).status is RequestStatus.QUEUED
            r = await s.client.delete(f"/v1/requests/{queued}", headers=s.auth())
            assert r.status_code == 200 and r.json()["status"] == "cancelled"
            await drained(s, ["sim-0", "sim-1"], False)

            running = (await s.submit(max_tokens=6000)).json()["id"]

            async def started() -> bool:
                return (await s.row(running)).first_token_at is not None

            await eventually(started, "the long request streams")
            r = await s.client.delete(f"/v1/requests/{running}", headers=s.auth())
            assert r.status_code in (200, 202), r.text
            view = await s.client.get(
                f"/v1/requests/{running}", params={"wait": 60}, headers=s.auth()
            )
            body = view.json()
            assert body["status"] == "cancelled", body
            assert 0 < body["output"]["tokens"] < 6000
            assert count_tokens(body["output"]["text"]) == body["output"]["tokens"]
            row = await s.row(queued)
            assert row.status is RequestStatus.CANCELLED and row.dispatched_at is None

    asyncio.run(main())


def test_tenants_limits_and_idempotency_hold_over_the_real_store_and_broker(
    settings: Settings, engines: list[str]
) -> None:
    async def main() -> None:
        async with stack(settings, engines) as s:
            mine = (await s.submit("acme")).json()["id"]
            r = await s.client.get(f"/v1/requests/{mine}", headers=s.auth("globex"))
            assert r.status_code == 404
            r = await s.client.delete(f"/v1/requests/{mine}", headers=s.auth("globex"))
            assert r.status_code == 404
            theirs = await s.client.get("/v1/requests", headers=s.auth("globex"))
            assert all(v["tenant"] == "globex" for v in theirs.json()["data"])

            key = {"Idempotency-Key": f"order-{uuid.uuid4().hex}"}
            first = await s.submit(headers=dict(key))
            again = await s.submit(headers=dict(key))
            assert first.json()["id"] == again.json()["id"] and again.json()["replayed"] is True
            clash = await s.submit(prompt="something else", headers=dict(key))
            assert clash.status_code == 409

            big = await s.submit(max_tokens=10**6)
            assert big.status_code == 422 and big.json()["error"]["param"] == "max_tokens"

        limited = settings.model_copy(
            update={
                "api": ApiSettings(
                    rate_per_s=0.01, rate_burst=2, max_body_bytes=2048, poll_interval_s=0.05
                )
            }
        )
        async with stack(limited, engines, controller=False) as s:
            codes = [(await s.submit("globex")).status_code for _ in range(3)]
            assert codes == [202, 202, 429]
            r = await s.submit("acme", prompt="x" * 4000)
            assert r.status_code == 413 and r.json()["error"]["code"] == "max_body_bytes"

        queued_limit = settings.model_copy(
            update={"api": ApiSettings(max_queued_per_tenant=1, queued_count_ttl_s=0)}
        )
        async with stack(queued_limit, engines, controller=False) as s:
            # No controller runs: what is submitted stays queued.
            tenant = f"t-{uuid.uuid4().hex[:6]}"
            s.keys[tenant] = await asyncio.to_thread(s.store.create_api_key, tenant)
            assert (await s.submit(tenant)).status_code == 202
            r = await s.submit(tenant)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "max_queued_per_tenant"

    asyncio.run(main())


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=120)


@pytest.mark.slow
def test_readiness_fails_while_the_broker_is_down_and_recovers_by_itself(
    settings: Settings, engines: list[str]
) -> None:
    async def main() -> None:
        async with stack(settings, engines, controller=False) as s:
            spec = InstanceSpec("sim-0", "A100", (MODEL,), url=engines[0])
            await asyncio.to_thread(s.store.upsert_instance, spec)  # as a controller would
            stop_heartbeat = asyncio.Event()

            async def heartbeat() -> None:  # a controller's published state, as one would
                while not stop_heartbeat.is_set():
                    await asyncio.to_thread(
                        s.store.put_controller_state, "it-fake", active=True, snapshot={}
                    )
                    await asyncio.sleep(0.5)

            beating = asyncio.create_task(heartbeat())

            async def ready(expected: int) -> bool:
                return (await s.client.get("/readyz")).status_code == expected

            try:
                await eventually(lambda: ready(200), "ready with the broker up")
                await asyncio.to_thread(rabbitmqctl, "stop_app")
                try:
                    await eventually(lambda: ready(503), "not ready with the broker down")
                    body = (await s.client.get("/readyz")).json()
                    assert body["checks"]["broker"]["ok"] is False
                    assert body["checks"]["store"]["ok"] is True
                    before = len((await asyncio.to_thread(s.store.list_requests, limit=1000))[0])
                    r = await s.submit()
                    assert (
                        r.status_code == 503 and r.json()["error"]["code"] == "broker_unavailable"
                    )
                    after = len((await asyncio.to_thread(s.store.list_requests, limit=1000))[0])
                    assert after == before  # nothing half-accepted
                finally:
                    await asyncio.to_thread(rabbitmqctl, "start_app")
                await eventually(lambda: ready(200), "ready again once the broker is back")
                assert (await s.submit()).status_code == 202
            finally:
                stop_heartbeat.set()
                await beating

    try:
        asyncio.run(main())
    finally:
        rabbitmqctl("start_app")  # whatever happened, leave the broker running


def test_ids_that_postgresql_cannot_hold_are_refused_at_the_edge(settings: Settings) -> None:
    async def main() -> None:
        async with stack(settings, [], controller=False) as s:
            for method, path in (
                ("GET", "/v1/requests/req_%00x"),
                ("GET", "/v1/requests/req_%00x/events"),
                ("DELETE", "/v1/requests/req_%00x"),
                ("POST", "/v1/admin/instances/sim%00/drain"),
                ("POST", "/v1/admin/instances/sim%00/undrain"),
            ):
                r = await s.client.request(method, path, headers=s.auth("admin"))
                assert r.status_code == 422, (path, r.text)
                assert r.json()["error"]["code"] == "invalid_id", r.text

    asyncio.run(main())


def test_a_forged_cursor_is_a_client_error_on_postgresql(settings: Settings) -> None:
    async def main() -> None:
        async with stack(settings, [], controller=False) as s:
            raw = json.dumps([1.0, "req_\u0000"]).encode()
            cursor = base64.urlsafe_b64encode(raw).decode().rstrip("=")
            r = await s.client.get("/v1/requests", params={"cursor": cursor}, headers=s.auth())
            assert r.status_code == 422, r.text
            assert r.json()["error"]["code"] == "invalid_cursor"

    asyncio.run(main())


def test_a_json_schema_holding_nul_is_a_client_error_on_postgresql(settings: Settings) -> None:
    async def main() -> None:
        async with stack(settings, [], controller=False) as s:
            await asyncio.to_thread(
                s.store.upsert_instance, InstanceSpec("sim-0", "A100", (MODEL,))
            )  # as a controller would
            schema = {"type": "object", "description": "a\u0000b"}
            r = await s.submit(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": schema},
                }
            )
            assert r.status_code == 422, r.text
            assert r.json()["error"]["code"] == "invalid_schema"

    asyncio.run(main())
