import sys
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
