"""The cluster's gauges on the gateway's registry, from a hand-built pool on a fake clock: load-report
age (finite, +Inf before the first report, absent for providers), breaker states including an open
breaker whose cool-down passed (read as half-open), slow-start weight."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from tokenops.cluster import Cluster, ReplicaPool, ReplicaSpec, ReportedLoad, make_policy
from tokenops.cluster.health import ReplicaBreakerSettings
from tokenops.gateway.metrics import GatewayMetrics


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def gauges(metrics: GatewayMetrics, name: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == name:
                out[s.labels["replica"]] = s.value
    return out


def test_replica_gauges_follow_the_pool() -> None:
    clock = Clock()
    specs = [
        ReplicaSpec("http://a/v1", id="a", kind="tokenops"),
        ReplicaSpec("http://b/v1", id="b", kind="vllm"),
        ReplicaSpec("http://c/v1", id="c", kind="openai"),
    ]
    breaker = ReplicaBreakerSettings(failure_threshold=1, open_seconds=5, slow_start_seconds=10)
    pool = ReplicaPool("m", specs, make_policy("least_outstanding"), breaker=breaker, clock=clock)
    cluster = Cluster({"m": pool})
    metrics = GatewayMetrics()
    metrics.watch_cluster(cluster)
    a, b, _ = pool.replicas.values()
    a.polled = b.polled = True  # what the load poller sets for kinds it reads
    a.reported = ReportedLoad(running=1, read_at=clock.t - 3)

    age = gauges(metrics, "tokenops_cluster_load_report_age_seconds")
    assert age["a"] == 3.0 and math.isinf(age["b"]) and "c" not in age
    assert gauges(metrics, "tokenops_cluster_breaker_state") == {"a": 0.0, "b": 0.0, "c": 0.0}

    b.breaker.failure("connection refused")
    assert gauges(metrics, "tokenops_cluster_breaker_state")["b"] == 2.0
    clock.t += 6  # cool-down over: half-open, even with no traffic to move it
    assert gauges(metrics, "tokenops_cluster_breaker_state")["b"] == 1.0
    assert gauges(metrics, "tokenops_cluster_load_report_age_seconds")["a"] == 9.0
    b.breaker.allow()
    b.breaker.success()
    b.breaker.success()  # closed again, in slow start: its weight ramps from 0.1
    assert gauges(metrics, "tokenops_cluster_breaker_state")["b"] == 0.0
    assert 0.0 < gauges(metrics, "tokenops_cluster_weight")["b"] < 0.2
    clock.t += 10
    assert gauges(metrics, "tokenops_cluster_weight")["b"] == 1.0
