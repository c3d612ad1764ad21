"""Requests: an index on ``finished_at`` (retention deletes the oldest ended requests; a
controller taking over reads the latest completions).

The store migrates in one transaction, so the index is built with a plain ``CREATE INDEX``,
which blocks writes to ``requests`` while it builds. On a large PostgreSQL table build it first,
without blocking, and this migration then leaves it be (docs/operations.md):
``CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_requests_finished_at ON requests (finished_at)``.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        op.f("ix_requests_finished_at"), "requests", ["finished_at"], if_not_exists=True
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_requests_finished_at"), table_name="requests")
