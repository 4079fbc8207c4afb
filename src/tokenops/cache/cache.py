"""The response cache façade the gateway calls: `lookup` before dispatch, `store` after a good answer.

This module owns the order of a lookup (bypass rules -> exact layer -> semantic layer with guards
-> the verifier, when one is configured),
what may be stored (a whole, finished answer within the size limit, not a sampled one unless opted
in), false-hit reports, and the metrics of all of it. The cache never fails a request: an index error
(Redis down) is logged and counted, and the request goes on as a miss. It does not speak HTTP, meter
or bill: the gateway renders the `CachedResponse` and settles a hit with no engine tokens.

    cache = ResponseCache.from_config(settings.cache, redis_url=settings.redis_url, registry=metrics.registry)
    scope = CacheScope(tenant=admission.principal.tenant, model=inbound.model)
    directive = directive_from_headers(header(scope, b"cache-control"), header(scope, b"x-tokenops-cache"))
    hit = await cache.lookup(scope, inbound, directive)          # CachedResponse | None
    ...
    await cache.store(scope, inbound, completion_json, directive)  # after a 200 with a finished answer
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CollectorRegistry

from tokenops.cache.config import CacheConfig
from tokenops.cache.index import CacheEntry, CacheIndex, Evictions, MemoryIndex
from tokenops.cache.metrics import CacheMetrics
from tokenops.cache.response import CachedResponse, Layer
from tokenops.cache.scope import CacheDirective, CacheQuery, CacheScope, RequestLike, build_query
from tokenops.cache.semantic import QueryEmbedder, choose, choose_verified
from tokenops.cache.verifier import LogprobVerifier, PairVerifier

if TYPE_CHECKING:
    from tokenops.embeddings import SentenceEmbedder

log = logging.getLogger("tokenops.cache")

# a truncated answer is still the answer to its max_tokens (which is in the scope); a filtered or
# unfinished one is not worth serving again
CACHEABLE_FINISH = frozenset({"stop", "length", "tool_calls", "function_call"})


def _default_embedder() -> SentenceEmbedder:
    from tokenops.embeddings import shared_embedder  # torch loads only when the semantic layer is used

    return shared_embedder()


class ResponseCache:
    """Exact and semantic response cache, always inside a hard scope."""

    def __init__(
        self,
        config: CacheConfig | None = None,
        index: CacheIndex | None = None,
        *,
        embedder: Callable[[], SentenceEmbedder] | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
        verifier: PairVerifier | None = None,
    ) -> None:
        self.config = config or CacheConfig()
        c = self.config
        if verifier is None and c.verifier is not None:
            v = c.verifier
            verifier = LogprobVerifier(
                v.base_url, v.model, api_key=v.api_key, min_p_yes=v.min_p_yes, timeout_s=v.timeout_s
            )
        self.verifier = verifier
        self.index: CacheIndex = index or MemoryIndex(c.max_entries, c.max_bytes)
        self.embedder = QueryEmbedder(embedder or _default_embedder, c.semantic_max_tokens)
        self.metrics = CacheMetrics(registry)
        self.clock = clock
        self._sampled_tenants = frozenset(c.sampled_tenants)

    @classmethod
    def from_config(
        cls,
        config: CacheConfig,
        *,
        redis_url: str | None = None,
        registry: CollectorRegistry | None = None,
        embedder: Callable[[], SentenceEmbedder] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> ResponseCache:
        """The cache the config names: in-process, or shared through Redis (`index: redis`)."""
        index: CacheIndex | None = None
        if config.index == "redis":
            from tokenops.cache.redis_index import RedisIndex

            url = config.redis_url or redis_url
            if not url:
                raise ValueError("cache.index is 'redis' but neither cache.redis_url nor redis_url is set")
            index = RedisIndex(url, config.redis_prefix, config.max_entries, config.max_bytes, config.ttl_s)
        return cls(config, index, registry=registry, embedder=embedder, clock=clock)

    def warm(self) -> None:
        """Load the embedder now (at startup) rather than on the first semantic lookup."""
        if self.config.enabled and self.config.semantic:
            self.embedder.embedder()

    def query(
        self, scope: CacheScope, request: RequestLike, directive: CacheDirective | None = None
    ) -> CacheQuery:
        return build_query(
            scope,
            request,
            directive or CacheDirective(),
            default_temperature=self.config.default_temperature,
            sampled_tenants=self._sampled_tenants,
        )

    # -- lookup ----------------------------------------------------------------------------------

    async def lookup(
        self, scope: CacheScope, request: RequestLike, directive: CacheDirective | None = None
    ) -> CachedResponse | None:
        """A stored answer for this request, or None (miss or bypass). Never raises for index failures."""
        m = self.metrics
        m.lookups.inc()
        if not self.config.enabled:
            m.bypasses.labels("disabled").inc()
            return None
        return await self.lookup_query(self.query(scope, request, directive), counted=True)

    async def lookup_query(self, q: CacheQuery, *, counted: bool = False) -> CachedResponse | None:
        """`lookup` for a query already built with `query`.

        The gateway builds the query once, for both lookup and store.
        """
        m = self.metrics
        if not counted:
            m.lookups.inc()
        if q.bypass:
            m.bypasses.labels(q.bypass).inc()
            return None
        try:
            return await self._lookup(q)
        except Exception:
            log.exception("cache lookup failed; serving the request as a miss")
            m.bypasses.labels("error").inc()
            return None

    async def _lookup(self, q: CacheQuery) -> CachedResponse | None:
        c, now = self.config, self.clock()
        entry = await self.index.get_exact(q.scope_hash, q.exact_key, now)
        if entry is not None:
            return self._hit(entry, "exact", 1.0, now)
        if not (c.semantic and q.text):
            return None
        vector = await self.embedder.embed(q.text)
        if vector is None:
            return None  # longer than the embedder's window: exact layer only
        candidates = await self.index.nearest(q.scope_hash, vector, c.candidates, c.similarity_threshold, now)
        if self.verifier is None:
            match = choose(q.text, candidates, c.similarity_threshold, c.guards)
        else:
            checks = c.verifier.max_checks if c.verifier is not None else 1
            match = await choose_verified(
                q.text, candidates, c.similarity_threshold, c.guards, self.verifier, checks
            )
            for v in match.verdicts:
                self.metrics.verifier_calls.labels(
                    "failed" if v.error else "same" if v.same else "different"
                ).inc()
                self.metrics.verifier_seconds.inc(v.seconds)
                self.metrics.verifier_tokens.inc(v.prompt_tokens + v.completion_tokens)
        for guard in match.vetoes:
            self.metrics.vetoes.labels(guard).inc()
        if match.entry is None:
            return None
        await self.index.touch(q.scope_hash, match.entry.id, now)
        return self._hit(match.entry, "semantic", match.similarity, now)

    def _hit(self, entry: CacheEntry, layer: Layer, similarity: float, now: float) -> CachedResponse:
        self.metrics.hits.labels(layer).inc()
        return CachedResponse(
            hit_id=f"{layer[0]}.{entry.scope_hash}.{entry.id}",
            layer=layer,
            similarity=similarity,
            body=orjson.loads(entry.response),
            age_s=max(0.0, now - entry.created_at),
            matched_text=entry.text,
        )

    # -- store -----------------------------------------------------------------------------------

    async def store(
        self,
        scope: CacheScope,
        request: RequestLike,
        response: dict[str, Any] | bytes,
        directive: CacheDirective | None = None,
    ) -> str | None:
        """Keep a finished answer for its scope; returns the entry id, or None when it is not stored."""
        if not self.config.enabled:
            return None
        return await self.store_query(self.query(scope, request, directive), response)

    async def store_query(self, q: CacheQuery, response: dict[str, Any] | bytes) -> str | None:
        """`store` for a query already built with `query`."""
        reason = self._unstorable(q, response)
        if reason is not None:
            self.metrics.store_skips.labels(reason).inc()
            return None
        raw = response if isinstance(response, bytes) else orjson.dumps(response)
        try:
            return await self._store(q, raw)
        except Exception:
            log.exception("cache store failed; the answer is not cached")
            self.metrics.store_skips.labels("error").inc()
            return None

    def _unstorable(self, q: CacheQuery, response: dict[str, Any] | bytes) -> str | None:
        if not q.store_ok:
            return (
                "sampled"
                if q.bypass == "sampled"
                else "unparsable"
                if q.bypass == "unparsable"
                else "client_no_store"
            )
        if not q.scope_hash:
            return "unparsable"
        body = response
        if isinstance(response, bytes):
            if len(response) > self.config.max_response_bytes:
                return "too_large"
            try:
                body = orjson.loads(response)
            except orjson.JSONDecodeError:
                return "not_json"
        elif len(orjson.dumps(response)) > self.config.max_response_bytes:
            return "too_large"
        if not isinstance(body, dict) or body.get("error") is not None:
            return "error"
        choices = body.get("choices")
        if not choices or any(ch.get("finish_reason") not in CACHEABLE_FINISH for ch in choices):
            return "unfinished"
        return None

    async def _store(self, q: CacheQuery, raw: bytes) -> str:
        c, now = self.config, self.clock()
        vector = await self.embedder.embed(q.text) if c.semantic and q.text else None
        entry = CacheEntry(
            id=uuid.uuid4().hex[:16],
            tenant=q.tenant,
            scope_hash=q.scope_hash,
            exact_key=q.exact_key,
            text=q.text if vector is not None else None,
            response=raw,
            created_at=now,
            expires_at=now + c.ttl_s,
            vector=vector,
        )
        ev = await self.index.put(entry, now)
        self.metrics.stores.inc()
        await self._account(ev)
        return entry.id

    async def _account(self, ev: Evictions) -> None:
        if ev.expired:
            self.metrics.evictions.labels("expired").inc(ev.expired)
        if ev.capacity:
            self.metrics.evictions.labels("capacity").inc(ev.capacity)
        n, b = await self.index.size()
        self.metrics.entries.set(n)
        self.metrics.bytes.set(b)

    # -- feedback --------------------------------------------------------------------------------

    async def report_false_hit(self, hit_id: str, tenant: str | None) -> bool:
        """Record that a served hit was wrong and drop its entry. `tenant` must own the entry (None: an
        operator). Returns False for an unknown, expired or foreign hit id."""
        parts = hit_id.split(".")
        if len(parts) != 3 or parts[0] not in ("e", "s"):
            return False
        layer: Layer = "exact" if parts[0] == "e" else "semantic"
        scope_hash, entry_id = parts[1], parts[2]
        entry = await self.index.get(scope_hash, entry_id, self.clock())
        if entry is None or (tenant is not None and entry.tenant != tenant):
            return False
        self.metrics.false_hits.labels(layer).inc()
        await self.index.remove(scope_hash, entry_id)
        await self._account(Evictions())
        return True

    async def close(self) -> None:
        await self.index.close()
        close = getattr(self.verifier, "aclose", None)
        if close is not None:
            await close()
