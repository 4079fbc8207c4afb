"""Adaptive concurrency per replica: an AIMD limit on requests in flight.

The limit grows by one when a request succeeds fast while the replica is well used, and shrinks by a
factor when a request fails, times out or its time to first byte passes `latency_threshold`. Requests
over the limit wait at the gateway (the pool queues them), so overload shows as queueing where we can
see and shed it, not as timeouts inside a replica. This module keeps the number; the waiting happens in
`pool.py`, which owns the one queue for the whole pool.
"""

from __future__ import annotations

from dataclasses import dataclass


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


class AIMDLimiter:
    """Additive increase, multiplicative decrease of one replica's concurrency limit."""

    def __init__(self, config: AIMDConfig | None = None) -> None:
        self.config = config or AIMDConfig()
        self._limit = float(self.config.initial)
        self.in_flight = 0

    @property
    def limit(self) -> int:
        return int(self._limit)

    def has_slot(self) -> bool:
        return self.in_flight < self.limit

    def start(self) -> None:
        self.in_flight += 1

    def finish(self, *, ok: bool, latency: float | None = None) -> None:
        """Record one finished request: `ok=False` for an error or timeout, `latency` in seconds."""
        in_flight_at_start = self.in_flight
        self.in_flight = max(0, self.in_flight - 1)
        dropped = not ok or (latency is not None and latency > self.config.latency_threshold)
        if dropped:
            self._limit = max(self.config.min_limit, self._limit * self.config.backoff)
        elif in_flight_at_start * 2 >= self._limit:
            # grow only while the limit is actually being used, else an idle replica's limit drifts up
            self._limit = min(self.config.max_limit, self._limit + 1)
