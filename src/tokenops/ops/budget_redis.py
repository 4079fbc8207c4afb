"""Budgets in Redis: the hot counters and reservations of every budgeted node live in Redis and
change only inside Lua scripts, so a check and its increment are one atomic step shared by every
gateway; the database is the durable record, written in batches.

- every script call goes through one pipeline per gateway (redis_scripts.py); each script is safe
  to run twice, as a batch sent again after a lost connection would.
- reserve: one script sweeps a few expired reservations, checks `spent + reserved + x <= limit` on
  every node of the path and adds `x` to each, and records the open admission (amount, counters,
  gateway instance, and a write-ahead ledger row: what the admission is billed as should its
  gateway die before settling).
- settle: one script marks the admission settled (a repeat finds the mark and moves nothing),
  moves its reservation to spent and appends the finished ledger row to a Redis stream; a flusher
  in every gateway reads the stream (consumer group) and inserts the rows in one transaction per
  batch, idempotent per admission id, acking only after the commit. A flusher that died with
  entries read but not acked has them claimed by another after `CLAIM_IDLE_MS`.
- a gateway heartbeats; a sweep (any gateway, every `HEARTBEAT_S`) settles the open admissions of
  an instance whose heartbeat lapsed from their write-ahead rows and releases their reservations;
  a reservation past its TTL is released too (settled from its write-ahead row when its gateway is
  gone; a live gateway still settles it with its real cost).
- a counter missing in Redis (a new period, a Redis that lost its data) is seeded once, by a
  script that sets it only if still absent, from the database's spent plus the stream's rows not
  yet in the database, so racing gateways cannot add the seed twice.
Redis must keep its data (AOF, `maxmemory-policy noeviction`): the stream holds rows not yet
written to the database."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import and_, select

from tokenops.ops import ledger
from tokenops.ops import models as m
from tokenops.ops.budgets import BudgetHold, Reservation, shrunk
from tokenops.ops.db import Database
from tokenops.ops.domain import Admission, Outcome
from tokenops.ops.pricing import Price
from tokenops.ops.redis_scripts import PackingConnection, ScriptPipeline
from tokenops.protocol import APIError

log = logging.getLogger("tokenops.ops")

HEARTBEAT_S = 2.0  # a gateway renews its heartbeat (and sweeps) this often
DEAD_AFTER_MS = 10_000  # a heartbeat older than this: the gateway is gone
CLAIM_IDLE_MS = 10_000  # stream entries read but unacked this long are taken over
DONE_TTL_S = 86_400  # how long a settled admission's mark answers a repeated settle
BATCH = 1000
FLUSH_GATHER_S = 0.05  # after a small batch the flusher waits this long: rows reach the database in
# well under a second, in a few transactions per second per gateway
GROUP = "flush"

# Shared Lua: ARGV[1] is the key prefix. `release` frees one open admission's reservation; with
# `recover` (its gateway is gone) it also settles it from its write-ahead row, once.
_PRELUDE = """
local P = ARGV[1]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function release(aid, recover)
  local ak = P .. 'a:' .. aid
  local a = redis.call('HMGET', ak, 'amount', 'holds', 'inst', 'wal')
  redis.call('ZREM', P .. 'rx', aid)
  if not a[1] then return 0 end
  local amount = tonumber(a[1])
  for k in string.gmatch(a[2], '%S+') do
    if redis.call('EXISTS', k) == 1 then
      redis.call('HINCRBY', k, 'reserved', string.format('%.0f', -amount))
    end
  end
  redis.call('DEL', ak)
  redis.call('SREM', P .. 'ri:' .. a[3], aid)
  if recover and redis.call('SET', P .. 'd:' .. aid, a[4], 'NX', 'EX', DONE_TTL) then
    redis.call('XADD', P .. 'ledger', '*', 'r', a[4])
  end
  return 1
end
local function alive(inst)
  return redis.call('EXISTS', P .. 'hb:' .. inst) == 1
end
local function sweep(now, limit)
  local n = 0
  for _, aid in ipairs(redis.call('ZRANGEBYSCORE', P .. 'rx', '-inf', now, 'LIMIT', 0, limit)) do
    local inst = redis.call('HGET', P .. 'a:' .. aid, 'inst')
    n = n + release(aid, (not inst) or not alive(inst))
  end
  return n
end
local function recover(inst)
  local n = 0
  for _, aid in ipairs(redis.call('SMEMBERS', P .. 'ri:' .. inst)) do n = n + release(aid, true) end
  redis.call('DEL', P .. 'ri:' .. inst)
  redis.call('SREM', P .. 'insts', inst)
  return n
end
""".replace("DONE_TTL", str(DONE_TTL_S))

# KEYS: the path's counters. ARGV: prefix, admission id, amount, ttl ms, instance, write-ahead row,
# then each counter's limit. Returns {'ok', left} | {'short', headroom, index} | {'missing', i...}.
_RESERVE = (
    _PRELUDE
    + """
local now = now_ms()
sweep(now, 16)
local aid, amount, ttl, inst, wal = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], ARGV[6]
local held = redis.call('HGET', P .. 'a:' .. aid, 'left')
if held then return {'ok', held} end  -- sent again (a lost connection): reserved once
local missing, minhead, tight, left = {}, nil, 0, 1
for i, k in ipairs(KEYS) do
  local c = redis.call('HMGET', k, 'spent', 'reserved')
  if not c[1] then
    missing[#missing + 1] = i
  else
    local lim = tonumber(ARGV[6 + i])
    local head = lim - tonumber(c[1]) - tonumber(c[2] or 0)
    if minhead == nil or head < minhead then minhead, tight = head, i end
    local frac = 0
    if lim > 0 then frac = math.min(1, math.max(0, head / lim)) end
    if frac < left then left = frac end
  end
end
if #missing > 0 then return {'missing', unpack(missing)} end
if minhead < amount then return {'short', string.format('%.0f', minhead), tight} end
for _, k in ipairs(KEYS) do redis.call('HINCRBY', k, 'reserved', ARGV[3]) end
left = string.format('%.6f', left)
redis.call('HSET', P .. 'a:' .. aid, 'amount', ARGV[3], 'holds', table.concat(KEYS, ' '),
  'inst', inst, 'wal', wal, 'left', left)
redis.call('ZADD', P .. 'rx', now + ttl, aid)
redis.call('SADD', P .. 'ri:' .. inst, aid)
redis.call('SADD', P .. 'insts', inst)
return {'ok', left}
"""
)

# KEYS: the admission's counters. ARGV: prefix, admission id, cost, row, session-turn key ('' for
# none), turn. Returns {'ok', spent after per counter ('-1': counter gone)} | {'repeat', first row}.
_SETTLE = (
    _PRELUDE
    + """
local aid, row = ARGV[2], ARGV[4]
if not redis.call('SET', P .. 'd:' .. aid, row, 'NX', 'EX', DONE_TTL) then
  return {'repeat', redis.call('GET', P .. 'd:' .. aid)}
end
local ak = P .. 'a:' .. aid
local a = redis.call('HMGET', ak, 'amount', 'inst')
local amount = tonumber(a[1]) or 0
local out = {'ok'}
for _, k in ipairs(KEYS) do
  if redis.call('EXISTS', k) == 1 then
    if amount ~= 0 then redis.call('HINCRBY', k, 'reserved', string.format('%.0f', -amount)) end
    out[#out + 1] = string.format('%.0f', redis.call('HINCRBY', k, 'spent', ARGV[3]))
  else
    out[#out + 1] = '-1'
  end
end
if a[1] then
  redis.call('DEL', ak)
  redis.call('ZREM', P .. 'rx', aid)
  redis.call('SREM', P .. 'ri:' .. a[2], aid)
end
redis.call('XADD', P .. 'ledger', '*', 'r', row)
if ARGV[5] ~= '' then redis.call('SET', ARGV[5], ARGV[6], 'EX', DONE_TTL) end
return out
""".replace("DONE_TTL", str(DONE_TTL_S))
)

# ARGV: prefix, admission id. Frees a reservation whose admit was cancelled (no ledger row).
_RELEASE = _PRELUDE + "return release(ARGV[2], false)"

# ARGV: prefix, this instance, heartbeat ms, instance to recover at start ('' for none). Renews the
# heartbeat, recovers dead instances and expired reservations; returns how many were released.
_SWEEP = (
    _PRELUDE
    + """
local me, beat, previous = ARGV[2], tonumber(ARGV[3]), ARGV[4]
local n = 0
if previous ~= '' then n = n + recover(previous) end
redis.call('SET', P .. 'hb:' .. me, '1', 'PX', beat)
for _, inst in ipairs(redis.call('SMEMBERS', P .. 'insts')) do
  if not alive(inst) then n = n + recover(inst) end
end
return n + sweep(now_ms(), 1000)
"""
)

# KEYS: a counter. ARGV: spent, expiry seconds (0: none). Sets it only if still absent.
_SEED = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'spent', ARGV[1], 'reserved', 0)
if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 1
"""


def _period_expiry_s(period: str) -> int:
    """How long a period's counter is kept: past its period nobody reserves on it."""
    if period == "total":
        return 0
    return 3 * 86_400 if len(period) == 10 else 62 * 86_400


def encode(values: dict[str, Any], holds: list[tuple[int, str]], turn: tuple[int, int] | None = None) -> str:
    """A ledger row as a stream entry (or write-ahead record): its values, budget rows and turn."""
    return orjson.dumps({"v": values, "h": holds, "t": turn}).decode()


def decode(raw: bytes | str) -> ledger.PendingRow:
    """A stream entry (or write-ahead record) back as the row it encodes."""
    d = orjson.loads(raw)
    v = d["v"]
    v["created_at"] = datetime.fromisoformat(v["created_at"])
    return ledger.PendingRow(v, [(int(n), str(p)) for n, p in d["h"]], tuple(d["t"]) if d["t"] else None)


class RedisBudgets:
    """Budget counters and reservations in Redis, the ledger written to the database in batches."""

    # a settled row is durable once settle returns (it is in the Redis stream): an admission with no
    # budget on its path settles here too, its row batched rather than a transaction of its own
    durable_settle = True

    def __init__(self, redis_url: str, prefix: str, db: Database, instance: str | None) -> None:
        import redis.asyncio as aioredis

        # a bounded pool that makes a burst wait for a connection rather than fail
        pool = aioredis.BlockingConnectionPool.from_url(
            redis_url, max_connections=64, timeout=30, connection_class=PackingConnection
        )
        self._redis = aioredis.Redis.from_pool(pool)
        self._p = prefix + "{bud}:"
        self._db = db
        # a restarted gateway with a stable name recovers its previous run's admissions at start
        self._previous = instance or ""
        self.instance = instance or f"anon-{uuid.uuid4().hex[:12]}"
        self._call = ScriptPipeline(
            self._redis,
            {"reserve": _RESERVE, "settle": _SETTLE, "release": _RELEASE, "sweep": _SWEEP, "seed": _SEED},
        ).call
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self._own_pending = True  # first read what this consumer name left unacked
        self._last_claim = 0.0

    def _counter(self, node_id: int, period: str) -> str:
        return f"{self._p}c:{node_id}:{period}"

    async def start(self) -> int:
        """Heartbeat, recover this instance's previous run and dead instances, start the flusher
        and the sweeper; returns how many open admissions were released."""
        try:
            await self._redis.xgroup_create(self._p + "ledger", GROUP, id="0", mkstream=True)
        except Exception as exc:  # noqa: BLE001 - BUSYGROUP: another gateway created it
            if "BUSYGROUP" not in str(exc):
                raise
        n = await self.sweep(recover_previous=True)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._flush_forever()), loop.create_task(self._sweep_forever())]
        return n

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        try:  # an admission still open now is never settled by this gateway: its write-ahead row
            await self._call("sweep", [], [self._p, self.instance, DEAD_AFTER_MS, self.instance])
        except Exception:  # left open: another gateway's sweep, or this one's next start, settles it
            log.exception("settling this gateway's open admissions at close failed")
        try:  # what this gateway settled last reaches the database before it stops
            while await self.flush_once():
                pass
        except Exception:  # left in the stream: another gateway or the next start writes it
            log.exception("final ledger flush failed")
        with contextlib.suppress(Exception):  # a clean stop: nothing of ours is open any more
            await self._redis.delete(self._p + "hb:" + self.instance)
        await self._redis.aclose()

    # ------------------------------------------------------------------ admission

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
        keys = [self._counter(h.node_id, h.period) for h in holds]
        limits = [h.limit_micros for h in holds]
        for _ in range(8):  # each retry follows a change of headroom by other gateways
            res = await self._call(
                "reserve",
                keys,
                [self._p, admission_id, amount, int(ttl_s * 1000), self.instance, write_ahead(amount)]
                + limits,
            )
            kind = res[0].decode()
            if kind == "ok":
                return Reservation(amount, float(res[1]))
            if kind == "missing":
                await self._seed_counters([holds[int(i) - 1] for i in res[1:]])
                continue
            amount = shrunk(holds[int(res[2]) - 1], int(res[1]), shrink, minimal)
        raise APIError(
            429,
            "Budget contended: the headroom kept changing under concurrent requests. Retry shortly.",
            type="insufficient_quota",
            code="insufficient_quota",
        )

    async def _seed_counters(self, holds: list[BudgetHold]) -> None:
        # the stream first, the database second: a row flushed in between is then in the database
        # and recognised there by its admission id, so it is counted exactly once
        pending: dict[str, ledger.PendingRow] = {}
        for _, fields in await self._redis.xrange(self._p + "ledger"):
            row = decode(fields[b"r"])
            pending[row.values["admission_id"]] = row
        wanted = [(h.node_id, h.period) for h in holds]

        def tx(conn):  # noqa: ANN001, ANN202
            U = m.budget_usage
            spent = {}
            for node_id, period in wanted:
                v = conn.execute(
                    select(U.c.spent_micros).where(and_(U.c.node_id == node_id, U.c.period == period))
                ).scalar_one_or_none()
                spent[(node_id, period)] = int(v or 0)
            ids = list(pending)
            in_db: set[str] = set()
            for i in range(0, len(ids), 500):
                chunk = ids[i : i + 500]
                q = select(m.ledger.c.admission_id).where(m.ledger.c.admission_id.in_(chunk))
                in_db.update(conn.execute(q).scalars())
            return spent, in_db

        spent, in_db = await self._db.run(tx)
        for aid, row in pending.items():
            if aid in in_db:
                continue
            for hold in row.holds:
                if hold in spent:
                    spent[hold] += int(row.values["cost_micros"])
        for (node_id, period), value in spent.items():
            await self._call("seed", [self._counter(node_id, period)], [value, _period_expiry_s(period)])

    async def release(self, admission_id: str) -> None:
        """Free the reservation of an admission that was never handed out (its admit was cancelled)."""
        await self._call("release", [], [self._p, admission_id])

    # ------------------------------------------------------------------ settle

    def _turn_key(self, key_id: str, session_id: str) -> str:
        return f"{self._p}t:{key_id}:{session_id}"

    async def settle(
        self, admission: Admission, outcome: Outcome, price: Price, side_micros: int
    ) -> ledger.SettleResult:
        sid = admission.session_id
        key_id = admission.principal.key_id
        previous = None
        if sid and outcome.usage.prompt_tokens > 0 and outcome.computed_prompt_tokens is None:
            raw = await self._redis.get(self._turn_key(key_id, sid))
            if raw is not None:
                p, o = raw.split()
                previous = (int(p), int(o))
            else:
                previous = await self._db.run(ledger.previous_turn, key_id, sid)
        row, values, turn = ledger.make_row(admission, outcome, price, side_micros, previous)
        encoded = encode(values, admission.holds, turn)
        turn_key, turn_value = "", ""
        if turn is not None and sid:
            turn_key, turn_value = self._turn_key(key_id, sid), f"{turn[0]} {turn[1]}"
        res = await self._call(
            "settle",
            [self._counter(n, p) for n, p in admission.holds],
            [self._p, admission.id, row.cost_micros, encoded, turn_key, turn_value],
        )
        if res[0] == b"repeat":
            return ledger.SettleResult(ledger.row_from_values(decode(res[1]).values), False, [])
        spent = [(n, p, int(s)) for (n, p), s in zip(admission.holds, res[1:], strict=True) if int(s) >= 0]
        return ledger.SettleResult(row, True, spent)

    # ------------------------------------------------------------------ background

    async def sweep(self, recover_previous: bool = False) -> int:
        """Renew this gateway's heartbeat; settle dead gateways' open admissions from their
        write-ahead rows and release expired reservations; returns how many were released."""
        previous = self._previous if recover_previous else ""
        return int(await self._call("sweep", [], [self._p, self.instance, DEAD_AFTER_MS, previous]))

    async def _sweep_forever(self) -> None:
        while not self._closing:
            try:
                n = await self.sweep()
                if n:
                    log.warning("released %d budget reservation(s) of dead or expired admissions", n)
            except Exception:  # retried next beat
                log.exception("budget sweep failed")
            await self._sleep(HEARTBEAT_S)

    async def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self._closing and time.monotonic() < end:
            await asyncio.sleep(min(0.1, seconds))

    async def _flush_forever(self) -> None:
        while not self._closing:
            try:
                if await self.flush_once(block_ms=50) < BATCH // 10:
                    # a small batch: let rows gather, so one transaction carries many of them
                    await asyncio.sleep(FLUSH_GATHER_S)
            except asyncio.CancelledError:
                raise
            except Exception:  # unacked entries are read again (ours) or claimed (another's)
                log.exception("ledger flush failed; retrying")
                self._own_pending = True
                await self._sleep(0.5)

    async def flush_once(self, block_ms: int | None = None) -> int:
        """Write one batch of settled rows from the stream to the database and ack it: first what
        this consumer left unacked (a restarted gateway, a failed batch), then entries other
        consumers left idle past `CLAIM_IDLE_MS` (a dead gateway's), then new ones; returns how
        many rows were written."""
        stream = self._p + "ledger"
        entries: list = []
        if self._own_pending:
            got = await self._redis.xreadgroup(GROUP, self.instance, {stream: "0"}, count=BATCH)
            entries = got[0][1] if got else []
            self._own_pending = bool(entries)
        if not entries and time.monotonic() - self._last_claim > HEARTBEAT_S:
            self._last_claim = time.monotonic()
            claimed = await self._redis.xautoclaim(
                stream, GROUP, self.instance, CLAIM_IDLE_MS, "0-0", count=BATCH
            )
            entries = claimed[1]
        if not entries:
            got = await self._redis.xreadgroup(
                GROUP, self.instance, {stream: ">"}, count=BATCH, block=block_ms
            )
            entries = got[0][1] if got else []
        if not entries:
            return 0
        try:
            await self._db.run(ledger.write_batch, [decode(f[b"r"]) for _, f in entries])
        except BaseException:
            self._own_pending = True
            raise
        ids = [eid for eid, _ in entries]
        await self._redis.xack(stream, GROUP, *ids)
        await self._redis.xdel(stream, *ids)
        return len(entries)

    async def usage(self, node_id: int, period: str) -> tuple[int, int] | None:
        """(spent, reserved) of a node's live counter; None when Redis has none."""
        spent, reserved = await self._redis.hmget(self._counter(node_id, period), "spent", "reserved")
        return None if spent is None else (int(spent), int(reserved or 0))

    async def open_admissions(self) -> int:
        """Admissions holding a reservation right now (every gateway)."""
        return int(await self._redis.zcard(self._p + "rx"))
