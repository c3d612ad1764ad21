"""Controller state: when a controller stopped cleanly, so that readers can tell a controller
that is gone from one that is only slow to publish.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("controller_state") as batch:
        batch.add_column(sa.Column("stopped_at", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("controller_state") as batch:
        batch.drop_column("stopped_at")
