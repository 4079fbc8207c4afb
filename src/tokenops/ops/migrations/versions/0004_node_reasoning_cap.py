"""tenant nodes carry a reasoning-budget cap (max_reasoning_tokens), inherited down the tree

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ops_nodes") as batch:
        batch.add_column(sa.Column("max_reasoning_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ops_nodes") as batch:
        batch.drop_column("max_reasoning_tokens")
