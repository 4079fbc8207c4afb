"""tenant nodes carry an agent session's history budget (max_history_tokens), the smallest on the path

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ops_nodes") as batch:
        batch.add_column(sa.Column("max_history_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ops_nodes") as batch:
        batch.drop_column("max_history_tokens")
