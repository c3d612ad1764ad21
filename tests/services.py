"""The real servers integration tests talk to: RabbitMQ and PostgreSQL on 127.0.0.1.

Addresses come from ``QLM_TEST_AMQP_URL`` and ``QLM_TEST_DATABASE_URL`` (defaults: the machine's
guest/guest broker and the trust-auth ``test`` database). Without a server a test skips on a
laptop and fails under ``CI=true``: CI must never pass by skipping what it was meant to check.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

import pytest

AMQP_URL = os.environ.get("QLM_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
DATABASE_URL = os.environ.get(
    "QLM_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def reachable(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or default_port), 2
        ):
            return True
    except OSError:
        return False


def require(url: str, default_port: int, what: str) -> str:
    """``url`` when its server answers; otherwise skip (fail under CI=true)."""
    if reachable(url, default_port):
        return url
    message = f"{what} not reachable at {url}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: integration tests must run)")
    pytest.skip(message)
