"""``POST /v1/requests`` served by the fast path (``qlm.api.hotpath``): what it serves itself is
answered exactly as the FastAPI route answers it, and everything else reaches the route."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from qlm.api.deps import get_principal
from qlm.api.errors import ApiError
from tests.unit.api.test_api import Harness, error, published, run

ROUTE = "application/merge-patch+json"
"""A JSON media type FastAPI parses and the fast path leaves to it: the same call, via the route."""


def post(h: Harness, content_type: str, body: Any, **headers: str) -> Any:
    data = body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).content
    return h.client.post(
        "/v1/requests", content=data, headers={"Content-Type": content_type, **headers}
    )


def test_well_formed_submissions_skip_fastapi_and_the_rest_reach_it() -> None:
    async def scenario(h: Harness) -> None:
        def route_only() -> None:
            raise ApiError(418, "served by the FastAPI route", type="test", code="route")

        h.app.dependency_overrides[get_principal] = route_only
        body = {"model": "m", "prompt": "hi", "max_tokens": 4}
        fast = await post(h, "application/json; charset=utf-8", body, **h.auth())
        assert fast.status_code == 202, fast.text
        assert [m.id for m in published(h.queue)] == [fast.json()["id"]]
        for content_type, payload, headers, answer in [
            ("application/json", body | {"colour": "red"}, {}, (418, "route")),
            ("text/plain", body, {}, (418, "route")),
            (ROUTE, body, {}, (418, "route")),
            ("application/json", body, {"Idempotency-Key": "k" * 256}, (418, "route")),
            ("application/json", b"{not json", {}, (422, "json_invalid")),  # FastAPI reads first
        ]:
            r = await post(h, content_type, payload, **h.auth(**headers))
            assert (r.status_code, error(r)["code"]) == answer, (content_type, payload)
        r = await h.client.get("/v1/requests", headers=h.auth())
        assert r.status_code == 418
        assert len(published(h.queue)) == 1

    run(scenario)


@pytest.mark.parametrize(
    ("body", "headers", "who"),
    [
        ({}, {}, "acme"),
        ({"labels": {"team": "x"}, "tier": "batch", "temperature": 0.5}, {}, "acme"),
        ({"messages": [{"role": "user", "content": "hi"}], "prompt": None}, {}, "acme"),
        ({}, {"Authorization": ""}, None),  # no key
        ({}, {"Authorization": "Bearer qlm_unknown"}, None),
        ({}, {"Authorization": "Basic dXNlcjpwdw=="}, None),  # not a bearer key
        ({"model": "gpt-9"}, {}, "acme"),  # 404 from admission
        ({"max_tokens": 50_000}, {}, "acme"),  # 422 from admission
        ({"slo_seconds": 5, "ttft_slo_seconds": 6}, {}, "acme"),
    ],
)
def test_the_fast_path_answers_as_the_route_does(
    body: dict[str, Any], headers: dict[str, str], who: str | None
) -> None:
    async def scenario(h: Harness) -> None:
        full = {"model": "m", "prompt": "hello there", "max_tokens": 16} | body
        full = {k: v for k, v in full.items() if v is not None}
        auth = h.auth(who) if who else {}
        fast = await post(h, "application/json", full, **(auth | headers))
        route = await post(h, ROUTE, full, **(auth | headers))
        assert fast.status_code == route.status_code, (fast.text, route.text)
        assert same_answer(fast) == same_answer(route)

    run(scenario, max_tokens_limit=4096)


def test_replays_and_conflicts_are_answered_alike() -> None:
    async def scenario(h: Harness) -> None:
        for content_type, key in [("application/json", "k-fast"), (ROUTE, "k-route")]:
            body = {"model": "m", "prompt": "p", "max_tokens": 4}
            first = await post(h, content_type, body, **h.auth(**{"Idempotency-Key": key}))
            again = await post(h, content_type, body, **h.auth(**{"Idempotency-Key": key}))
            assert first.status_code == again.status_code == 202
            assert again.json()["id"] == first.json()["id"] and again.json()["replayed"]
            assert again.headers["idempotent-replayed"] == "true"
            other = await post(
                h, content_type, body | {"prompt": "q"}, **h.auth(**{"Idempotency-Key": key})
            )
            assert other.status_code == 409 and error(other)["param"] == "Idempotency-Key"

    run(scenario)


def test_the_store_or_broker_down_is_the_routes_503() -> None:
    async def scenario(h: Harness) -> None:
        h.store.close()
        h.store._engine.dispose()  # in-memory SQLite: the tables are gone
        body = {"model": "m", "prompt": "p", "max_tokens": 4}
        fast = await post(h, "application/json", body, **h.auth())
        route = await post(h, ROUTE, body, **h.auth())
        assert fast.status_code == route.status_code == 503
        assert error(fast)["code"] == error(route)["code"] == "store_unavailable"

    run(scenario)


def same_answer(response: httpx.Response) -> dict[str, Any]:
    """What must not depend on the path taken: the body (ids and times aside), the headers."""
    body = response.json()
    if "id" in body:
        body = body | {"id": "?", "submitted_at": 0, "deadline_at": 0}
    headers = {
        k: v
        for k, v in response.headers.items()
        if k not in ("content-length", "location", "date", "server")
    }
    return {"body": body, "headers": headers, "location": "location" in response.headers}
