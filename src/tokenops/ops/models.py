"""The operations schema as SQLAlchemy Core tables: the node tree (tenants, projects, keys' own
nodes), API keys (hashes only), per-(node, period) budget aggregates, the metering ledger, per-session
state for incremental prefill, fired alerts, stored responses and the distillation set. Core, not the
ORM: the hot path issues a handful of plain statements. Alembic migrations in `migrations/versions`
create exactly these tables; a test compares the two."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)

from tokenops.token_types import TOKEN_TYPES

metadata = MetaData()

# One row per node of the tenant tree. A key owns a node of kind "key" (so its limits and budget
# are held exactly like an organisation's or a project's).
nodes = Table(
    "ops_nodes",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("parent_id", Integer, ForeignKey("ops_nodes.id"), nullable=True),
    Column("name", String(128), nullable=False),
    Column("path", String(1024), nullable=False, unique=True),
    Column("kind", String(16), nullable=False),  # "node" | "key"
    Column("allowed_models", JSON, nullable=True),  # null: every model
    Column("rpm", Integer, nullable=True),
    Column("tpm", BigInteger, nullable=True),
    Column("max_concurrent", Integer, nullable=True),
    Column("budget_micros", BigInteger, nullable=True),
    Column("budget_period", String(8), nullable=True),  # day | month | total
    Column("priority", Integer, nullable=True),  # null: inherited from the parent
    Column("alert_threshold", Float, nullable=True),  # fraction of the budget, e.g. 0.8
    Column("alert_thresholds", JSON, nullable=True),  # several fractions, e.g. [0.5, 0.8, 1.0]
    Column("max_reasoning_tokens", Integer, nullable=True),  # thinking-budget cap; null: none of its own
    Column("max_history_tokens", Integer, nullable=True),  # a responses session's compaction budget
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)

api_keys = Table(
    "ops_api_keys",
    metadata,
    Column("id", String(40), primary_key=True),  # public id, e.g. "key_3f9a..."
    Column("node_id", Integer, ForeignKey("ops_nodes.id"), nullable=False, unique=True),
    Column("name", String(128), nullable=False),
    Column("prefix", String(16), nullable=False),  # the first characters, for display only
    Column("secret_hash", String(64), nullable=False, unique=True),  # sha256 hex of the whole key
    Column("scopes", String(256), nullable=True),  # space-separated extra grants, e.g. "admin:read"
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("revoked_at", DateTime(timezone=True), nullable=True),
)

# Budget aggregates: what admission checks (never the ledger). period is "total", "YYYY-MM" or
# "YYYY-MM-DD" (UTC), so a new period starts with a fresh row.
budget_usage = Table(
    "ops_budget_usage",
    metadata,
    Column("node_id", Integer, ForeignKey("ops_nodes.id"), primary_key=True),
    Column("period", String(16), primary_key=True),
    Column("spent_micros", BigInteger, nullable=False),
    Column("reserved_micros", BigInteger, nullable=False),
)

ledger = Table(
    "ops_ledger",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("admission_id", String(48), nullable=False, unique=True),  # idempotent settle
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("key_id", String(40), nullable=False),
    Column("tenant", String(128), nullable=False),
    Column("node_path", String(1024), nullable=False),
    Column("model_requested", String(256), nullable=False),
    Column("model_served", String(256), nullable=False),
    Column("session_id", String(256), nullable=True),
    Column("priority", Integer, nullable=False),
    *(Column(t.column, BigInteger, nullable=False) for t in TOKEN_TYPES),
    Column("cost_micros", BigInteger, nullable=False),
    Column("reserved_micros", BigInteger, nullable=False),
    Column("status", String(32), nullable=False),
    Column("finish_reason", String(32), nullable=True),
    Column("ttft_ms", Float, nullable=True),
    Column("latency_ms", Float, nullable=False),
    Column("http_status", Integer, nullable=False),
    Column("error_code", String(64), nullable=True),
    Column("route", String(256), nullable=True),  # the fusion decision, when a virtual model was asked
    Column("degraded", String(256), nullable=True),  # why a lighter model or fallback group served it
    # what the row meters when it is not a plain completion: "responses", "compaction", "embeddings"
    Column("operation", String(32), nullable=True),
    Index("ix_ops_ledger_created_at", "created_at"),
    Index("ix_ops_ledger_tenant_created", "tenant", "created_at"),
    Index("ix_ops_ledger_key_created", "key_id", "created_at"),
)

# One row per (admission, budgeted node) while a reservation is outstanding: settle deletes it and
# releases exactly what it holds; a sweeper releases rows past `expires_at` (a gateway that crashed
# mid-request), so a lost admission cannot hold budget forever.
reservations = Table(
    "ops_reservations",
    metadata,
    Column("admission_id", String(48), primary_key=True),
    Column("node_id", Integer, ForeignKey("ops_nodes.id"), primary_key=True),
    Column("period", String(16), nullable=False),
    Column("amount_micros", BigInteger, nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Index("ix_ops_reservations_expires_at", "expires_at"),
)

# The in-process budget store's write-ahead rows: one per open admission (what it is settled as should
# its gateway die before settling it), deleted in the transaction that writes its ledger row.
write_ahead = Table(
    "ops_write_ahead",
    metadata,
    Column("admission_id", String(48), primary_key=True),
    Column("row", Text, nullable=False),
)

# The previous turn of each session (per key), for the incremental-prefill meter.
sessions = Table(
    "ops_sessions",
    metadata,
    Column("key_id", String(40), primary_key=True),
    Column("session_id", String(256), primary_key=True),
    Column("prompt_tokens", BigInteger, nullable=False),
    Column("output_tokens", BigInteger, nullable=False),
    Column("turns", Integer, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)

# An alert fires once per (node, kind, level, period): the insert that wins fires it. kind "budget":
# level is the threshold (a fraction of the budget), period the budget's; kind "spend_rate": level is
# the multiple of the recent average, period the clock hour (YYYY-MM-DDTHH).
alerts_sent = Table(
    "ops_alerts_sent",
    metadata,
    Column("node_id", Integer, ForeignKey("ops_nodes.id"), primary_key=True),
    Column("kind", String(16), primary_key=True),
    Column("level", Float, primary_key=True),
    Column("period", String(32), primary_key=True),
    Column("fired_at", DateTime(timezone=True), nullable=False),
    Column("value_micros", BigInteger, nullable=False),  # spent, or spent in the minute
    Column("limit_micros", BigInteger, nullable=False),  # the budget, or the rate that was crossed
)

# Stored `/v1/responses` answers, scoped to their tenant: the response as returned, and the chat
# history a follow-up (`previous_response_id`) resends, already compacted where it was.
responses = Table(
    "ops_responses",
    metadata,
    Column("id", String(64), primary_key=True),  # "resp_..."
    Column("tenant", String(128), nullable=False),
    Column("key_id", String(40), nullable=False),
    Column("model", String(256), nullable=False),
    Column("session_id", String(256), nullable=False),  # the first response of the chain: the affinity key
    Column("previous_response_id", String(64), nullable=True),
    Column("body", JSON, nullable=False),  # the response object
    Column("history", JSON, nullable=False),  # chat messages after this turn, instructions excluded
    Column("history_tokens", BigInteger, nullable=False),  # prompt + output tokens of this turn
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Index("ix_ops_responses_expires_at", "expires_at"),
)

# Console login sessions: the cookie names a row; logging out deletes it (and with it the session
# on every replica), expired rows are purged at the next login.
console_sessions = Table(
    "ops_console_sessions",
    metadata,
    Column("id", String(48), primary_key=True),
    Column("role", String(8), nullable=False),  # "admin" | "read"
    Column("key_id", String(40), nullable=True),  # the read-only key's id; null for the admin key
    Column("csrf", String(64), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Index("ix_ops_console_sessions_expires_at", "expires_at"),
)

# The distillation set: a prompt and the strong model's answer, for tenants that opted in.
distill_examples = Table(
    "ops_distill_examples",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("tenant", String(128), nullable=False),
    Column("model", String(256), nullable=False),  # the model whose answer was kept
    Column("route", String(256), nullable=False),  # the virtual model the client named
    Column("reason", String(32), nullable=False),  # "escalated" | "agreed"
    Column("messages", JSON, nullable=False),  # the prompt's messages, then the answer's
    Index("ix_ops_distill_tenant_created", "tenant", "created_at"),
)

__all__ = [
    "metadata",
    "nodes",
    "api_keys",
    "budget_usage",
    "reservations",
    "ledger",
    "sessions",
    "alerts_sent",
    "responses",
    "distill_examples",
]
