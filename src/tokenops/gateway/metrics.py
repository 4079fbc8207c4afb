"""Prometheus metrics of the gateway: requests, tokens by type, cost, TTFT and end-to-end latency by
model and tenant, refusals by reason, and the steps of cascade and ensemble routes by outcome.

This module owns the metric names and their labels, in a registry per gateway app (several apps in one
test process do not collide). It records what it is told at settle and at refusal; it does not
measure anything itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tokenops.ops.domain import Outcome

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_TYPES = ("uncached_input", "cached_input", "incremental_prefill", "output", "reasoning")

CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(slots=True)
class _Children:
    tokens: dict[str, Any]
    cost: Any
    ttft: Any
    e2e: Any


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tokenops_requests", "Requests settled, by model, tenant and status", ["model", "tenant", "status"], registry=r
        )
        self.tokens = Counter("tokenops_tokens", "Tokens metered, by type", ["model", "tenant", "type"], registry=r)
        self.cost = Counter("tokenops_cost_micros", "Cost committed, in micro-units", ["model", "tenant"], registry=r)
        self.ttft = Histogram(
            "tokenops_ttft_seconds", "Time to first token", ["model", "tenant"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "tokenops_e2e_seconds", "End-to-end latency", ["model", "tenant"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.refusals = Counter("tokenops_refusals", "Requests refused, by reason", ["reason"], registry=r)
        self.fusion_steps = Counter(
            "tokenops_fusion_steps",
            "Steps of cascade and ensemble routes, by route, model and outcome "
            "(accepted, rejected, failed, answered, not_picked, judge_unclear)",
            ["route", "model", "outcome"],
            registry=r,
        )
        self._by_pair: dict[tuple[str, str], _Children] = {}

    def _children(self, model: str, tenant: str) -> _Children:
        # labels() hashes and locks on every call: resolve each (model, tenant) once
        key = (model, tenant)
        children = self._by_pair.get(key)
        if children is None:
            children = _Children(
                tokens={t: self.tokens.labels(model, tenant, t) for t in TOKEN_TYPES},
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
        for name in TOKEN_TYPES:
            n = getattr(u, name)
            if n:
                c.tokens[name].inc(n)
        for call in outcome.side_calls:  # a cascade's or ensemble's other calls, under their own model
            side = self._children(call.model, tenant).tokens
            for name in TOKEN_TYPES:
                n = getattr(call.usage, name)
                if n:
                    side[name].inc(n)
        if cost_micros:  # the whole request's cost, side calls included, under the answering model
            c.cost.inc(cost_micros)
        if outcome.ttft_ms is not None:
            c.ttft.observe(outcome.ttft_ms / 1000)
        c.e2e.observe(outcome.latency_ms / 1000)

    def fusion_step(self, route: str, model: str, outcome: str) -> None:
        self.fusion_steps.labels(route, model, outcome).inc()

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
