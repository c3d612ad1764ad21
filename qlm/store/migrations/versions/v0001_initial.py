"""Initial schema: requests and their labels, instances, plans, API keys.

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "requests",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("tenant", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("slo_class", sa.String(), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=True),
        sa.Column("messages", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("sampling", sa.JSON(), nullable=False),
        sa.Column("slo_e2e_s", sa.Double(), nullable=False),
        sa.Column("slo_ttft_s", sa.Double(), nullable=True),
        sa.Column("tier", sa.Integer(), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("idempotency_key", sa.String(), nullable=True),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("submitted_at", sa.Double(), nullable=False),
        sa.Column("dispatched_at", sa.Double(), nullable=True),
        sa.Column("first_token_at", sa.Double(), nullable=True),
        sa.Column("finished_at", sa.Double(), nullable=True),
        sa.Column("instance", sa.String(), nullable=True),
        sa.Column("output_text", sa.Text(), nullable=True),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("partial_text", sa.Text(), nullable=False),
        sa.Column("partial_tokens", sa.Integer(), nullable=False),
        sa.Column("evictions", sa.Integer(), nullable=False),
        sa.Column("swaps", sa.Integer(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("slo_met", sa.Boolean(), nullable=True),
        sa.Column("ttft_met", sa.Boolean(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("predicted_completion_at", sa.Double(), nullable=True),
        sa.Column("at_risk", sa.Boolean(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'finished', 'failed', 'cancelled')",
            name=op.f("ck_requests_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
        sa.UniqueConstraint(
            "tenant", "idempotency_key", name=op.f("uq_requests_tenant_idempotency_key")
        ),
    )
    op.create_index(op.f("ix_requests_model"), "requests", ["model"])
    op.create_index(op.f("ix_requests_status"), "requests", ["status"])
    op.create_index(op.f("ix_requests_submitted_at_id"), "requests", ["submitted_at", "id"])
    op.create_index(op.f("ix_requests_tenant_status"), "requests", ["tenant", "status"])
    op.create_index(
        op.f("ix_requests_tenant_submitted_at_id"), "requests", ["tenant", "submitted_at", "id"]
    )

    op.create_table(
        "request_labels",
        sa.Column("request_id", sa.String(), nullable=False),
        sa.Column("key", sa.String(), nullable=False),
        sa.Column("value", sa.String(), nullable=False),
        sa.ForeignKeyConstraint(
            ["request_id"],
            ["requests.id"],
            name=op.f("fk_request_labels_request_id_requests"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("request_id", "key", name=op.f("pk_request_labels")),
    )
    op.create_index(op.f("ix_request_labels_key_value"), "request_labels", ["key", "value"])

    op.create_table(
        "instances",
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("url", sa.String(), nullable=False),
        sa.Column("gpu", sa.String(), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("models", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("model_tiers", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.CheckConstraint("state IN ('up', 'down', 'draining')", name=op.f("ck_instances_state")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_instances")),
    )

    op.create_table(
        "plans",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("controller", sa.String(), nullable=False),
        sa.Column("at", sa.Double(), nullable=False),
        sa.Column("trigger", sa.String(), nullable=False),
        sa.Column("groups", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("method", sa.String(), nullable=False),
        sa.Column("objective", sa.Double(), nullable=False),
        sa.Column("edf_objective", sa.Double(), nullable=False),
        sa.Column("at_risk", sa.JSON(), nullable=False),
        sa.Column("capacity_needed", sa.Double(), nullable=True),
        sa.Column("solve_s", sa.Double(), nullable=False),
        sa.Column("evaluations", sa.Integer(), nullable=False),
        sa.Column("concurrency", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_plans")),
    )

    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("prefix", sa.String(), nullable=False),
        sa.Column("key_hash", sa.String(), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("revoked_at", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant"), "api_keys", ["tenant"])


def downgrade() -> None:
    op.drop_table("api_keys")
    op.drop_table("plans")
    op.drop_table("instances")
    op.drop_table("request_labels")
    op.drop_table("requests")
