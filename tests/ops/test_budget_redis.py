"""Budgets in Redis (budget_redis.py) with the real Redis server and a real database: the 200-way race
across two gateways' Operations never overspends and writes exactly one ledger row per admission;
counters are seeded once from the database and the unflushed stream when Redis lacks them; a dead
gateway's open admissions are settled from their write-ahead rows and their reservations freed;
an expired reservation of a live gateway is freed and still billed when it settles."""

from __future__ import annotations

import asyncio

import pytest
import redis
from ops_helpers import PG_URL, REDIS_URL, budget_race, open_ops, outcome, request
from sqlalchemy import func, select

from tokenops.ops import models as m
from tokenops.protocol import APIError

pytestmark = pytest.mark.redis

BUDGET = 1000  # m1: prompt 10 + max 10 reserves 30 micro-units; fits 33 worst cases of 200


def redis_ops(target, prefix, **kw):
    """Operations on the Redis budget store (opt-in: the default is the database)."""
    return open_ops(target, redis_url=REDIS_URL, redis_prefix=prefix, budget_store="redis", **kw)


def _ledger(ops):
    with ops.db.engine.connect() as conn:
        spent = int(conn.execute(select(func.coalesce(func.sum(m.ledger.c.cost_micros), 0))).scalar_one())
        rows = conn.execute(select(m.ledger.c.admission_id, m.ledger.c.status)).all()
        agg = conn.execute(select(m.budget_usage.c.spent_micros)).scalars().all()
    return spent, rows, sorted(agg)


def _open_reservations(prefix: str) -> tuple[int, list[int]]:
    r = redis.Redis.from_url(REDIS_URL)
    try:
        open_ = r.zcard(prefix + "{bud}:rx")
        reserved = [int(r.hget(k, "reserved")) for k in r.scan_iter(match=prefix + "{bud}:c:*")]
        return open_, reserved
    finally:
        r.close()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def target(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/ops.db", None
    return PG_URL, request.getfixturevalue("pg_schema")


@pytest.mark.timeout(300)
def test_200_way_race_on_two_gateways_never_overspends(target, redis_prefix):
    async def main():
        a = await redis_ops(target, redis_prefix, instance_id="gw-a")
        b = await redis_ops(target, redis_prefix, instance_id="gw-b")
        try:
            await a.create_node(None, "org", {"budget_micros": BUDGET, "budget_period": "total"})
            await a.create_node("org", "p", {"budget_micros": BUDGET // 2, "budget_period": "day"})
            key, _ = await b.create_key("org/p", "k", {})
            admitted, refused = await budget_race([a, b], key)
            assert refused > 0 and len(admitted) >= (BUDGET // 2) // 30
            assert _open_reservations(redis_prefix)[0] == 0
        finally:
            await a.close()
            await b.close()  # both flushers drained: every settled row is in the database
        spent, rows, agg = _ledger(a)
        assert sorted(r[0] for r in rows) == sorted(admitted)  # exactly one row per admission
        assert spent <= BUDGET // 2  # the tighter (project) budget binds
        assert agg == [spent, spent]  # the durable aggregates agree with the ledger
        assert _open_reservations(redis_prefix)[1] == [0, 0]

    asyncio.run(main())


def test_settle_is_idempotent_and_budget_shrinks_then_refuses(tmp_path, redis_prefix):
    async def main():
        ops = await open_ops(
            (f"sqlite:///{tmp_path}/ops.db", None),
            redis_url=REDIS_URL,
            redis_prefix=redis_prefix,
            budget_store="redis",
        )
        try:
            await ops.create_node(None, "org", {"budget_micros": 50, "budget_period": "month"})
            key, _ = await ops.create_key("org", "k", {})
            p = await ops.authenticate(key)
            adm = await ops.admit(p, request(prompt=10, max_tokens=10))
            assert adm.reserved_micros == 30 and not adm.budget_limited
            rows = await asyncio.gather(*(ops.settle(adm, outcome(prompt=10, output=5)) for _ in range(5)))
            assert {r.cost_micros for r in rows} == {20}
            status = await ops.node_status("org")
            assert (status["spent_micros"], status["reserved_micros"]) == (20, 0)
            # 30 left: a worst case of 30 fits exactly; then 0 left
            a2 = await ops.admit(p, request(prompt=10, max_tokens=15))
            assert a2.budget_limited and a2.max_output_tokens == 10 and a2.reserved_micros == 30
            with pytest.raises(APIError) as e:
                await ops.admit(p, request(prompt=10, max_tokens=10))
            assert e.value.status == 429 and e.value.code == "insufficient_quota"
            assert "Budget exhausted for 'org'" in e.value.message
            await ops.release(a2)
        finally:
            await ops.close()
        spent, rows, agg = _ledger(ops)
        assert (spent, len(rows), agg) == (20, 2, [20])

    asyncio.run(main())


def test_an_unbudgeted_admission_settles_through_the_stream_once(tmp_path, redis_prefix):
    """No budget on the path: the row still goes through the Redis stream (batched, durable once
    settled) rather than a transaction of its own, once however often it is settled, and the
    session's previous turn still meters incremental prefill."""

    async def main():
        ops = await redis_ops((f"sqlite:///{tmp_path}/ops.db", None), redis_prefix)
        try:
            await ops.create_node(None, "free", {})
            p = await ops.authenticate((await ops.create_key("free", "k", {}))[0])
            first = await ops.admit(p, request(prompt=10, max_tokens=10, session="s"))
            assert first.holds == []
            rows = await asyncio.gather(*(ops.settle(first, outcome(prompt=10, output=5)) for _ in range(3)))
            assert {r.cost_micros for r in rows} == {20}
            r = redis.Redis.from_url(REDIS_URL)
            try:  # settled by the script (its settled mark), its row left to the flusher's batch
                assert r.exists(redis_prefix + "{bud}:d:" + first.id) == 1
            finally:
                r.close()
            second = await ops.admit(p, request(prompt=25, max_tokens=10, session="s"))
            row = await ops.settle(second, outcome(prompt=25, output=5))
            assert row.incremental_prefill == 25 - (10 + 5)
        finally:
            await ops.close()
        spent, rows, agg = _ledger(ops)
        assert (spent, sorted(a for a, _ in rows), agg) == (20 + 35, sorted([first.id, second.id]), [])

    asyncio.run(main())


def test_counters_are_seeded_once_from_the_database_and_the_stream(tmp_path, redis_prefix):
    """Redis loses the counters (not the stream): the next admissions, racing on two gateways,
    seed them from what the database and the unflushed stream hold, once."""

    async def main():
        url = (f"sqlite:///{tmp_path}/ops.db", None)
        a = await redis_ops(url, redis_prefix)
        b = await redis_ops(url, redis_prefix)
        r = redis.Redis.from_url(REDIS_URL)
        try:
            await a.create_node(None, "org", {"budget_micros": 400, "budget_period": "total"})
            key, _ = await a.create_key("org", "k", {})
            p = await a.authenticate(key)
            for _ in range(5):
                await a.settle(await a.admit(p, request()), outcome(prompt=10, output=10))  # 30 each
            await asyncio.sleep(0.3)  # flushed
            for x in (a, b):  # the flushers stop: the next rows wait in the stream
                x.hot_budgets._closing = True
                await asyncio.gather(*x.hot_budgets._tasks, return_exceptions=True)
            for _ in range(3):
                await a.settle(await a.admit(p, request()), outcome(prompt=10, output=10))
            for k in r.scan_iter(match=redis_prefix + "{bud}:c:*"):
                r.delete(k)
            pb = await b.authenticate(key)
            results = await asyncio.gather(
                *(x.admit(q, request()) for x, q in [(a, p), (b, pb)] * 10), return_exceptions=True
            )
            ok = [x for x in results if not isinstance(x, Exception)]
            assert len(ok) == (400 - 8 * 30) // 30  # 240 spent: 5 rows in the database, 3 in the stream
            status = await b.node_status("org")
            assert (status["spent_micros"], status["reserved_micros"]) == (240, 30 * len(ok))
            for adm in ok:
                await b.release(adm)
        finally:
            r.close()
            await a.close()
            await b.close()
        spent, rows, _ = _ledger(a)
        assert spent == 240 and len(rows) == 8 + 5

    asyncio.run(main())


def test_a_dead_gateways_admissions_are_settled_from_their_write_ahead_rows(tmp_path, redis_prefix):
    async def main():
        url = (f"sqlite:///{tmp_path}/ops.db", None)
        dead = await redis_ops(url, redis_prefix, instance_id="gw-dead")
        live = await redis_ops(url, redis_prefix, instance_id="gw-live")
        r = redis.Redis.from_url(REDIS_URL)
        try:
            await live.create_node(None, "org", {"budget_micros": 100, "budget_period": "total"})
            key, _ = await live.create_key("org", "k", {})
            p = await dead.authenticate(key)
            held = [await dead.admit(p, request(prompt=10, max_tokens=10)) for _ in range(3)]
            # the gateway dies: its background tasks stop, its heartbeat lapses
            dead.hot_budgets._closing = True
            await asyncio.gather(*dead.hot_budgets._tasks, return_exceptions=True)
            pl = await live.authenticate(key)
            with pytest.raises(APIError):
                await live.admit(pl, request(prompt=10, max_tokens=10))  # 90 of 100 held
            assert await live.sweep() == 0  # its heartbeat is still fresh: nothing is touched
            r.delete(redis_prefix + "{bud}:hb:gw-dead")
            await live.sweep()  # (or its own sweeper, every couple of seconds)
            assert _open_reservations(redis_prefix) == (0, [0])
            ok = await live.admit(pl, request(prompt=10, max_tokens=10))
            await live.settle(ok, outcome(prompt=10, output=10))
            # a settle arriving after all (the gateway was only partitioned) moves nothing
            late = await dead.hot_budgets.settle(
                held[0], outcome(prompt=10, output=10), live.price_of("m1"), 0
            )
            assert not late.first and late.row.status == "gateway_lost"
        finally:
            r.close()
            await live.close()
            await dead.close()
        spent, rows, agg = _ledger(live)
        statuses = sorted(s for _, s in rows)
        assert statuses == ["gateway_lost"] * 3 + ["ok"]
        assert {a for a, _ in rows} >= {h.id for h in held}
        assert spent == 30 and agg == [30]

    asyncio.run(main())


def test_expired_reservation_of_a_live_gateway_is_freed_and_still_billed(tmp_path, redis_prefix):
    async def main():
        ops = await open_ops(
            (f"sqlite:///{tmp_path}/ops.db", None),
            redis_url=REDIS_URL,
            redis_prefix=redis_prefix,
            budget_store="redis",
            reservation_ttl_s=0.2,
        )
        try:
            await ops.create_node(None, "org", {"budget_micros": 100, "budget_period": "total"})
            key, _ = await ops.create_key("org", "k", {})
            p = await ops.authenticate(key)
            slow = await ops.admit(p, request(prompt=10, max_tokens=45))  # 100: the whole budget
            with pytest.raises(APIError):
                await ops.admit(p, request(prompt=10, max_tokens=30))
            await asyncio.sleep(0.3)
            # past its expiry the reservation no longer counts (the admission sweeps it first)
            ok = await ops.admit(p, request(prompt=10, max_tokens=30))
            await ops.settle(ok, outcome(prompt=10, output=30))
            late = await ops.settle(slow, outcome(prompt=10, output=5))  # billed for what it served
            assert late.status == "ok" and late.cost_micros == 20
            assert _open_reservations(redis_prefix) == (0, [0])
        finally:
            await ops.close()
        spent, rows, agg = _ledger(ops)
        assert (spent, len(rows), agg) == (90, 2, [90])

    asyncio.run(main())


def test_close_waits_for_settles_in_flight_and_settles_what_never_will(target, redis_prefix):
    """A gateway stopping while the settles of its last answered requests are still running (the
    response leaves before the settle) writes every one of their rows before it closes, and an
    admission that will never be settled gets its write-ahead row: one row per admission."""

    async def main():
        ops = await redis_ops(target, redis_prefix, instance_id="gw-stop")
        await ops.create_node(None, "org", {"budget_micros": 10**9, "budget_period": "total"})
        key, _ = await ops.create_key("org", "k", {})
        p = await ops.authenticate(key)
        answered = [await ops.admit(p, request()) for _ in range(60)]
        abandoned = await ops.admit(p, request())  # its request is cut off by the stop
        call = ops.hot_budgets._call

        async def slow(name, keys, args):  # a loaded gateway: settles outlast the stop's own steps
            if name == "settle":
                await asyncio.sleep(0.3)
            return await call(name, keys, args)

        ops.hot_budgets._call = slow
        settles = [asyncio.ensure_future(ops.settle(a, outcome(prompt=10, output=8))) for a in answered]
        await asyncio.sleep(0)  # every settle has started
        await ops.close()
        assert all(s.done() and s.exception() is None for s in settles)
        return ops, answered, abandoned

    ops, answered, abandoned = asyncio.run(main())
    spent, rows, agg = _ledger(ops)
    status = dict(rows)
    assert len(rows) == 61 and set(status) == {a.id for a in answered} | {abandoned.id}
    assert {status[a.id] for a in answered} == {"ok"} and status[abandoned.id] == "gateway_lost"
    assert spent == 60 * 26 and agg == [spent]
    assert _open_reservations(redis_prefix) == (0, [0])


def test_a_batch_delivered_twice_writes_each_row_once(db_target):
    """The flusher's batch insert (unnest arrays on PostgreSQL, multi-row VALUES on SQLite): a batch
    sent again, or naming an admission twice, writes each row and adds its cost once."""
    from datetime import UTC, datetime

    from tokenops.ops import ledger

    def row(node_id, aid, cost, session=None, ttft=None):
        values = {
            "admission_id": aid, "created_at": datetime.now(UTC), "key_id": "k", "tenant": "org",
            "node_path": "org/k", "model_requested": "m1", "model_served": "m1", "session_id": session,
            "priority": 1, "uncached_input_tokens": 10, "cached_input_tokens": 0,
            "incremental_prefill_tokens": 10, "output_tokens": 5, "reasoning_tokens": 0,
            "cost_micros": cost, "reserved_micros": 30, "status": "ok", "finish_reason": None,
            "ttft_ms": ttft, "latency_ms": 1.0, "http_status": 200, "error_code": None, "route": None,
            "degraded": None, "operation": None,
        }  # fmt: skip
        return ledger.PendingRow(values, [(node_id, "total")], (10, 5) if session else None)

    async def main():
        ops = await open_ops(db_target)
        try:
            n = (await ops.create_node(None, "org", {"budget_micros": 1000, "budget_period": "total"})).id
            first = [row(n, "a1", 20), row(n, "a2", 21, session="s", ttft=3.5), row(n, "a1", 20)]
            assert await ops.db.run(ledger.write_batch, first) == 2
            assert await ops.db.run(ledger.write_batch, first) == 0
            assert await ops.db.run(ledger.write_batch, [row(n, "a2", 21), row(n, "a3", 22)]) == 1
            assert await ops.db.run(ledger.previous_turn, "k", "s") == (10, 5)
        finally:
            await ops.close()
        spent, rows, agg = _ledger(ops)
        assert (spent, sorted(a for a, _ in rows), agg) == (63, ["a1", "a2", "a3"], [63])

    asyncio.run(main())
