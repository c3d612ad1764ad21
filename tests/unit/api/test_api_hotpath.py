"""``POST /v1/requests`` served by the fast path (``qlm.api.hotpath``): what it serves itself is
answered exactly as the FastAPI route answers it, and everything else reaches the route."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from qlm.api import hotpath
from qlm.api.app import Api, create_app
from qlm.api.deps import get_principal
from qlm.api.errors import ApiError
from qlm.settings import Settings
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


def test_the_front_door_serves_submissions_before_fastapis_middlewares() -> None:
    """In front of the stack (FastAPI's telemetry off), a submission reaches no middleware of
    FastAPI's: the stack's own fast path never sees it. Bodies without a declared size and
    other calls still take the whole stack."""

    async def scenario(h: Harness) -> None:
        assert isinstance(h.app, Api) and h.app.front_door is not None
        seen: list[str] = []
        stack = h.app.build_middleware_stack()
        h.app.middleware_stack = counting(stack, seen)
        body = {"model": "m", "prompt": "p", "max_tokens": 4}
        assert (await post(h, "application/json", body, **h.auth())).status_code == 202
        assert seen == []
        assert (await post(h, ROUTE, body, **h.auth())).status_code == 202
        assert (await h.client.get("/v1/requests", headers=h.auth())).status_code == 200

        async def chunks() -> Any:  # no Content-Length: BodyLimit counts it in the stack
            yield httpx.Request("POST", "/", json=body).content

        r = await h.client.post(
            "/v1/requests",
            content=chunks(),
            headers={"Content-Type": "application/json"} | h.auth(),
        )
        assert r.status_code == 202
        assert seen == ["/v1/requests", "/v1/requests", "/v1/requests"]

    run(scenario)


def test_an_unexpected_failure_in_the_front_door_is_the_stacks_500(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario(h: Harness) -> None:
        async def broken(*_: Any) -> None:
            raise RuntimeError("a bug")

        monkeypatch.setattr(hotpath, "submit", broken)
        transport = httpx.ASGITransport(app=h.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://qlm") as client:
            body = {"model": "m", "prompt": "p", "max_tokens": 4}
            r = await client.post("/v1/requests", json=body, headers=h.auth())
        assert r.status_code == 500
        err = error(r)
        assert err["code"] == "internal_error" and "a bug" not in err["message"]

    run(scenario)


def test_with_fastapis_telemetry_on_every_call_takes_the_whole_stack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = create_app(Settings())
    assert isinstance(app, Api)
    monkeypatch.setattr(app._native_telemetry, "enabled", lambda: True)
    app.open_front_door(1000)
    assert app.front_door is None
    monkeypatch.setattr(app._native_telemetry, "enabled", lambda: False)
    app.open_front_door(1000)
    assert app.front_door is not None
    app.close_front_door()
    assert app.front_door is None


def counting(app: ASGIApp, seen: list[str]) -> ASGIApp:
    """``app``, noting the path of each HTTP call that reaches it."""

    async def counted(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            seen.append(scope["path"])
        await app(scope, receive, send)

    return counted


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


@pytest.mark.parametrize(
    "values",
    [
        (
            "req_0123456789abcdef01234567",
            "queued",
            "llama-3-8b",
            1764278400.123456,
            1764278430.1,
            False,
            False,
        ),
        ("req_1", "running", 'mödel ☃ "q" \\ \n', 0.0, 1e-7, True, True),
        ("req_2", "succeeded", "m", 1.5e300, 2.0, False, True),
        ("req_3", "queued", "m", 1764278400, 1764278430, True, False),  # ints: the encoder's way
        ("req_4", "queued", "m", 1.0, float("inf"), False, False),  # not finite: the encoder's way
    ],
)
def test_the_202_body_is_the_compact_encoders(values: tuple[Any, ...]) -> None:
    from qlm.api.routes.requests import _COMPACT, submitted_body

    names = ("id", "status", "model", "submitted_at", "deadline_at", "at_risk", "replayed")
    out = dict(zip(names, values, strict=True))
    out = {"id": out.pop("id"), "object": "request", **out}
    assert submitted_body(*values) == _COMPACT.encode(out).encode()


_PARSED = [
    b'{"model":"m","prompt":"x","max_tokens":1.0,"temperature":"0.5","slo_seconds":1E1}',
    b'{"model":"m","prompt":"x","max_tokens":"12","temperature":-0,"seed":true}',
    b' {"model":"m","prompt":"\\u00e9 \\ud83d\\ude00 \\u2028 \xe2\x98\x83","tier":"batch"}\n',
    b'{"model":"a","model":"m","prompt":"x","labels":{"b":"1","a":"2","b":"3"}}',
    b'{"model":"m","prompt":"x","temperature":0.1000000000000000055511151231257827}',
    b'{"model":"m","prompt":"x","stop":["a","b"],"ttft_slo_seconds":1}',
    b'{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function",'
    b'"function":{"name":"f","parameters":{"type":"object","z":1,"y":[1.5e-320,1e308,'
    b'12345678901234567890123,{"q":1,"q":2}]}}}],"tool_choice":"auto"}',
    b'{"model":"m","prompt":"x","response_format":{"type":"json_schema","json_schema":'
    b'{"name":"n","schema":{"b":1,"a":2.50,"b":3,"c":{"z":[true,null,"\\"\\\\\\/"]}}}}}',
    b'{"model":"m","prompt":"x","response_format":{"type":"json_schema","json_schema":'
    b'{"name":"n","schema":{"big":1e400}}}}',
]
_REFUSED = [
    b'{"model":"m","prompt":"a\x01b"}',  # a raw control character
    b'{"model":"m","prompt":"a\\qb"}',  # an unknown escape
    b'{"model":"m","prompt":"a\\ud800b"}',  # a lone surrogate
    b'{"model":"m","prompt":"x","max_tokens":01}',
    b'{"model":"m","prompt":"x",}',
    b'{"model":"m","prompt":"x"} x',
    b'{"model":"m","prompt":"\xff"}',
    b'{"model":"m","prompt":"x","temperature":NaN}',
    b'{"model":"m","prompt":"x","max_tokens":128.5}',
    b'{"model":"m","prompt":"x","seed":1.5}',
    b'\xef\xbb\xbf{"model":"m","prompt":"x"}',  # json.loads takes these two; the route answers
    '{"model":"m","prompt":"x"}'.encode("utf-16"),
    b"[" * 40 + b"]" * 40,
]


@pytest.mark.parametrize("body", _PARSED + _REFUSED)
def test_the_fast_path_reads_a_body_as_json_loads_then_submitin(body: bytes) -> None:
    """The fast path parses and validates in one pass; what it accepts is what ``json.loads``
    and ``SubmitIn`` (the route's way) make of the body, value for value, key order included."""
    import json

    from qlm.api.schemas.native import SubmitIn

    try:
        expected: SubmitIn | None = SubmitIn.model_validate(json.loads(body))
    except Exception:
        expected = None
    parsed = hotpath._parse(b"application/json", body, [])
    if parsed is None:
        assert body in _REFUSED
        return
    assert body in _PARSED
    assert expected is not None, "the fast path took a body the route refuses"
    got = parsed[0]
    assert type(got) is type(expected)
    assert repr(got.model_dump()) == repr(expected.model_dump())
    assert json.dumps(got.model_dump()) == json.dumps(expected.model_dump())


_SAMPLING = [
    {},
    {"temperature": 0.7},
    {"temperature": 1, "top_p": 0.5, "top_k": -1, "seed": 2**63 - 1, "presence_penalty": -0.0},
    {"seed": True, "frequency_penalty": 2, "repetition_penalty": 1.5e-300},
    {"stop": "END"},
    {"stop": ["a", "b"], "temperature": 0},
    {"response_format": {"type": "text"}, "temperature": 0.1},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}}},
]


@pytest.mark.parametrize("given", _SAMPLING)
def test_sampling_is_what_model_dump_makes_of_it(given: dict[str, Any]) -> None:
    """The sampling parameters read off a body are ``model_dump``'s, value for value, types and
    key order included, for every body that has them."""
    import json

    from qlm.api.schemas.common import SamplingIn
    from qlm.api.schemas.native import SubmitIn
    from qlm.api.schemas.openai import ChatCompletionIn, CompletionIn

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for model, base in [
        (SubmitIn, {"prompt": "x"}),
        (SubmitIn, chat),
        (CompletionIn, {"prompt": "x"}),
        (ChatCompletionIn, chat),
    ]:
        body = model.model_validate_json(json.dumps({"model": "m", **base, **given}))
        got, expected = SamplingIn.sampling(body), body._dumped_sampling()
        assert repr(got) == repr(expected), model
        assert [type(v) for v in got.values()] == [type(v) for v in expected.values()]


def test_tier_names_are_tiers() -> None:
    from typing import get_args

    from qlm.api.schemas.common import TierName, tier_of
    from qlm.domain import Tier

    for name in get_args(TierName):
        assert tier_of(name) is Tier.parse(name)
