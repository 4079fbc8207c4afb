"""Write-ahead ledger rows of the in-process budget store: what an admission is settled as should its
gateway die before settling it

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ops_write_ahead",
        sa.Column("admission_id", sa.String(48), primary_key=True),
        sa.Column("row", sa.Text(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("ops_write_ahead")
