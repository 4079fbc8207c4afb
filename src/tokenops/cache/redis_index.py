"""The shared cache index in Redis, for several gateway replicas serving one cache.

Layout under a prefix P, per scope S (each key expires ttl after the scope's last store, so an
abandoned scope disappears on its own):

    P:e:S    hash   entry id -> entry JSON (prompt text, response, timestamps; no vector)
    P:v:S    hash   entry id -> float32 unit vector (384 x 4 bytes)
    P:x:S    hash   exact key -> entry id

and, across scopes, for TTL and the memory bound (member "S/id"):

    P:lru    zset   last use time        P:exp    zset   expiry time
    P:meta   hash   "size exact_key"     P:bytes  int    bytes held

A semantic search fetches the scope's vectors (HGETALL P:v:S) and ranks them here with one
matrix-vector product, then reads only the candidates' entries (HMGET). A scope is one tenant x model
x system prompt x conversation, so it holds tens to thousands of entries: fetching a few hundred KB
beats keeping a vector index in sync. Redis 7.0 has no per-field expiry, so each entry carries its
expiry, reads skip expired entries, and every put sweeps P:exp. Removal is one Lua script, so two
gateways evicting the same entry count it once. This module does not decide what may be cached.
"""

from __future__ import annotations

import numpy as np
import redis.asyncio as aioredis

from tokenops.cache.index import CacheEntry, Evictions

_REMOVE = """
local meta = redis.call('HGET', KEYS[6], ARGV[2])
if not meta then return 0 end
local sp = string.find(meta, ' ')
local size = tonumber(string.sub(meta, 1, sp - 1))
local xk = string.sub(meta, sp + 1)
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if redis.call('HGET', KEYS[3], xk) == ARGV[1] then redis.call('HDEL', KEYS[3], xk) end
redis.call('ZREM', KEYS[4], ARGV[2])
redis.call('ZREM', KEYS[5], ARGV[2])
redis.call('HDEL', KEYS[6], ARGV[2])
redis.call('DECRBY', KEYS[7], size)
return 1
"""

# entries evicted per round trip when the bound is exceeded
_EVICT_BATCH = 16


class RedisIndex:
    """A `CacheIndex` shared by every gateway that names the same Redis and prefix."""

    def __init__(self, url: str, prefix: str, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        self.client = aioredis.Redis.from_url(url)
        self.prefix = prefix.rstrip(":")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.key_ttl_s = max(1, int(ttl_s) + 1)
        self._remove = self.client.register_script(_REMOVE)

    # -- keys --------------------------------------------------------------------------------

    def _k(self, kind: str, scope_hash: str = "") -> str:
        return f"{self.prefix}:{kind}:{scope_hash}" if scope_hash else f"{self.prefix}:{kind}"

    def _keys(self, scope_hash: str) -> list[str]:
        return [
            self._k("e", scope_hash),
            self._k("v", scope_hash),
            self._k("x", scope_hash),
            self._k("lru"),
            self._k("exp"),
            self._k("meta"),
            self._k("bytes"),
        ]

    # -- reads -------------------------------------------------------------------------------

    async def _entry(self, scope_hash: str, entry_id: str, now: float) -> CacheEntry | None:
        raw = await self.client.hget(self._k("e", scope_hash), entry_id)
        if raw is None:
            return None
        entry = CacheEntry.from_record(raw)
        if entry.expires_at <= now:
            await self.remove(scope_hash, entry_id)
            return None
        return entry

    async def touch(self, scope_hash: str, entry_id: str, now: float) -> None:
        # xx: never re-add an entry another gateway has just removed
        await self.client.zadd(self._k("lru"), {f"{scope_hash}/{entry_id}": now}, xx=True)

    async def get_exact(self, scope_hash: str, exact_key: str, now: float) -> CacheEntry | None:
        entry_id = await self.client.hget(self._k("x", scope_hash), exact_key)
        if entry_id is None:
            return None
        entry = await self._entry(scope_hash, entry_id.decode(), now)
        if entry is not None:
            await self.touch(scope_hash, entry.id, now)
        return entry

    async def nearest(
        self, scope_hash: str, vector: np.ndarray, k: int, min_similarity: float, now: float
    ) -> list[tuple[CacheEntry, float]]:
        rows = await self.client.hgetall(self._k("v", scope_hash))
        if not rows:
            return []
        ids = [i.decode() for i in rows]
        matrix = np.frombuffer(b"".join(rows.values()), dtype=np.float32).reshape(len(ids), -1)
        sims = matrix @ vector.astype(np.float32)
        top = np.argsort(-sims)[:k]
        chosen = [(ids[i], float(sims[i])) for i in top if sims[i] >= min_similarity]
        if not chosen:
            return []
        raws = await self.client.hmget(self._k("e", scope_hash), [c[0] for c in chosen])
        out = []
        for (entry_id, sim), raw in zip(chosen, raws, strict=True):
            if raw is None:
                continue  # evicted between the two reads
            entry = CacheEntry.from_record(raw, matrix[ids.index(entry_id)].copy())
            if entry.expires_at <= now:
                await self.remove(scope_hash, entry_id)
                continue
            out.append((entry, sim))
        return out

    async def get(self, scope_hash: str, entry_id: str, now: float) -> CacheEntry | None:
        return await self._entry(scope_hash, entry_id, now)

    async def size(self) -> tuple[int, int]:
        n = await self.client.zcard(self._k("lru"))
        b = await self.client.get(self._k("bytes"))
        return int(n), int(b or 0)

    # -- writes ------------------------------------------------------------------------------

    async def remove(self, scope_hash: str, entry_id: str) -> bool:
        removed = await self._remove(keys=self._keys(scope_hash), args=[entry_id, f"{scope_hash}/{entry_id}"])
        return bool(removed)

    async def _remove_member(self, member: str) -> bool:
        scope_hash, _, entry_id = member.partition("/")
        if await self.remove(scope_hash, entry_id):
            return True
        # an orphan (its meta row is gone): drop it from the orders so the bound loop ends
        await self.client.zrem(self._k("lru"), member)
        await self.client.zrem(self._k("exp"), member)
        return False

    async def put(self, entry: CacheEntry, now: float) -> Evictions:
        s = entry.scope_hash
        ev = Evictions()
        old = await self.client.hget(self._k("x", s), entry.exact_key)
        if old is not None and old.decode() != entry.id:
            await self.remove(s, old.decode())  # the newer answer replaces the older
        member = f"{s}/{entry.id}"
        size = entry.size
        async with self.client.pipeline(transaction=True) as p:
            p.hset(self._k("e", s), entry.id, entry.record())
            if entry.vector is not None:
                p.hset(self._k("v", s), entry.id, entry.vector.astype(np.float32).tobytes())
            p.hset(self._k("x", s), entry.exact_key, entry.id)
            p.zadd(self._k("lru"), {member: now})
            p.zadd(self._k("exp"), {member: entry.expires_at})
            p.hset(self._k("meta"), member, f"{size} {entry.exact_key}")
            p.incrby(self._k("bytes"), size)
            for kind in ("e", "v", "x"):
                p.expire(self._k(kind, s), self.key_ttl_s)
            await p.execute()
        for m in await self.client.zrangebyscore(self._k("exp"), "-inf", now):
            ev.expired += await self._remove_member(m.decode())
        while True:
            n, b = await self.size()
            over = max(n - self.max_entries, 1 if b > self.max_bytes else 0)
            if over <= 0:
                break
            victims = await self.client.zrange(self._k("lru"), 0, min(over, _EVICT_BATCH) - 1)
            if not victims:
                break
            for m in victims:
                ev.capacity += await self._remove_member(m.decode())
        return ev

    async def clear(self) -> None:
        """Delete every key under this prefix (tests, `cache clear`)."""
        keys = [k async for k in self.client.scan_iter(match=f"{self.prefix}:*")]
        if keys:
            await self.client.delete(*keys)

    async def close(self) -> None:
        await self.client.aclose()
