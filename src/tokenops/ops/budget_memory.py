"""Budgets in one gateway's memory, for a gateway without Redis that is the only one on its database:
the counters and reservations are plain dicts changed without an await between check and increment
(so the event loop makes every admission atomic), and the database is the durable record, written
in batches by one writer task.

- reserve: checks `spent + reserved + x <= limit` on every node of the path and adds `x`, then waits
  until its write-ahead ledger row (what it is settled as should the gateway die: status
  `gateway_lost`, nothing billed) is committed in `ops_write_ahead`, in the next batch.
- settle: moves the reservation to spent at once and queues the finished row; the batch that writes
  it to the ledger (with `spent +=` on the durable aggregates) deletes its write-ahead row in the same
  transaction. Its result's `written` resolves once that batch is committed: the gateway waits for
  it before a response's last byte, so a client that has a whole answer has its row.
- start: the write-ahead rows a killed run left are settled from (ledger rows, nothing billed) and
  deleted, in one transaction; counters are seeded from the durable aggregates on first use.

A kill -9 thus loses no row of an admission: it was either written, or its write-ahead row is, and
the next start settles it. Two gateways on one database must not both use it (each would check only
its own counters): with several gateways, use Redis or the database store."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import and_, delete, insert, select
from sqlalchemy.engine import Connection

from tokenops.ops import ledger
from tokenops.ops import models as m
from tokenops.ops.budget_redis import decode
from tokenops.ops.budgets import BudgetHold, Reservation, shrunk
from tokenops.ops.db import Database
from tokenops.ops.domain import Admission, Outcome
from tokenops.ops.pricing import Price

log = logging.getLogger("tokenops.ops")

SETTLED_KEPT = 100_000  # settled admission ids remembered to answer a repeated settle
W = m.write_ahead


@dataclass(slots=True)
class _Open:
    amount: int
    holds: list[tuple[int, str]]
    expires: float  # monotonic


def _recover(conn: Connection) -> int:
    """Settle every write-ahead row left in the database from its row; returns how many."""
    rows = conn.execute(select(W.c.admission_id, W.c.row)).all()
    if rows:
        ledger.write_batch(conn, [decode(r) for _, r in rows])
        conn.execute(delete(W))
    return len(rows)


def _write(conn: Connection, ahead: list[tuple[str, str]], finished: list[ledger.PendingRow]) -> None:
    if ahead:
        conn.execute(insert(W), [{"admission_id": a, "row": r} for a, r in ahead])
    if finished:
        ledger.write_batch(conn, finished)
        conn.execute(delete(W).where(W.c.admission_id.in_([r.values["admission_id"] for r in finished])))


def _spent(conn: Connection, node_id: int, period: str) -> int:
    U = m.budget_usage
    q = select(U.c.spent_micros).where(and_(U.c.node_id == node_id, U.c.period == period))
    return int(conn.execute(q).scalar_one_or_none() or 0)


class MemoryBudgets:
    """Budget counters and reservations in this process, the ledger written in batches."""

    # a settled row waits in this process for the writer: only a budgeted admission (its write-ahead
    # row committed at admit) may settle here, an unbudgeted one writes its row in its own transaction
    durable_settle = False

    def __init__(self, db: Database) -> None:
        self._db = db
        self._counters: dict[tuple[int, str], list[int]] = {}  # [spent, reserved]
        self._seeding: dict[tuple[int, str], asyncio.Future] = {}
        self._open: dict[str, _Open] = {}
        self._settled: OrderedDict[str, ledger.LedgerRow] = OrderedDict()
        self._turns: dict[tuple[str, str], tuple[int, int]] = {}
        self._ahead: list[tuple[str, str, asyncio.Future]] = []
        self._finished: list[ledger.PendingRow] = []
        self._written: dict[str, asyncio.Future] = {}  # settled admission id -> its batch committed
        self._wake = asyncio.Event()
        self._writer: asyncio.Task | None = None
        self._closing = False

    async def start(self) -> int:
        """Settle what a killed run left open, start the writer; returns how many were settled."""
        n = await self._db.run(_recover)
        if n:
            log.warning("settled %d admission(s) a previous run left open, from their write-ahead rows", n)
        self._writer = asyncio.get_running_loop().create_task(self._write_forever())
        return n

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await self._writer
        # an admission still open is never settled by this run: its write-ahead row settles it now
        with contextlib.suppress(Exception):
            await self._db.run(_recover)

    # ------------------------------------------------------------------ admission

    async def _seed(self, holds: list[BudgetHold]) -> None:
        """Counters this process has not used yet start from the durable spent (one read per
        counter, shared by the admissions that need it at once)."""
        for h in holds:
            key = (h.node_id, h.period)
            if key in self._counters:
                continue
            pending = self._seeding.get(key)
            if pending is None:
                pending = self._seeding[key] = asyncio.ensure_future(self._db.run(_spent, *key))
                pending.add_done_callback(lambda _, key=key: self._seeding.pop(key, None))
            spent = await asyncio.shield(pending)
            self._counters.setdefault(key, [spent, 0])

    async def reserve(
        self,
        holds: list[BudgetHold],
        amount: int,
        shrink: Callable[[int], int],
        minimal: int,
        admission_id: str,
        ttl_s: float,
        write_ahead: Callable[[int], str],
    ) -> Reservation:
        await self._seed(holds)
        # from here to the increment nothing awaits: no other admission runs in between
        left, tight, headroom = 1.0, None, None
        for h in holds:
            spent, reserved = self._counters[(h.node_id, h.period)]
            head = h.limit_micros - spent - reserved
            if headroom is None or head < headroom:
                headroom, tight = head, h
            if h.limit_micros > 0:
                left = min(left, max(0.0, head / h.limit_micros))
            else:
                left = 0.0
        if tight is not None and headroom is not None and headroom < amount:
            amount = shrunk(tight, headroom, shrink, minimal)
        keys = [(h.node_id, h.period) for h in holds]
        for k in keys:
            self._counters[k][1] += amount
        self._open[admission_id] = _Open(amount, keys, time.monotonic() + ttl_s)
        done = asyncio.get_running_loop().create_future()
        self._ahead.append((admission_id, write_ahead(amount), done))
        self._wake.set()
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            raise  # the caller's orphan release frees it once the row is in
        except BaseException:
            self._free(admission_id)
            raise
        return Reservation(amount, left)

    def _free(self, admission_id: str) -> _Open | None:
        held = self._open.pop(admission_id, None)
        if held is not None:
            for k in held.holds:
                self._counters[k][1] -= held.amount
        return held

    async def release(self, admission_id: str) -> None:
        """Free the reservation of an admission that was never handed out (its admit was cancelled)."""
        if self._free(admission_id) is not None:
            await self._db.run(lambda conn: conn.execute(delete(W).where(W.c.admission_id == admission_id)))

    # ------------------------------------------------------------------ settle

    async def settle(
        self, admission: Admission, outcome: Outcome, price: Price, side_micros: int
    ) -> ledger.SettleResult:
        first = self._settled.get(admission.id)
        if first is not None:
            return ledger.SettleResult(first, False, [])
        sid, key_id = admission.session_id, admission.principal.key_id
        previous = None
        if sid and outcome.usage.prompt_tokens > 0 and outcome.computed_prompt_tokens is None:
            previous = self._turns.get((key_id, sid))
            if previous is None:
                previous = await self._db.run(ledger.previous_turn, key_id, sid)
            first = self._settled.get(admission.id)  # settled by a concurrent call meanwhile
            if first is not None:
                return ledger.SettleResult(first, False, [])
        row, values, turn = ledger.make_row(admission, outcome, price, side_micros, previous)
        self._settled[admission.id] = row
        if len(self._settled) > SETTLED_KEPT:
            self._settled.popitem(last=False)
        if turn is not None and sid:
            self._turns[(key_id, sid)] = turn
        self._free(admission.id)
        spent_after = []
        for node_id, period in admission.holds:
            counter = self._counters.get((node_id, period))
            if counter is not None:
                counter[0] += row.cost_micros
                spent_after.append((node_id, period, counter[0]))
        self._finished.append(ledger.PendingRow(values, list(admission.holds), turn))
        written = self._written[admission.id] = asyncio.get_running_loop().create_future()
        self._wake.set()
        return ledger.SettleResult(row, True, spent_after, written)

    # ------------------------------------------------------------------ background

    async def _write_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._ahead or self._finished:
                ahead, self._ahead = self._ahead, []
                finished, self._finished = self._finished, []
                try:
                    await self._db.run(_write, [(a, r) for a, r, _ in ahead], finished)
                except Exception as exc:  # admits fail; settled rows are tried again with the next batch
                    log.exception("budget batch write failed")
                    for *_, fut in ahead:
                        if not fut.done():
                            fut.set_exception(exc)
                    self._finished[:0] = finished
                    await asyncio.sleep(0.5)
                    continue
                for *_, fut in ahead:
                    if not fut.done():
                        fut.set_result(None)
                for r in finished:
                    fut = self._written.pop(r.values["admission_id"], None)
                    if fut is not None and not fut.done():
                        fut.set_result(None)
            if self._closing:
                return

    async def sweep(self) -> int:
        """Release reservations past their expiry (their settle still bills them); returns how many."""
        now = time.monotonic()
        expired = [a for a, o in self._open.items() if o.expires < now]
        for a in expired:
            self._free(a)
        return len(expired)

    async def usage(self, node_id: int, period: str) -> tuple[int, int] | None:
        """(spent, reserved) of a node's live counter; None when this process has none."""
        c = self._counters.get((node_id, period))
        return None if c is None else (c[0], c[1])

    async def open_admissions(self) -> int:
        return len(self._open)
