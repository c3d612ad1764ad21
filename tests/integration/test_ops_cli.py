"""``qlm ops``, the operator CLI, against the REST API served by uvicorn on a free port with a
controller service and simulated instances in process: it lists instances, drains and undrains
one, shows a request, plans, queues and controllers, and reports SLO attainment that agrees with
the API's own records; on a busy fleet it shows one group's requests and tenants, the requests
each instance runs, and requests past their deadline as missed; bad input and a missing key fail
in one line. Nothing asserts on timing: the CLI runs once the requests it looks at are final, or
once the API shows the state it looks at."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
from typer.testing import CliRunner, Result

from qlm.api import create_app
from qlm.api.server import ApiServer
from qlm.cli import app
from qlm.cli.ops import parse_span
from qlm.global_queue import MemoryBroker, MemoryGlobalQueue
from qlm.settings import Settings
from qlm.store import Store
from tests.unit.service.test_controller_service import make_service

N = 6


def run(
    scenario: Callable[[str, str, str, list[str]], Awaitable[None]], *, busy: bool = False
) -> None:
    """``scenario(url, admin key, tenant key, request ids)`` once the requests are final; with
    ``busy``, slow engines running one request at a time, once the API shows requests running
    and waiting, some of them past their deadline (``busy_submissions``)."""

    async def main() -> None:
        store = Store.open("sqlite://")
        broker = MemoryBroker()
        service = (
            make_service(store, broker, step_ms=2000.0, max_running=1)
            if busy
            else make_service(store, broker)
        )
        await service.start()
        admin = store.create_api_key("ops", admin=True)
        tenant = store.create_api_key("acme")
        api = create_app(
            Settings(),
            queue=MemoryGlobalQueue(broker=broker),
            store=store,
            controller=service,
            clock=service.runtime.clock.now,
        )
        server = ApiServer(api, host="127.0.0.1", port=0, log_level="warning")
        await server.start()
        try:
            async with httpx.AsyncClient(base_url=server.url) as client:
                if busy:
                    ids = await busy_submissions(client, store, tenant, admin)
                    await scenario(server.url, admin, tenant, ids)
                    return
                auth = {"Authorization": f"Bearer {tenant}"}
                ids = []
                for i in range(N):
                    body = {"model": "m", "prompt": "hi", "max_tokens": 20 + i, "slo_seconds": 60}
                    body["tier"] = "interactive" if i % 2 else "batch"
                    r = await client.post("/v1/requests", json=body, headers=auth)
                    assert r.status_code in (200, 201, 202), r.text
                    ids.append(r.json()["id"])
                deadline = time.monotonic() + 60
                for rid in ids:
                    while True:
                        r = await client.get(f"/v1/requests/{rid}", headers=auth)
                        if r.json()["status"] in ("finished", "failed", "cancelled"):
                            break
                        assert time.monotonic() < deadline, f"{rid} never became final"
                        await asyncio.sleep(0.02)
            await scenario(server.url, admin, tenant, ids)
        finally:
            await server.stop()
            await service.stop()
            store.close()

    asyncio.run(main())


async def busy_submissions(
    client: httpx.AsyncClient, store: Store, tenant: str, admin: str
) -> list[str]:
    """Six requests of two tenants on engines that take minutes (of the sped-up clock) each,
    one at a time: two run, four wait, and the waiting ones with a 60 s SLO go past their
    deadline while the long one runs. Returns once the API shows it (or fails after 60 s)."""
    other = store.create_api_key("globex")
    ids = []
    for i in range(6):
        key = tenant if i % 3 else other
        body = {"model": "m", "prompt": "hi", "max_tokens": 200, "slo_seconds": 60}
        if i >= 4:
            body["slo_seconds"] = 3600
        r = await client.post("/v1/requests", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code in (200, 201, 202), r.text
        ids.append(r.json()["id"])
    auth = {"Authorization": f"Bearer {admin}"}
    deadline = time.monotonic() + 60
    while True:
        running = (await client.get("/v1/admin/running", headers=auth)).json()["data"]
        groups = (await client.get("/v1/admin/groups", headers=auth)).json()["data"]
        if all(i["requests"] for i in running) and any(g["missed"] for g in groups):
            return ids
        assert time.monotonic() < deadline, (running, groups)
        await asyncio.sleep(0.05)


async def ops(url: str, key: str | None, *args: str) -> Result:
    base = ["ops", "--url", url, *(["--key", key] if key else [])]
    return await asyncio.to_thread(
        CliRunner().invoke, app, [*base, *args], env={"QLM_KEY": "", "QLM_API_KEY": ""}
    )


def test_operators_inspect_and_steer_a_running_qlm() -> None:
    async def scenario(url: str, admin: str, tenant: str, ids: list[str]) -> None:
        r = await ops(url, admin, "instances")
        assert r.exit_code == 0, r.output
        assert "i0" in r.output and "i1" in r.output and "m (active)" in r.output
        r = await ops(url, admin, "drain", "i0")
        assert (r.exit_code, r.output.strip()) == (0, "i0: draining")
        r = await ops(url, admin, "--json", "instances")
        states = {i["name"]: i["state"] for i in json.loads(r.output)["data"]}
        assert states == {"i0": "draining", "i1": "up"}
        r = await ops(url, admin, "undrain", "i0")
        assert (r.exit_code, r.output.strip()) == (0, "i0: up")

        r = await ops(url, admin, "request", ids[1])
        assert r.exit_code == 0, r.output
        assert (
            ids[1] in r.output and "acme / m / interactive" in r.output and "finished" in r.output
        )

        for command in ("queues", "groups", "plans", "controllers"):
            r = await ops(url, admin, command)
            assert r.exit_code == 0, (command, r.output)
        r = await ops(url, admin, "--json", "plans")
        assert json.loads(r.output)["data"], "the QLM policy planned at least once"

    run(scenario)


def test_a_controller_that_leads_an_empty_queue_shows_active_not_standby() -> None:
    """Before any request arrives, the only controller leads: ``qlm ops controllers`` says
    active (it said standby until its first delivery)."""

    async def main() -> None:
        store = Store.open("sqlite://")
        broker = MemoryBroker()
        service = make_service(store, broker)
        service.publish_s = 0.02
        await service.start()
        admin = store.create_api_key("ops", admin=True)
        api = create_app(
            Settings(), queue=MemoryGlobalQueue(broker=broker), store=store, controller=service
        )
        server = ApiServer(api, host="127.0.0.1", port=0, log_level="warning")
        await server.start()
        try:
            deadline = time.monotonic() + 60
            while not store.controller_states():
                assert time.monotonic() < deadline, "the controller never published its state"
                await asyncio.sleep(0.02)
            r = await ops(server.url, admin, "controllers")
            assert r.exit_code == 0, r.output
            row = next(line for line in r.output.splitlines() if "c0" in line)
            assert "active" in row and "standby" not in row, r.output
            assert service.received == 0
        finally:
            await server.stop()
            await service.stop()
            store.close()

    asyncio.run(main())


def test_operators_see_a_group_s_requests_what_runs_and_what_is_already_missed() -> None:
    async def scenario(url: str, admin: str, tenant: str, ids: list[str]) -> None:
        r = await ops(url, admin, "groups", "--json")
        groups = json.loads(r.output)["data"]
        missed = next(g for g in groups if g["missed"])
        # the key from the environment, --json after the command
        r = await asyncio.to_thread(
            CliRunner().invoke,
            app,
            ["ops", "--url", url, "group", missed["id"], "--json"],
            env={"QLM_KEY": admin, "QLM_API_KEY": ""},
        )
        assert r.exit_code == 0, r.output
        doc = json.loads(r.output)
        assert doc["group"]["id"] == missed["id"] and doc["listed"] == missed["size"]
        members = doc["requests"]
        assert {m["id"] for m in members} <= set(ids) and len(members) == missed["size"]
        assert sum(doc["group"]["tenants"].values()) == missed["size"]
        assert {m["tenant"] for m in members} == set(doc["group"]["tenants"])
        assert sum(m["missed"] for m in members) == missed["missed"]
        assert all(m["deadline_at"] < doc["at"] for m in members if m["missed"])

        r = await ops(url, admin, "group", missed["id"])
        assert r.exit_code == 0, r.output
        assert f"group {missed['id']}" in r.output and "tenants" in r.output
        assert "missed" in r.output and members[0]["id"] in r.output
        r = await ops(url, admin, "group", "g-nope")
        assert r.exit_code == 1 and "'g-nope'" in r.output and "404" in r.output

        r = await ops(url, admin, "--json", "running")
        running = {i["instance"]: i["requests"] for i in json.loads(r.output)["data"]}
        assert set(running) == {"i0", "i1"}
        assert all(len(reqs) == 1 and reqs[0]["status"] == "running" for reqs in running.values())
        r = await ops(url, admin, "running", "--instance", "i0")
        assert r.exit_code == 0 and "i0: 1 request running of 1" in r.output, r.output
        assert running["i0"][0]["id"] in r.output and "i1" not in r.output
        r = await ops(url, admin, "running", "--instance", "nope")
        assert r.exit_code == 1 and "'nope'" in r.output

        r = await ops(url, admin, "queues")
        assert r.exit_code == 0 and " missed" in r.output, r.output
        r = await ops(url, admin, "queues", "--watch", "--count", "2", "--interval", "0.1")
        assert r.exit_code == 0 and r.output.count("(Ctrl-C to stop)") == 2, r.output
        r = await ops(url, admin, "queues", "-w", "--count", "2", "--interval", "0.1", "--json")
        rounds = [json.loads(line) for line in r.output.splitlines()]
        assert len(rounds) == 2 and all("queues" in doc for doc in rounds)

    run(scenario, busy=True)


def test_the_slo_report_agrees_with_the_requests_the_api_records(tmp_path: Path) -> None:
    async def scenario(url: str, admin: str, tenant: str, ids: list[str]) -> None:
        async with httpx.AsyncClient(base_url=url) as client:
            rows = [
                (await client.get(f"/v1/requests/{i}", headers={"Authorization": f"Bearer {admin}"})).json()
                for i in ids
            ]  # fmt: skip
        met = sum(bool(r["slo_met"]) for r in rows)
        out = tmp_path / "slo.md"
        # This API runs on the controller's sped-up clock, not unix time: say when the span ends.
        until = str(max(r["submitted_at"] for r in rows) + 1.0)
        r = await ops(url, admin, "--json", "report", "--since", "1h", "--until", until)
        assert r.exit_code == 0, r.output
        doc = json.loads(r.output)
        overall = doc["overall"]
        assert (overall["requests"], overall["judged"], overall["slo_met"]) == (N, N, met)
        tiers = {row["name"]: row for row in doc["by"]["tier"]}
        assert set(tiers) == {"batch", "interactive"} and tiers["batch"]["requests"] == N // 2
        assert [row["name"] for row in doc["by"]["tenant"]] == ["acme"]
        # The trend comes from the store: on this clock, the requests are in its first day.
        r = await ops(url, admin, "--json", "report", "--since", "3d", "--until", "259200")
        days = json.loads(r.output)["days"]
        assert [(d["start"], d["requests"], d["slo_met"]) for d in days] == [
            (0.0, N, met), (86400.0, 0, 0), (172800.0, 0, 0),
        ]  # fmt: skip
        r = await ops(url, admin, "report", "--since", "1h", "--until", until, "--out", str(out))
        assert r.exit_code == 0, r.output
        text = out.read_text(encoding="utf-8")
        assert text.startswith("# SLO attainment") and "## By tier" in text
        assert f"({met} of {N})" in text
        html = tmp_path / "slo.html"
        r = await ops(
            url, admin, "report", "--since", "3d", "--until", "259200", "--out", str(html)
        )
        assert r.exit_code == 0, r.output
        assert html.read_text(encoding="utf-8").count('<svg class="chart"') == 5
        narrow = await asyncio.to_thread(
            CliRunner().invoke,
            app,
            ["ops", "--url", url, "--key", admin, "report", "--since", "1h", "--until", until],
            env={"QLM_KEY": "", "QLM_API_KEY": "", "COLUMNS": "60"},
        )
        assert narrow.exit_code == 0, narrow.output
        assert "│ interactive │" in narrow.output  # names whole on a narrow terminal
        r = await ops(url, admin, "report", "--until", until, "--tenant", "nobody")
        assert r.exit_code == 0 and "Overall" in r.output  # an empty span reports zeros

    run(scenario)


def test_without_an_admin_key_or_with_bad_input_the_cli_fails_in_one_line() -> None:
    async def scenario(url: str, admin: str, tenant: str, ids: list[str]) -> None:
        cases: list[tuple[str | None, tuple[str, ...], str]] = [
            (None, ("queues",), "401"),
            (tenant, ("instances",), "admin key"),
            (admin, ("drain", "nope"), "nope"),
            (admin, ("report", "--since", "yesterday"), "--since"),
            (admin, ("report", "--format", "pdf"), "--format"),
            (admin, ("report", "--target", "90"), "--target"),
            (admin, ("request", "no-such-id"), "404"),
        ]
        for key, args, named in cases:
            r = await ops(url, key, *args)
            assert r.exit_code == 1, (args, r.output)
            assert named in r.output and len(r.output.strip().splitlines()) == 1, (args, r.output)
        r = await ops("http://127.0.0.1:1", admin, "instances")
        assert r.exit_code == 1 and "cannot reach QLM" in r.output
        r = await ops("localhost:8000", admin, "instances")
        assert r.exit_code == 1 and "--url" in r.output

    run(scenario)


def test_spans() -> None:
    assert [parse_span(s) for s in ("30m", "24h", "7d", "90s", "1.5h")] == [
        1800.0, 86400.0, 604800.0, 90.0, 5400.0,
    ]  # fmt: skip
