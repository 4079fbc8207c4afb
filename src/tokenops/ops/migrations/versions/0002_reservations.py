"""per-admission reservation records, so a crashed gateway's reservations expire

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ops_reservations",
        sa.Column("admission_id", sa.String(48), primary_key=True),
        sa.Column("node_id", sa.Integer, sa.ForeignKey("ops_nodes.id"), primary_key=True),
        sa.Column("period", sa.String(16), nullable=False),
        sa.Column("amount_micros", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_ops_reservations_expires_at", "ops_reservations", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_ops_reservations_expires_at", "ops_reservations")
    op.drop_table("ops_reservations")
