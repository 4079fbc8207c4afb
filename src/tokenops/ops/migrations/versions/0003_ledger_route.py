"""ledger rows say which fusion route chose the model and why the cluster degraded a request

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ops_ledger") as batch:
        batch.add_column(sa.Column("route", sa.String(256), nullable=True))
        batch.add_column(sa.Column("degraded", sa.String(256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ops_ledger") as batch:
        batch.drop_column("degraded")
        batch.drop_column("route")
