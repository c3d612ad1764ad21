"""What the API refuses at its edge, and how: ids in paths that no request can have, SLOs no
queue can plan for, bodies that cannot be read, and every other error in the one shape with a
code. In process (httpx over ASGI), on the harness of ``tests.unit.test_api``."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from qlm.api.schemas import MAX_API_SLO_S
from qlm.domain import MIN_SLO_S
from qlm.store import Store, StoreError
from tests.unit.test_api import Harness, error, published, run


def refuse_nul_like_postgresql(store: Store) -> list[str]:
    """Make ``store`` answer a text argument holding NUL as PostgreSQL does (a ``StoreError``:
    text cannot hold it), and return the names of the store methods called with one."""
    asked: list[str] = []

    def wrap(name: str) -> None:
        method = getattr(store, name)

        @functools.wraps(method)
        def refusing(*args: Any, **kwargs: Any) -> Any:
            if any(isinstance(a, str) and "\x00" in a for a in (*args, *kwargs.values())):
                asked.append(name)
                raise StoreError(f"cannot {name}: PostgreSQL text cannot contain NUL (0x00)")
            return method(*args, **kwargs)

        setattr(store, name, refusing)

    for name in ("get", "cancel", "set_instance_state", "instances"):
        wrap(name)
    return asked


PATHS_WITH_IDS = [
    ("GET", "/v1/requests/{}", "request_id"),
    ("GET", "/v1/requests/{}/events", "request_id"),
    ("DELETE", "/v1/requests/{}", "request_id"),
    ("POST", "/v1/admin/instances/{}/drain", "name"),
    ("POST", "/v1/admin/instances/{}/undrain", "name"),
    ("GET", "/v1/models/{}", "model"),
]


@pytest.mark.parametrize(("method", "path", "param"), PATHS_WITH_IDS)
@pytest.mark.parametrize("bad", ["req_%00x", "%00", "a%1fb", "x" * 257])
def test_an_id_no_request_can_have_is_refused_before_the_store_sees_it(
    method: str, path: str, param: str, bad: str
) -> None:
    async def scenario(h: Harness) -> None:
        asked = refuse_nul_like_postgresql(h.store)
        r = await h.client.request(method, path.format(bad), headers=h.auth("admin"))
        assert r.status_code == 422, r.text
        err = error(r)
        assert (err["param"], err["code"]) == (param, "invalid_id"), err
        assert f"{param} is not a valid id" in err["message"]
        assert asked == []

    run(scenario)


@pytest.mark.parametrize(("method", "path", "param"), PATHS_WITH_IDS)
def test_a_well_formed_unknown_id_is_404_naming_it(method: str, path: str, param: str) -> None:
    async def scenario(h: Harness) -> None:
        r = await h.client.request(
            method, path.format("req_0123 unknown é"), headers=h.auth("admin")
        )
        assert r.status_code == 404, r.text
        assert error(r)["code"] is not None

    run(scenario)


# --- SLOs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"slo_seconds": 1e-300}, "slo_seconds"),
        ({"slo_seconds": MIN_SLO_S / 2}, "slo_seconds"),
        ({"slo_seconds": 0}, "slo_seconds"),
        ({"slo_seconds": 10.0, "ttft_slo_seconds": 1e-300}, "ttft_slo_seconds"),
        ({"slo_seconds": 1e9}, "slo_seconds"),
        ({"ttft_slo_seconds": 1e9}, "ttft_slo_seconds"),
    ],
)
def test_an_slo_outside_the_documented_range_is_refused_naming_it(
    body: dict[str, Any], param: str
) -> None:
    async def scenario(h: Harness) -> None:
        r = await h.submit(**body)
        assert r.status_code == 422, r.text
        assert error(r)["param"] == param
        assert published(h.queue) == []

    run(scenario)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_an_slo_that_is_not_a_finite_number_is_refused(literal: str) -> None:
    async def scenario(h: Harness) -> None:
        for field in ("slo_seconds", "ttft_slo_seconds"):
            body = f'{{"model": "m", "prompt": "x", "max_tokens": 1, "{field}": {literal}}}'
            r = await h.client.post(
                "/v1/requests",
                content=body.encode(),
                headers=h.auth(**{"content-type": "application/json"}),
            )
            assert r.status_code == 422, r.text
            assert error(r)["param"] == field
        assert published(h.queue) == []

    run(scenario)


def test_the_shortest_and_longest_slos_are_accepted() -> None:
    async def scenario(h: Harness) -> None:
        r = await h.submit(slo_seconds=MIN_SLO_S, ttft_slo_seconds=MIN_SLO_S)
        assert r.status_code == 202, r.text
        r = await h.submit(slo_seconds=MAX_API_SLO_S, ttft_slo_seconds=MAX_API_SLO_S)
        assert r.status_code == 202, r.text

    run(scenario)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-qlm-slo-seconds", "1e-300"),
        ("x-qlm-slo-seconds", "0.001"),
        ("x-qlm-slo-seconds", "nan"),
        ("x-qlm-slo-seconds", "inf"),
        ("x-qlm-slo-seconds", "1e9"),
        ("x-qlm-ttft-slo-seconds", "1e-300"),
        ("x-qlm-ttft-slo-seconds", "nan"),
        ("x-llm-d-slo-ttft-ms", "1e-300"),
        ("x-llm-d-slo-ttft-ms", "5"),
        ("x-llm-d-slo-ttft-ms", "nan"),
    ],
)
def test_openai_slo_headers_outside_the_range_are_refused_naming_them(
    path: str, header: str, value: str
) -> None:
    async def scenario(h: Harness) -> None:
        body: dict[str, Any] = {"model": "m", "max_tokens": 1}
        if path == "/v1/completions":
            body["prompt"] = "x"
        else:
            body["messages"] = [{"role": "user", "content": "x"}]
        r = await h.client.post(path, json=body, headers=h.auth(**{header: value}))
        assert r.status_code == 422, r.text
        assert error(r)["param"] == header
        assert published(h.queue) == []

    run(scenario, wait_timeout_s=1.0)


@pytest.mark.parametrize("field", ["slo_seconds", "ttft_slo_seconds"])
def test_openai_slo_body_fields_below_the_minimum_are_refused(field: str) -> None:
    async def scenario(h: Harness) -> None:
        body = {"model": "m", "prompt": "x", "max_tokens": 1, field: 1e-300}
        r = await h.client.post("/v1/completions", json=body, headers=h.auth())
        assert r.status_code == 422, r.text
        assert error(r)["param"] == field

    run(scenario, wait_timeout_s=1.0)


# --- Idempotency-Key ----------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["application/json", "application/merge-patch+json"])
def test_an_idempotency_key_may_be_any_printable_ascii_spaces_included(content_type: str) -> None:
    """Both the fast path (application/json) and the route (another JSON type) take it."""

    async def scenario(h: Harness) -> None:
        body = b'{"model": "m", "prompt": "p", "max_tokens": 4}'
        for key in ("order 42 of 2026", "".join(chr(c) for c in range(0x21, 0x7F)), "a" * 255):
            headers = h.auth(**{"Idempotency-Key": key, "Content-Type": content_type})
            first = await h.client.post("/v1/requests", content=body, headers=headers)
            assert first.status_code == 202, first.text
            again = await h.client.post("/v1/requests", content=body, headers=headers)
            assert again.status_code == 202 and again.json()["replayed"] is True
            assert again.json()["id"] == first.json()["id"]
        row = h.store.get(first.json()["id"])
        assert row is not None

    run(scenario)


@pytest.mark.parametrize("key", ["tab\there", "a" * 256])
def test_an_idempotency_key_outside_printable_ascii_is_refused_naming_it(key: str) -> None:
    async def scenario(h: Harness) -> None:
        r = await h.submit(headers={"Idempotency-Key": key})
        assert r.status_code == 422, r.text
        assert error(r)["param"] == "Idempotency-Key"

    run(scenario)
