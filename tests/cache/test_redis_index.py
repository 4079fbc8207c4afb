"""The shared index on the real Redis: two cache instances (two gateways) see each other's entries,
exact and semantic; TTL, the memory bound and false-hit removal hold across them."""

from __future__ import annotations

import asyncio

import pytest

from tokenops.cache import CacheConfig, CacheScope, ResponseCache
from tokenops.cache.redis_index import RedisIndex

from .conftest import REDIS_URL, SCOPE, answer, chat

pytestmark = pytest.mark.redis


def gateways(n, prefix, embedder, clock, **overrides):
    """n caches on one Redis prefix, as n gateway replicas would build them."""
    config = CacheConfig(index="redis", redis_url=REDIS_URL, redis_prefix=prefix, **overrides)
    return [ResponseCache.from_config(config, embedder=lambda: embedder, clock=clock) for _ in range(n)]


def test_two_instances_share_entries(redis_prefix, embedder, clock):
    a, b = gateways(2, redis_prefix, embedder, clock)

    async def go():
        try:
            assert isinstance(a.index, RedisIndex)
            await a.store(SCOPE, chat("How do I reset my password?"), answer("Click 'Forgot password'."))
            exact = await b.lookup(SCOPE, chat("How do I reset my password?"))
            assert exact is not None and exact.layer == "exact"
            semantic = await b.lookup(SCOPE, chat("How can I reset my password?"))
            assert semantic is not None and semantic.layer == "semantic"
            assert semantic.body["choices"][0]["message"]["content"] == "Click 'Forgot password'."
            # hard negatives and other scopes never hit through the shared index either
            assert await b.lookup(SCOPE, chat("How do I not reset my password?")) is None
            assert await b.lookup(CacheScope("globex", "m"), chat("How do I reset my password?")) is None
            # a false hit reported on one gateway removes the entry for both
            assert await b.report_false_hit(semantic.hit_id, "acme")
            assert await a.lookup(SCOPE, chat("How do I reset my password?")) is None
            assert await a.index.size() == (0, 0)
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_ttl_across_instances(redis_prefix, embedder, clock):
    a, b = gateways(2, redis_prefix, embedder, clock, ttl_s=30, semantic=False)

    async def go():
        try:
            await a.store(SCOPE, chat("q1"), answer("1"))
            clock.t += 29
            assert await b.lookup(SCOPE, chat("q1")) is not None
            clock.t += 2
            assert await b.lookup(SCOPE, chat("q1")) is None
            await a.store(SCOPE, chat("q2"), answer("2"))
            assert await a.index.size() == (1, (await a.index.size())[1])
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_memory_bound_lru_across_instances(redis_prefix, embedder, clock):
    a, b = gateways(2, redis_prefix, embedder, clock, max_entries=3, semantic=False)

    async def go():
        try:
            for i, q in enumerate(("q1", "q2", "q3")):
                clock.t += 1
                await (a if i % 2 else b).store(SCOPE, chat(q), answer(q))
            clock.t += 1
            assert await b.lookup(SCOPE, chat("q1")) is not None  # q1 becomes the most recent
            clock.t += 1
            await a.store(SCOPE, chat("q4"), answer("q4"))  # evicts q2, the least recently used
            present = [q for q in ("q1", "q2", "q3", "q4") if await b.lookup(SCOPE, chat(q)) is not None]
            assert present == ["q1", "q3", "q4"]
            n, nbytes = await a.index.size()
            assert n == 3 and nbytes > 0
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_clear_removes_every_key(redis_prefix, embedder, clock):
    (a,) = gateways(1, redis_prefix, embedder, clock, semantic=False)

    async def go():
        try:
            await a.store(SCOPE, chat("q"), answer("a"))
            await a.index.clear()
            assert [k async for k in a.index.client.scan_iter(match=f"{redis_prefix}:*")] == []
        finally:
            await a.close()

    asyncio.run(go())
