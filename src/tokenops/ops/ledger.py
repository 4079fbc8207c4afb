"""The metering ledger: one row per admitted request, written in the settle transaction together with
the move of its reservation into spent, so money and the ledger can never disagree. Settle is
idempotent per admission id (the row's unique key decides; a repeat moves no money). It also keeps
each session's previous turn (`ops_sessions`) to meter incremental prefill where the engine does not
report it: the new input tokens since that turn, prompt - (previous prompt + previous output) when
positive, else the whole prompt. An engine that reports the prompt tokens it computed (beyond its
prefix cache and KV from peers) meters it exactly instead.
Pricing and reservation rules live in `pricing.py` and `budgets.py`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import and_, bindparam, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection

from tokenops.ops import budgets
from tokenops.ops import models as m
from tokenops.ops.domain import Admission, LedgerRow, Outcome, TokenUsage
from tokenops.ops.pricing import Price, cost_micros
from tokenops.token_types import COUNTED_TYPES, TOKEN_TYPES

L = m.ledger
S = m.sessions


def incremental_prefill(prompt_tokens: int, previous: tuple[int, int] | None) -> int:
    """New input tokens since the session's previous turn (whole prompt for a new session)."""
    if previous is None:
        return prompt_tokens
    new = prompt_tokens - (previous[0] + previous[1])
    return new if new > 0 else prompt_tokens


# Hot-path statements are built once per dialect (bind parameters only): building and
# cache-keying a Core statement per call costs more than SQLite's own work.
def _insert(dialect: str, table):  # noqa: ANN001, ANN202
    return (pg_insert if dialect == "postgresql" else sqlite_insert)(table)


def _statements(dialect: str) -> dict[str, Any]:
    prev = select(S.c.prompt_tokens, S.c.output_tokens).where(
        and_(S.c.key_id == bindparam("k"), S.c.session_id == bindparam("s"))
    )
    if dialect == "postgresql":
        prev = prev.with_for_update()  # two turns of one session settling at once meter one after the other
    ins_s = _insert(dialect, S)
    return {
        "previous": prev,
        "save_turn": ins_s.on_conflict_do_update(
            index_elements=["key_id", "session_id"],
            set_={
                "prompt_tokens": ins_s.excluded.prompt_tokens,
                "output_tokens": ins_s.excluded.output_tokens,
                "turns": S.c.turns + 1,
                "updated_at": ins_s.excluded.updated_at,
            },
        ),
        "ledger": _insert(dialect, L)
        .on_conflict_do_nothing(index_elements=["admission_id"])
        .returning(L.c.id),
        "ledger_ids": _insert(dialect, L)
        .on_conflict_do_nothing(index_elements=["admission_id"])
        .returning(L.c.admission_id, sort_by_parameter_order=True),
    }


_STATEMENTS = {d: _statements(d) for d in ("sqlite", "postgresql")}


def _unnest_insert() -> tuple[str, list[str]]:
    """PostgreSQL: a batch of ledger rows as one array per column, inserted with `unnest`. The
    statement's text never changes, so psycopg parses it once, where a multi-row VALUES statement is
    new text (parsed again, placeholder by placeholder) for every batch size."""
    dialect = postgresql.dialect()
    cols = [c for c in L.columns if not c.primary_key]
    arrays = ", ".join(f"%({c.name})s::{c.type.compile(dialect=dialect)}[]" for c in cols)
    sql = (
        f"INSERT INTO {L.name} ({', '.join(c.name for c in cols)}) SELECT * FROM unnest({arrays}) "
        "ON CONFLICT (admission_id) DO NOTHING RETURNING admission_id"
    )
    return sql, [c.name for c in cols]


_UNNEST_INSERT, _UNNEST_COLUMNS = _unnest_insert()


def _insert_rows(conn: Connection, rows: list[PendingRow]) -> set[str]:
    """Insert the rows whose admission id is new; returns those ids."""
    if conn.dialect.name == "postgresql":
        arrays = {c: [r.values.get(c) for r in rows] for c in _UNNEST_COLUMNS}
        return set(conn.exec_driver_sql(_UNNEST_INSERT, arrays).scalars())
    # one multi-row INSERT .. ON CONFLICT DO NOTHING RETURNING: the ids it names are the new rows
    return set(conn.execute(_STATEMENTS[conn.dialect.name]["ledger_ids"], [r.values for r in rows]).scalars())


def _previous_turn(conn: Connection, key_id: str, session_id: str) -> tuple[int, int] | None:
    row = conn.execute(_STATEMENTS[conn.dialect.name]["previous"], {"k": key_id, "s": session_id}).first()
    return (row[0], row[1]) if row else None


def _save_turn(
    conn: Connection, key_id: str, session_id: str, prompt: int, output: int, now: datetime
) -> None:
    conn.execute(
        _STATEMENTS[conn.dialect.name]["save_turn"],
        {
            "key_id": key_id,
            "session_id": session_id,
            "prompt_tokens": prompt,
            "output_tokens": output,
            "turns": 1,
            "updated_at": now,
        },
    )


def _fit(text: str | None, width: int) -> str | None:
    """Text cut to the column's width keeping both ends: a route trace's end says who answered."""
    if text is None or len(text) <= width:
        return text or None
    head = width // 2 - 2
    return text[:head] + " .. " + text[len(text) - (width - head - 4) :]


@dataclass
class SettleResult:
    row: LedgerRow
    first: bool  # False: this admission was settled before; nothing moved
    spent_after: list[tuple[int, str, int]]  # (node id, period, spent) for alert checks
    # resolves once the row is committed, for a store that writes rows behind; None: it already is
    written: asyncio.Future | None = None


_ROW_FIELDS = [f.name for f in fields(LedgerRow)]
_COLUMN_OF = {t.name: t.column for t in TOKEN_TYPES}


def row_from_db(r: Any) -> LedgerRow:
    mapping = r._mapping
    return LedgerRow(**{f: mapping[_COLUMN_OF.get(f, f)] for f in _ROW_FIELDS})


def make_row(
    admission: Admission,
    outcome: Outcome,
    price: Price,
    side_micros: int,
    previous: tuple[int, int] | None,
) -> tuple[LedgerRow, dict[str, Any], tuple[int, int] | None]:
    """The ledger row of a settled admission, its column values, and the session turn to save
    (prompt, output; None when there is none). `previous` is the session's previous turn."""
    now = datetime.now(UTC)
    usage = outcome.usage
    prompt = usage.prompt_tokens
    if prompt > 0 and outcome.computed_prompt_tokens is not None:
        usage.incremental_prefill = min(outcome.computed_prompt_tokens, prompt)
    elif prompt > 0:
        usage.incremental_prefill = incremental_prefill(prompt, previous)
    else:
        usage.incremental_prefill = 0
    cost = cost_micros(price, usage) + side_micros
    billed = TokenUsage(**vars(usage))
    for call in outcome.side_calls:
        # a side call's incremental prefill is not metered: it has no session of its own
        for t in COUNTED_TYPES:
            setattr(billed, t.name, getattr(billed, t.name) + getattr(call.usage, t.name))
    row = LedgerRow(
        admission_id=admission.id,
        key_id=admission.principal.key_id,
        node_path="/".join(admission.principal.node_path),
        model_requested=admission.model,
        model_served=outcome.model_served or admission.model,
        session_id=admission.session_id,
        **{t.name: getattr(billed, t.name) for t in TOKEN_TYPES},
        cost_micros=cost,
        reserved_micros=admission.reserved_micros,
        status=outcome.status,
        finish_reason=outcome.finish_reason,
        ttft_ms=outcome.ttft_ms,
        latency_ms=float(outcome.latency_ms or 0.0),
        http_status=int(outcome.http_status),
        error_code=outcome.error_code,
        route=_fit(outcome.route, 256),
        degraded=outcome.degraded[:256] if outcome.degraded else None,
        created_at=now,
        operation=outcome.operation,
    )
    turn = (prompt, usage.output) if admission.session_id and prompt > 0 else None
    return row, row_values(row, admission.principal.tenant, admission.priority), turn


def row_values(row: LedgerRow, tenant: str, priority: int) -> dict[str, Any]:
    """The ledger table's column values for a row."""
    values = {_COLUMN_OF.get(f, f): getattr(row, f) for f in _ROW_FIELDS}
    values["tenant"] = tenant
    values["priority"] = priority
    return values


def row_from_values(values: dict[str, Any]) -> LedgerRow:
    return LedgerRow(**{f: values[_COLUMN_OF.get(f, f)] for f in _ROW_FIELDS})


def settle(
    conn: Connection, admission: Admission, outcome: Outcome, price: Price, side_micros: int = 0
) -> SettleResult:
    """Write the ledger row and move money, in the caller's (single) transaction. `side_micros` is
    the cost of `outcome.side_calls` at their own models' prices: the row holds the tokens and the
    cost of every call the request made, the answer's at `price`."""
    sid = admission.session_id
    key_id = admission.principal.key_id
    needs_previous = sid and outcome.usage.prompt_tokens > 0 and outcome.computed_prompt_tokens is None
    previous = _previous_turn(conn, key_id, sid) if needs_previous else None
    row, values, turn = make_row(admission, outcome, price, side_micros, previous)
    inserted = conn.execute(_STATEMENTS[conn.dialect.name]["ledger"], values).first()
    if inserted is None:  # (rowcount is unreliable here: PostgreSQL adds an implicit RETURNING)
        existing = conn.execute(select(L).where(L.c.admission_id == admission.id)).one()
        return SettleResult(row_from_db(existing), False, [])
    if turn is not None and sid:
        _save_turn(conn, key_id, sid, turn[0], turn[1], row.created_at or datetime.now(UTC))
    cost = row.cost_micros
    spent_after = budgets.commit(conn, admission.id, admission.holds, cost) if admission.holds else []
    return SettleResult(row, True, spent_after)


@dataclass
class PendingRow:
    """A settled row on its way to the database in a batch: its column values, the budget rows its
    cost counts on (node id, period), and the session turn to save."""

    values: dict[str, Any]
    holds: list[tuple[int, str]]
    turn: tuple[int, int] | None = None


def previous_turn(conn: Connection, key_id: str, session_id: str) -> tuple[int, int] | None:
    return _previous_turn(conn, key_id, session_id)


def write_batch(conn: Connection, rows: list[PendingRow]) -> int:
    """Insert settled rows (a repeat of an admission id is skipped: a batch delivered twice writes
    nothing twice), save their session turns and add each inserted row's cost to the spent of its
    budget rows, in the caller's transaction; returns how many rows were new."""
    if not rows:
        return 0
    inserted = _insert_rows(conn, rows)
    spent: dict[tuple[int, str], int] = {}
    new = 0
    for r in rows:
        if r.values["admission_id"] not in inserted:
            continue
        new += 1
        inserted.discard(r.values["admission_id"])  # a batch naming one admission twice counts it once
        sid, key_id = r.values.get("session_id"), r.values["key_id"]
        if r.turn is not None and sid:
            _save_turn(conn, key_id, sid, r.turn[0], r.turn[1], r.values["created_at"])
        for hold in r.holds:
            spent[hold] = spent.get(hold, 0) + int(r.values["cost_micros"])
    for (node_id, period), cost in sorted(spent.items()):  # root first: the lock order of admit
        budgets.add_spent(conn, node_id, period, cost)
    return new


def record_alert(
    conn: Connection, node_id: int, kind: str, level: float, period: str, value: int, limit: int
) -> bool:
    """True for the one caller that records this (node, kind, level, period)'s alert first."""
    t = m.alerts_sent
    ins = pg_insert(t) if conn.dialect.name == "postgresql" else sqlite_insert(t)
    res = conn.execute(
        ins.values(
            node_id=node_id,
            kind=kind,
            level=float(level),
            period=period,
            fired_at=datetime.now(UTC),
            value_micros=value,
            limit_micros=limit,
        )
        .on_conflict_do_nothing(index_elements=["node_id", "kind", "level", "period"])
        .returning(t.c.node_id)
    ).first()
    return res is not None


__all__ = [
    "settle",
    "make_row",
    "write_batch",
    "PendingRow",
    "incremental_prefill",
    "record_alert",
    "row_from_db",
    "SettleResult",
]
