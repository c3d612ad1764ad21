"""What the API refuses at its edge, and how: ids in paths that no request can have, SLOs no
queue can plan for, bodies that cannot be read, and every other error in the one shape with a
code. In process (httpx over ASGI), on the harness of ``tests.unit.api.test_api``."""

from __future__ import annotations

import functools
import json
from typing import Any

import httpx
import pytest

from qlm.api import create_app
from qlm.api.deps import get_principal
from qlm.domain import MAX_API_SLO_S, MIN_SLO_S
from qlm.settings import Settings
from qlm.store import Store, StoreError
from tests.unit.api.test_api import Harness, error, published, run


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


# --- every error in one shape ----------------------------------------------------------------------

SUBMIT = b'{"model": "m", "prompt": "x", "max_tokens": 1}'
CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}'
JSON = {"content-type": "application/json"}


def nested(levels: int) -> bytes:
    """A chat submission whose body nests ``levels`` deep: a tool's parameters (depth 5) with
    a ``default`` of nested arrays."""
    default = "[" * (levels - 5) + "]" * (levels - 5)
    tool = (
        '{"type": "function", "function": {"name": "f", "parameters": '
        f'{{"type": "object", "default": {default}}}}}}}'
    )
    return (
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, '
        b'"tools": [' + tool.encode() + b"]}"
    )


def shaped(response: Any) -> dict[str, Any]:
    """The error of ``response``, checked to have the one shape, a code and a message."""
    body = response.json()
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and err["type"] and err["code"], err
    return err


@pytest.mark.parametrize(
    ("method", "path", "content", "headers", "answer"),
    [
        ("GET", "/v1/nothing", b"", {}, (404, "unknown_endpoint", None)),
        ("POST", "/v1/requests/x/events", b"", {}, (405, "method_not_allowed", None)),
        ("PUT", "/v1/requests", SUBMIT, JSON, (405, "method_not_allowed", None)),
        ("POST", "/v1/requests", SUBMIT, {"content-type": "text/plain"}, (415, "unsupported_media_type", "Content-Type")),
        ("POST", "/v1/requests", SUBMIT, {}, (415, "unsupported_media_type", "Content-Type")),
        ("POST", "/v1/completions", SUBMIT, {"content-type": "application/x-www-form-urlencoded"}, (415, "unsupported_media_type", "Content-Type")),
        ("POST", "/v1/chat/completions", CHAT, {"content-type": "text/plain"}, (415, "unsupported_media_type", "Content-Type")),
        ("POST", "/v1/requests", b"{nope", JSON, (422, "json_invalid", "body")),
        ("POST", "/v1/requests", b'{"model": "m\xff", "prompt": "x", "max_tokens": 1}', JSON, (422, "body_not_utf8", "body")),
        ("POST", "/v1/completions", b'{"model": "\xc3\x28"}', JSON, (422, "body_not_utf8", "body")),
        ("POST", "/v1/chat/completions", b"\xff\xfe\xfd", JSON, (422, "body_not_utf8", "body")),
        ("POST", "/v1/requests", b"[" * 1500 + b"]" * 1500, JSON, (422, "json_too_deep", "body")),
        ("POST", "/v1/requests", nested(65), JSON, (422, "json_too_deep", "body")),
        ("POST", "/v1/requests", nested(900), JSON, (422, "json_too_deep", "body")),
        ("POST", "/v1/chat/completions", nested(65), JSON, (422, "json_too_deep", "body")),
        ("POST", "/v1/chat/completions", b"[" * 1500 + b"]" * 1500, JSON, (422, "json_too_deep", "body")),
        ("POST", "/v1/requests", b"", JSON, (422, "missing", "body")),
        ("POST", "/v1/requests", SUBMIT.replace(b"x", b"x" * 5000), JSON, (413, "max_body_bytes", "body")),
        ("GET", "/v1/requests", b"", {"Authorization": ""}, (401, "missing_api_key", "Authorization")),
        ("GET", "/v1/requests", b"", {"Authorization": "Bearer qlm_nope"}, (401, "invalid_api_key", "Authorization")),
        ("POST", "/v1/requests", SUBMIT, {**JSON, "Authorization": "Basic dTpw"}, (401, "missing_api_key", "Authorization")),
        ("GET", "/v1/admin/queues", b"", {}, (403, "admin_required", "Authorization")),
        ("GET", "/v1/requests/req_nope", b"", {}, (404, "request_not_found", "request_id")),
        ("GET", "/v1/requests", b"", {}, (200, None, None)),
    ],
)  # fmt: skip
def test_every_error_has_the_one_shape_with_a_code(
    method: str,
    path: str,
    content: bytes,
    headers: dict[str, str],
    answer: tuple[int, str | None, str | None],
) -> None:
    async def scenario(h: Harness) -> None:
        r = await h.client.request(method, path, content=content, headers=h.auth() | headers)
        assert r.status_code == answer[0], r.text
        if answer[0] >= 400:
            err = shaped(r)
            assert (err["code"], err["param"]) == answer[1:], err
        assert published(h.queue) == []

    run(scenario, max_body_bytes=4096)


def test_a_body_nested_as_deep_as_the_limit_is_accepted() -> None:
    async def scenario(h: Harness) -> None:
        r = await h.client.post("/v1/requests", content=nested(64), headers=h.auth(**JSON))
        assert r.status_code == 202, r.text

    run(scenario)


def test_a_405_allows_every_method_of_the_path() -> None:
    async def scenario(h: Harness) -> None:
        for method, path, allow in [
            ("OPTIONS", "/v1/requests/req_x", "DELETE, GET"),
            ("PUT", "/v1/requests/req_x", "DELETE, GET"),
            ("PATCH", "/v1/requests", "GET, POST"),
            ("GET", "/v1/admin/instances/i0/drain", "POST"),
        ]:
            r = await h.client.request(method, path, headers=h.auth())
            assert r.status_code == 405, r.text
            assert r.headers["allow"] == allow, (method, path)
            assert method in shaped(r)["message"] and allow in shaped(r)["message"]

    run(scenario)


async def raw_call(h: Harness, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> Any:
    """Call the app with headers httpx would not send (an invalid Content-Length)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "server": ("qlm", 80),
        "client": ("127.0.0.1", 1),
    }
    await h.app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body)


def test_an_invalid_content_length_is_400_naming_it() -> None:
    async def scenario(h: Harness) -> None:
        key = h.auth()["Authorization"].encode()
        for value in (b"-1", b"lots"):
            status, body = await raw_call(
                h,
                "POST",
                "/v1/requests",
                [(b"authorization", key), (b"content-length", value), (b"content-type", b"application/json")],
            )  # fmt: skip
            assert status == 400
            assert body["error"]["code"] == "invalid_content_length"
            assert body["error"]["param"] == "Content-Length"

    run(scenario)


def test_an_unexpected_failure_is_a_500_with_the_shape() -> None:
    async def scenario(h: Harness) -> None:
        def broken() -> None:
            raise RuntimeError("a bug")

        h.app.dependency_overrides[get_principal] = broken
        transport = httpx.ASGITransport(app=h.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://qlm") as client:
            r = await client.get("/v1/requests", headers=h.auth())
        assert r.status_code == 500
        err = shaped(r)
        assert err["code"] == "internal_error" and "a bug" not in err["message"]

    run(scenario)


def test_not_ready_carries_the_error_with_a_code_beside_the_checks() -> None:
    async def scenario(h: Harness) -> None:
        r = await h.client.get("/readyz")  # no controller published its state
        assert r.status_code == 503
        body = r.json()
        assert body["checks"]["controller"]["ok"] is False
        assert body["error"]["code"] == "not_ready" and "controller" in body["error"]["message"]

    run(scenario)


def test_the_schema_says_every_error_has_a_code() -> None:
    schema = create_app(Settings()).openapi()
    detail = schema["components"]["schemas"]["ErrorDetail"]
    assert "code" in detail["required"] and detail["properties"]["code"]["type"] == "string"


# --- free-form JSON the store keeps as it is ------------------------------------------------------

SCHEMA_WITH = {"type": "object", "properties": {"a": {"type": "string"}}}


@pytest.mark.parametrize(
    ("extra", "param", "pointer"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA_WITH | {"description": "a\u0000b"}}}},
            "response_format.json_schema.schema",
            "/description",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA_WITH | {"properties": {"a\u0000": {"type": "string"}}}}}},
            "response_format.json_schema.schema",
            "/properties/a\u0000",
        ),
        (
            {"prompt": None, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA_WITH | {"default": {"k": ["\u0000"]}}}}]},
            "tools[0].function.parameters",
            "/default/k/0",
        ),
    ],
)  # fmt: skip
def test_a_json_schema_holding_nul_is_refused_naming_where(
    extra: dict[str, Any], param: str, pointer: str
) -> None:
    """PostgreSQL cannot keep NUL in JSON either: such a request was a 503 store_unavailable."""

    async def scenario(h: Harness) -> None:
        r = await h.submit(**extra)
        assert r.status_code == 422, r.text
        err = error(r)
        assert (err["param"], err["code"]) == (param, "invalid_schema"), err
        assert err["message"].startswith(f"{param}: {pointer}: ")
        assert published(h.queue) == []

    run(scenario)
