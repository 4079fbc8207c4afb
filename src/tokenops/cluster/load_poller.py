"""Read each replica's own view of its load on an interval, and its KV events.

Our engine serves `/v1/load` (JSON: running, waiting, kv_usage, prefix cache queries/hits, ...) and
`/v1/kv_events?since=N`; vLLM and SGLang serve Prometheus `/metrics` (`vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` or the older `vllm:gpu_cache_usage_perc`, the
counters `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` in tokens; `sglang:num_running_reqs`,
`sglang:num_queue_reqs`, `sglang:token_usage`). The poller writes a `ReportedLoad` with the time it was
read onto each replica; a replica whose reads stop becomes stale and policies treat it as saturated.
KV events feed the policy's prefix index when the policy runs in exact mode (`learn=False`): our
engine's are polled over HTTP, a vLLM replica's arrive on its ZeroMQ stream (`kv_event_stream`). This
module does not decide anything from the numbers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenops.cluster.background import BackgroundTask, poll_every
from tokenops.cluster.health import Clock
from tokenops.cluster.kv_event_stream import VLLMKVEventSubscriber
from tokenops.cluster.pool import Replica, ReplicaPool
from tokenops.cluster.prefix_index import BlockRemoved, BlockStored, KVEvent, KVEventApplier
from tokenops.cluster.snapshot import ReportedLoad

log = logging.getLogger("tokenops.cluster.load")

PROMETHEUS_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    # kind: field -> sample names, first present wins (counters' samples carry the `_total` suffix)
    "vllm": {
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    },
    "sglang": {
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "kv_usage": ("sglang:token_usage",),
    },
}


def root_url(url: str) -> str:
    """The server root of a configured base URL (`http://h:p/v1` -> `http://h:p`)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def parse_engine_load(data: Mapping[str, Any], read_at: float) -> ReportedLoad:
    """Our engine's `/v1/load` JSON."""
    kv = float(data.get("kv_usage", 0.0))
    block = int(data.get("block_size", 1))
    total, used = int(data.get("kv_blocks_total", 0)), int(data.get("kv_blocks_used", 0))
    peer = data.get("kv_transfer")
    return ReportedLoad(
        int(data.get("running", 0)),
        int(data.get("waiting", 0)),
        min(max(kv, 0.0), 1.0),
        read_at,
        int(data.get("prefix_cache_queries", 0)),
        int(data.get("prefix_cache_hits", 0)),
        context_tokens=int(data.get("tokens_in_flight", 0)),
        kv_free_tokens=max(0, total - used) * block,
        kv_total_tokens=total * block,
        kv_transfer=(str(peer["engine_id"]), str(peer["host"]), int(peer["port"])) if peer else None,
    )


def parse_prometheus_load(text: str, kind: str, read_at: float) -> ReportedLoad:
    """vLLM's or SGLang's `/metrics`; values of one metric are summed over label sets (models, ranks)."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    names = PROMETHEUS_NAMES[kind]

    def first(field: str) -> float:
        return next((sums[n] for n in names.get(field, ()) if n in sums), 0.0)

    kv = first("kv_usage")
    kv = kv / 100 if kv > 1.0 else kv  # a few versions export percent, most a fraction
    return ReportedLoad(
        int(first("running")),
        int(first("waiting")),
        min(max(kv, 0.0), 1.0),
        read_at,
        int(first("prefix_cache_queries")),
        int(first("prefix_cache_hits")),
    )


def parse_engine_kv_events(rows: Iterable[Mapping[str, Any]]) -> list[KVEvent]:
    """Our engine's `/v1/kv_events` rows (one block each) as typed events."""
    out: list[KVEvent] = []
    for row in rows:
        if row.get("kind") == "stored" and row.get("token_ids"):
            toks = tuple(int(t) for t in row["token_ids"])
            parent = row.get("parent_hash")
            out.append(
                BlockStored(
                    (int(row["block_hash"]),), None if parent is None else int(parent), toks, len(toks)
                )
            )
        elif row.get("kind") == "evicted":
            out.append(BlockRemoved((int(row["block_hash"]),)))
    return out


class LoadPoller:
    """Polls every replica of the given pools each `interval` seconds (all concurrently)."""

    def __init__(
        self,
        pools: Iterable[ReplicaPool],
        *,
        interval: float = 1.0,
        timeout: float = 2.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.pools = list(pools)
        self.interval = interval
        self.timeout = timeout
        self.clock = clock
        self._appliers: dict[tuple[str, str], KVEventApplier] = {}
        self._cursor: dict[tuple[str, str], int] = {}
        self._subscribers: dict[tuple[str, str], VLLMKVEventSubscriber] = {}
        self._task = BackgroundTask(self.run, "cluster-load-poller")

    def _attach(self) -> None:
        for pool in self.pools:
            for r in pool.replicas.values():
                # from now on a missing or old report means "blind", which policies treat as saturated
                r.polled = r.spec.kind != "openai"

    def _exact_index(self, pool: ReplicaPool) -> bool:
        return getattr(pool.policy, "learn", True) is False and hasattr(pool.policy, "kv_events")

    def _applier(self, pool: ReplicaPool, r: Replica) -> KVEventApplier:
        key = (pool.model, r.id)
        applier = self._appliers.get(key)
        if applier is None:
            applier = self._appliers[key] = pool.policy.kv_events(r.id)  # type: ignore[attr-defined]
        return applier

    def subscribers(self) -> dict[tuple[str, str], VLLMKVEventSubscriber]:
        """One ZeroMQ subscriber per replica that publishes KV events, for pools with an exact index."""
        for pool in self.pools:
            if not self._exact_index(pool):
                continue
            for r in pool.replicas.values():
                key = (pool.model, r.id)
                if r.spec.kv_events is not None and key not in self._subscribers:
                    self._subscribers[key] = VLLMKVEventSubscriber(self._applier(pool, r), r.spec.kv_events)
        return self._subscribers

    async def poll_once(self, client: httpx.AsyncClient) -> None:
        self._attach()
        jobs = [
            self._poll(client, pool, r) for pool in self.pools for r in pool.replicas.values() if r.polled
        ]
        await asyncio.gather(*jobs)

    async def _poll(self, client: httpx.AsyncClient, pool: ReplicaPool, r: Replica) -> None:
        root = root_url(r.url)
        try:
            if r.spec.kind == "tokenops":
                resp = await client.get(root + "/v1/load", timeout=self.timeout)
                resp.raise_for_status()
                data = resp.json()
                r.reported = parse_engine_load(data, self.clock())
                if self._exact_index(pool):
                    await self._poll_events(client, pool, r, root, data.get("kv_root_hash"))
            else:
                resp = await client.get(root + "/metrics", timeout=self.timeout)
                resp.raise_for_status()
                r.reported = parse_prometheus_load(resp.text, r.spec.kind, self.clock())
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            # leave the old report to go stale
            log.debug("load poll of %s failed: %s", r.url, exc)
            if isinstance(exc, httpx.ConnectError):
                self.replica_restarted(pool.model, r.id)  # down, so it will come back with an empty cache

    async def _poll_events(
        self, client: httpx.AsyncClient, pool: ReplicaPool, r: Replica, root: str, root_hash: Any
    ) -> None:
        key = (pool.model, r.id)
        applier = self._applier(pool, r)
        if root_hash is not None:
            applier.roots.add(int(root_hash))
        while True:
            since = self._cursor.get(key, 0)
            resp = await client.get(root + "/v1/kv_events", params={"since": since}, timeout=self.timeout)
            resp.raise_for_status()
            data = resp.json()
            if since == 0:
                # reading from the very first event: every unknown parent is the engine's root
                applier.complete = not data.get("missed")
            if data.get("missed"):
                applier.resync()
                applier.complete = False
            for event in parse_engine_kv_events(data.get("events", ())):
                applier.apply(event)
            self._cursor[key] = int(data.get("next", since))
            if not data.get("events"):
                return

    def replica_restarted(self, model: str, replica: str) -> None:
        """A supervised replica restarted: its event numbering starts again from 0."""
        key = (model, replica)
        self._cursor[key] = 0
        if key in self._subscribers:
            self._subscribers[key].reset()
        elif key in self._appliers:
            self._appliers[key].resync()

    async def run(self) -> None:
        await poll_every(self.interval, self.poll_once, log, "load poll")

    def start(self) -> None:
        self._task.start()
        for sub in self.subscribers().values():
            sub.start()

    async def stop(self) -> None:
        await self._task.stop()
        for sub in self._subscribers.values():
            await sub.stop()
