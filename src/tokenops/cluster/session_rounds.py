"""What every gateway in front of the same engines must agree on about a session: how many of its
requests the cluster has seen (the round a PD placement is made for) and the decode worker its PD
policy bound it to.

A session's first request (round 0) has no history anywhere; from its second on, the prefill leg names
the decode worker that holds the history, and every gateway should send the session there. With a
`redis_url` both live in Redis (one round trip per request: the round's INCR with the binding's GET;
one SET when a policy binds or rebinds; both expire with the session); without one the rounds live in
this process, bounded, oldest forgotten first, and the bindings in the gateway's own policy object.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("tokenops.cluster")


@dataclass(frozen=True, slots=True)
class SessionTurn:
    """A session's request being placed: its round, and the decode worker the session is bound to by
    any gateway sharing the store (None: unbound, or bindings are per gateway)."""

    round: int
    bound: str | None = None


class SessionRounds(Protocol):
    async def next(self, session_id: str | None) -> SessionTurn:
        """The round of this session's request now being placed (0 for its first, and for no
        session), with the session's shared binding."""
        ...

    async def bind(self, session_id: str, worker: str) -> None:
        """A policy bound (or rebound) the session to decode worker `worker`."""
        ...

    async def aclose(self) -> None: ...


class LocalSessionRounds:
    """Counts in this process; past `limit` sessions the oldest is forgotten and comes back as new.
    Bindings are not shared: each gateway's policy object keeps its own."""

    def __init__(self, limit: int = 100_000) -> None:
        self._limit = limit
        self._rounds: OrderedDict[str, int] = OrderedDict()

    async def next(self, session_id: str | None) -> SessionTurn:
        if session_id is None:
            return SessionTurn(0)
        n = self._rounds.pop(session_id, -1) + 1
        self._rounds[session_id] = n
        if len(self._rounds) > self._limit:
            self._rounds.popitem(last=False)
        return SessionTurn(n)

    async def bind(self, session_id: str, worker: str) -> None:
        return None

    async def aclose(self) -> None:
        return None


class RedisSessionRounds:
    """Counts under `prefix` + session id and bindings under `binding_prefix` + session id, shared by
    every gateway that names the same `redis_url` and prefixes; a session idle for `ttl_s` starts
    again at round 0, unbound. Redis unreachable: the request counts as a first round (its prefill
    then recomputes the history instead of pulling it) and the gateway's own binding stands."""

    def __init__(self, redis_url: str, prefix: str, binding_prefix: str, ttl_s: int = 86_400) -> None:
        import redis.asyncio as aioredis
        from redis.exceptions import RedisError

        self._faults = (RedisError, OSError)
        self._redis = aioredis.Redis.from_url(redis_url)
        self._prefix = prefix
        self._binding_prefix = binding_prefix
        self._ttl = ttl_s

    async def next(self, session_id: str | None) -> SessionTurn:
        if session_id is None:
            return SessionTurn(0)
        key, bound_key = self._prefix + session_id, self._binding_prefix + session_id
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                n, _, bound = await pipe.incr(key).expire(key, self._ttl).get(bound_key).execute()
        except self._faults as exc:
            log.warning("session round count in Redis failed: %s", exc)
            return SessionTurn(0)
        return SessionTurn(int(n) - 1, bound.decode() if bound is not None else None)

    async def bind(self, session_id: str, worker: str) -> None:
        try:
            await self._redis.set(self._binding_prefix + session_id, worker, ex=self._ttl)
        except self._faults as exc:
            log.warning("session binding in Redis failed: %s", exc)

    async def aclose(self) -> None:
        await self._redis.aclose()
