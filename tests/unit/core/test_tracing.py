"""OpenTelemetry tracing of a request's path (``qlm.tracing``), with OpenTelemetry's in-memory
exporter: a request submitted to the API and served by the controller is one trace — the API's
accept, then the controller's placement, the engine run and the completion as its children,
linked through the context the message carries. Without tracing nothing of OpenTelemetry is
imported and messages are as they were; asked for without the package, it fails in one line."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from services import in_ci

from qlm import tracing
from qlm.global_queue import MessageError, QueuedRequest
from tests.unit.service.test_api_service import run
from tests.unit.service.test_controller_service import eventually


def sdk() -> Any:
    """OpenTelemetry's SDK (the ``otel`` extra, part of ``dev``): skips without it locally,
    fails under CI=true."""
    try:
        from opentelemetry.sdk import trace as sdk_trace

        return sdk_trace
    except ImportError:
        message = "opentelemetry-sdk not installed (pip install -e '.[otel]')"
        if in_ci():
            pytest.fail(f"{message} (CI=true: tracing must be tested)")
        pytest.skip(message)


@pytest.fixture
def spans() -> Iterator[Any]:
    """Tracing on, into an in-memory exporter (returned); off again afterwards."""
    sdk_trace = sdk()
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    try:
        yield exporter
    finally:
        tracing.disable()
        provider.shutdown()


def test_a_served_request_is_one_trace_from_the_api_to_its_recorded_outcome(spans: Any) -> None:
    from opentelemetry.trace import SpanKind

    async def scenario(h: Any, _service: Any) -> None:
        r = await h.submit(max_tokens=8, slo_seconds=600, tier="interactive")
        assert r.status_code == 202, r.text
        rid = r.json()["id"]
        view = (
            await h.client.get(f"/v1/requests/{rid}", params={"wait": 60}, headers=h.auth())
        ).json()
        assert view["status"] == "finished", view

        def names() -> set[str]:
            return {s.name for s in spans.get_finished_spans()}

        await eventually(lambda: "qlm.request.complete" in names(), "the outcome's span ended")
        got = {s.name: s for s in spans.get_finished_spans()}
        accept = got["qlm.api.accept"]
        assert accept.kind is SpanKind.PRODUCER
        assert accept.attributes["qlm.request.id"] == rid
        assert accept.attributes["qlm.tenant"] == "acme"
        trace_id = accept.context.trace_id
        for name in ("qlm.controller.place", "qlm.engine.run", "qlm.request.complete"):
            span = got[name]
            assert span.context.trace_id == trace_id, name  # one trace
            assert span.parent is not None and span.parent.span_id == accept.context.span_id, name
            assert span.attributes["qlm.request.id"] == rid, name
        place, engine, done = (got[n] for n in ("qlm.controller.place", "qlm.engine.run", "qlm.request.complete"))  # fmt: skip
        assert (
            place.attributes["qlm.instance"]
            == view["instance"]
            == engine.attributes["qlm.instance"]
        )
        assert place.attributes["qlm.tier"] == 0 and place.attributes["qlm.model"] == "m"
        assert engine.kind is SpanKind.CLIENT and engine.attributes["qlm.run.outcome"] == "finished"
        assert done.attributes["qlm.request.status"] == "finished"
        assert done.attributes["qlm.slo_met"] is True
        # In order: accepted, placed, run, recorded.
        assert accept.start_time <= place.start_time <= place.end_time <= engine.start_time + 1
        assert engine.end_time <= done.end_time
        # Nothing left open: every span the controller started has ended.
        assert not _service._spans._runs and not _service._spans._outcomes

    run(scenario)


def test_a_message_without_a_context_starts_its_trace_at_the_controller(spans: Any) -> None:
    import asyncio

    from qlm.global_queue import MemoryBroker, MemoryGlobalQueue
    from qlm.store import Store
    from tests.unit.service.test_controller_service import make_service

    async def main() -> None:
        store = Store.open("sqlite://")
        broker = MemoryBroker()
        service = make_service(store, broker, policy="edf")
        await service.start()
        try:
            msg = QueuedRequest(id="replayed", model="m", prompt_tokens=10, max_tokens=4,
                                slo_e2e_s=600.0, submitted_at=service.runtime.clock.now())  # fmt: skip
            await MemoryGlobalQueue(broker=broker).publish(msg)
            await eventually(
                lambda: "qlm.request.complete" in {s.name for s in spans.get_finished_spans()},
                "the outcome's span ended",
            )
        finally:
            await service.stop()
            store.close()

    asyncio.run(main())
    got = {s.name: s for s in spans.get_finished_spans()}
    root = got["qlm.controller.accept"]
    assert root.parent is None
    for name in ("qlm.controller.place", "qlm.engine.run", "qlm.request.complete"):
        assert got[name].parent.span_id == root.context.span_id, name


def test_the_trace_context_travels_in_the_message_only_when_there_is_one() -> None:
    base = {"id": "r", "model": "m", "prompt_tokens": 1, "max_tokens": 1, "slo_e2e_s": 1.0,
            "submitted_at": 0.0}  # fmt: skip
    assert b'"trace"' not in QueuedRequest(**base).encode()
    parent = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    traced = QueuedRequest(**base, trace=parent)
    assert QueuedRequest.decode(traced.encode()).trace == parent
    with pytest.raises(MessageError, match=r"trace\.traceparent"):
        QueuedRequest(**base, trace={"traceparent": 1})  # type: ignore[dict-item]


def python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_untraced_qlm_imports_nothing_of_opentelemetry_and_runs_without_its_sdk() -> None:
    # The controller's process imports none of it (the API's has its API: FastAPI needs it).
    imported = python(
        "import sys, qlm.service, qlm.cli, qlm.tracing as t; t.end(t.start('x')); "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    assert imported == "[]"
    # Without the SDK (the otel extra): every module imports, and the calls do nothing.
    assert (
        python(
            "import sys; sys.modules['opentelemetry.sdk'] = None; "
            "import qlm.api, qlm.service, qlm.cli, qlm.tracing as t; "
            "s = t.start('x', attributes={'a': 1}); t.end(s); "
            "print(s is None and t.inject(s) == {} and not t.enabled())"
        )
        == "True"
    )


def test_tracing_asked_for_without_opentelemetry_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # as if not installed
    with pytest.raises(tracing.TracingError, match=r"qlm\[otel\]"):
        tracing.enable()
    assert not tracing.enabled()


def test_tracing_with_no_provider_and_no_sdk_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [m for m in sys.modules if m.startswith("opentelemetry.sdk")] + [
        "opentelemetry.sdk"
    ]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(tracing.TracingError, match=r"SDK: pip install 'qlm\[otel\]'"):
        tracing._sdk_provider()


def test_an_unknown_exporter_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sdk()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(tracing.TracingError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        tracing._sdk_provider()


@pytest.mark.parametrize(
    ("var", "value"),
    [("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"), ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")],
)
def test_an_otlp_protocol_other_than_http_protobuf_is_one_line_naming_the_variable(
    var: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sdk()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv(var, value)
    with pytest.raises(tracing.TracingError, match=f"{var}='{value}'"):
        tracing._sdk_provider()


def test_otlp_over_http_protobuf_is_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    sdk()
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
    except ImportError:
        message = "the OTLP exporter is not installed (pip install -e '.[otel]')"
        if in_ci():
            pytest.fail(f"{message} (CI=true: tracing must be tested)")
        pytest.skip(message)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")  # it wins
    provider = tracing._sdk_provider()
    provider.shutdown()
