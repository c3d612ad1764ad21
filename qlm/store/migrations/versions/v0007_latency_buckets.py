"""Latency histograms of finished requests: a row per bucket, only ever added to
(``qlm.store.latency``). They count from this revision on: requests finished before it are
not in them.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "latency_buckets",
        sa.Column("histogram", sa.String(), nullable=False),
        sa.Column("tier", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("le", sa.Double(), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("sum", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint(
            "histogram", "tier", "model", "le", name=op.f("pk_latency_buckets")
        ),
    )


def downgrade() -> None:
    op.drop_table("latency_buckets")
