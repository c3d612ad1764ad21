"""The store's tables as SQLAlchemy 2.0 typed models. Only ``qlm.store`` touches them: callers get
the plain rows of ``qlm.store.rows``.

Every timestamp is a float of unix epoch seconds (``Double``, never a 4-byte float), the same clock
as ``Request.arrival_s``, so the store needs no time-zone handling and the simulator's virtual clock
records as well as the wall clock. Enums are stored by lowercase name (status, state, model tier)
and tiers by number, so rows read well in ``psql`` and survive reordering of the Python enums.
Strings carry no length: SQLite ignores lengths and PostgreSQL would enforce them, so limits are the
API's job and both backends behave alike.

Changing a model needs an Alembic revision in ``migrations/versions``; a test checks that the
migrations produce exactly this schema.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Double,
    ForeignKey,
    Index,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

REQUEST_STATUSES = ("queued", "running", "finished", "failed", "cancelled")
ACTIVE_STATUSES = ("queued", "running")
FINAL_STATUSES = ("finished", "failed", "cancelled")
INSTANCE_STATES = ("up", "down", "draining")

# Named constraints let Alembic alter them later (SQLite batch mode needs names).
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {float: Double(), str: String()}


class RequestModel(Base):
    """One client request from submission to its outcome; the id is the client-visible one."""

    __tablename__ = "requests"

    id: Mapped[str] = mapped_column(primary_key=True)
    tenant: Mapped[str]
    model: Mapped[str]
    slo_class: Mapped[str]
    prompt: Mapped[str | None] = mapped_column(Text)
    messages: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True))
    prompt_tokens: Mapped[int]
    max_tokens: Mapped[int]
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON)
    slo_e2e_s: Mapped[float]
    slo_ttft_s: Mapped[float | None]
    tier: Mapped[int]
    # A copy of the request's labels to return it whole; filtering uses ``request_labels``.
    labels: Mapped[dict[str, str]] = mapped_column(JSON)
    idempotency_key: Mapped[str | None]
    status: Mapped[str]
    cancel_requested: Mapped[bool]
    submitted_at: Mapped[float]
    dispatched_at: Mapped[float | None]
    first_token_at: Mapped[float | None]
    finished_at: Mapped[float | None]
    instance: Mapped[str | None]
    output_text: Mapped[str | None] = mapped_column(Text)
    output_tool_calls: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True))
    output_tokens: Mapped[int]
    partial_text: Mapped[str] = mapped_column(Text)
    partial_tokens: Mapped[int]
    evictions: Mapped[int]
    swaps: Mapped[int]
    attempts: Mapped[int]
    slo_met: Mapped[bool | None]
    ttft_met: Mapped[bool | None]
    error: Mapped[str | None] = mapped_column(Text)
    predicted_completion_at: Mapped[float | None]
    at_risk: Mapped[bool]
    updated_at: Mapped[float]

    __table_args__ = (
        # NULL keys are distinct on both backends: requests without a key never conflict.
        UniqueConstraint("tenant", "idempotency_key"),
        CheckConstraint(_one_of("status", REQUEST_STATUSES), name="status"),
        # Keyset pagination walks (submitted_at, id), within a tenant or across all of them.
        Index(None, "tenant", "submitted_at", "id"),
        Index(None, "submitted_at", "id"),
        Index(None, "tenant", "status"),  # the per-tenant queued limit, on every submit
        Index(None, "status"),
        Index(None, "model"),
        Index(None, "finished_at"),  # retention and the recent completions, oldest or latest
    )


class RequestLabelModel(Base):
    """One ``key=value`` label of a request: a side table makes label filters an indexed EXISTS
    that is the same SQL on SQLite and PostgreSQL (JSON operators differ between them)."""

    __tablename__ = "request_labels"

    request_id: Mapped[str] = mapped_column(
        ForeignKey("requests.id", ondelete="CASCADE"), primary_key=True
    )
    key: Mapped[str] = mapped_column(primary_key=True)
    value: Mapped[str]

    __table_args__ = (Index(None, "key", "value"),)


class InstanceModel(Base):
    """One serving instance the control plane knows, and what it last reported of itself."""

    __tablename__ = "instances"

    name: Mapped[str] = mapped_column(primary_key=True)
    url: Mapped[str]
    gpu: Mapped[str]
    gpu_count: Mapped[int]
    models: Mapped[list[str]] = mapped_column(JSON)
    state: Mapped[str]
    model_tiers: Mapped[dict[str, str]] = mapped_column(JSON)  # model -> active / warm / cold
    updated_at: Mapped[float]

    __table_args__ = (CheckConstraint(_one_of("state", INSTANCE_STATES), name="state"),)


class PlanModel(Base):
    """One planning event (``qlm.domain.PlanRecord``) and the controller that made it."""

    __tablename__ = "plans"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    controller: Mapped[str]
    at: Mapped[float]
    trigger: Mapped[str]
    groups: Mapped[int]
    status: Mapped[str]
    method: Mapped[str]
    objective: Mapped[float]
    edf_objective: Mapped[float]
    at_risk: Mapped[list[str]] = mapped_column(JSON)  # group ids
    capacity_needed: Mapped[float | None]
    solve_s: Mapped[float]
    evaluations: Mapped[int]
    concurrency: Mapped[dict[str, int]] = mapped_column(JSON)  # instance -> concurrency limit
    deferred: Mapped[int] = mapped_column(default=0, server_default="0")  # cost-aware admission


class ControllerStateModel(Base):
    """What a controller last published of its state (virtual queues, groups, instances,
    counters), so that stateless API replicas and the CLI can show it."""

    __tablename__ = "controller_state"

    name: Mapped[str] = mapped_column(primary_key=True)
    active: Mapped[bool]
    updated_at: Mapped[float]
    snapshot: Mapped[dict[str, Any]] = mapped_column(JSON)
    # Set by a controller's last words when it stops cleanly; cleared when it publishes again.
    stopped_at: Mapped[float | None]


class LatencyBucketModel(Base):
    """One bucket of a latency histogram of finished requests (``qlm.store.latency``): how many
    observations fell in it, and their sum. Only ever added to."""

    __tablename__ = "latency_buckets"

    histogram: Mapped[str] = mapped_column(primary_key=True)  # ttft, e2e or queue
    tier: Mapped[int] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(primary_key=True)
    le: Mapped[float] = mapped_column(primary_key=True)  # upper bound, seconds (may be inf)
    count: Mapped[int] = mapped_column(BigInteger)  # never reset: past 2**31 in time
    sum: Mapped[float]


class ApiKeyModel(Base):
    """An API key's SHA-256 digest, never the key: see ``qlm.store.keys`` for why that suffices."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    tenant: Mapped[str]
    name: Mapped[str]
    prefix: Mapped[str]  # the key's first characters, to recognise it in a listing
    key_hash: Mapped[str] = mapped_column(unique=True)
    admin: Mapped[bool]
    created_at: Mapped[float]
    revoked_at: Mapped[float | None]

    __table_args__ = (Index(None, "tenant"),)
