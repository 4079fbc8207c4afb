"""The gradient concurrency limiter (Gradient2) on hand-fed latencies, and choosing it in the config."""

from __future__ import annotations

import pytest

from tokenops.cluster.concurrency import AIMDLimiter, GradientConfig, GradientLimiter
from tokenops.cluster.config import ClusterConfig, build_cluster
from tokenops.config import ServedModel


def busy_round(lim: GradientLimiter, latency: float) -> None:
    """As many requests as the limit allows, all in flight at once, each with this time to first byte."""
    n = lim.limit
    for _ in range(n):
        lim.start()
    for _ in range(n):
        lim.finish(ok=True, latency=latency)


def test_limit_grows_while_latency_holds_and_shrinks_when_it_rises() -> None:
    lim = GradientLimiter(GradientConfig(initial=8, min_limit=2, max_limit=64))
    for _ in range(5):
        busy_round(lim, 0.5)
    grown = lim.limit
    assert grown > 8  # steady latency: gradient 1, the sqrt(limit) headroom grows the limit
    for _ in range(10):
        busy_round(lim, 0.5)
    assert lim.limit == 64  # ...up to max_limit
    # the replica starts queueing: time to first byte triples, the limit falls well below its peak
    for _ in range(6):
        busy_round(lim, 1.5)
    assert lim.limit < 20
    assert lim.short is not None and lim.long is not None and lim.short > lim.long
    # latency back to normal: the limit recovers
    low = lim.limit
    for _ in range(20):
        busy_round(lim, 0.5)
    assert lim.limit > low


def test_latency_within_tolerance_does_not_shrink_the_limit() -> None:
    lim = GradientLimiter(GradientConfig(initial=16, max_limit=16, tolerance=1.5))
    for _ in range(5):
        busy_round(lim, 1.0)
    for _ in range(5):
        busy_round(lim, 1.4)  # 1.4x the long-term average is within 1.5x
    assert lim.limit == 16


def test_an_idle_replica_keeps_its_limit_and_failures_back_off() -> None:
    lim = GradientLimiter(GradientConfig(initial=8, min_limit=2, max_limit=64, backoff=0.5))
    for latency in (0.1, 5.0, 0.1, 5.0):  # one at a time: the limit is not what holds traffic back
        lim.start()
        lim.finish(ok=True, latency=latency)
    assert lim.limit == 8 and lim.in_flight == 0
    lim.start()
    lim.finish(ok=False)
    assert lim.limit == 4
    for _ in range(5):
        lim.start()
        lim.finish(ok=False)
    assert lim.limit == 2  # never below min_limit
    with pytest.raises(ValueError):
        GradientConfig(tolerance=0.9)


def test_config_chooses_the_gradient_limiter() -> None:
    models = {"m": ServedModel(backends=["http://10.0.0.1:8000/v1"], max_inflight=32)}
    cfg = ClusterConfig.model_validate(
        {"concurrency": {"algorithm": "gradient", "initial": 8, "tolerance": 2.0}}
    )
    replica = next(iter(build_cluster(models, cfg).pools["m"].replicas.values()))
    assert isinstance(replica.limiter, GradientLimiter)
    assert replica.limiter.limit == 8 and replica.limiter.config.max_limit == 32
    assert replica.limiter.config.tolerance == 2.0
    default = next(iter(build_cluster(models, ClusterConfig()).pools["m"].replicas.values()))
    assert isinstance(default.limiter, AIMDLimiter)
