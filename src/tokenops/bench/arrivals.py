"""Open-loop arrival processes: when each request (or session) is sent, as offsets from the start.

It owns the inter-arrival law only. Gamma inter-arrival times with shape `burstiness` and mean
1/rate, as vLLM's `bench serve` does: burstiness 1 is a Poisson process, below 1 is burstier
(coefficient of variation 1/sqrt(burstiness) > 1), above 1 is smoother, and an infinite rate sends
everything at once. It is seeded and never reads a clock; the driver sleeps until each offset.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np


class ArrivalProcess:
    """An infinite stream of arrival offsets in seconds, seeded so that runs repeat."""

    def __init__(self, rate: float, burstiness: float = 1.0, seed: int = 0) -> None:
        if not rate > 0:
            raise ValueError("rate must be > 0 requests/s (use math.inf for all at once)")
        if not burstiness > 0:
            raise ValueError("burstiness must be > 0 (1 is Poisson)")
        self.rate = rate
        self.burstiness = burstiness
        self.seed = seed

    def gaps(self) -> Iterator[float]:
        """Inter-arrival gaps; the first request goes at the first gap, as in vLLM."""
        if math.isinf(self.rate):
            while True:
                yield 0.0
        rng = np.random.default_rng(self.seed)
        scale = 1.0 / (self.rate * self.burstiness)
        while True:
            # draw in blocks: one numpy call per 1024 arrivals keeps long runs cheap
            yield from rng.gamma(self.burstiness, scale, size=1024).tolist()

    def times(self) -> Iterator[float]:
        t = 0.0
        for gap in self.gaps():
            t += gap
            yield t

    def first(self, n: int) -> list[float]:
        out = []
        for t in self.times():
            if len(out) == n:
                break
            out.append(t)
        return out


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """The first `n` arrival offsets (seconds) of a Gamma process at `rate` requests/s."""
    return ArrivalProcess(rate, burstiness, seed).first(n)
