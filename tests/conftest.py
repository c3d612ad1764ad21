import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Let tests import the shared builders as ``from builders import ...``.
sys.path.insert(0, str(Path(__file__).parent))
from services import AMQP_URL, DATABASE_URL, require


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """The RabbitMQ broker's URL; skips without one (fails under CI=true)."""
    return require(AMQP_URL, 5672, "RabbitMQ")


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The PostgreSQL server's URL; skips without one (fails under CI=true)."""
    return require(DATABASE_URL, 5432, "PostgreSQL")


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A command run in process (typer's CliRunner) sets the root logger up for its run
    (``qlm.cli.logs.setup_logging``); each test gets the logging it started with back, so that
    one command's handler never writes into the next test's captured output."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
