"""several alert thresholds per node and a spend-rate alert: a fired alert is keyed by its kind and
level as well as its node and period

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ops_nodes") as batch:
        batch.add_column(sa.Column("alert_thresholds", sa.JSON(), nullable=True))
    op.create_table(
        "ops_alerts_sent",
        sa.Column("node_id", sa.Integer, sa.ForeignKey("ops_nodes.id"), primary_key=True),
        sa.Column("kind", sa.String(16), primary_key=True),
        sa.Column("level", sa.Float, primary_key=True),
        sa.Column("period", sa.String(32), primary_key=True),
        sa.Column("fired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("value_micros", sa.BigInteger, nullable=False),
        sa.Column("limit_micros", sa.BigInteger, nullable=False),
    )
    # an alert fired before the upgrade stays fired: a restart on the new schema does not repeat it
    op.execute(
        "INSERT INTO ops_alerts_sent (node_id, kind, level, period, fired_at, value_micros, limit_micros) "
        "SELECT f.node_id, 'budget', COALESCE(n.alert_threshold, 1.0), f.period, f.fired_at, "
        "f.spent_micros, f.budget_micros FROM ops_alerts_fired f JOIN ops_nodes n ON n.id = f.node_id"
    )
    op.drop_table("ops_alerts_fired")


def downgrade() -> None:
    op.create_table(
        "ops_alerts_fired",
        sa.Column("node_id", sa.Integer, sa.ForeignKey("ops_nodes.id"), primary_key=True),
        sa.Column("period", sa.String(16), primary_key=True),
        sa.Column("fired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("spent_micros", sa.BigInteger, nullable=False),
        sa.Column("budget_micros", sa.BigInteger, nullable=False),
        sa.Column("webhook_ok", sa.Boolean, nullable=True),
    )
    op.drop_table("ops_alerts_sent")
    with op.batch_alter_table("ops_nodes") as batch:
        batch.drop_column("alert_thresholds")
