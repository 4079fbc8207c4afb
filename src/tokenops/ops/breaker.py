"""The runaway-agent breaker, per session (the key plus `x-session-id` or `user`). It trips when the
same request (same body fingerprint) arrives more than `repeat_limit` times within `window_s`, or
when the session's spend within the last `window_s` passes `spend_limit_micros`; once tripped every
request of the session is refused until `cooldown_s` has passed. State lives in process by default
or in Redis (one Lua call per check) so several gateways see the same trips. Budgets and rate
limits are elsewhere; this only stops loops."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from tokenops.protocol import APIError


@dataclass(frozen=True)
class SessionBreakerSettings:
    """When the runaway-agent breaker pauses a session (config: `breaker:`, `SessionBreakerConfig`)."""

    repeat_limit: int = 10  # identical requests allowed per window; the next one trips
    window_s: float = 60.0
    spend_limit_micros: int | None = None  # per session per window; None: no spend-rate trip
    cooldown_s: float = 60.0


def breaker_open(session_id: str, reason: str, retry_after_s: float) -> APIError:
    secs = max(1, math.ceil(retry_after_s))
    return APIError(
        429,
        f"Session '{session_id}' is paused by the runaway-agent breaker ({reason}). It resets in {secs} s; "
        "change the request or the session id only if the loop is intended.",
        type="rate_limit_error",
        code="session_breaker_open",
        headers={"Retry-After": str(secs)},
    )


class BreakerStore(Protocol):
    async def check(self, session: str, fingerprint: str) -> tuple[str, float] | None: ...
    async def record_spend(self, session: str, micros: int) -> None: ...
    async def close(self) -> None: ...


class InProcessBreaker:
    def __init__(self, settings: SessionBreakerSettings, clock=time.monotonic) -> None:  # noqa: ANN001
        self.s = settings
        self._clock = clock
        self._open: dict[str, tuple[float, str]] = {}  # session -> (until, reason)
        self._seen: dict[tuple[str, str], deque[float]] = {}
        self._spend: dict[str, deque[tuple[float, int]]] = {}

    def _tripped(self, session: str, now: float) -> tuple[str, float] | None:
        state = self._open.get(session)
        if state is None:
            return None
        if state[0] <= now:
            del self._open[session]
            return None
        return state[1], state[0] - now

    async def check(self, session: str, fingerprint: str) -> tuple[str, float] | None:
        """(reason, seconds left) when the session is paused (tripping it now if this request is one
        repeat too many); None to go ahead."""
        now = self._clock()
        tripped = self._tripped(session, now)
        if tripped:
            return tripped
        if len(self._seen) > 100_000:  # bound memory: forget sessions idle past the window
            for k in [k for k, v in self._seen.items() if not v or v[-1] <= now - self.s.window_s]:
                del self._seen[k]
        log = self._seen.setdefault((session, fingerprint), deque())
        while log and log[0] <= now - self.s.window_s:
            log.popleft()
        log.append(now)
        if len(log) > self.s.repeat_limit:
            reason = f"the same request {len(log)} times within {self.s.window_s:g} s"
            self._open[session] = (now + self.s.cooldown_s, reason)
            log.clear()
            return reason, self.s.cooldown_s
        return None

    async def record_spend(self, session: str, micros: int) -> None:
        if self.s.spend_limit_micros is None or micros <= 0:
            return
        now = self._clock()
        if len(self._spend) > 100_000:  # bound memory: forget sessions idle past the window
            for k in [k for k, v in self._spend.items() if not v or v[-1][0] <= now - self.s.window_s]:
                del self._spend[k]
        log = self._spend.setdefault(session, deque())
        while log and log[0][0] <= now - self.s.window_s:
            log.popleft()
        log.append((now, micros))
        total = sum(x for _, x in log)
        if total > self.s.spend_limit_micros:
            reason = (
                f"spent {total} micro-units within {self.s.window_s:g} s, over {self.s.spend_limit_micros}"
            )
            self._open[session] = (now + self.s.cooldown_s, reason)
            log.clear()

    async def close(self) -> None:
        return None


# KEYS: open flag, fingerprint log. ARGV: window, repeat limit, cooldown, a unique member.
_CHECK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local reason = redis.call('GET', KEYS[1])
if reason then return {reason, tostring(redis.call('PTTL', KEYS[1]) / 1000)} end
local window, limit, cooldown = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
redis.call('ZADD', KEYS[2], now, ARGV[4])
redis.call('PEXPIRE', KEYS[2], math.ceil(window * 1000))
local n = redis.call('ZCARD', KEYS[2])
if n > limit then
  local r = 'the same request ' .. n .. ' times within ' .. ARGV[1] .. ' s'
  redis.call('SET', KEYS[1], r, 'PX', math.ceil(cooldown * 1000))
  redis.call('DEL', KEYS[2])
  return {r, tostring(cooldown)}
end
return {}
"""

# KEYS: open flag, spend log. ARGV: window, spend limit, cooldown, micros, a unique member.
_SPEND = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local window, limit, cooldown = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
redis.call('ZADD', KEYS[2], now, ARGV[5] .. ':' .. ARGV[4])
redis.call('PEXPIRE', KEYS[2], math.ceil(window * 1000))
local total = 0
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  total = total + tonumber(string.match(m, ':(%d+)$'))
end
if total > limit then
  redis.call('SET', KEYS[1], 'spent ' .. total .. ' micro-units within ' .. ARGV[1] .. ' s, over ' .. ARGV[2],
    'PX', math.ceil(cooldown * 1000))
  redis.call('DEL', KEYS[2])
end
return 0
"""


class RedisBreaker:
    def __init__(
        self, settings: SessionBreakerSettings, redis_url: str, prefix: str = "tokenops:ops:"
    ) -> None:
        import redis.asyncio as aioredis

        self.s = settings
        self._redis = aioredis.Redis.from_url(redis_url)
        self._prefix = prefix + "brk:"
        self._check = self._redis.register_script(_CHECK)
        self._spend = self._redis.register_script(_SPEND)
        self._n = 0

    def _member(self) -> str:
        self._n += 1
        return f"{id(self):x}.{self._n}.{time.time_ns()}"

    async def check(self, session: str, fingerprint: str) -> tuple[str, float] | None:
        p = f"{self._prefix}{{{session}}}:"
        res = await self._check(
            keys=[p + "open", p + "fp:" + fingerprint],
            args=[self.s.window_s, self.s.repeat_limit, self.s.cooldown_s, self._member()],
        )
        if not res:
            return None
        reason = res[0].decode() if isinstance(res[0], bytes) else str(res[0])
        return reason, float(res[1])

    async def record_spend(self, session: str, micros: int) -> None:
        if self.s.spend_limit_micros is None or micros <= 0:
            return
        p = f"{self._prefix}{{{session}}}:"
        await self._spend(
            keys=[p + "open", p + "spend"],
            args=[self.s.window_s, self.s.spend_limit_micros, self.s.cooldown_s, int(micros), self._member()],
        )

    async def close(self) -> None:
        await self._redis.aclose()
