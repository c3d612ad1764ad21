"""The API keeps an idle client connection open well past the time a client reuses one: httpx
keeps one 5 s, as uvicorn's default closes it, and at equal times a request written on a
connection the server is closing gets a reset (seen by the real-vLLM service test polling the
API on a busy host)."""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from qlm.api.server import API_KEEPALIVE_S, ApiServer


def test_the_api_keeps_idle_connections_longer_than_clients_reuse_them() -> None:
    server = ApiServer(FastAPI(), host="127.0.0.1", port=0)
    client_reuse_s = httpx.Limits().keepalive_expiry
    assert client_reuse_s is not None
    assert server._config.timeout_keep_alive == API_KEEPALIVE_S >= 10 * client_reuse_s
