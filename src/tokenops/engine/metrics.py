"""Prometheus metrics of one engine server.

`EngineMetrics` owns a private `CollectorRegistry` (several servers may live in one process, as in
the tests) with two kinds of series: gauges and counters read at scrape time from the engine
thread's latest load snapshot (running and waiting requests, KV blocks used and total, prefix-cache
queries and hits, speculative draft and accepted tokens, tokens routed to each expert of an MoE
model by layer), and series the server records per request
as it answers (prompt and generation tokens, finished requests by reason, TTFT / TPOT / end-to-end
latency histograms). It does not
serve HTTP; the server renders `render()` at `/metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tokenops.engine.load import LoadSnapshot

CONTENT_TYPE = CONTENT_TYPE_LATEST

# CPU serving is slow: buckets reach minutes for end-to-end latency and seconds for TTFT
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _LoadCollector:
    """Reads the latest `LoadSnapshot` at scrape time (never the engine itself)."""

    def __init__(self, load: Callable[[], LoadSnapshot], model: str) -> None:
        self._load = load
        self._model = model

    def collect(self) -> Iterator[Metric]:
        view = self._load()
        labels = ["model_name"]
        value = [self._model]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("tokenops_engine_requests_running", "Requests in the running batch.", view.running)
        yield gauge("tokenops_engine_requests_waiting", "Requests waiting to be scheduled.", view.waiting)
        yield gauge(
            "tokenops_engine_kv_blocks_used", "KV cache blocks referenced by requests.", view.kv_blocks_used
        )
        yield gauge("tokenops_engine_kv_blocks_total", "KV cache blocks in the pool.", view.kv_blocks_total)
        yield gauge("tokenops_engine_kv_usage_ratio", "Fraction of KV blocks in use (0-1).", view.kv_usage)
        yield gauge(
            "tokenops_engine_tokens_in_flight",
            "Tokens held by running and waiting requests.",
            view.tokens_in_flight,
        )
        yield counter(
            "tokenops_engine_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            view.prefix_cache_queries,
        )
        yield counter(
            "tokenops_engine_prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            view.prefix_cache_hits,
        )
        yield gauge(
            "tokenops_engine_kv_bytes_per_token",
            "KV cache bytes per token, all layers (int8: with scales).",
            view.kv_bytes_per_token,
        )
        yield counter(
            "tokenops_engine_kv_evicted_blocks",
            "KV blocks dropped by sink+window eviction.",
            view.kv_evicted_blocks,
        )
        yield counter(
            "tokenops_engine_preemptions", "Requests preempted for lack of KV blocks.", view.preemptions
        )
        yield counter(
            "tokenops_engine_spec_draft_tokens",
            "Speculative draft tokens verified by the target.",
            view.spec_draft_tokens,
        )
        yield counter(
            "tokenops_engine_spec_accepted_tokens",
            "Speculative draft tokens accepted.",
            view.spec_accepted_tokens,
        )
        yield gauge(
            "tokenops_engine_spec_acceptance_rate",
            "Accepted / verified draft tokens since start (0-1).",
            view.spec_acceptance_rate,
        )
        yield gauge(
            "tokenops_engine_spec_mean_accepted_length",
            "Tokens emitted per speculative verification (accepted drafts + 1).",
            view.spec_mean_accepted_length,
        )
        experts = view.expert_tokens
        if experts:
            c = CounterMetricFamily(
                "tokenops_engine_moe_expert_tokens",
                "Tokens routed to each expert of an MoE layer (top-k slots).",
                labels=[*labels, "layer", "expert"],
            )
            for layer, counts in experts.items():
                for expert, n in enumerate(counts):
                    c.add_metric([*value, str(layer), str(expert)], n)
            yield c


class TransferCollector:
    """The KV transfer counters (`kv_transfer.TransferStats`), read at scrape time."""

    def __init__(self, stats: Any, model: str) -> None:
        self._stats = stats
        self._model = model

    def collect(self) -> Iterator[Metric]:
        s, labels = self._stats, [self._model]
        for name, doc, value in (
            ("blocks_sent", "KV blocks sent to peer engines.", s.blocks_sent),
            ("bytes_sent", "KV bytes sent to peer engines.", s.bytes_sent),
            ("blocks_received", "KV blocks received from peer engines and registered.", s.blocks_received),
            ("bytes_received", "KV bytes received from peer engines.", s.bytes_received),
            ("receive_seconds", "Time spent pulling KV from peer engines.", s.receive_seconds),
            ("holds_created", "Prompt KV holds pinned for a decode engine's pull.", s.holds_created),
            ("holds_released", "KV holds released after their pull.", s.holds_released),
            ("holds_expired", "KV holds released by timeout, never pulled.", s.holds_expired),
            ("holds_cancelled", "KV holds released at the puller's word, never pulled.", s.holds_cancelled),
        ):
            c = CounterMetricFamily(f"tokenops_engine_kv_transfer_{name}", doc, labels=["model_name"])
            c.add_metric(labels, value)
            yield c
        c = CounterMetricFamily(
            "tokenops_engine_kv_transfer_fallbacks",
            "Decode or prefill legs that computed locally because a pull failed.",
            labels=["model_name", "reason"],
        )
        for reason, n in sorted(s.fallbacks.items()):
            c.add_metric([self._model, reason], n)
        yield c


class EngineMetrics:
    def __init__(self, model: str, load: Callable[[], LoadSnapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_LoadCollector(load, model))
        labels = ["model_name"]
        self.prompt_tokens = Counter(
            "tokenops_engine_prompt_tokens",
            "Prompt tokens of finished requests.",
            labels,
            registry=self.registry,
        ).labels(model)
        self.cached_prompt_tokens = Counter(
            "tokenops_engine_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache.",
            labels,
            registry=self.registry,
        ).labels(model)
        self.generation_tokens = Counter(
            "tokenops_engine_generation_tokens", "Generated tokens.", labels, registry=self.registry
        ).labels(model)
        self._finished = Counter(
            "tokenops_engine_requests_finished",
            "Finished requests by finish reason.",
            [*labels, "finish_reason"],
            registry=self.registry,
        )
        self._model = model
        self.ttft = Histogram(
            "tokenops_engine_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.tpot = Histogram(
            "tokenops_engine_time_per_output_token_seconds",
            "Mean time between output tokens of a request.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.reasoning_tokens = Counter(
            "tokenops_engine_reasoning_tokens",
            "Reasoning tokens (inside the thinking markers) of finished requests.",
            labels,
            registry=self.registry,
        ).labels(model)
        self.reasoning_budget_closures = Counter(
            "tokenops_engine_reasoning_budget_closures",
            "Thinking sections the reasoning budget closed.",
            labels,
            registry=self.registry,
        ).labels(model)
        self.e2e = Histogram(
            "tokenops_engine_e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(model)

    def request_finished(
        self,
        finish_reason: str,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        ttft: float | None,
        e2e: float,
        output_tokens: int,
    ) -> None:
        """Record one finished choice (`prompt_tokens` is 0 for the extra choices of n > 1)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(cached_tokens)
        self._finished.labels(self._model, finish_reason).inc()
        if ttft is not None:
            self.ttft.observe(ttft)
            if output_tokens > 1:
                self.tpot.observe((e2e - ttft) / (output_tokens - 1))
        self.e2e.observe(e2e)

    def reasoning_finished(self, reasoning_tokens: int, *, closed_by_budget: bool) -> None:
        self.reasoning_tokens.inc(reasoning_tokens)
        if closed_by_budget:
            self.reasoning_budget_closures.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
