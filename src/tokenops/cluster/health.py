"""Replica health: a circuit breaker per replica, passive outlier detection, and an active checker.

The breaker is a small state machine (closed -> open after consecutive failures -> half-open after a
cool-down, where a few probes decide -> closed with a slow-start ramp, or back to open with a longer
cool-down). Passive outlier detection trips a breaker when a replica's latency runs far above the pool's
median. The active checker is a coroutine that GETs each replica's health URL on an interval and feeds
the same breakers. This module decides *whether* a replica may take traffic and with what weight
factor; it does not pick among replicas (policies) or send requests (pool).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import httpx

from tokenops.cluster.background import BackgroundTask, poll_every

log = logging.getLogger("tokenops.cluster.health")

Clock = Callable[[], float]


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class ReplicaBreakerSettings:
    """When a replica's circuit breaker opens, how it probes and how it ramps back."""

    failure_threshold: int = 3  # consecutive failures that open the breaker
    open_seconds: float = 5.0  # first cool-down; doubles on each failed probe up to max_open_seconds
    max_open_seconds: float = 30.0
    half_open_probes: int = 1  # concurrent probes allowed while half-open
    probe_successes: int = 2  # successes in half-open that close the breaker
    slow_start_seconds: float = 10.0  # weight ramps from slow_start_min to 1 over this long
    slow_start_min: float = 0.1

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.half_open_probes < 1 or self.probe_successes < 1:
            raise ValueError("breaker thresholds must be >= 1")
        if not 0 < self.slow_start_min <= 1:
            raise ValueError("slow_start_min must be in (0, 1]")


class CircuitBreaker:
    """One replica's breaker. Callers ask `allow()` before sending, then report `success()` or
    `failure()`; `weight_factor()` is the slow-start multiplier the pool applies to the weight."""

    def __init__(self, config: ReplicaBreakerSettings | None = None, clock: Clock = time.monotonic) -> None:
        self.config = config or ReplicaBreakerSettings()
        self.clock = clock
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self._opened_at = 0.0
        self._open_for = self.config.open_seconds
        self._probes_in_flight = 0
        self._probe_successes = 0
        self._closed_at: float | None = None  # None: never recovered, so no slow start
        self.transitions: list[tuple[BreakerState, str]] = []  # (new state, why), for logs and tests

    def _move(self, state: BreakerState, why: str) -> None:
        self.state = state
        self.transitions.append((state, why))

    def _tick(self) -> None:
        if self.state is BreakerState.OPEN and self.clock() - self._opened_at >= self._open_for:
            self._probes_in_flight = 0
            self._probe_successes = 0
            self._move(BreakerState.HALF_OPEN, "cool-down elapsed")

    def available(self) -> bool:
        """May this replica be offered to a policy now (without claiming a probe)?"""
        self._tick()
        if self.state is BreakerState.CLOSED:
            return True
        return self.state is BreakerState.HALF_OPEN and self._probes_in_flight < self.config.half_open_probes

    def allow(self) -> bool:
        """Claim the right to send one request; in half-open this takes one of the probe slots."""
        if not self.available():
            return False
        if self.state is BreakerState.HALF_OPEN:
            self._probes_in_flight += 1
        return True

    def success(self) -> None:
        self.consecutive_failures = 0
        if self.state is BreakerState.HALF_OPEN:
            self._probes_in_flight = max(0, self._probes_in_flight - 1)
            self._probe_successes += 1
            if self._probe_successes >= self.config.probe_successes:
                self._open_for = self.config.open_seconds
                self._closed_at = self.clock()
                self._move(BreakerState.CLOSED, "probes succeeded")

    def failure(self, why: str = "failure") -> None:
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN:
            self._open_for = min(self._open_for * 2, self.config.max_open_seconds)
            self._open(f"probe failed: {why}")
        elif self.state is BreakerState.CLOSED and self.consecutive_failures >= self.config.failure_threshold:
            self._open(f"{self.consecutive_failures} consecutive failures: {why}")

    def release_probe(self) -> None:
        """A claimed probe ended with neither verdict (the caller gave up): free its slot."""
        if self.state is BreakerState.HALF_OPEN:
            self._probes_in_flight = max(0, self._probes_in_flight - 1)

    def trip(self, why: str) -> None:
        """Open now, whatever the state (outlier detection, a failed active check)."""
        if self.state is not BreakerState.OPEN:
            self._open(why)

    def _open(self, why: str) -> None:
        self._opened_at = self.clock()
        self._closed_at = None
        self._move(BreakerState.OPEN, why)

    def weight_factor(self) -> float:
        """1.0 normally; after recovering, ramps linearly from `slow_start_min` to 1."""
        if self.state is not BreakerState.CLOSED or self._closed_at is None:
            return self.config.slow_start_min if self.state is BreakerState.HALF_OPEN else 1.0
        span = self.config.slow_start_seconds
        elapsed = self.clock() - self._closed_at
        if span <= 0 or elapsed >= span:
            return 1.0
        lo = self.config.slow_start_min
        return lo + (1.0 - lo) * elapsed / span


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    latency_factor: float = 3.0  # trip when a replica's latency EWMA exceeds factor x pool median...
    min_latency: float = 1.0  # ...and this many seconds (never trip on fast-but-relatively-slower)
    alpha: float = 0.2  # EWMA smoothing
    min_samples: int = 5


class LatencyTracker:
    """EWMA of a replica's time to first byte, for passive outlier detection."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.ewma: float | None = None
        self.samples = 0

    def observe(self, seconds: float) -> None:
        self.samples += 1
        self.ewma = seconds if self.ewma is None else self.alpha * seconds + (1 - self.alpha) * self.ewma


def latency_outliers(trackers: dict[str, LatencyTracker], config: OutlierConfig) -> list[str]:
    """Replicas whose latency EWMA is an outlier against the median of the others (needs >= 3 replicas
    with enough samples: with two, neither is the odd one out)."""
    ready = {
        rid: t.ewma for rid, t in trackers.items() if t.ewma is not None and t.samples >= config.min_samples
    }
    if len(ready) < 3:
        return []
    out = []
    for rid, v in ready.items():
        median = statistics.median(x for k, x in ready.items() if k != rid)
        if v > config.min_latency and v > config.latency_factor * median:
            out.append(rid)
    return out


class HealthChecker:
    """Active health checks: GET `url + path` for each target every `interval` seconds.

    A failed check counts as a breaker failure; a passing check while half-open counts as a probe
    success, so a recovered replica returns even when no traffic is routed to it.
    """

    def __init__(
        self,
        targets: Callable[[], Iterable[tuple[str, CircuitBreaker]]],
        path: str = "/health",
        interval: float = 2.0,
        timeout: float = 5.0,
    ) -> None:
        self.targets = targets
        self.path = path
        self.interval = interval
        self.timeout = timeout
        self._task = BackgroundTask(self.run, "cluster-health-check")

    async def check_once(self, client: httpx.AsyncClient) -> dict[str, bool]:
        targets = list(self.targets())

        async def one(url: str, breaker: CircuitBreaker) -> bool:
            try:
                resp = await client.get(url.rstrip("/") + self.path, timeout=self.timeout)
                ok = resp.status_code < 500
            except httpx.HTTPError:
                ok = False
            if not ok:
                breaker.failure("active health check failed")
            elif breaker.state is not BreakerState.CLOSED and breaker.allow():
                breaker.success()
            return ok

        results = await asyncio.gather(*(one(u, b) for u, b in targets))
        return {u: ok for (u, _), ok in zip(targets, results, strict=True)}

    async def run(self) -> None:
        await poll_every(self.interval, self.check_once, log, "health check")

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
