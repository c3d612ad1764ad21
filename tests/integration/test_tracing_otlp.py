"""Tracing as an operator turns it on: a ``qlm serve`` process with ``QLM_TRACING=otel`` and
nothing else but the standard ``OTEL_*`` variables sends its spans over OTLP/HTTP (the default
exporter, which the ``otel`` extra installs) to a collector — here a small HTTP server in the
test that keeps what it is sent. A request submitted to the API and served arrives there as one
trace of the four spans, under the service name ``OTEL_SERVICE_NAME`` gives."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from services import free_port, in_ci, output, start_process, stop, wait_healthy

import qlm

SPANS = ("qlm.api.accept", "qlm.controller.place", "qlm.engine.run", "qlm.request.complete")


def otlp_protobuf() -> Any:
    """OTLP's protobuf messages (``opentelemetry-proto``, installed with the ``otel`` extra's
    exporter): skips without them locally, fails under CI=true."""
    try:
        from opentelemetry.exporter.otlp.proto.http import trace_exporter  # noqa: F401
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    except ImportError:
        message = "the OTLP exporter is not installed (pip install -e '.[otel]')"
        if in_ci():
            pytest.fail(f"{message} (CI=true: tracing must be tested)")
        pytest.skip(message)
    return trace_service_pb2


class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1: every ``POST /v1/traces`` body it was sent,
    decoded, answered 200 as a collector does."""

    def __init__(self, messages: Any) -> None:
        self.requests: list[Any] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    request = messages.ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    with collector.lock:
                        collector.requests.append(request)
                    reply = messages.ExportTraceServiceResponse().SerializeToString()
                    self.send_response(200)
                else:
                    reply = b""
                    self.send_response(404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[str, Any]]:
        """(service.name, span) of every span received."""
        out = []
        with self.lock:
            for request in self.requests:
                for resource_spans in request.resource_spans:
                    attrs = {
                        a.key: a.value.string_value for a in resource_spans.resource.attributes
                    }
                    for scope in resource_spans.scope_spans:
                        out += [(attrs.get("service.name", ""), s) for s in scope.spans]
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector(otlp_protobuf())
    try:
        yield c
    finally:
        c.close()


def attributes(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, kind) if kind else None
    return out


def test_qlm_serve_sends_a_request_s_trace_to_an_otlp_collector(
    tmp_path: Path, collector: Collector
) -> None:
    here = str(Path(qlm.__file__).resolve().parents[1])  # the qlm under test, not another
    port = free_port()
    env = {
        "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
        "QLM_DATABASE_URL": f"sqlite:///{tmp_path / 'qlm.db'}",
        "QLM_API__HOST": "127.0.0.1",
        "QLM_API__PORT": str(port),
        "QLM_CONTROLLER__SIM_TIME_SCALE": "20",
        "QLM_TRACING": "otel",
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        "OTEL_SERVICE_NAME": "qlm-under-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: spans leave soon after they end
        "OTEL_TRACES_EXPORTER": "otlp",  # the default, in case the environment says another
    }
    made = subprocess.run(
        [sys.executable, "-m", "qlm.cli", "keys", "create", "--tenant", "acme", "--json"],
        env={**os.environ, **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    key = json.loads(made.stdout)["key"]
    proc = start_process(["serve"], env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, f"{url}/healthz", "qlm serve")
        auth = {"Authorization": f"Bearer {key}"}
        body = {"model": "llama-3-8b", "prompt": "hello there", "max_tokens": 8,
                "slo_seconds": 600, "tier": "interactive"}  # fmt: skip
        r = httpx.post(f"{url}/v1/requests", json=body, headers=auth, timeout=60)
        assert r.status_code == 202, r.text
        rid = r.json()["id"]
        view = httpx.get(
            f"{url}/v1/requests/{rid}", params={"wait": 60}, headers=auth, timeout=90
        ).json()
        assert view["status"] == "finished", view
        deadline = time.monotonic() + 60
        while "qlm.request.complete" not in {s.name for _, s in collector.spans()}:
            assert proc.poll() is None, output(proc)
            assert time.monotonic() < deadline, (
                f"no qlm.request.complete span reached the collector:\n{output(proc)}"
            )
            time.sleep(0.1)
    finally:
        stop(proc)
    received = collector.spans()
    assert {name for name, _ in received} == {"qlm-under-test"}
    got = {s.name: s for _, s in received if attributes(s).get("qlm.request.id") == rid}
    assert set(got) == set(SPANS), sorted(got)
    accept = got["qlm.api.accept"]
    assert attributes(accept)["qlm.tenant"] == "acme"
    for name in SPANS[1:]:
        assert got[name].trace_id == accept.trace_id, name  # one trace
        assert got[name].parent_span_id == accept.span_id, name
    assert attributes(got["qlm.engine.run"])["qlm.instance"] == view["instance"]
    assert attributes(got["qlm.request.complete"])["qlm.request.status"] == "finished"
