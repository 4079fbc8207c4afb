"""Rate and concurrency limits per node: RPM (a sliding 60 s log of admissions), TPM (a token bucket
of `tpm` tokens refilled at tpm/60 per second, charged the reserved tokens at admit and corrected by
the difference at settle) and max concurrent (a lease set, so a crashed gateway's slots expire).
A gateway renews the leases of its running requests every third of `concurrency_lease_s`, so a lease
can be short (a dead gateway's slots free within it) however long a request runs, and a refusal's
Retry-After tells the truth: 1 s while some holder is alive (a slot frees whenever its request ends),
the time until the first lease expires when every holder has stopped renewing (its gateway died).
Every node of the path is checked and then charged in one atomic step: in process (no await in
between) by default, or in Redis with one Lua script per call, using the Redis server's clock, so
that several gateways share a limit exactly. Budgets (money) are not here: see `budgets.py`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

WINDOW_S = 60.0
log = logging.getLogger("tokenops.ops")


def renew_interval(lease_s: float) -> float:
    return lease_s / 3


# a lease is renewed for at most this long: an admission that was never settled (a bug) must not
# hold its slot forever (the budget's reservation TTL bounds the same case for money)
MAX_HOLD_S = 3600.0


class _Renewer:
    """The leases this gateway holds, renewed in the background every third of the lease."""

    def __init__(self, lease_s: float, renew, clock=time.monotonic) -> None:  # noqa: ANN001
        # admission -> (when it took its leases, the nodes whose max_concurrent it holds)
        self.held: dict[str, tuple[float, list[LimitNode]]] = {}
        self._lease = lease_s
        self._renew = renew  # async (admission -> nodes) -> None
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    def hold(self, admission_id: str, nodes: list[LimitNode]) -> None:
        leased = [n for n in nodes if n.max_concurrent]
        if not leased:
            return
        self.held[admission_id] = (self._clock(), leased)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._forever())

    def drop(self, admission_id: str) -> None:
        self.held.pop(admission_id, None)

    def due(self) -> dict[str, list[LimitNode]]:
        """The leases to renew now; those held past MAX_HOLD_S are let expire."""
        oldest = self._clock() - MAX_HOLD_S
        for admission_id in [a for a, (since, _) in self.held.items() if since < oldest]:
            log.warning("admission %s held its concurrency lease %.0f s unsettled", admission_id, MAX_HOLD_S)
            del self.held[admission_id]
        return {a: nodes for a, (_, nodes) in self.held.items()}

    async def _forever(self) -> None:
        while self.held:
            await asyncio.sleep(renew_interval(self._lease))
            try:
                due = self.due()
                if due:
                    await self._renew(due)
            except Exception:  # retried next interval; a lease outlives two missed renewals
                log.exception("concurrency lease renewal failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


@dataclass(frozen=True)
class LimitNode:
    node_id: int
    path: str
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None


@dataclass
class LimitRefusal:
    limit: str  # "rpm" | "tpm" | "max_concurrent"
    node_path: str
    value: int
    retry_after_s: float
    # max_concurrent: when the oldest lease expires, the latest a slot frees (its request may have
    # died with its gateway); None for the other limits
    frees_by_s: float | None = None

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


class LimitStore(Protocol):
    async def acquire(
        self, admission_id: str, nodes: list[LimitNode], tokens: int
    ) -> LimitRefusal | None: ...
    async def settle(
        self, admission_id: str, nodes: list[LimitNode], reserved_tokens: int, actual_tokens: int
    ) -> None: ...
    async def release_instance(self, admission_prefix: str) -> int: ...
    async def close(self) -> None: ...


class InProcessLimits:
    """Counters in this process's memory (one gateway)."""

    def __init__(self, concurrency_lease_s: float = 30.0, clock=time.monotonic) -> None:  # noqa: ANN001
        self._rpm: dict[int, deque[float]] = {}
        self._tpm: dict[int, list[float]] = {}  # node -> [level, ts]
        self._conc: dict[int, dict[str, float]] = {}  # node -> admission -> lease expiry
        self._lease = concurrency_lease_s
        self._clock = clock
        self._renewer = _Renewer(concurrency_lease_s, self._renew, clock)

    async def _renew(self, held: dict[str, list[LimitNode]]) -> None:
        expiry = self._clock() + self._lease
        for admission_id, nodes in held.items():
            for n in nodes:
                leases = self._conc.get(n.node_id, {})
                if admission_id in leases:
                    leases[admission_id] = expiry

    def _level(self, node: LimitNode, now: float) -> float:
        level, ts = self._tpm.get(node.node_id, (float(node.tpm), now))
        return min(float(node.tpm), level + (now - ts) * node.tpm / WINDOW_S)

    async def acquire(self, admission_id: str, nodes: list[LimitNode], tokens: int) -> LimitRefusal | None:
        now = self._clock()
        for n in nodes:  # check every node first: a refusal charges nothing
            if n.rpm:
                log = self._rpm.setdefault(n.node_id, deque())
                while log and log[0] <= now - WINDOW_S:
                    log.popleft()
                if len(log) >= n.rpm:
                    return LimitRefusal("rpm", n.path, n.rpm, log[0] + WINDOW_S - now)
            if n.tpm:
                level = self._level(n, now)
                if level < tokens:
                    return LimitRefusal("tpm", n.path, n.tpm, (tokens - level) * WINDOW_S / n.tpm)
            if n.max_concurrent:
                held = self._conc.setdefault(n.node_id, {})
                for aid in [a for a, exp in held.items() if exp <= now]:
                    del held[aid]
                if len(held) >= n.max_concurrent:
                    # every holder is a live request of this process: a slot frees when one ends
                    frees_by = min(held.values()) - now
                    return LimitRefusal("max_concurrent", n.path, n.max_concurrent, 1.0, frees_by)
        for n in nodes:
            if n.rpm:
                self._rpm[n.node_id].append(now)
            if n.tpm:
                self._tpm[n.node_id] = [self._level(n, now) - tokens, now]
            if n.max_concurrent:
                self._conc[n.node_id][admission_id] = now + self._lease
        self._renewer.hold(admission_id, nodes)
        return None

    async def settle(
        self, admission_id: str, nodes: list[LimitNode], reserved_tokens: int, actual_tokens: int
    ) -> None:
        now = self._clock()
        for n in nodes:
            if n.tpm:
                self._tpm[n.node_id] = [
                    min(float(n.tpm), self._level(n, now) + reserved_tokens - actual_tokens),
                    now,
                ]
            if n.max_concurrent:
                self._conc.get(n.node_id, {}).pop(admission_id, None)
        self._renewer.drop(admission_id)

    async def release_instance(self, admission_prefix: str) -> int:
        return 0  # counters in memory die with the process that held them

    async def close(self) -> None:
        await self._renewer.close()


# KEYS: 3 per node (rpm log, tpm bucket, concurrency leases). ARGV: admission id, tokens, lease
# seconds, then rpm, tpm, max_concurrent per node (0 = none). Returns {0} or {node index, limit,
# retry-after as a string (Lua numbers would be truncated to integers)}.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local id, tokens, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local n = #KEYS / 3
local levels = {}
for i = 1, n do
  local rpm, tpm, conc = tonumber(ARGV[1 + 3 * i]), tonumber(ARGV[2 + 3 * i]), tonumber(ARGV[3 + 3 * i])
  local kr, kt, kc = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  if rpm > 0 then
    redis.call('ZREMRANGEBYSCORE', kr, '-inf', now - 60)
    if redis.call('ZCARD', kr) >= rpm then
      local oldest = redis.call('ZRANGE', kr, 0, 0, 'WITHSCORES')
      return {i, 'rpm', tostring(tonumber(oldest[2]) + 60 - now)}
    end
  end
  if tpm > 0 then
    local b = redis.call('HMGET', kt, 'level', 'ts')
    local level, ts = tonumber(b[1]) or tpm, tonumber(b[2]) or now
    level = math.min(tpm, level + (now - ts) * tpm / 60)
    if level < tokens then return {i, 'tpm', tostring((tokens - level) * 60 / tpm)} end
    levels[i] = level
  end
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', kc, '-inf', now)
    if redis.call('ZCARD', kc) >= conc then
      local oldest = redis.call('ZRANGE', kc, 0, 0, 'WITHSCORES')
      local newest = redis.call('ZRANGE', kc, -1, -1, 'WITHSCORES')
      local frees_by = tonumber(oldest[2]) - now
      -- a live holder's lease was renewed within a third of the lease: it may end any moment
      local retry = '1'
      if tonumber(newest[2]) < now + lease / 3 then retry = tostring(frees_by) end
      return {i, 'max_concurrent', retry, tostring(frees_by)}
    end
  end
end
for i = 1, n do
  local rpm, tpm, conc = tonumber(ARGV[1 + 3 * i]), tonumber(ARGV[2 + 3 * i]), tonumber(ARGV[3 + 3 * i])
  local kr, kt, kc = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  if rpm > 0 then redis.call('ZADD', kr, now, id); redis.call('EXPIRE', kr, 61) end
  if tpm > 0 then
    redis.call('HSET', kt, 'level', tostring(levels[i] - tokens), 'ts', tostring(now))
    redis.call('EXPIRE', kt, 120)
  end
  if conc > 0 then
    redis.call('ZADD', kc, now + lease, id); redis.call('EXPIRE', kc, math.ceil(lease) + 60)
  end
end
return {0}
"""

# KEYS: the concurrency-lease sets. ARGV: lease seconds, then for each key the number of admissions
# and their ids. Moves each lease still held to now + lease (XX: a settled one is not re-added).
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local lease = tonumber(ARGV[1])
local at = 2
for i = 1, #KEYS do
  local count = tonumber(ARGV[at])
  for j = 1, count do
    redis.call('ZADD', KEYS[i], 'XX', now + lease, ARGV[at + j])
  end
  at = at + count + 1
  redis.call('EXPIRE', KEYS[i], math.ceil(lease) + 60)
end
return 0
"""

# KEYS: 2 per node (tpm bucket, concurrency leases). ARGV: admission id, token refund (reserved -
# actual, may be negative), then tpm per node (0 = none).
_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local id, refund = ARGV[1], tonumber(ARGV[2])
for i = 1, #KEYS / 2 do
  local tpm = tonumber(ARGV[2 + i])
  local kt, kc = KEYS[2 * i - 1], KEYS[2 * i]
  if tpm > 0 then
    local b = redis.call('HMGET', kt, 'level', 'ts')
    local level, ts = tonumber(b[1]) or tpm, tonumber(b[2]) or now
    level = math.min(tpm, level + (now - ts) * tpm / 60 + refund)
    redis.call('HSET', kt, 'level', tostring(level), 'ts', tostring(now)); redis.call('EXPIRE', kt, 120)
  end
  redis.call('ZREM', kc, id)
end
return 0
"""


class RedisLimits:
    """Counters in Redis, shared by every gateway that names the same `redis_url` and prefix."""

    def __init__(
        self, redis_url: str, prefix: str = "tokenops:ops:", concurrency_lease_s: float = 30.0
    ) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.Redis.from_url(redis_url)
        self._prefix = prefix
        self._lease = concurrency_lease_s
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._settle = self._redis.register_script(_SETTLE)
        self._renew_script = self._redis.register_script(_RENEW)
        self._renewer = _Renewer(concurrency_lease_s, self._renew)

    async def _renew(self, held: dict[str, list[LimitNode]]) -> None:
        by_key: dict[str, list[str]] = {}
        for admission_id, nodes in held.items():
            for n in nodes:
                by_key.setdefault(self._keys(n.node_id)[2], []).append(admission_id)
        args: list[str | float | int] = [self._lease]
        for ids in by_key.values():
            args.extend((len(ids), *ids))
        await self._renew_script(keys=list(by_key), args=args)

    def _keys(self, node_id: int) -> tuple[str, str, str]:
        # a hash tag keeps every node's keys on one slot, should this run on Redis Cluster
        p = f"{self._prefix}{{lim}}:{node_id}:"
        return p + "rpm", p + "tpm", p + "conc"

    async def acquire(self, admission_id: str, nodes: list[LimitNode], tokens: int) -> LimitRefusal | None:
        nodes = [n for n in nodes if n.rpm or n.tpm or n.max_concurrent]
        if not nodes:
            return None
        keys: list[str] = []
        args: list[str | int | float] = [admission_id, tokens, self._lease]
        for n in nodes:
            keys.extend(self._keys(n.node_id))
            args.extend((n.rpm or 0, n.tpm or 0, n.max_concurrent or 0))
        res = await self._acquire(keys=keys, args=args)
        if int(res[0]) == 0:
            self._renewer.hold(admission_id, nodes)
            return None
        n = nodes[int(res[0]) - 1]
        limit = res[1].decode() if isinstance(res[1], bytes) else str(res[1])
        value = {"rpm": n.rpm, "tpm": n.tpm, "max_concurrent": n.max_concurrent}[limit] or 0
        frees_by = float(res[3]) if len(res) > 3 else None
        return LimitRefusal(limit, n.path, value, float(res[2]), frees_by)

    async def settle(
        self, admission_id: str, nodes: list[LimitNode], reserved_tokens: int, actual_tokens: int
    ) -> None:
        self._renewer.drop(admission_id)
        nodes = [n for n in nodes if n.tpm or n.max_concurrent]
        if not nodes:
            return
        keys: list[str] = []
        args: list[str | int] = [admission_id, reserved_tokens - actual_tokens]
        for n in nodes:
            _, kt, kc = self._keys(n.node_id)
            keys.extend((kt, kc))
            args.append(n.tpm or 0)
        await self._settle(keys=keys, args=args)

    async def release_instance(self, admission_prefix: str) -> int:
        """Drop the concurrency leases of admissions whose id starts with `admission_prefix` (a
        restarted gateway's own, left by its previous run); returns how many."""
        dropped = 0
        async for key in self._redis.scan_iter(match=f"{self._prefix}{{lim}}:*:conc", count=500):
            stale = [m async for m, _ in self._redis.zscan_iter(key, match=f"{admission_prefix}*")]
            if stale:
                dropped += await self._redis.zrem(key, *stale)
        return dropped

    async def close(self) -> None:
        await self._renewer.close()
        await self._redis.aclose()
