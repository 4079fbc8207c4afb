"""Budgets by reservation. Each budgeted node has one aggregate row per period (`ops_budget_usage`:
spent and reserved micro-units). Admission reserves the worst case on every budgeted node of the
path with a conditional UPDATE (`reserved = reserved + x WHERE spent + reserved + x <= limit`),
root first, in the caller's transaction; settle moves the reservation to spent. No increment is ever
made without that guard or a row lock taken after reading the headroom, so committed spend plus
outstanding reservations never pass a limit, however many gateways race. Each reservation is also
recorded per admission (`ops_reservations`) so that one never settled (a crashed gateway) expires
and is swept. Checks never scan the ledger. Prices live in `pricing.py`; the ledger row in `ledger.py`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, bindparam, delete, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection

from tokenops.ops import models as m
from tokenops.protocol import APIError

U = m.budget_usage
R = m.reservations


def period_key(period: str, now: datetime) -> str:
    """The aggregate row a period maps to at `now` (UTC): "total", "YYYY-MM" or "YYYY-MM-DD"."""
    if period == "day":
        return now.strftime("%Y-%m-%d")
    if period == "month":
        return now.strftime("%Y-%m")
    return "total"


@dataclass
class BudgetHold:
    node_id: int
    node_path: str
    period: str
    limit_micros: int


def _ensure_row(conn: Connection, node_id: int, period: str) -> None:
    ins = pg_insert(U) if conn.dialect.name == "postgresql" else sqlite_insert(U)
    conn.execute(
        ins.values(node_id=node_id, period=period, spent_micros=0, reserved_micros=0).on_conflict_do_nothing(
            index_elements=["node_id", "period"]
        )
    )


# Hot-path statements are built once (bind parameters only): building and cache-keying a Core
# statement per call costs more than SQLite's own work.
_ROW = and_(U.c.node_id == bindparam("n"), U.c.period == bindparam("p"))
_GUARDED_ADD = (
    update(U)
    .where(_ROW, U.c.spent_micros + U.c.reserved_micros + bindparam("x") <= bindparam("lim"))
    .values(reserved_micros=U.c.reserved_micros + bindparam("x"))
    .returning(U.c.spent_micros, U.c.reserved_micros)
)
_ADD = update(U).where(_ROW).values(reserved_micros=U.c.reserved_micros + bindparam("x"))
_TAKE_RESERVATIONS = (
    delete(R).where(R.c.admission_id == bindparam("a")).returning(R.c.node_id, R.c.period, R.c.amount_micros)
)
_COMMIT = (
    update(U)
    .where(_ROW)
    .values(
        reserved_micros=U.c.reserved_micros - bindparam("r"), spent_micros=U.c.spent_micros + bindparam("c")
    )
    .returning(U.c.spent_micros)
)


def _guarded_add(conn: Connection, hold: BudgetHold, amount: int) -> int | None:
    """Add `amount` when it fits and return the headroom the node had before it; None when it does not fit."""
    row = conn.execute(
        _GUARDED_ADD, {"n": hold.node_id, "p": hold.period, "x": amount, "lim": hold.limit_micros}
    ).first()
    return None if row is None else hold.limit_micros - row[0] - row[1] + amount


def _fraction_left(headroom: int, limit: int) -> float:
    return min(1.0, max(0.0, headroom / limit)) if limit > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Reservation:
    amount: int  # micro-units reserved on every hold
    # the tightest hold's headroom before this reservation, as a fraction of its limit (spent and
    # other requests' reservations taken out): what degradation's `budget_below` compares with
    left: float


def _add(conn: Connection, hold: BudgetHold, amount: int) -> None:
    conn.execute(_ADD, {"n": hold.node_id, "p": hold.period, "x": amount})


def _headroom_locked(conn: Connection, hold: BudgetHold) -> int:
    _ensure_row(conn, hold.node_id, hold.period)
    q = select(U.c.spent_micros, U.c.reserved_micros).where(
        and_(U.c.node_id == hold.node_id, U.c.period == hold.period)
    )
    if conn.dialect.name == "postgresql":
        q = q.with_for_update()  # SQLite: BEGIN IMMEDIATE already holds the database's write lock
    spent, reserved = conn.execute(q).one()
    return hold.limit_micros - spent - reserved


def shrunk(hold: BudgetHold, headroom: int, shrink: Callable[[int], int], minimal: int) -> int:
    """The largest reservation `headroom` pays for (`shrink`), or 429 insufficient_quota when not even
    `minimal` (the prompt and one output token) fits."""
    smaller = shrink(headroom) if headroom >= minimal else -1
    if smaller < minimal or smaller > headroom:
        raise APIError(
            429,
            f"Budget exhausted for '{hold.node_path}' ({hold.period}): "
            f"{max(headroom, 0)} micro-units left, "
            f"the smallest possible request needs {minimal}. "
            "Raise the budget or wait for the next period.",
            type="insufficient_quota",
            code="insufficient_quota",
        )
    return smaller


def reserve(
    conn: Connection,
    holds: list[BudgetHold],
    amount: int,
    shrink: Callable[[int], int],
    minimal: int,
    admission_id: str,
    expires_at: datetime,
) -> Reservation:
    """Reserve `amount` on every hold (root first) and return what was reserved: `amount`, or when a
    node has less headroom, `shrink(headroom)` (the largest reservation that fits, at least
    `minimal`), with the fraction of the tightest budget that was left. Raises 429
    insufficient_quota when even `minimal` does not fit. Records the reservation per node
    (`ops_reservations`) so it can expire."""
    applied: list[BudgetHold] = []
    left = 1.0
    for hold in holds:
        before = _guarded_add(conn, hold, amount)
        if before is not None:
            applied.append(hold)
            left = min(left, _fraction_left(before, hold.limit_micros))
            continue
        # the row is missing (a new period) or the node cannot take the whole amount: read its
        # headroom under a lock, then add what fits
        headroom = _headroom_locked(conn, hold)
        left = min(left, _fraction_left(headroom, hold.limit_micros))
        if headroom < amount:
            smaller = shrunk(hold, headroom, shrink, minimal)
            for done in applied:  # lowering a reservation never needs a guard
                _add(conn, done, smaller - amount)
            amount = smaller
        _add(conn, hold, amount)
        applied.append(hold)
    if holds:
        conn.execute(
            insert(R),
            [
                {
                    "admission_id": admission_id,
                    "node_id": h.node_id,
                    "period": h.period,
                    "amount_micros": amount,
                    "expires_at": expires_at,
                }
                for h in holds
            ],
        )
    return Reservation(amount, left)


def commit(
    conn: Connection, admission_id: str, holds: list[tuple[int, str]], cost: int
) -> list[tuple[int, str, int]]:
    """Release what the admission still holds and add `cost` to spent on each hold; returns
    (node id, period, spent after) for alert checks. A reservation already swept (expired) is not
    released twice."""
    held = {(n, p): amt for n, p, amt in conn.execute(_TAKE_RESERVATIONS, {"a": admission_id}).all()}
    out = []
    for node_id, period in holds:
        r = held.get((node_id, period), 0)
        spent = conn.execute(_COMMIT, {"n": node_id, "p": period, "r": r, "c": cost}).scalar_one_or_none()
        if spent is not None:
            out.append((node_id, period, spent))
    return out


def sweep_expired(conn: Connection, now: datetime) -> int:
    """Release reservations past their expiry (their gateway died before settling); returns how many."""
    return _release(conn, R.c.expires_at < now)


def release_instance(conn: Connection, admission_prefix: str) -> int:
    """Release the reservations of admissions whose id starts with `admission_prefix`: those of a
    gateway instance that died and is starting again (nothing of its own can be in flight yet)."""
    return _release(conn, R.c.admission_id.startswith(admission_prefix, autoescape=True))


def _release(conn: Connection, where: Any) -> int:
    rows = conn.execute(delete(R).where(where).returning(R.c.node_id, R.c.period, R.c.amount_micros)).all()
    totals: dict[tuple[int, str], int] = {}
    for node_id, period, amount in rows:
        totals[(node_id, period)] = totals.get((node_id, period), 0) + amount
    # ascending node id is root first (a parent is created before its children): the same lock
    # order as admit and settle, so a sweep never deadlocks with them
    for (node_id, period), amount in sorted(totals.items()):
        conn.execute(_ADD, {"n": node_id, "p": period, "x": -amount})
    return len(rows)


def add_spent(conn: Connection, node_id: int, period: str, cost: int) -> None:
    """Add settled cost to a node's durable spent (the batch writer of a hot budget store: its
    reservations live outside the database, so `reserved` stays untouched)."""
    _ensure_row(conn, node_id, period)
    conn.execute(_COMMIT, {"n": node_id, "p": period, "r": 0, "c": cost})


def node_usage(conn: Connection, node_id: int, period: str) -> tuple[int, int]:
    """(spent, reserved) of a node's aggregate row for a period, zeros when none."""
    row = conn.execute(
        select(U.c.spent_micros, U.c.reserved_micros).where(
            and_(U.c.node_id == node_id, U.c.period == period)
        )
    ).first()
    return (row[0], row[1]) if row else (0, 0)
