"""OpenTelemetry tracing of a request's path, when OpenTelemetry is installed (the ``otel`` extra)
and asked for (``QLM_TRACING=otel``). Off, nothing of OpenTelemetry is imported and every call
here returns at once.

The spans of one request share one trace:

- ``qlm.api.accept`` (producer; the API): the request recorded in the store and published to the
  global queue, until the broker confirmed it. Its context travels in the message (the
  ``trace`` field: W3C ``traceparent`` and ``tracestate``), so it survives either queue, every
  redelivery and a controller failover.
- ``qlm.controller.place`` (the controller): from taking the request (or having it back after an
  eviction or a lost instance) to dispatching it onto the instance its plan chose.
- ``qlm.engine.run`` (client): the run on that instance, from dispatch to the engine's answer —
  finished, failed, cancelled, or returned (evicted, instance down).
- ``qlm.request.complete``: from the outcome to its commit in the store, after which the
  delivery is acked.

``enable`` is called once per process by the commands that serve (``qlm api``, ``controller``,
``serve``) when the setting asks for it; tests pass their own tracer provider. A process whose
OpenTelemetry SDK is already configured (``opentelemetry-instrument``, or code that set a
tracer provider) keeps it; otherwise QLM sets up the SDK with the exporter that
``OTEL_TRACES_EXPORTER`` names (``otlp``, the default: OTLP over HTTP, whose exporter the ``otel``
extra installs; ``console``; ``none``) and the resource the ``OTEL_*`` variables describe.

This module keeps process state (the tracer), as OpenTelemetry itself does, and imports nothing
of QLM's but its error root.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from qlm.errors import QLMError

_tracer: Any = None
_propagate: Any = None
_kinds: dict[str, Any] = {}


class TracingError(QLMError):
    """Tracing was asked for and cannot be set up; the text says what to install or set."""


def enabled() -> bool:
    return _tracer is not None


def enable(provider: Any = None) -> None:
    """Trace from now on, with ``provider``'s tracer (a test's), else the global one (set up
    here when nothing set it: module docstring). Raise ``TracingError`` when OpenTelemetry is
    not installed or its exporter cannot be made."""
    global _tracer, _propagate
    try:
        from opentelemetry import propagate, trace
    except ImportError:
        raise TracingError(
            "QLM_TRACING=otel needs OpenTelemetry: pip install 'qlm[otel]' "
            "(opentelemetry-api and opentelemetry-sdk)"
        ) from None
    if provider is None:
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider):  # nothing configured it
            provider = _sdk_provider()
            trace.set_tracer_provider(provider)
    _kinds.update({k.name.lower(): k for k in trace.SpanKind})
    _propagate = propagate
    _tracer = provider.get_tracer("qlm")


def disable() -> None:
    """Stop tracing (tests; a process traces for its whole life otherwise)."""
    global _tracer, _propagate
    _tracer = _propagate = None


def _sdk_provider() -> Any:
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        raise TracingError(
            "QLM_TRACING=otel without a configured tracer provider needs the OpenTelemetry SDK: "
            "pip install 'qlm[otel]'"
        ) from None
    name = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")[0].strip().lower()
    provider = TracerProvider(resource=Resource.create({"service.name": "qlm"} | _service()))
    exporter: Any
    if name == "none":
        return provider
    if name == "console":
        exporter = ConsoleSpanExporter()
    elif name == "otlp":
        _require_http_protobuf()
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise TracingError(
                "OTEL_TRACES_EXPORTER=otlp (the default) needs opentelemetry-exporter-otlp-proto-http"
                " (pip install 'qlm[otel]'), or set OTEL_TRACES_EXPORTER=console"
            ) from None
        exporter = OTLPSpanExporter()  # its endpoint from OTEL_EXPORTER_OTLP_* variables
    else:
        raise TracingError(
            f"OTEL_TRACES_EXPORTER={name!r}: QLM sets up otlp, console or none (for another "
            "exporter, run QLM under opentelemetry-instrument)"
        )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _require_http_protobuf() -> None:
    """QLM's OTLP exporter speaks HTTP with protobuf: a protocol variable asking for another
    (``grpc``, ``http/json``) is refused in one line rather than sending to a port that does not
    speak it."""
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = os.environ.get(var, "").strip().lower()
        if value:
            if value != "http/protobuf":
                raise TracingError(
                    f"{var}={value!r}: QLM exports OTLP as http/protobuf (port 4318); for "
                    f"{value}, run QLM under opentelemetry-instrument"
                )
            return


def _service() -> dict[str, str]:
    """``OTEL_SERVICE_NAME`` when set: it names the service over the default ``qlm``."""
    name = os.environ.get("OTEL_SERVICE_NAME", "").strip()
    return {"service.name": name} if name else {}


def _ns(at_s: float | None) -> int | None:
    """A span time: wall-clock seconds to nanoseconds."""
    return None if at_s is None else int(at_s * 1e9)


def _context(carrier: Mapping[str, str] | None) -> Any:
    return None if not carrier else _propagate.extract(dict(carrier))


def start(
    name: str,
    *,
    carrier: Mapping[str, str] | None = None,
    kind: str = "internal",
    attributes: Mapping[str, Any] | None = None,
    start_s: float | None = None,
) -> Any:
    """A span started (as a child of the context in ``carrier``, if any), to be ended with
    ``end``; None when tracing is off. ``start_s``: when it began (wall clock), if earlier."""
    if _tracer is None:
        return None
    return _tracer.start_span(
        name,
        context=_context(carrier),
        kind=_kinds[kind],
        attributes=_clean(attributes),
        start_time=_ns(start_s),
    )


def end(span: Any, attributes: Mapping[str, Any] | None = None, error: str | None = None) -> None:
    """End ``span`` (None: nothing), setting ``attributes`` and, with ``error``, its status."""
    if span is None:
        return
    if attributes:
        span.set_attributes(_clean(attributes))
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


@contextmanager
def span(
    name: str,
    *,
    carrier: Mapping[str, str] | None = None,
    kind: str = "internal",
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[Any]:
    """``start`` and ``end`` around a block, with the span current within it (None when off);
    an exception leaving the block is recorded on it."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(
        name, context=_context(carrier), kind=_kinds[kind], attributes=_clean(attributes)
    ) as current:
        yield current


def inject(span: Any) -> dict[str, str]:
    """The W3C trace context of ``span`` as a carrier (``traceparent``, ``tracestate``), for a
    message; empty when tracing is off."""
    if span is None or _propagate is None:
        return {}
    from opentelemetry import trace

    carrier: dict[str, str] = {}
    _propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """Attributes OpenTelemetry accepts: None values dropped (it refuses them)."""
    return {k: v for k, v in (attributes or {}).items() if v is not None}


class RequestSpans:
    """The controller's spans of the requests it holds (``qlm.controller.place``,
    ``qlm.engine.run``, ``qlm.request.complete``), by request id: the service calls it as
    its listener hears of each step. Every span is a child of the request's context from its
    message."""

    def __init__(self) -> None:
        self._carrier: dict[str, Mapping[str, str]] = {}
        self._waiting: dict[str, float] = {}  # since when it waits for a placement
        self._runs: dict[str, Any] = {}
        self._outcomes: dict[str, Any] = {}
        self._attributes: dict[str, Mapping[str, Any]] = {}  # tenant, model, tier

    def held(self, request_id: str, carrier: Mapping[str, str], attributes: Mapping[str, Any]) -> None:  # fmt: skip
        """The controller took the request: it waits for a placement from now. A message with
        no trace context (its API does not trace; a replay) starts its trace here."""
        if not carrier:
            root = start("qlm.controller.accept", kind="consumer", attributes=attributes)
            carrier = inject(root)
            end(root)
        self._carrier[request_id] = carrier
        self._attributes[request_id] = attributes
        self._waiting[request_id] = time.time()

    def dispatched(self, request_id: str, instance: str) -> None:
        carrier = self._carrier.get(request_id)
        if carrier is None:
            return
        since = self._waiting.pop(request_id, None)
        ids = {"qlm.request.id": request_id, "qlm.instance": instance}
        place = {**self._attributes.get(request_id, {}), **ids}
        end(start("qlm.controller.place", carrier=carrier, attributes=place, start_s=since))
        self._end_run(request_id, {"qlm.run.outcome": "superseded"})
        self._runs[request_id] = start(
            "qlm.engine.run", carrier=carrier, kind="client", attributes=ids
        )

    def returned(self, request_id: str, *, evicted: bool) -> None:
        """Back from its instance (evicted, or the instance lost): it waits again."""
        self._end_run(request_id, {"qlm.run.outcome": "evicted" if evicted else "returned"})
        if request_id in self._carrier:
            self._waiting[request_id] = time.time()

    def outcome(self, request_id: str, status: str, attributes: Mapping[str, Any], error: str | None = None) -> None:  # fmt: skip
        """The request ended (``status``): its run ends, its recording begins."""
        self._end_run(request_id, {"qlm.run.outcome": status}, error)
        carrier = self._carrier.get(request_id)
        if carrier is None or request_id in self._outcomes:
            return
        attrs = {"qlm.request.id": request_id, "qlm.request.status": status, **attributes}
        self._outcomes[request_id] = start(
            "qlm.request.complete", carrier=carrier, attributes=attrs
        )

    def committed(self, request_id: str) -> None:
        """Its outcome is in the store: its delivery is acked next; the request is forgotten."""
        end(self._outcomes.pop(request_id, None))
        self.forget(request_id)

    def forget(self, request_id: str) -> None:
        """Let the request go (recorded, or another controller serves it); an open span ends."""
        self._end_run(request_id, {"qlm.run.outcome": "released"})
        end(self._outcomes.pop(request_id, None))
        self._carrier.pop(request_id, None)
        self._waiting.pop(request_id, None)
        self._attributes.pop(request_id, None)

    def _end_run(self, request_id: str, attributes: Mapping[str, Any], error: str | None = None) -> None:  # fmt: skip
        end(self._runs.pop(request_id, None), attributes, error)
