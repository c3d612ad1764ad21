"""The HTTP access log of a real server (``QLM_API__ACCESS_LOG=true``), in the JSON log format:
one line per response, through QLM's one handler, with the request, its status and how long
the app took to start answering as fields."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI

from qlm.api.server import AccessFields, ApiServer, log_access_fields
from qlm.cli.logs import setup_logging

PAUSE_S = 0.05


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.captureWarnings(False)


@pytest.mark.usefixtures("root_logging")
def test_a_server_s_access_lines_are_json_with_the_request_as_fields() -> None:
    out = io.StringIO()
    setup_logging("INFO", "json", stream=out)
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, bool]:
        await asyncio.sleep(PAUSE_S)  # the app takes at least this long to answer
        return {"ok": True}

    async def main() -> str:
        server = ApiServer(app, host="127.0.0.1", port=0, access_log=True)
        await server.start()
        try:
            async with httpx.AsyncClient(base_url=server.url) as client:
                assert (await client.get("/ping", params={"n": 1})).status_code == 200
                assert (await client.post("/nowhere")).status_code == 404
        finally:
            await server.stop()
        return server.url

    url = asyncio.run(main())
    lines = out.getvalue().splitlines()
    docs = [json.loads(line) for line in lines]  # every line JSON, the server's own too
    access = [d for d in docs if d["logger"] == "uvicorn.access"]
    assert [(d["method"], d["path"], d["status"]) for d in access] == [
        ("GET", "/ping?n=1", 200),
        ("POST", "/nowhere", 404),
    ]
    for d in access:
        assert d["client"].startswith("127.0.0.1:") and d["http_version"] == "1.1", d
        assert d["message"] == f'{d["client"]} - "{d["method"]} {d["path"]} HTTP/1.1" {d["status"]}'
    pinged, nowhere = access
    assert pinged["duration_s"] >= PAUSE_S and nowhere["duration_s"] >= 0
    assert any(d["message"] == f"API listening on {url}" for d in docs)


@pytest.mark.usefixtures("root_logging")
def test_the_fields_are_added_once_and_only_to_lines_of_uvicorn_s_shape() -> None:
    out = io.StringIO()
    setup_logging("INFO", "json", stream=out)
    log_access_fields()
    log_access_fields()
    access = logging.getLogger("uvicorn.access")
    assert sum(isinstance(f, AccessFields) for f in access.filters) == 1
    access.info('%s - "%s %s HTTP/%s" %d', "10.0.0.7:5123", "GET", "/v1/requests?limit=5", "1.1", 404)  # fmt: skip
    access.info("a line of another shape: %s", "x")
    line, other = (json.loads(text) for text in out.getvalue().splitlines())
    fields = ("client", "method", "path", "http_version", "status")
    assert {k: line[k] for k in fields} == {
        "client": "10.0.0.7:5123",
        "method": "GET",
        "path": "/v1/requests?limit=5",
        "http_version": "1.1",
        "status": 404,
    }
    assert "duration_s" not in line  # outside a request: nothing to time
    assert not {*fields, "duration_s"} & set(other)
