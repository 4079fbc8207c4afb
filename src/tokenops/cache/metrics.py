"""Prometheus metrics of the response cache: lookups, hits by layer, bypasses, guard vetoes, stores,
evictions, false hits, and the hit and false-hit ratios computed at scrape time.

This module owns the metric names and labels. The registry is the caller's (the gateway passes its
own so one /metrics page shows everything) or a fresh one. It records what the cache tells it; it does
not measure anything itself. Labels carry no tenant (unbounded cardinality); per-tenant hits belong
in the ledger, where a hit is metered as such.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.lookups = Counter("tokenops_cache_lookups", "Cache lookups (bypasses included)", registry=r)
        self.hits = Counter(
            "tokenops_cache_hits", "Answers served from the cache, by layer", ["layer"], registry=r
        )
        self.bypasses = Counter(
            "tokenops_cache_bypasses", "Lookups not served by rule, by reason", ["reason"], registry=r
        )
        self.vetoes = Counter(
            "tokenops_cache_guard_vetoes",
            "Semantic candidates refused by a guard, by guard",
            ["guard"],
            registry=r,
        )
        self.stores = Counter("tokenops_cache_stores", "Answers stored", registry=r)
        self.store_skips = Counter(
            "tokenops_cache_store_skips", "Answers not stored, by reason", ["reason"], registry=r
        )
        self.evictions = Counter(
            "tokenops_cache_evictions",
            "Entries removed, by reason (expired, capacity)",
            ["reason"],
            registry=r,
        )
        self.false_hits = Counter(
            "tokenops_cache_false_hits",
            "Hits reported wrong by a client or an operator, by layer",
            ["layer"],
            registry=r,
        )
        self.verifier_calls = Counter(
            "tokenops_cache_verifier_calls",
            "Semantic candidates put to the verifier, by verdict (same, different, failed)",
            ["verdict"],
            registry=r,
        )
        self.verifier_seconds = Counter(
            "tokenops_cache_verifier_seconds", "Time spent waiting for the verifier", registry=r
        )
        self.verifier_tokens = Counter(
            "tokenops_cache_verifier_tokens", "Prompt and completion tokens of verifier calls", registry=r
        )
        self.entries = Gauge("tokenops_cache_entries", "Entries held (this process's view)", registry=r)
        self.bytes = Gauge("tokenops_cache_bytes", "Bytes held (this process's view)", registry=r)
        self.hit_ratio = Gauge("tokenops_cache_hit_ratio", "Hits / lookups since start", registry=r)
        self.hit_ratio.set_function(self._hit_ratio)
        self.false_hit_ratio = Gauge(
            "tokenops_cache_false_hit_ratio", "Reported false hits / hits since start", registry=r
        )
        self.false_hit_ratio.set_function(self._false_hit_ratio)

    def _total(self, counter: Counter) -> float:
        return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))

    def _hit_ratio(self) -> float:
        lookups = self._total(self.lookups)
        return self._total(self.hits) / lookups if lookups else 0.0

    def _false_hit_ratio(self) -> float:
        hits = self._total(self.hits)
        return self._total(self.false_hits) / hits if hits else 0.0
