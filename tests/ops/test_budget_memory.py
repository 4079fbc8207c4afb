"""Budgets in one gateway's memory (budget_memory.py) with a real database: the 200-way race never
overspends and writes exactly one ledger row per admission; a stop settles what stays open from its
write-ahead row; a run killed with admissions open (their write-ahead rows committed, nothing else)
is settled at the next start."""

from __future__ import annotations

import asyncio

import pytest
from ops_helpers import budget_race, open_ops, outcome, request
from sqlalchemy import func, select

from tokenops.ops import models as m
from tokenops.protocol import APIError

BUDGET = 1000  # m1: prompt 10 + max 10 reserves 30 micro-units; fits 33 worst cases of 200


def memory_ops(target, **kw):
    return open_ops(target, budget_store="memory", **kw)


def _ledger(ops):
    with ops.db.engine.connect() as conn:
        spent = int(conn.execute(select(func.coalesce(func.sum(m.ledger.c.cost_micros), 0))).scalar_one())
        rows = conn.execute(select(m.ledger.c.admission_id, m.ledger.c.status)).all()
        agg = conn.execute(select(m.budget_usage.c.spent_micros)).scalars().all()
        ahead = conn.execute(select(func.count()).select_from(m.write_ahead)).scalar_one()
    return spent, rows, sorted(agg), ahead


@pytest.mark.timeout(300)
def test_200_way_race_never_overspends(db_target):
    async def main():
        ops = await memory_ops(db_target)
        try:
            await ops.create_node(None, "org", {"budget_micros": BUDGET, "budget_period": "total"})
            await ops.create_node("org", "p", {"budget_micros": BUDGET // 2, "budget_period": "day"})
            key, _ = await ops.create_key("org/p", "k", {})
            admitted, refused = await budget_race([ops], key)
            assert refused > 0 and len(admitted) >= (BUDGET // 2) // 30
            assert await ops.hot_budgets.open_admissions() == 0
        finally:
            await ops.close()
        spent, rows, agg, ahead = _ledger(ops)
        assert sorted(r[0] for r in rows) == sorted(admitted)  # exactly one row per admission
        assert spent <= BUDGET // 2
        assert agg == [spent, spent] and ahead == 0

    asyncio.run(main())


def test_shrink_refuse_idempotent_settle_and_restart(db_target):
    """The budget binds across a restart (counters start from the durable spent); a repeated settle
    moves nothing; an admission open at the stop is settled from its write-ahead row."""

    async def main():
        ops = await memory_ops(db_target)
        try:
            await ops.create_node(None, "org", {"budget_micros": 80, "budget_period": "month"})
            key, _ = await ops.create_key("org", "k", {})
            p = await ops.authenticate(key)
            adm = await ops.admit(p, request(prompt=10, max_tokens=10))
            rows = await asyncio.gather(*(ops.settle(adm, outcome(prompt=10, output=5)) for _ in range(5)))
            assert {r.cost_micros for r in rows} == {20}
            open_at_stop = await ops.admit(p, request(prompt=10, max_tokens=10))  # 30 held
        finally:
            await ops.close()
        again = await memory_ops(db_target)
        try:
            p = await again.authenticate(key)
            status = await again.node_status("org")
            # 20 spent; the open admission was settled at the stop, as lost: nothing billed
            shrunk = await again.admit(p, request(prompt=10, max_tokens=40))
            assert shrunk.budget_limited and shrunk.reserved_micros == 60
            with pytest.raises(APIError) as e:
                await again.admit(p, request(prompt=10, max_tokens=10))
            assert e.value.code == "insufficient_quota"
            await again.release(shrunk)
        finally:
            await again.close()
        return open_at_stop, status

    open_at_stop, status = asyncio.run(main())
    assert (status["spent_micros"], status["reserved_micros"]) == (20, 0)
    spent, rows, agg, ahead = _ledger_of(db_target)
    assert dict(rows)[open_at_stop.id] == "gateway_lost"
    assert (spent, len(rows), agg, ahead) == (20, 3, [20], 0)


def test_a_settle_returns_once_its_row_is_committed(db_target):
    """The rows are written behind, in batches, but a settle returns only once its batch is
    committed: the gateway answers after it, so a gateway killed after an answer has its row."""

    async def main():
        ops = await memory_ops(db_target)
        try:
            await ops.create_node(None, "org", {"budget_micros": 10**6, "budget_period": "total"})
            key, _ = await ops.create_key("org", "k", {})
            p = await ops.authenticate(key)
            admitted = [await ops.admit(p, request()) for _ in range(20)]
            for a in admitted[:4]:
                await ops.settle(a, outcome(prompt=10, output=10))
                assert dict(_ledger(ops)[1]).get(a.id) == "ok"  # read on another connection
            await asyncio.gather(*(ops.settle(a, outcome(prompt=10, output=10)) for a in admitted[4:]))
            spent, rows, _, ahead = _ledger(ops)
            assert sorted(a for a, _ in rows) == sorted(a.id for a in admitted) and ahead == 0
            assert spent == 20 * 30
        finally:
            await ops.close()

    asyncio.run(main())


def test_a_killed_run_is_settled_at_the_next_start(db_target):
    """Killed: the event loop stops with admissions open and settled rows still queued; only what
    was committed survives. The next start writes a row for every admission, none twice."""

    async def main():
        ops = await memory_ops(db_target)
        await ops.create_node(None, "org", {"budget_micros": 10**6, "budget_period": "total"})
        key, _ = await ops.create_key("org", "k", {})
        p = await ops.authenticate(key)
        done = [await ops.admit(p, request()) for _ in range(5)]
        for a in done:
            await ops.settle(a, outcome(prompt=10, output=10))
        await asyncio.sleep(0.2)  # written
        queued = [await ops.admit(p, request()) for _ in range(3)]
        ops.hot_budgets._writer.cancel()  # the kill: nothing more reaches the database
        # each settle waits its bounded while for a commit that never comes
        await asyncio.gather(*(ops.settle(a, outcome(prompt=10, output=10)) for a in queued))
        ops.db.dispose()
        return done, queued

    done, queued = asyncio.run(main())

    async def restart():
        again = await memory_ops(db_target)
        await again.close()
        return again

    again = asyncio.run(restart())
    spent, rows, agg, ahead = _ledger(again)
    status = dict(rows)
    assert {status[a.id] for a in done} == {"ok"} and {status[a.id] for a in queued} == {"gateway_lost"}
    assert len(rows) == 8 and spent == 5 * 30 and agg == [spent] and ahead == 0


def _ledger_of(db_target):
    async def main():
        ops = await open_ops(db_target)
        await ops.close()
        return _ledger(ops)

    return asyncio.run(main())
