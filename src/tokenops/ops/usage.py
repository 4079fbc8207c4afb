"""Grouped usage reports from the ledger (by tenant, key node, key, route, model served, day,
hour): token sums per type, request counts, cost, and cost per million tokens. This is the only
reader that scans the ledger; admission never does. A price of P per million tokens is P micro-units
per token, so cost per million tokens in currency units is simply cost_micros / tokens."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.engine import Connection

from tokenops.ops import models as m
from tokenops.protocol import invalid_request
from tokenops.token_types import COUNTED_TYPES, TOKEN_TYPES

L = m.ledger
GROUPS = ("tenant", "node", "key", "route", "model", "day", "hour")
_TOKEN_COLUMNS = {t.name: L.c[t.column] for t in TOKEN_TYPES}


def _group_column(conn: Connection, name: str):  # noqa: ANN202
    if name == "tenant":
        return L.c.tenant
    if name == "key":
        return L.c.key_id
    if name == "node":  # the key's node path, e.g. org/project/key: the console drills down it
        return L.c.node_path
    if name == "model":
        return L.c.model_served
    if name == "route":  # the route's name, from the recorded decision "route=NAME; ..." (null: none)
        find = func.strpos if conn.dialect.name == "postgresql" else func.instr
        end = find(L.c.route, ";")
        return case((end > 7, func.substr(L.c.route, 7, end - 7)), else_=None)
    # day "YYYY-MM-DD", hour "YYYY-MM-DD HH" (UTC) on both dialects
    if conn.dialect.name == "postgresql":
        fmt = "YYYY-MM-DD" if name == "day" else "YYYY-MM-DD HH24"
        return func.to_char(func.timezone("UTC", L.c.created_at), fmt)
    return func.substr(L.c.created_at, 1, 10 if name == "day" else 13)  # SQLite stores UTC ISO text


def check_group_by(group_by: list[str] | tuple[str, ...] | None) -> list[str]:
    groups = list(group_by or [])
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        raise invalid_request(
            f"Cannot group usage by {', '.join(repr(b) for b in bad)}: use any of {', '.join(GROUPS)}.",
            param="group_by",
        )
    return list(dict.fromkeys(groups))


def usage_report(
    conn: Connection,
    group_by: list[str] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    tenant: str | None = None,
    under: str | None = None,
) -> list[dict[str, Any]]:
    """`tenant`: only that organisation's rows; `under`: only keys at or below that node path."""
    groups = check_group_by(group_by)
    # SQLite stores UTC wall-clock text: compare in UTC (a naive bound is taken as UTC)
    since, until = (
        None if t is None else (t.astimezone(UTC) if t.tzinfo else t.replace(tzinfo=UTC))
        for t in (since, until)
    )
    cols = [_group_column(conn, g).label(g) for g in groups]
    sums = [func.coalesce(func.sum(c), 0).label(n) for n, c in _TOKEN_COLUMNS.items()]
    q = select(
        *cols,
        func.count().label("requests"),
        *sums,
        func.coalesce(func.sum(L.c.cost_micros), 0).label("cost_micros"),
    )
    if since is not None:
        q = q.where(L.c.created_at >= since)
    if until is not None:
        q = q.where(L.c.created_at < until)
    if tenant is not None:
        q = q.where(L.c.tenant == tenant)
    if under:
        under = under.strip("/")
        q = q.where((L.c.node_path == under) | L.c.node_path.startswith(under + "/", autoescape=True))
    if cols:
        q = q.group_by(*cols).order_by(*cols)
    out = []
    for r in conn.execute(q).all():
        row = dict(r._mapping)
        for k in ("requests", "cost_micros", *_TOKEN_COLUMNS):
            row[k] = int(row[k] or 0)
        row["total_tokens"] = sum(row[t.name] for t in COUNTED_TYPES)
        row["cost_per_million_tokens"] = (
            row["cost_micros"] / row["total_tokens"] if row["total_tokens"] else 0.0
        )
        out.append(row)
    if not groups and out and out[0]["requests"] == 0:
        return []
    return out
