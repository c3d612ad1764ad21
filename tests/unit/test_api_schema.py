"""Schemathesis against the API's own OpenAPI schema: generated calls to every operation, with an
admin key, against uvicorn (in a thread) over an in-memory queue, SQLite and a controller service
with simulated instances. No answer may be a 5xx, and every answer must match the schema
(status code, content type, headers, body)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

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
from tests.unit.test_controller_service import make_service

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
        api = ApiSettings(
            max_tokens_limit=64,
            max_prompt_tokens=2000,
            wait_timeout_s=2.0,
            max_long_poll_s=0.5,
            rate_per_s=10_000,
            rate_burst=10_000,
            poll_interval_s=0.05,
        )
        app = create_app(
            Settings(api=api),
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


# The schema as the app serves it (``/openapi.json``); loaded at collection time to parametrize by
# operation. Schemathesis' own pytest plugin (``from_fixture``) does not run on pytest 9.
SCHEMA = schemathesis.openapi.from_dict(create_app(Settings()).openapi())
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]
"""Not ``positive_data_acceptance``: limits that are settings (``max_tokens``, labels, prompt
size) and rules across fields (``prompt`` or ``messages``) are not in the schema, so a schema-valid
body may rightly get a 422 that names them."""
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
