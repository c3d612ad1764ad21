"""Schemathesis against the API's own OpenAPI schema: generated calls to every operation, with an
admin key, against uvicorn (in a thread) over an in-memory queue, SQLite and a controller service
with simulated instances. No answer may be a 5xx, every answer must match the schema (status
code, content type, headers, body), what the schema refuses must be refused and what it admits
accepted (but for the few rules across fields that JSON Schema cannot state, ``CROSS_FIELD``), and
a method a path does not serve is a 405 whose ``Allow`` names the path's methods."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode, checks

from qlm.api import create_app
from qlm.api.server import ApiServer
from qlm.global_queue import MemoryBroker, MemoryGlobalQueue
from qlm.settings import ApiSettings, Settings
from qlm.store import Store
from tests.unit.api.test_api import Harness, run
from tests.unit.service.test_controller_service import make_service

pytestmark = pytest.mark.timeout(240)


class ServedApi:
    """The app and a controller on their own event loop in a thread, for a synchronous client."""

    def __init__(self) -> None:
        self.url = ""
        self.key = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="qlm-api-under-test", daemon=True)

    def __enter__(self) -> ServedApi:
        self._thread.start()
        if not self._ready.wait(60) or self._error is not None:
            raise RuntimeError(f"the API did not start: {self._error!r}")
        return self

    def __exit__(self, *_exc: Any) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        store = Store.open("sqlite://")
        broker = MemoryBroker()
        service = make_service(store, broker, policy="edf")
        await service.start()
        self.key = store.create_api_key("ops", admin=True)
        app = create_app(
            Settings(api=API),
            queue=MemoryGlobalQueue(broker=broker),
            store=store,
            controller=service,
            clock=service.runtime.clock.now,
        )
        server = ApiServer(app, host="127.0.0.1", port=0, log_level="warning")
        await server.start()
        self.url = server.url
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await server.stop()
            await service.stop()
            store.close()


@pytest.fixture(scope="module")
def served() -> Iterator[ServedApi]:
    with ServedApi() as api:
        yield api


API = ApiSettings(
    max_tokens_limit=64,
    default_max_tokens=16,
    max_labels=4,
    wait_timeout_s=2.0,
    max_long_poll_s=0.5,
    rate_per_s=10_000,
    rate_burst=10_000,
    poll_interval_s=0.05,
)
"""The served app's settings. Its limits that are settings (``max_tokens``, labels, prompt size)
are in its schema (``qlm.api.schemas.common.with_limits``)."""

# The schema as the app serves it (``/openapi.json``); loaded at collection time to parametrize by
# operation. Schemathesis' own pytest plugin (``from_fixture``) does not run on pytest 9.
SCHEMA = schemathesis.openapi.from_dict(create_app(Settings(api=API)).openapi())
# Unknown query parameters are ignored, as most HTTP APIs do (unknown body fields are refused);
# the key is the test's admin key (auth errors have tests of their own).
SCHEMA.config.generation.update(allow_extra_parameters=False, with_security_parameters=False)
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]

CROSS_FIELD = {
    "ttft_after_deadline": "a TTFT SLO above the end-to-end one, given or the tier's default",
    "tool_choice_not_offered": "a named tool_choice names one of the tools",
    "duplicate_function_name": "no two tools have one name",
    "invalid_schema": "a JSON Schema QLM can use (response_format, a tool's parameters)",
    "invalid_cursor": "a cursor the API handed out (it is opaque)",
    "max_prompt_tokens": "chat messages and tools, counted together",
    "empty_span": "an attainment series' until after its since",
    "too_many_buckets": "at most so many buckets of step seconds between since and until",
}
"""The 422s (by code) that a schema-valid call may get: rules across fields, or about values,
that JSON Schema cannot state. Every other rule is in the schema."""


def positive_data_acceptance(ctx: Any, response: Any, case: Any) -> bool | None:
    """Schemathesis' ``positive_data_acceptance`` (ST202), but for the ``CROSS_FIELD`` 422s."""
    if response.status_code == 422:
        code = (response.json().get("error") or {}).get("code")
        if code in CROSS_FIELD:
            return None
    result: bool | None = checks.positive_data_acceptance(ctx, response, case)
    return result


CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
    positive_data_acceptance,
    checks.missing_required_header,
]
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op.label)
def test_every_answer_matches_the_schema_and_none_is_a_server_error(
    operation: Any, mode: GenerationMode, served: ServedApi
) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=15,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any) -> None:
        case.call_and_validate(
            base_url=served.url,
            headers={"Authorization": f"Bearer {served.key}"},
            timeout=30,
            checks=CHECKS,
        )

    try:
        check()
    except Unsatisfiable:
        pytest.skip(f"{operation.label} has no input that can be made invalid")


PATHS = sorted(SCHEMA.raw_schema["paths"])
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
SAMPLE = {"request_id": "req_0", "name": "i0", "model": "m", "group_id": "g0"}
"""A value for each path parameter: a method a path does not serve is refused before it."""


@pytest.mark.parametrize("path", PATHS)
def test_a_method_a_path_does_not_serve_is_405_allowing_the_documented_ones(
    path: str, served: ServedApi
) -> None:
    """Schemathesis' ``unsupported_method`` (ST204) and ``allow_header_conformance`` (ST205):
    its generated calls only use the documented methods, so each other method is sent here."""
    declared = {m.upper() for m in SCHEMA.raw_schema["paths"][path]} & set(METHODS)
    operation = next(op for op in OPERATIONS if op.path == path)
    parameters = {p: SAMPLE[p] for p in SAMPLE if "{" + p + "}" in path}
    for method in sorted(set(METHODS) - declared):
        case = operation.Case(method=method, path_parameters=parameters)
        response = case.call(
            base_url=served.url, headers={"Authorization": f"Bearer {served.key}"}, timeout=30
        )
        assert response.status_code == 405, (method, path, response.text)
        allow = ", ".join(response.headers["allow"])  # (a list per header, here)
        assert set(allow.split(", ")) == declared, (method, path, allow)
        assert response.json()["error"]["code"] == "method_not_allowed"
        case.validate_response(response, checks=[checks.allow_header_conformance])


def _validator(component: str) -> Any:
    """A validator of the served schema's ``component`` (its refs resolved in the document)."""
    document = create_app(Settings(api=API)).openapi()
    return jsonschema_rs.Draft202012Validator(
        {"$ref": f"#/components/schemas/{component}", "components": document["components"]}
    )


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
USER = {"role": "user", "content": "hi"}
NATIVE = {"model": "m", "max_tokens": 4}
CHAT = {"model": "m", "max_tokens": 4, "messages": [USER]}
COMPLETION = {"model": "m", "max_tokens": 4, "prompt": "hi"}


@pytest.mark.parametrize(
    ("path", "component", "body", "admitted"),
    [
        ("/v1/requests", "SubmitIn", NATIVE | {"prompt": "hi"}, True),
        ("/v1/requests", "SubmitIn", NATIVE | {"messages": [USER], "prompt": None}, True),
        ("/v1/requests", "SubmitIn", NATIVE, False),
        ("/v1/requests", "SubmitIn", NATIVE | {"prompt": None}, False),
        ("/v1/requests", "SubmitIn", NATIVE | {"prompt": "hi", "messages": [USER]}, False),
        ("/v1/requests", "SubmitIn", NATIVE | {"prompt": "hi", "tools": [TOOL]}, False),
        ("/v1/requests", "SubmitIn", NATIVE | {"prompt": "hi", "tools": []}, True),
        ("/v1/requests", "SubmitIn", NATIVE | {"prompt": "hi", "max_tokens": 65}, False),
        ("/v1/requests", "SubmitIn", NATIVE | {"prompt": "a\u0000b"}, False),
        ("/v1/requests", "SubmitIn", NATIVE | {"prompt": "hi", "labels": {"a\u0000": "b"}}, False),
        ("/v1/requests", "SubmitIn", NATIVE | {"prompt": "hi", "labels": {str(i): "v" for i in range(5)}}, False),
        ("/v1/requests", "SubmitIn", NATIVE | {"prompt": "hi", "stop": ["a"] * 5}, False),
        ("/v1/requests", "SubmitIn", NATIVE | {"prompt": "hi", "stop": ["a"] * 4}, True),
        ("/v1/requests", "SubmitIn", NATIVE | {"prompt": "hi", "response_format": {"type": "json_schema"}}, False),
        ("/v1/requests", "SubmitIn", NATIVE | {"prompt": "hi", "response_format": {"type": "text", "json_schema": {"name": "n"}}}, False),
        ("/v1/requests", "SubmitIn", NATIVE | {"prompt": "hi", "response_format": {"type": "json_object"}}, True),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT, True),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"messages": [{"role": "tool", "content": "42"}]}, False),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}, True),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"messages": [USER | {"tool_call_id": "c1"}]}, False),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"messages": [USER | {"tool_calls": [CALL]}]}, False),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"messages": [{"role": "user"}]}, False),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"messages": [{"role": "assistant"}]}, False),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"messages": [{"role": "assistant", "tool_calls": []}]}, False),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"messages": [USER, {"role": "assistant", "tool_calls": [CALL]}]}, True),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"tool_choice": "auto"}, False),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"tool_choice": "none"}, True),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"tool_choice": "required", "tools": [TOOL]}, True),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"logprobs": True}, False),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"functions": []}, False),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"seed": -9223372036854775999}, False),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"seed": -(2**63) + 1024}, True),
        ("/v1/chat/completions", "ChatCompletionIn", CHAT | {"seed": 2**63 - 1024}, True),
        ("/v1/completions", "CompletionIn", COMPLETION, True),
        ("/v1/completions", "CompletionIn", COMPLETION | {"prompt": ""}, False),
        ("/v1/completions", "CompletionIn", COMPLETION | {"prompt": [""]}, False),
        ("/v1/completions", "CompletionIn", COMPLETION | {"prompt": []}, False),
        ("/v1/completions", "CompletionIn", COMPLETION | {"prompt": ["a", "b"]}, False),
        ("/v1/completions", "CompletionIn", COMPLETION | {"prompt": ["a"]}, True),
        ("/v1/completions", "CompletionIn", COMPLETION | {"n": 2}, False),
        ("/v1/completions", "CompletionIn", COMPLETION | {"n": 1, "best_of": 1, "echo": False}, True),
        ("/v1/completions", "CompletionIn", COMPLETION | {"echo": True}, False),
        ("/v1/completions", "CompletionIn", COMPLETION | {"logprobs": 0}, False),
        ("/v1/completions", "CompletionIn", COMPLETION | {"min_tokens": 3}, False),
        ("/v1/completions", "CompletionIn", COMPLETION | {"min_tokens": 0, "min_p": 0.0}, True),
        ("/v1/completions", "CompletionIn", COMPLETION | {"logit_bias": {"1": 2}}, False),
        ("/v1/completions", "CompletionIn", COMPLETION | {"modalities": ["text"]}, True),
        ("/v1/completions", "CompletionIn", COMPLETION | {"modalities": ["audio"]}, False),
        ("/v1/completions", "CompletionIn", COMPLETION | {"guided_json": {}}, False),
    ],
)  # fmt: skip
def test_the_schema_admits_a_body_exactly_when_the_api_does(
    path: str, component: str, body: dict[str, Any], admitted: bool
) -> None:
    assert _validator(component).is_valid(body) is admitted, body

    async def scenario(h: Harness) -> None:
        r = await h.client.post(path, json=body, headers=h.auth())
        assert (r.status_code != 422) is admitted, r.text

    run(scenario, **API.model_dump() | {"wait_timeout_s": 0.01})


@pytest.mark.parametrize(
    ("label", "admitted"), [("team=search", True), ("team=", True), ("team", False), ("=x", False)]
)
def test_the_schema_admits_a_label_filter_exactly_when_the_api_does(
    label: str, admitted: bool
) -> None:
    [parameter] = [
        p
        for p in SCHEMA.raw_schema["paths"]["/v1/requests"]["get"]["parameters"]
        if p["name"] == "label"
    ]
    assert jsonschema_rs.Draft202012Validator(parameter["schema"]).is_valid(label) is admitted

    async def scenario(h: Harness) -> None:
        r = await h.client.get("/v1/requests", params={"label": label}, headers=h.auth())
        assert (r.status_code != 422) is admitted, r.text

    run(scenario)
