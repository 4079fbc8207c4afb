import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from ops_helpers import PG_URL, budget_race, open_ops, outcome, request
from sqlalchemy import func, select

from tokenops.ops import models as m
from tokenops.ops.budgets import period_key
from tokenops.protocol import APIError

# m1 costs 1 micro per input token and 2 per output token: prompt 10 + max 10 reserves 30
BUDGET = 1000  # fits 33 worst-case reservations, far fewer than 200


def _totals(ops):
    with ops.db.engine.connect() as conn:
        spent = int(conn.execute(select(func.coalesce(func.sum(m.ledger.c.cost_micros), 0))).scalar_one())
        rows = conn.execute(select(func.count()).select_from(m.ledger)).scalar_one()
        agg = conn.execute(select(m.budget_usage.c.spent_micros, m.budget_usage.c.reserved_micros)).all()
    return spent, rows, agg


@pytest.mark.timeout(300)
def test_budget_race_200_concurrent_never_overspends(db_target):
    async def main():
        ops = await open_ops(db_target)
        try:
            await ops.create_node(None, "org", {"budget_micros": BUDGET, "budget_period": "total"})
            key, _ = await ops.create_key("org", "k", {})
            ids, refused = await budget_race([ops], key)
            admitted = len(ids)
            spent, rows, agg = _totals(ops)
            assert admitted + refused == 200 and refused > 0 and admitted >= BUDGET // 30
            assert rows == admitted
            assert spent <= BUDGET
            assert agg == [(spent, 0)]  # every reservation released, aggregate == ledger
        finally:
            await ops.close()

    asyncio.run(main())


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_budget_race_two_operations_instances_on_postgres(pg_schema):
    target = (PG_URL, pg_schema)

    async def main():
        a = await open_ops(target)
        b = await open_ops(target)  # a second gateway process, its own pool and caches
        try:
            await a.create_node(None, "org", {"budget_micros": BUDGET, "budget_period": "total"})
            await a.create_node("org", "p", {"budget_micros": BUDGET // 2, "budget_period": "day"})
            key, _ = await b.create_key("org/p", "k", {})
            ids, refused = await budget_race([a, b], key)
            admitted = len(ids)
            spent, rows, agg = _totals(a)
            assert rows == admitted and refused > 0
            assert spent <= BUDGET // 2  # the tighter (project) budget binds
            assert sorted(agg) == [(spent, 0), (spent, 0)]
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


def test_settle_is_idempotent_and_releases(db_target):
    async def main():
        ops = await open_ops(db_target)
        try:
            await ops.create_node(None, "org", {"budget_micros": 100, "budget_period": "month"})
            key, _ = await ops.create_key("org", "k", {})
            p = await ops.authenticate(key)
            adm = await ops.admit(p, request(prompt=10, max_tokens=10))
            assert adm.reserved_micros == 30 and not adm.budget_limited
            out = outcome(prompt=10, output=5)
            rows = await asyncio.gather(*(ops.settle(adm, out) for _ in range(5)))
            assert {r.cost_micros for r in rows} == {20}
            spent, n, agg = _totals(ops)
            assert (spent, n, agg) == (20, 1, [(20, 0)])
            status = await ops.node_status("org")
            assert status["spent_micros"] == 20 and status["reserved_micros"] == 0
            assert status["period"] == period_key("month", datetime.now(UTC))
        finally:
            await ops.close()

    asyncio.run(main())


def test_budget_lowers_max_output_then_refuses(db_target):
    async def main():
        ops = await open_ops(db_target)
        try:
            await ops.create_node(None, "org", {"budget_micros": 100, "budget_period": "day"})
            key, _ = await ops.create_key("org", "k", {"budget_micros": 40, "budget_period": "total"})
            p = await ops.authenticate(key)
            a1 = await ops.admit(p, request(prompt=10, max_tokens=5))  # 20, fits
            a2 = await ops.admit(p, request(prompt=10, max_tokens=100))  # 20 left: 5 output tokens
            assert a2.budget_limited and a2.max_output_tokens == 5 and a2.reserved_micros == 20
            with pytest.raises(APIError) as e:
                await ops.admit(p, request(prompt=10, max_tokens=1))
            assert (
                e.value.status == 429 and e.value.code == "insufficient_quota" and "org/k" in e.value.message
            )
            await ops.settle(a1, outcome(prompt=10, output=0))  # frees 10
            a3 = await ops.admit(p, request(prompt=4, max_tokens=None, window=4096))
            assert a3.budget_limited and a3.max_output_tokens == 3  # 4 + 2*3 = 10
            for a in (a2, a3):
                await ops.release(a)
            spent, n, agg = _totals(ops)
            assert spent == 10 and n == 3
            # a free model passes a budget that has room for nothing else
            await ops.admit(p, request(model="free"))
        finally:
            await ops.close()

    asyncio.run(main())


def test_disconnect_and_upstream_error_billing(db_target):
    async def main():
        ops = await open_ops(db_target)
        try:
            await ops.create_node(None, "org", {})
            key, _ = await ops.create_key("org", "k", {})
            p = await ops.authenticate(key)
            a = await ops.admit(p, request())
            row = await ops.settle(a, outcome(prompt=10, output=3, status="client_disconnected"))
            assert row.status == "client_disconnected" and row.output == 3 and row.cost_micros == 16
            b = await ops.admit(p, request())
            row = await ops.settle(b, outcome(prompt=0, output=0, status="upstream_error"))
            assert row.cost_micros == 0 and row.status == "upstream_error"
        finally:
            await ops.close()

    asyncio.run(main())


def test_incremental_prefill_per_session(db_target):
    async def main():
        ops = await open_ops(db_target)
        try:
            await ops.create_node(None, "org", {})
            key, _ = await ops.create_key("org", "k", {})
            p = await ops.authenticate(key)

            async def turn(prompt, output, session="s1", cached=0):
                a = await ops.admit(p, request(prompt=prompt, session=session, fingerprint=str(prompt)))
                return await ops.settle(a, outcome(prompt=prompt, output=output, cached=cached))

            assert (await turn(100, 20)).incremental_prefill == 100  # new session: the whole prompt
            r = await turn(150, 10, cached=120)
            assert r.incremental_prefill == 30 and r.cached_input == 120  # 150 - (100 + 20)
            assert (await turn(50, 5)).incremental_prefill == 50  # context shrank: whole prompt
            assert (await turn(70, 5, session="s2")).incremental_prefill == 70
            assert (await turn(60, 0)).incremental_prefill == 5  # 60 - (50 + 5)
            # the state is in the database: a fresh instance continues the session
            ops2 = await open_ops(ops_target)
            try:
                a = await ops2.admit(await ops2.authenticate(key), request(prompt=80, session="s1"))
                assert (await ops2.settle(a, outcome(prompt=80, output=1))).incremental_prefill == 20
            finally:
                await ops2.close()
        finally:
            await ops.close()

    ops_target = db_target
    asyncio.run(main())


def test_usage_report_groups(db_target):
    async def main():
        ops = await open_ops(db_target)
        try:
            for org in ("a", "b"):
                await ops.create_node(None, org, {})
            ka, ia = await ops.create_key("a", "k", {})
            kb, ib = await ops.create_key("b", "k", {})
            for key, model, n in ((ka, "m1", 3), (kb, "m1", 1), (kb, "free", 2)):
                p = await ops.authenticate(key)
                for _ in range(n):
                    adm = await ops.admit(p, request(model=model))
                    await ops.settle(adm, outcome(prompt=10, output=10, model=model, reasoning=4))
            rows = await ops.usage(["tenant", "model"])
            got = {
                (r["tenant"], r["model"]): (r["requests"], r["cost_micros"], r["total_tokens"]) for r in rows
            }
            assert got == {("a", "m1"): (3, 90, 60), ("b", "free"): (2, 0, 40), ("b", "m1"): (1, 30, 20)}
            a_m1 = next(r for r in rows if r["tenant"] == "a")
            assert a_m1["cost_per_million_tokens"] == pytest.approx(1.5)
            assert a_m1["output"] == 18 and a_m1["reasoning"] == 12
            day = await ops.usage(["day", "key"])
            today = datetime.now(UTC).strftime("%Y-%m-%d")
            assert {(r["day"], r["key"]) for r in day} == {(today, ia.id), (today, ib.id)}
            total = await ops.usage([])
            assert total[0]["requests"] == 6
            assert await ops.usage(["tenant"], since=datetime(2100, 1, 1, tzinfo=UTC)) == []
            from datetime import timedelta, timezone

            east = timezone(timedelta(hours=5))
            now_east = datetime.now(UTC).astimezone(east)
            assert (await ops.usage([], since=now_east - timedelta(minutes=5)))[0]["requests"] == 6
            assert await ops.usage([], until=now_east - timedelta(minutes=5)) == []
            with pytest.raises(APIError) as e:
                await ops.usage(["colour"])
            assert e.value.status == 400
        finally:
            await ops.close()

    asyncio.run(main())


def test_unsettled_reservations_expire_and_a_late_settle_is_not_released_twice(db_target):
    async def main():
        ops = await open_ops(db_target, reservation_ttl_s=0.2)
        try:
            await ops.create_node(None, "org", {"budget_micros": 100, "budget_period": "total"})
            key, _ = await ops.create_key("org", "k", {})
            p = await ops.authenticate(key)
            lost = await ops.admit(
                p, request(prompt=10, max_tokens=45)
            )  # 100 reserved, never settled in time
            with pytest.raises(APIError):
                await ops.admit(p, request(prompt=10, max_tokens=30))
            await asyncio.sleep(0.3)
            assert await ops.sweep() == 1
            assert _totals(ops)[2] == [(0, 0)]
            ok = await ops.admit(p, request(prompt=10, max_tokens=30))
            await ops.settle(ok, outcome(prompt=10, output=30))
            await ops.settle(lost, outcome(prompt=10, output=5))  # late: billed, its reservation already gone
            spent, n, agg = _totals(ops)
            assert (spent, n, agg) == (90, 2, [(90, 0)])
        finally:
            await ops.close()

    asyncio.run(main())


def test_admit_cancelled_mid_transaction_releases_its_reservation(tmp_path):
    async def main():
        ops = await open_ops((f"sqlite:///{tmp_path}/ops.db", None))
        try:
            await ops.create_node(None, "org", {"budget_micros": 100, "budget_period": "total"})
            key, _ = await ops.create_key("org", "k", {})
            p = await ops.authenticate(key)
            spawned = []
            spawn = ops._spawn
            ops._spawn = lambda coro: (spawned.append(1), spawn(coro))
            for _ in range(20):
                task = asyncio.ensure_future(ops.admit(p, request(prompt=10, max_tokens=30)))
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            await asyncio.gather(*list(ops._tasks))
            assert len(spawned) == 20  # every cancel landed while the reservation was in flight
            assert _totals(ops)[2] == [(0, 0)]
        finally:
            await ops.close()

    asyncio.run(main())


def test_periods_day_month_total(db_target):
    from sqlalchemy import update

    t = datetime(2026, 2, 28, 23, 59, tzinfo=UTC)
    assert (period_key("day", t), period_key("month", t), period_key("total", t)) == (
        "2026-02-28",
        "2026-02",
        "total",
    )

    async def main():
        ops = await open_ops(db_target)
        try:
            await ops.create_node(None, "org", {"budget_micros": 30, "budget_period": "day"})
            key, _ = await ops.create_key("org", "k", {})
            p = await ops.authenticate(key)
            await ops.settle(
                await ops.admit(p, request(prompt=10, max_tokens=10)), outcome(prompt=10, output=10)
            )
            with pytest.raises(APIError) as e:
                await ops.admit(p, request(prompt=10, max_tokens=10))
            assert e.value.code == "insufficient_quota"
            # pretend today's row is yesterday's: a new day starts with a fresh, empty row
            with ops.db.engine.begin() as conn:
                conn.execute(update(m.budget_usage).values(period="2000-01-01"))
            a = await ops.admit(p, request(prompt=10, max_tokens=10))
            await ops.settle(a, outcome(prompt=10, output=10))
            _, n, agg = _totals(ops)
            assert n == 2 and sorted(agg) == [(30, 0), (30, 0)]
        finally:
            await ops.close()

    asyncio.run(main())


def test_admission_reports_the_tightest_budget_left(db_target):
    """`budget_left` is the fraction of the tightest budget on the path that neither spent money nor
    other requests' reservations take, before this request: what the cluster's `budget_below` reads."""

    async def main():
        ops = await open_ops(db_target)
        try:
            await ops.create_node(None, "org", {"budget_micros": 10_000, "budget_period": "total"})
            await ops.create_node("org", "team", {"budget_micros": 1000, "budget_period": "total"})
            key, _ = await ops.create_key("org/team", "k", {})
            free, _ = await ops.create_key("org", "free", {})
            p = await ops.authenticate(key)
            first = await ops.admit(p, request(prompt=10, max_tokens=10))  # reserves 30 on both
            assert first.budget_left == 1.0
            second = await ops.admit(p, request(prompt=10, max_tokens=10))  # the team's 1000 is tighter
            assert second.budget_left == pytest.approx(0.97)
            await ops.settle(first, outcome(prompt=10, output=10))  # spends 30
            await ops.settle(second, outcome(prompt=100, output=300))  # spends 700
            third = await ops.admit(p, request(prompt=10, max_tokens=10))
            assert third.budget_left == pytest.approx(0.27)
            # a key under the org only sees the org's budget (10,000 - 730 spent - 30 reserved)
            other = await ops.admit(await ops.authenticate(free), request(prompt=10, max_tokens=10))
            assert other.budget_left == pytest.approx(0.924)
            await ops.settle(third, outcome(prompt=10, output=0))
            await ops.settle(other, outcome(prompt=10, output=0))
        finally:
            await ops.close()

    asyncio.run(main())


def test_usage_by_node_hour_and_asked_model_below_a_node(db_target):
    async def main():
        ops = await open_ops(db_target)
        try:
            await ops.create_node(None, "org", {})
            await ops.create_node("org", "p1", {})
            await ops.create_node(None, "org2", {})  # a name that starts like org: not under it
            k1, _ = await ops.create_key("org/p1", "k", {})
            k2, _ = await ops.create_key("org2", "k", {})
            for key, n in ((k1, 2), (k2, 3)):
                p = await ops.authenticate(key)
                for _ in range(n):
                    await ops.settle(await ops.admit(p, request()), outcome())
            rows = await ops.usage(["node", "route", "hour"], under="org")
            hour = datetime.now(UTC).strftime("%Y-%m-%d %H")
            assert [(r["node"], r["route"], r["hour"], r["requests"]) for r in rows] in (
                [("org/p1/k", None, hour, 2)],
                # the hour turned between the settles and the query's clock read
                [("org/p1/k", None, (datetime.now(UTC) - timedelta(hours=1)).strftime("%Y-%m-%d %H"), 2)],
            )
            assert (await ops.usage([], under="org/p1/k"))[0]["requests"] == 2
            p = await ops.authenticate(k1)
            routed = dataclasses.replace(outcome(), route="route=auto; model=m1; reason=rules score 0.20")
            await ops.settle(await ops.admit(p, request()), routed)
            by_route = await ops.usage(["route"], under="org")
            assert [(r["route"], r["requests"]) for r in by_route] in (
                [(None, 2), ("auto", 1)],
                [("auto", 1), (None, 2)],
            )
            assert (await ops.usage([], under="org2"))[0]["requests"] == 3
            assert await ops.usage([], under="org/p2") == []
        finally:
            await ops.close()

    asyncio.run(main())
