"""stored responses, the distillation set, and the ledger's operation column

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ops_ledger") as batch:
        batch.add_column(sa.Column("operation", sa.String(32), nullable=True))
    op.create_table(
        "ops_responses",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("key_id", sa.String(40), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("session_id", sa.String(256), nullable=False),
        sa.Column("previous_response_id", sa.String(64), nullable=True),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("history", sa.JSON(), nullable=False),
        sa.Column("history_tokens", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_ops_responses_expires_at", "ops_responses", ["expires_at"])
    op.create_table(
        "ops_distill_examples",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("route", sa.String(256), nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("messages", sa.JSON(), nullable=False),
    )
    op.create_index("ix_ops_distill_tenant_created", "ops_distill_examples", ["tenant", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_ops_distill_tenant_created", "ops_distill_examples")
    op.drop_table("ops_distill_examples")
    op.drop_index("ix_ops_responses_expires_at", "ops_responses")
    op.drop_table("ops_responses")
    with op.batch_alter_table("ops_ledger") as batch:
        batch.drop_column("operation")
