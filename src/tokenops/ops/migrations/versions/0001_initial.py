"""initial operations schema: nodes, api keys, budget aggregates, ledger, sessions, fired alerts

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "ops_nodes",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("parent_id", sa.Integer, sa.ForeignKey("ops_nodes.id"), nullable=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("path", sa.String(1024), nullable=False, unique=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("allowed_models", sa.JSON, nullable=True),
        sa.Column("rpm", sa.Integer, nullable=True),
        sa.Column("tpm", sa.BigInteger, nullable=True),
        sa.Column("max_concurrent", sa.Integer, nullable=True),
        sa.Column("budget_micros", sa.BigInteger, nullable=True),
        sa.Column("budget_period", sa.String(8), nullable=True),
        sa.Column("priority", sa.Integer, nullable=True),
        sa.Column("alert_threshold", sa.Float, nullable=True),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("updated_at", TZ, nullable=False),
    )
    op.create_table(
        "ops_api_keys",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("node_id", sa.Integer, sa.ForeignKey("ops_nodes.id"), nullable=False, unique=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("secret_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("revoked_at", TZ, nullable=True),
    )
    op.create_table(
        "ops_budget_usage",
        sa.Column("node_id", sa.Integer, sa.ForeignKey("ops_nodes.id"), primary_key=True),
        sa.Column("period", sa.String(16), primary_key=True),
        sa.Column("spent_micros", sa.BigInteger, nullable=False),
        sa.Column("reserved_micros", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "ops_ledger",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("admission_id", sa.String(48), nullable=False, unique=True),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("key_id", sa.String(40), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("node_path", sa.String(1024), nullable=False),
        sa.Column("model_requested", sa.String(256), nullable=False),
        sa.Column("model_served", sa.String(256), nullable=False),
        sa.Column("session_id", sa.String(256), nullable=True),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("uncached_input_tokens", sa.BigInteger, nullable=False),
        sa.Column("cached_input_tokens", sa.BigInteger, nullable=False),
        sa.Column("incremental_prefill_tokens", sa.BigInteger, nullable=False),
        sa.Column("output_tokens", sa.BigInteger, nullable=False),
        sa.Column("reasoning_tokens", sa.BigInteger, nullable=False),
        sa.Column("cost_micros", sa.BigInteger, nullable=False),
        sa.Column("reserved_micros", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=True),
        sa.Column("ttft_ms", sa.Float, nullable=True),
        sa.Column("latency_ms", sa.Float, nullable=False),
        sa.Column("http_status", sa.Integer, nullable=False),
        sa.Column("error_code", sa.String(64), nullable=True),
    )
    op.create_index("ix_ops_ledger_created_at", "ops_ledger", ["created_at"])
    op.create_index("ix_ops_ledger_tenant_created", "ops_ledger", ["tenant", "created_at"])
    op.create_index("ix_ops_ledger_key_created", "ops_ledger", ["key_id", "created_at"])
    op.create_table(
        "ops_sessions",
        sa.Column("key_id", sa.String(40), primary_key=True),
        sa.Column("session_id", sa.String(256), primary_key=True),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
        sa.Column("output_tokens", sa.BigInteger, nullable=False),
        sa.Column("turns", sa.Integer, nullable=False),
        sa.Column("updated_at", TZ, nullable=False),
    )
    op.create_table(
        "ops_alerts_fired",
        sa.Column("node_id", sa.Integer, sa.ForeignKey("ops_nodes.id"), primary_key=True),
        sa.Column("period", sa.String(16), primary_key=True),
        sa.Column("fired_at", TZ, nullable=False),
        sa.Column("spent_micros", sa.BigInteger, nullable=False),
        sa.Column("budget_micros", sa.BigInteger, nullable=False),
        sa.Column("webhook_ok", sa.Boolean, nullable=True),
    )


def downgrade() -> None:
    for table in (
        "ops_alerts_fired",
        "ops_sessions",
        "ops_ledger",
        "ops_budget_usage",
        "ops_api_keys",
        "ops_nodes",
    ):
        op.drop_table(table)
