"""The durable record of every request, instance, plan and API key: SQLAlchemy on SQLite (the
embedded default) or PostgreSQL, with Alembic migrations shipped in the package.

See ``qlm.store.store`` for the guarantees (thread-safe, idempotent outcomes) and
``qlm.store.keys`` for how API keys are kept.
"""

from __future__ import annotations

from qlm.store.base import StoreError
from qlm.store.requests import InvalidCursor, SummaryKey
from qlm.store.rows import (
    ApiKey,
    ControllerStateRow,
    InstanceRow,
    InstanceState,
    LatencyBucketRow,
    NewRequest,
    OutcomeRow,
    PlanRow,
    RequestRow,
    SloBucketRow,
    SloSummaryRow,
)
from qlm.store.store import Store

__all__ = [
    "ApiKey",
    "ControllerStateRow",
    "InstanceRow",
    "InstanceState",
    "InvalidCursor",
    "LatencyBucketRow",
    "NewRequest",
    "OutcomeRow",
    "PlanRow",
    "RequestRow",
    "SloBucketRow",
    "SloSummaryRow",
    "Store",
    "StoreError",
    "SummaryKey",
]
