"""Load polling against real loopback servers: our engine's `/v1/load` and KV events, vLLM-style
Prometheus `/metrics`, and staleness when a replica stops answering."""

from __future__ import annotations

import httpx
import pytest

from tokenops.bench.ports import free_port
from tokenops.cluster.load_poller import LoadPoller, parse_engine_load, parse_prometheus_load, root_url
from tokenops.cluster.policies import PrefixAware
from tokenops.cluster.pool import ReplicaPool, ReplicaSpec
from tokenops.cluster.prefix_index import block_hashes_from_tokens
from tokenops.cluster.snapshot import RequestInfo

from .conftest import serve_replicas

pytestmark = pytest.mark.anyio


def test_prometheus_parsing_for_vllm_and_sglang() -> None:
    vllm = (
        'vllm:num_requests_running{model_name="a"} 3\nvllm:num_requests_running{model_name="b"} 2\n'
        'vllm:num_requests_waiting{model_name="a"} 7\nvllm:gpu_cache_usage_perc{model_name="a"} 0.42\n'
    )
    load = parse_prometheus_load(vllm, "vllm", read_at=5.0)
    assert (load.running, load.waiting, load.kv_usage, load.read_at) == (5, 7, 0.42, 5.0)
    # the prefix cache counters, as vLLM exports them (tokens; the sample carries `_total`)
    counters = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="a"} 480.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="a"} 320.0\n'
    )
    load = parse_prometheus_load(counters + "vllm:kv_cache_usage_perc 0.1\n", "vllm", read_at=1.0)
    assert (load.prefix_cache_queries, load.prefix_cache_hits, load.kv_usage) == (480, 320, 0.1)
    sglang = "sglang:num_running_reqs 4\nsglang:num_queue_reqs 1\nsglang:token_usage 0.9\n"
    load = parse_prometheus_load(sglang, "sglang", read_at=1.0)
    assert (load.running, load.waiting, load.kv_usage) == (4, 1, 0.9)
    assert root_url("http://h:1/v1/") == "http://h:1" and root_url("http://h:1") == "http://h:1"


async def test_poller_reads_engine_and_vllm_replicas_and_marks_the_dead_stale() -> None:
    async with serve_replicas(2) as urls:
        dead = f"http://127.0.0.1:{free_port()}/v1"
        specs = [
            ReplicaSpec(url=urls[0] + "/v1", id="ours", kind="tokenops"),
            ReplicaSpec(url=urls[1], id="vllm", kind="vllm"),
            ReplicaSpec(url=dead, id="dead", kind="tokenops"),
            ReplicaSpec(url=dead, id="provider", kind="openai"),  # not polled
        ]
        pool = ReplicaPool("m", specs, PrefixAware(), stale_after=5.0)
        poller = LoadPoller([pool], timeout=0.5)
        async with httpx.AsyncClient() as client:
            await poller.poll_once(client)
        ours, vllm = pool.replicas["ours"].reported, pool.replicas["vllm"].reported
        assert ours is not None and ours.kv_usage == 0.25
        assert vllm is not None and (vllm.waiting, vllm.kv_usage) == (2, 0.5)
        assert pool.replicas["dead"].reported is None and pool.replicas["provider"].reported is None
        snap = pool.snapshot()
        saturated = {r.id for r in snap.replicas if snap.is_saturated(r)}
        assert saturated == {"dead"}  # polled but never read: blind, so saturated; the provider is not


async def test_kv_events_make_the_prefix_index_exact() -> None:
    async with serve_replicas(2) as urls:
        toks = list(range(48))
        rows = []
        parent = 555  # the engine's root hash: any number
        for i in range(3):
            rows.append(
                {
                    "seq_no": i,
                    "kind": "stored",
                    "block_hash": 1000 + i,
                    "block_id": i,
                    "parent_hash": parent,
                    "token_ids": toks[16 * i : 16 * (i + 1)],
                }
            )
            parent = 1000 + i
        rows.append({"seq_no": 3, "kind": "evicted", "block_hash": 1002, "block_id": 2})
        async with httpx.AsyncClient() as c:
            await c.post(urls[1] + "/admin/fail", json={"events": rows})
        policy = PrefixAware(learn=False)
        specs = [ReplicaSpec(url=u + "/v1", id=f"r{i}", kind="tokenops") for i, u in enumerate(urls)]
        pool = ReplicaPool("m", specs, policy)
        poller = LoadPoller([pool], timeout=0.5)
        async with httpx.AsyncClient() as client:
            await poller.poll_once(client)
        hashes = tuple(block_hashes_from_tokens(toks, 16))
        assert policy.index.match(hashes) == {"r1": 2}  # three stored, one evicted
        d = policy.choose(RequestInfo(model="m", block_hashes=hashes, prompt_tokens=48), pool.snapshot())
        assert d.replica == "r1" and d.matched_blocks == 2
        assert len(policy.index) == 2  # exact mode: the decision itself taught nothing


def test_engine_load_carries_the_prefix_cache_counts() -> None:
    rep = parse_engine_load(
        {"running": 2, "waiting": 1, "kv_usage": 0.4, "prefix_cache_queries": 40, "prefix_cache_hits": 30},
        5.0,
    )
    assert (rep.prefix_cache_queries, rep.prefix_cache_hits, rep.kv_usage) == (40, 30, 0.4)
    assert parse_engine_load({"running": 0}, 1.0).prefix_cache_queries == 0  # an older engine: not reported
