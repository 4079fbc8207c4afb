"""Prometheus metrics of the gateway: requests, tokens by type, cost, TTFT and end-to-end latency by
model and tenant, the gateway's own time on a request by model (timing.py), refusals by reason, the
steps of cascade and ensemble routes by outcome, and the cluster's pools (per model and replica: in
flight, breaker state, concurrency limit, load-report age, placements by policy and reason; per model:
retries, fallbacks, degradations, sheds, waiting line, utilisation).

This module owns the metric names and their labels, in a registry per gateway app (several apps in one
test process do not collide). It records what it is told at settle and at refusal, and reads the
cluster's live state and plain counters when scraped; it does not measure anything itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tokenops.cluster.health import BreakerState
from tokenops.gateway.timing import PathTimer
from tokenops.ops.domain import Outcome
from tokenops.token_types import TOKEN_TYPE_NAMES

if TYPE_CHECKING:
    from tokenops.cluster import Cluster

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# the gateway's own steps take 0.05-5 ms: buckets fine enough to read a p50 and p99 in that range
PATH_BUCKETS = (
    0.000025, 0.00005, 0.000075, 0.0001, 0.00015, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075,
    0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(slots=True)
class _Children:
    tokens: dict[str, Any]
    cost: Any
    ttft: Any
    e2e: Any


@dataclass(slots=True)
class _PathChildren:
    pre_upstream: Any
    first_byte: Any
    relay_read: Any
    last_byte: Any
    added: Any
    settle: Any


@dataclass(slots=True)
class _Probes:
    loop_lag: Any
    loop_pass: Any
    connect: Any
    write: Any
    headers: Any
    first_chunk: Any
    connections: Any


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tokenops_requests",
            "Requests settled, by model, tenant and status",
            ["model", "tenant", "status"],
            registry=r,
        )
        self.tokens = Counter(
            "tokenops_tokens", "Tokens metered, by type", ["model", "tenant", "type"], registry=r
        )
        self.cost = Counter(
            "tokenops_cost_micros", "Cost committed, in micro-units", ["model", "tenant"], registry=r
        )
        self.ttft = Histogram(
            "tokenops_ttft_seconds",
            "Time to first token",
            ["model", "tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tokenops_e2e_seconds",
            "End-to-end latency",
            ["model", "tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        def path_histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=PATH_BUCKETS, registry=r)

        self.pre_upstream = path_histogram(
            "tokenops_gateway_pre_upstream_seconds",
            "Request received -> upstream request handed to the HTTP client: parsing, key, limits, "
            "reservation, cache lookup, routing, waiting for a replica slot",
        )
        self.first_byte = path_histogram(
            "tokenops_gateway_first_byte_seconds",
            "The backend's first byte in -> the client's first byte out (a non-streamed answer: "
            "all of it in -> all of it out)",
        )
        self.relay_read = path_histogram(
            "tokenops_gateway_relay_read_seconds",
            "Streams: mean time to relay one read from the backend to the client, one observation per stream",
        )
        self.last_byte = path_histogram(
            "tokenops_gateway_last_byte_seconds",
            "The backend's last read in -> the client's last byte out",
        )
        self.added = path_histogram(
            "tokenops_gateway_added_seconds",
            "The gateway's own share of a request's end-to-end latency: pre-upstream + last byte",
        )
        self.settle = path_histogram(
            "tokenops_gateway_settle_seconds",
            "Settling a request (its ledger row), after its last byte is out: off the client's path",
        )
        self._paths: dict[str, _PathChildren] = {}
        self.probes: _Probes | None = None  # enable_probes(): the diagnostic probes' series
        self.refusals = Counter("tokenops_refusals", "Requests refused, by reason", ["reason"], registry=r)
        self.whole_retries = Counter(
            "tokenops_whole_answer_retries",
            "Non-streamed requests asked again after the backend's stream broke off before the answer "
            "was complete (the client had received nothing)",
            ["model"],
            registry=r,
        )
        self.fusion_steps = Counter(
            "tokenops_fusion_steps",
            "Steps of cascade and ensemble routes, by route, model and outcome "
            "(accepted, rejected, failed, answered, not_picked, judge_unclear)",
            ["route", "model", "outcome"],
            registry=r,
        )
        self.router_retrains = Counter(
            "tokenops_router_retrains",
            "Scheduled retraining rounds of learning routes, by result (swapped, kept, waiting, failed)",
            ["route", "result"],
            registry=r,
        )
        self._by_pair: dict[tuple[str, str], _Children] = {}

    def _children(self, model: str, tenant: str) -> _Children:
        # labels() hashes and locks on every call: resolve each (model, tenant) once
        key = (model, tenant)
        children = self._by_pair.get(key)
        if children is None:
            children = _Children(
                tokens={t: self.tokens.labels(model, tenant, t) for t in TOKEN_TYPE_NAMES},
                cost=self.cost.labels(model, tenant),
                ttft=self.ttft.labels(model, tenant),
                e2e=self.e2e.labels(model, tenant),
            )
            self._by_pair[key] = children
        return children

    def settled(self, model: str, tenant: str, outcome: Outcome, cost_micros: int) -> None:
        c = self._children(model, tenant)
        self.requests.labels(model, tenant, outcome.status).inc()
        u = outcome.usage
        for name in TOKEN_TYPE_NAMES:
            n = getattr(u, name)
            if n:
                c.tokens[name].inc(n)
        for call in outcome.side_calls:  # a cascade's or ensemble's other calls, under their own model
            side = self._children(call.model, tenant).tokens
            for name in TOKEN_TYPE_NAMES:
                n = getattr(call.usage, name)
                if n:
                    side[name].inc(n)
        if cost_micros:  # the whole request's cost, side calls included, under the answering model
            c.cost.inc(cost_micros)
        if outcome.ttft_ms is not None:
            c.ttft.observe(outcome.ttft_ms / 1000)
        c.e2e.observe(outcome.latency_ms / 1000)

    def timed(self, model: str, timer: PathTimer, settle_ns: int) -> None:
        """The gateway's own intervals of one settled request (called after its last byte is out)."""
        c = self._paths.get(model)
        if c is None:
            c = self._paths[model] = _PathChildren(
                self.pre_upstream.labels(model),
                self.first_byte.labels(model),
                self.relay_read.labels(model),
                self.last_byte.labels(model),
                self.added.labels(model),
                self.settle.labels(model),
            )
        c.settle.observe(settle_ns / 1e9)
        if not timer.relayed_all:
            return  # a cache hit, a fused route, a refusal or a client gone: no whole path to time
        pre = timer.upstream_sent - timer.received
        last = timer.done - timer.last_in
        c.pre_upstream.observe(pre / 1e9)
        c.first_byte.observe((timer.client_first - timer.upstream_in) / 1e9)
        c.last_byte.observe(last / 1e9)
        c.added.observe((pre + last) / 1e9)
        if timer.reads:
            c.relay_read.observe(timer.relay_ns / timer.reads / 1e9)
        if self.probes is not None:
            self._probed(model, timer)

    def enable_probes(self) -> _Probes:
        """Register the diagnostic probes' series (probes.py; `tokenops serve --probes`)."""
        if self.probes is None:
            r = self.registry

            def hist(name: str, doc: str, labels: tuple[str, ...] = ("model",)) -> Histogram:
                return Histogram(name, doc, list(labels), buckets=PATH_BUCKETS, registry=r)

            self.probes = _Probes(
                loop_lag=hist(
                    "tokenops_gateway_loop_lag_seconds",
                    "Probe: how late a 1 ms sleep of the event loop woke (loop busy or no core free)",
                    (),
                ),
                loop_pass=hist(
                    "tokenops_gateway_loop_pass_seconds",
                    "Probe: how long one call_soon callback waited to run (one pass of the event loop)",
                    (),
                ),
                connect=hist(
                    "tokenops_gateway_upstream_connect_seconds",
                    "Probe: upstream request handed to the HTTP client -> connection ready (pooled or new)",
                ),
                write=hist(
                    "tokenops_gateway_upstream_write_seconds",
                    "Probe: connection ready -> request headers and body written to the socket",
                ),
                headers=hist(
                    "tokenops_gateway_upstream_headers_seconds",
                    "Probe: request written -> the backend's response headers in and parsed",
                ),
                first_chunk=hist(
                    "tokenops_gateway_upstream_first_chunk_seconds",
                    "Probe: response headers parsed -> the first body chunk handed to the gateway",
                ),
                connections=Counter(
                    "tokenops_gateway_upstream_connections",
                    "Probe: upstream requests by connection (new: opened for the request, else pooled)",
                    ["model", "new"],
                    registry=r,
                ),
            )
        return self.probes

    def _probed(self, model: str, timer: PathTimer) -> None:
        p = self.probes
        assert p is not None
        if not (timer.conn_ready and timer.body_sent and timer.resp_headers):
            return
        p.connections.labels(model, "true" if timer.conn_new else "false").inc()
        p.connect.labels(model).observe((timer.conn_ready - timer.upstream_sent) / 1e9)
        p.write.labels(model).observe((timer.body_sent - timer.conn_ready) / 1e9)
        p.headers.labels(model).observe((timer.resp_headers - timer.body_sent) / 1e9)
        p.first_chunk.labels(model).observe((timer.upstream_in - timer.resp_headers) / 1e9)

    def whole_answer_retried(self, model: str) -> None:
        self.whole_retries.labels(model).inc()

    def fusion_step(self, route: str, model: str, outcome: str) -> None:
        self.fusion_steps.labels(route, model, outcome).inc()

    def watch_cluster(self, cluster: Cluster) -> None:
        """Export the cluster's pools on /metrics (read at scrape time, nothing on the request path)."""
        self.registry.register(ClusterCollector(cluster))

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class ClusterCollector:
    """A Prometheus collector over a live `Cluster`: gauges from its replicas' state, counters from
    the pools' placement counts and the dispatch counters."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def collect(self) -> Iterator[Metric]:
        rl = ["model", "replica"]
        in_flight = GaugeMetricFamily(
            "tokenops_cluster_in_flight", "Requests the gateway has in flight on a replica", labels=rl
        )
        limit = GaugeMetricFamily(
            "tokenops_cluster_concurrency_limit",
            "A replica's adaptive concurrency limit (slow start included)",
            labels=rl,
        )
        breaker = GaugeMetricFamily(
            "tokenops_cluster_breaker_state",
            "A replica's circuit breaker: 0 closed, 1 half-open, 2 open",
            labels=rl,
        )
        weight = GaugeMetricFamily(
            "tokenops_cluster_weight", "A replica's effective weight (slow start included)", labels=rl
        )
        age = GaugeMetricFamily(
            "tokenops_cluster_load_report_age_seconds",
            "Seconds since a polled replica's last load report (+Inf: none yet); "
            "past stale_after_s it counts as saturated",
            labels=rl,
        )
        picks = CounterMetricFamily(
            "tokenops_cluster_picks",
            "Requests placed on a replica, by balancing policy and reason",
            labels=[*rl, "policy", "reason"],
        )
        retries = CounterMetricFamily(
            "tokenops_cluster_retries",
            "Tries that failed before the first byte (then retried while tries remained)",
            labels=rl,
        )
        waiting = GaugeMetricFamily(
            "tokenops_cluster_waiting", "Requests waiting at the gateway for a replica slot", labels=["model"]
        )
        util = GaugeMetricFamily(
            "tokenops_cluster_utilisation",
            "Pool utilisation (what degradation and shedding read)",
            labels=["model"],
        )
        fallbacks = CounterMetricFamily(
            "tokenops_cluster_fallbacks",
            "Requests served by a fallback model group",
            labels=["model", "served"],
        )
        degradations = CounterMetricFamily(
            "tokenops_cluster_degradations",
            "Requests sent to the model's degrade_to, by cause",
            labels=["model", "served", "cause"],
        )
        sheds = CounterMetricFamily(
            "tokenops_cluster_sheds",
            "Requests refused by a shed_at rule, by priority class",
            labels=["model", "priority"],
        )
        for model, pool in self.cluster.pools.items():
            now = pool.clock()
            policy = getattr(pool.policy, "name", type(pool.policy).__name__)
            for r in pool.replicas.values():
                labels = [model, r.id]
                in_flight.add_metric(labels, r.in_flight)
                limit.add_metric(labels, r.effective_limit())
                r.breaker.available()  # moves an open breaker whose cool-down passed to half-open
                breaker.add_metric(labels, BREAKER_VALUE[r.breaker.state])
                weight.add_metric(labels, r.spec.weight * r.breaker.weight_factor())
                if r.polled:
                    age.add_metric(
                        labels, math.inf if r.reported is None else max(0.0, now - r.reported.read_at)
                    )
            for (replica, reason), n in pool.picks.items():
                picks.add_metric([model, replica, policy, reason], n)
            waiting.add_metric([model], pool.waiting)
            u = pool.utilisation()
            util.add_metric([model], u if math.isfinite(u) else 1.0)
        counters = self.cluster.counters
        for (model, replica), n in counters.retries.items():
            retries.add_metric([model, replica], n)
        for (model, served), n in counters.fallbacks.items():
            fallbacks.add_metric([model, served], n)
        for (model, served, cause), n in counters.degradations.items():
            degradations.add_metric([model, served, cause], n)
        for (model, priority), n in counters.sheds.items():
            sheds.add_metric([model, str(priority)], n)
        yield from (
            in_flight,
            limit,
            breaker,
            weight,
            age,
            picks,
            retries,
            waiting,
            util,
            fallbacks,
            degradations,
            sheds,
        )
