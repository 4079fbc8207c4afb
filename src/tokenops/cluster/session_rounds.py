"""How many requests of a session the cluster has seen: the round a PD placement is made for.

A session's first request (round 0) has no history anywhere; from its second on, the prefill leg names
the decode worker that holds the history. Every gateway in front of the same engines must count the
same rounds, so with a `redis_url` the counts live in Redis (one INCR per request, expiring with the
session); without one they live in this process, bounded, oldest forgotten first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Protocol

log = logging.getLogger("tokenops.cluster")


class SessionRounds(Protocol):
    async def next(self, session_id: str | None) -> int:
        """The round of this session's request now being placed (0 for its first, and for no session)."""
        ...

    async def aclose(self) -> None: ...


class LocalSessionRounds:
    """Counts in this process; past `limit` sessions the oldest is forgotten and comes back as new."""

    def __init__(self, limit: int = 100_000) -> None:
        self._limit = limit
        self._rounds: OrderedDict[str, int] = OrderedDict()

    async def next(self, session_id: str | None) -> int:
        if session_id is None:
            return 0
        n = self._rounds.pop(session_id, -1) + 1
        self._rounds[session_id] = n
        if len(self._rounds) > self._limit:
            self._rounds.popitem(last=False)
        return n

    async def aclose(self) -> None:
        return None


class RedisSessionRounds:
    """Counts in Redis under `prefix` + session id, shared by every gateway that names the same
    `redis_url` and prefix; a session idle for `ttl_s` starts again at round 0. Redis unreachable: the
    request counts as a first round (its prefill then recomputes the history instead of pulling it)."""

    def __init__(self, redis_url: str, prefix: str, ttl_s: int = 86_400) -> None:
        import redis.asyncio as aioredis
        from redis.exceptions import RedisError

        self._faults = (RedisError, OSError)
        self._redis = aioredis.Redis.from_url(redis_url)
        self._prefix = prefix
        self._ttl = ttl_s

    async def next(self, session_id: str | None) -> int:
        if session_id is None:
            return 0
        key = self._prefix + session_id
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                n, _ = await pipe.incr(key).expire(key, self._ttl).execute()
        except self._faults as exc:
            log.warning("session round count in Redis failed: %s", exc)
            return 0
        return int(n) - 1

    async def aclose(self) -> None:
        await self._redis.aclose()
