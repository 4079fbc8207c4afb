"""Circuit breaker transitions, slow start, latency outliers and AIMD, on a hand-driven clock."""

from __future__ import annotations

import pytest

from tokenops.cluster.concurrency import AIMDConfig, AIMDLimiter
from tokenops.cluster.health import (
    BreakerState,
    CircuitBreaker,
    LatencyTracker,
    OutlierConfig,
    ReplicaBreakerSettings,
    latency_outliers,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_breaker_closed_open_half_open_closed_with_slow_start() -> None:
    clock = Clock()
    cfg = ReplicaBreakerSettings(
        failure_threshold=3, open_seconds=5, probe_successes=2, slow_start_seconds=10, slow_start_min=0.1
    )
    b = CircuitBreaker(cfg, clock)
    assert b.allow() and b.weight_factor() == 1.0
    b.failure()
    b.failure()
    assert b.state is BreakerState.CLOSED  # under the threshold
    b.success()  # a success resets the count
    for _ in range(3):
        b.failure("connect refused")
    assert b.state is BreakerState.OPEN and not b.allow()
    clock.t += 4.9
    assert not b.available()
    clock.t += 0.2
    assert b.available() and b.state is BreakerState.HALF_OPEN
    assert b.allow()  # the one probe slot
    assert not b.allow()  # no second concurrent probe
    b.success()
    assert b.state is BreakerState.HALF_OPEN and b.allow()
    b.success()
    assert b.state is BreakerState.CLOSED
    # slow start: the weight ramps linearly from 0.1 to 1 over 10 s
    assert b.weight_factor() == pytest.approx(0.1)
    clock.t += 5
    assert b.weight_factor() == pytest.approx(0.55)
    clock.t += 5
    assert b.weight_factor() == 1.0
    assert [s for s, _ in b.transitions] == ["open", "half_open", "closed"]


def test_failed_probe_reopens_with_a_longer_cool_down() -> None:
    clock = Clock()
    b = CircuitBreaker(ReplicaBreakerSettings(failure_threshold=1, open_seconds=2, max_open_seconds=5), clock)
    b.failure()
    clock.t += 2
    assert b.allow()
    b.failure("probe refused")
    assert b.state is BreakerState.OPEN
    clock.t += 3
    assert not b.available()  # cool-down doubled to 4 s
    clock.t += 1
    assert b.allow()
    b.failure()
    clock.t += 5  # capped at max_open_seconds
    assert b.available()


def test_abandoned_probe_frees_its_slot() -> None:
    clock = Clock()
    b = CircuitBreaker(ReplicaBreakerSettings(failure_threshold=1, open_seconds=1), clock)
    b.failure()
    clock.t += 1
    assert b.allow() and not b.allow()
    b.release_probe()
    assert b.allow()


def test_latency_outlier_needs_three_replicas_and_an_absolute_floor() -> None:
    cfg = OutlierConfig(latency_factor=3.0, min_latency=1.0, min_samples=3)

    def tracker(v: float, n: int = 5) -> LatencyTracker:
        t = LatencyTracker()
        for _ in range(n):
            t.observe(v)
        return t

    assert latency_outliers({"a": tracker(0.2), "b": tracker(0.25), "c": tracker(5.0)}, cfg) == ["c"]
    assert (
        latency_outliers({"a": tracker(0.1), "b": tracker(0.1), "c": tracker(0.5)}, cfg) == []
    )  # under floor
    assert latency_outliers({"a": tracker(0.2), "c": tracker(5.0)}, cfg) == []  # two: no majority
    assert latency_outliers({"a": tracker(0.2), "b": tracker(0.2), "c": tracker(5.0, n=2)}, cfg) == []


def test_aimd_grows_under_use_and_backs_off_on_drops() -> None:
    lim = AIMDLimiter(AIMDConfig(initial=4, min_limit=2, max_limit=6, backoff=0.5, latency_threshold=1.0))
    # idle successes (one at a time, limit 4) do not grow the limit
    for _ in range(10):
        lim.start()
        lim.finish(ok=True, latency=0.1)
    assert lim.limit == 4
    # busy successes grow it by one each, up to max
    for _ in range(5):
        for _ in range(lim.limit):
            lim.start()
        for _ in range(lim.limit):
            lim.finish(ok=True, latency=0.1)
    assert lim.limit == 6
    assert lim.in_flight == 0 and lim.has_slot()
    # a failure halves it; a slow success counts as a drop too; never below min
    lim.start()
    lim.finish(ok=False)
    assert lim.limit == 3
    lim.start()
    lim.finish(ok=True, latency=2.0)
    assert lim.limit == 2
    lim.start()
    lim.finish(ok=False)
    assert lim.limit == 2
    for _ in range(lim.limit):
        lim.start()
    assert not lim.has_slot()
