"""The HTTP access log of a real server (``QLM_API__ACCESS_LOG=true``), in the JSON log format:
one line per response, through QLM's one handler, with the request and its status as fields."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI

from qlm.api.server import ApiServer
from qlm.cli.logs import setup_logging


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
    assert any(d["message"] == f"API listening on {url}" for d in docs)
