"""Exact prefix index from our real engine's KV events: two supervised `tokenops engine` processes
with the bundled model, a prompt given as token ids, and the second request sharing its prefix routed
to the replica whose engine reported storing those blocks (and the engine confirms the cache hit)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenops.cluster.dispatch import Cluster
from tokenops.cluster.policies import PrefixAware
from tokenops.cluster.pool import ReplicaPool, ReplicaSpec
from tokenops.cluster.prefix_index import block_hashes_from_tokens
from tokenops.cluster.snapshot import RequestInfo
from tokenops.cluster.supervisor import Supervisor, engine_specs

from .conftest import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.bundled, pytest.mark.timeout(400)]


async def test_routing_follows_the_engines_kv_events() -> None:
    specs = engine_specs(
        [free_port(), free_port()], args=["--kv-cache-memory", "64MiB", "--log-level", "warning"]
    )
    sup = Supervisor(specs)
    await sup.start()
    cluster: Cluster | None = None
    try:
        await sup.wait_ready("/v1/load", timeout=300)
        policy = PrefixAware(learn=False)
        replicas = [ReplicaSpec(url=s.url, id=s.name, kind="tokenops") for s in specs]
        pool = ReplicaPool("smollm2-135m-instruct", replicas, policy)
        cluster = Cluster({pool.model: pool}, load_poll_interval=0.2)
        await cluster.start()

        async def complete(tokens: list[int]) -> tuple[str, dict]:
            info = RequestInfo(
                model=pool.model,
                block_hashes=tuple(block_hashes_from_tokens(tokens, 16)),
                prompt_tokens=len(tokens),
                max_tokens=2,
            )
            body = {"prompt": tokens, "max_tokens": 2, "temperature": 0}
            async with cluster.open(info, "/v1/completions", body) as up:
                data = json.loads(await up.read())
            assert up.status == 200, data
            return up.replica, data

        shared = list(range(200, 264))  # four full blocks
        first, _ = await complete(shared + [7, 8, 9])
        hashes = block_hashes_from_tokens(shared, 16)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while policy.index.match(hashes).get(first, 0) < 4:  # the engine's events reached the index
            assert loop.time() < deadline, "KV events never arrived"
            await asyncio.sleep(0.1)
        second, data = await complete(shared + [11, 12, 13])
        assert second == first
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64  # the engine agrees
        # the other replica learnt nothing: the index is exactly what the engines reported
        other = next(s.name for s in specs if s.name != first)
        assert policy.index.match(hashes).get(other, 0) == 0
    finally:
        if cluster is not None:
            await cluster.aclose()
        await sup.stop()
