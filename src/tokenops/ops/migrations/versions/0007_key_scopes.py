"""API keys carry scopes (e.g. admin:read, the console's read-only admin access)

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ops_api_keys") as batch:
        batch.add_column(sa.Column("scopes", sa.String(256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ops_api_keys") as batch:
        batch.drop_column("scopes")
