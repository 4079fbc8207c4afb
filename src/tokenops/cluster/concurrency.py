"""Adaptive concurrency per replica: a limit on requests in flight, by AIMD or by latency gradient.

AIMD: the limit grows by one when a request succeeds fast while the replica is well used, and shrinks
by a factor when a request fails, times out or its time to first byte passes `latency_threshold` (an
SLO the operator sets). Gradient (Netflix's Gradient2): no threshold to tune; the limit follows the
ratio of the long-term to the short-term time to first byte, so it shrinks as soon as latency rises
above what the replica usually shows and grows while it does not. Requests over the limit wait at the
gateway (the pool queues them), so overload shows as queueing where we can see and shed it, not as
timeouts inside a replica. This module keeps the number; the waiting happens in `pool.py`, which owns
the one queue for the whole pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class AIMDConfig:
    initial: int = 16
    min_limit: int = 1
    max_limit: int = 256
    backoff: float = 0.9  # multiplicative decrease on a drop
    latency_threshold: float = 30.0  # seconds to first byte that count as a drop (an SLO, tune it)

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.initial <= self.max_limit:
            raise ValueError("need 1 <= min_limit <= initial <= max_limit")
        if not 0 < self.backoff < 1:
            raise ValueError("backoff must be in (0, 1)")


class _SlotCount:
    """The count in flight against a float limit, shared by both limiters (they differ in `finish`)."""

    def __init__(self, initial: int) -> None:
        self._limit = float(initial)
        self.in_flight = 0

    @property
    def limit(self) -> int:
        return int(self._limit)

    def has_slot(self) -> bool:
        return self.in_flight < self.limit

    def start(self) -> None:
        self.in_flight += 1

    def _release(self) -> int:
        """Count one request out; the number in flight when it was counted out (it included)."""
        in_flight_at_start = self.in_flight
        self.in_flight = max(0, self.in_flight - 1)
        return in_flight_at_start


class AIMDLimiter(_SlotCount):
    """Additive increase, multiplicative decrease of one replica's concurrency limit."""

    def __init__(self, config: AIMDConfig | None = None) -> None:
        self.config = config or AIMDConfig()
        super().__init__(self.config.initial)

    def finish(self, *, ok: bool, latency: float | None = None) -> None:
        """Record one finished request: `ok=False` for an error or timeout, `latency` in seconds."""
        in_flight_at_start = self._release()
        dropped = not ok or (latency is not None and latency > self.config.latency_threshold)
        if dropped:
            self._limit = max(self.config.min_limit, self._limit * self.config.backoff)
        elif in_flight_at_start * 2 >= self._limit:
            # grow only while the limit is actually being used, else an idle replica's limit drifts up
            self._limit = min(self.config.max_limit, self._limit + 1)


@dataclass(frozen=True, slots=True)
class GradientConfig:
    initial: int = 16
    min_limit: int = 1
    max_limit: int = 256
    tolerance: float = (
        1.5  # short-term latency may reach this multiple of the long-term before the limit shrinks
    )
    smoothing: float = 0.2  # weight of each new estimate in the limit
    short_window: int = 10  # samples in the short-term latency average (EWMA span)
    long_window: int = 600  # samples in the long-term latency average (Netflix's default)
    backoff: float = 0.9  # multiplicative decrease on a failure

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.initial <= self.max_limit:
            raise ValueError("need 1 <= min_limit <= initial <= max_limit")
        if self.tolerance < 1 or not 0 < self.smoothing <= 1 or not 0 < self.backoff < 1:
            raise ValueError("need tolerance >= 1, smoothing in (0, 1] and backoff in (0, 1)")
        if not 1 <= self.short_window < self.long_window:
            raise ValueError("need 1 <= short_window < long_window")


class GradientLimiter(_SlotCount):
    """Gradient2: `limit <- limit x clamp(tolerance x long / short, 0.5, 1) + sqrt(limit)`, smoothed.

    While the short-term time to first byte stays within `tolerance` of the long-term one, the
    gradient is 1 and the sqrt(limit) headroom lets the limit grow; when requests start queueing in
    the replica, the short-term latency rises, the gradient falls below 1 and the limit shrinks
    toward what the replica serves without queueing. The long-term average drifts down when it is
    far above the short-term one, so a replica that got faster is learned. Time to first byte grows
    with prompt length too: a burst of long prompts reads as load, which for a limit is the safe side.
    """

    def __init__(self, config: GradientConfig | None = None) -> None:
        self.config = config or GradientConfig()
        super().__init__(self.config.initial)
        self.short: float | None = None  # EWMA of time to first byte, seconds
        self.long: float | None = None

    def finish(self, *, ok: bool, latency: float | None = None) -> None:
        c = self.config
        in_flight_at_start = self._release()
        if not ok:
            self._limit = max(c.min_limit, self._limit * c.backoff)
            return
        if latency is None or latency <= 0:
            return
        self.short = (
            latency if self.short is None else self.short + 2 / (c.short_window + 1) * (latency - self.short)
        )
        self.long = (
            latency if self.long is None else self.long + 2 / (c.long_window + 1) * (latency - self.long)
        )
        if self.long > 2 * self.short:
            self.long *= 0.95
        if in_flight_at_start * 2 < self._limit:
            return  # the limit is not what holds traffic back: neither grow nor shrink it
        gradient = max(0.5, min(1.0, c.tolerance * self.long / self.short))
        estimate = self._limit * gradient + math.sqrt(self._limit)
        new = (1 - c.smoothing) * self._limit + c.smoothing * estimate
        self._limit = min(float(c.max_limit), max(float(c.min_limit), new))


class ConcurrencyLimiter(Protocol):
    """What the pool needs of a limiter: the limit, the count in flight, and each outcome."""

    in_flight: int

    @property
    def limit(self) -> int: ...

    def start(self) -> None: ...

    def finish(self, *, ok: bool, latency: float | None = None) -> None: ...


def make_limiter(config: AIMDConfig | GradientConfig | None) -> AIMDLimiter | GradientLimiter:
    return GradientLimiter(config) if isinstance(config, GradientConfig) else AIMDLimiter(config)
