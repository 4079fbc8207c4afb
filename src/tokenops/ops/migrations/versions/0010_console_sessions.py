"""console login sessions held on the server: logging out deletes the row, so a copied cookie no
longer opens the console

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ops_console_sessions",
        sa.Column("id", sa.String(48), primary_key=True),
        sa.Column("role", sa.String(8), nullable=False),
        sa.Column("key_id", sa.String(40), nullable=True),
        sa.Column("csrf", sa.String(64), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_ops_console_sessions_expires_at", "ops_console_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_ops_console_sessions_expires_at", "ops_console_sessions")
    op.drop_table("ops_console_sessions")
