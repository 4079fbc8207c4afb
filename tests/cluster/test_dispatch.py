"""The dispatch API against real loopback HTTP replicas: retries before the first byte only, fallback
model groups, degradation and shedding, and queueing at the concurrency limit."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import aiohttp
import httpx
import pytest

from tokenops.bench.ports import free_port
from tokenops.cluster.concurrency import AIMDConfig
from tokenops.cluster.degrade import DegradePolicy, DegradeRule
from tokenops.cluster.dispatch import Cluster, DispatchRequest, RetryConfig, UpstreamBroken
from tokenops.cluster.health import BreakerState, ReplicaBreakerSettings
from tokenops.cluster.policies import RoundRobin
from tokenops.cluster.pool import ReplicaPool, ReplicaSpec
from tokenops.cluster.snapshot import RequestInfo
from tokenops.protocol import APIError

from .conftest import serve_replicas

CHAT = "/v1/chat/completions"
pytestmark = pytest.mark.anyio
FAST_RETRY = RetryConfig(attempts=3, backoff_base=0.01, first_byte_timeout=5.0)


def make_pool(model: str, urls: list[str], **kw: object) -> ReplicaPool:
    specs = [
        ReplicaSpec(url=u, id=f"r{i}", served_model=kw.pop("served_model", None)) for i, u in enumerate(urls)
    ]  # type: ignore[arg-type]
    return ReplicaPool(model, specs, RoundRobin(), **kw)  # type: ignore[arg-type]


async def knob(url: str, **state: object) -> None:
    async with httpx.AsyncClient() as c:
        (await c.post(url + "/admin/fail", json=state)).raise_for_status()


def chunks_of(body: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in body.decode().split("\n") if line.startswith("data: {")]


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3}


async def test_streams_from_a_replica_and_rewrites_the_model() -> None:
    async with serve_replicas(2) as urls:
        pool = make_pool("m", urls, served_model="org/real-name")
        cluster = Cluster({"m": pool}, retry=FAST_RETRY)
        try:
            async with cluster.open(DispatchRequest(RequestInfo(model="m"), CHAT, BODY)) as up:
                assert up.status == 200 and up.replica == "r0" and up.degraded is None
                chunks = chunks_of(await up.read())
            assert len(chunks) == 3 and {c["replica"] for c in chunks} == {"r0"}
            assert chunks[0]["model"] == "org/real-name"
            assert pool.replicas["r0"].in_flight == 0  # the lease was released
        finally:
            await cluster.aclose()


@pytest.mark.parametrize("mode", ["500", "drop"])
async def test_failure_before_first_byte_is_retried_elsewhere(mode: str) -> None:
    async with serve_replicas(3) as urls:
        cluster = Cluster({"m": make_pool("m", urls)}, retry=FAST_RETRY)
        await knob(urls[0], mode=mode, count=1)
        try:
            async with cluster.open(DispatchRequest(RequestInfo(model="m"), CHAT, BODY)) as up:
                chunks = chunks_of(await up.read())
            assert up.replica == "r1" and {c["replica"] for c in chunks} == {"r1"}
            assert [a.replica for a in up.attempts] == ["r0", "r1"]
            assert up.attempts[0].outcome != "ok" and up.attempts[1].outcome == "ok"
            assert cluster.pools["m"].replicas["r0"].breaker.consecutive_failures == 1
        finally:
            await cluster.aclose()


async def test_a_started_stream_is_never_retried() -> None:
    async with serve_replicas(2) as urls:
        cluster = Cluster({"m": make_pool("m", urls)}, retry=FAST_RETRY)
        await knob(urls[0], mode="midstream", count=1)
        got: list[bytes] = []
        try:
            with pytest.raises(UpstreamBroken, match="r0 broke mid-stream"):
                async with cluster.open(DispatchRequest(RequestInfo(model="m"), CHAT, BODY)) as up:
                    async for chunk in up.aiter_bytes():
                        got.append(chunk)
            assert len(up.attempts) == 1 and b"t0" in b"".join(got)
            async with httpx.AsyncClient() as c:
                assert (await c.get(urls[1] + "/v1/load")).json()["served"] == 0  # not re-run elsewhere
            assert cluster.pools["m"].replicas["r0"].breaker.consecutive_failures == 1
        finally:
            await cluster.aclose()


async def test_an_upstream_silent_past_the_read_timeout_breaks_the_stream() -> None:
    # the first chunk arrives, then the replica stalls 2 s between chunks: past the 0.3 s read timeout
    async with serve_replicas(2) as urls:
        cluster = Cluster({"m": make_pool("m", urls)}, retry=replace(FAST_RETRY, read_timeout=0.3))
        got: list[bytes] = []
        try:
            with pytest.raises(UpstreamBroken, match="r0 broke mid-stream") as err:
                async with cluster.open(
                    DispatchRequest(
                        RequestInfo(model="m"), "/v1/chat/completions", dict(BODY, chunk_delay=2.0)
                    )
                ) as up:
                    async for chunk in up.aiter_bytes():
                        got.append(chunk)
            # the same error aiohttp's own sock_read timer raised
            assert isinstance(err.value.__cause__, aiohttp.ServerTimeoutError)
            assert "Timeout on reading data from socket" in str(err.value)
            assert b"t0" in b"".join(got) and b"t1" not in b"".join(got)
            assert cluster.pools["m"].replicas["r0"].breaker.consecutive_failures == 1
            assert cluster.pools["m"].replicas["r0"].in_flight == 0
            # the stalled connection was closed, not pooled: the next request is served whole
            async with cluster.open(DispatchRequest(RequestInfo(model="m"), CHAT, BODY)) as up:
                assert len(chunks_of(await up.read())) == 3
        finally:
            await cluster.aclose()


async def test_the_read_timeout_bounds_each_gap_not_the_whole_stream() -> None:
    # 10 chunks 0.06 s apart: 0.6 s in all, every gap well under the 0.4 s read timeout
    async with serve_replicas(1) as urls:
        cluster = Cluster({"m": make_pool("m", urls)}, retry=replace(FAST_RETRY, read_timeout=0.4))
        body = dict(BODY, chunk_delay=0.06, max_tokens=10)
        try:
            async with cluster.open(DispatchRequest(RequestInfo(model="m"), CHAT, body)) as up:
                assert len(chunks_of(await up.read())) == 10
        finally:
            await cluster.aclose()


async def test_a_slow_reader_is_not_a_silent_upstream() -> None:
    # the replica is quick; the gateway's side holds each chunk 0.3 s (a slow client) against a 0.2 s
    # read timeout: only time spent waiting for the replica counts
    async with serve_replicas(1) as urls:
        cluster = Cluster({"m": make_pool("m", urls)}, retry=replace(FAST_RETRY, read_timeout=0.2))
        body = dict(BODY, chunk_delay=0.01, max_tokens=4)
        got: list[bytes] = []
        try:
            async with cluster.open(DispatchRequest(RequestInfo(model="m"), CHAT, body)) as up:
                async for chunk in up.aiter_bytes():
                    got.append(chunk)
                    await asyncio.sleep(0.3)
            assert len(chunks_of(b"".join(got))) == 4 and b"[DONE]" in b"".join(got)
        finally:
            await cluster.aclose()


async def test_client_errors_are_relayed_not_retried() -> None:
    async with serve_replicas(2) as urls:
        cluster = Cluster({"m": make_pool("m", urls)}, retry=FAST_RETRY)
        await knob(urls[0], mode="400", count=1)
        try:
            async with cluster.open(DispatchRequest(RequestInfo(model="m"), CHAT, BODY)) as up:
                assert up.status == 400 and up.replica == "r0"
                assert json.loads(await up.read())["error"]["type"] == "injected"
            assert cluster.pools["m"].replicas["r0"].breaker.consecutive_failures == 0
        finally:
            await cluster.aclose()


async def test_connection_refused_opens_breaker_and_fallback_group_serves() -> None:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    async with serve_replicas(1) as light:
        big = make_pool("big", dead, breaker=ReplicaBreakerSettings(failure_threshold=1, open_seconds=60))
        cluster = Cluster(
            {"big": big, "light": make_pool("light", light)}, fallbacks={"big": ["light"]}, retry=FAST_RETRY
        )
        try:
            body = dict(BODY, model="big")
            async with cluster.open(DispatchRequest(RequestInfo(model="big"), CHAT, body)) as up:
                assert up.model == "light" and up.replica == "r0"
                assert "fallback: big unavailable, served by light" in (up.degraded or "")
                assert [a.model for a in up.attempts] == ["big", "big", "light"]
                assert chunks_of(await up.read())[0]["model"] == "light"
            assert all(r.breaker.state is BreakerState.OPEN for r in big.replicas.values())
            # with the whole pool open, the next request goes straight to the fallback
            async with cluster.open(DispatchRequest(RequestInfo(model="big"), CHAT, body)) as up:
                assert [a.model for a in up.attempts] == ["light"]
        finally:
            await cluster.aclose()


async def test_every_try_failing_is_a_clear_502_and_unknown_model_a_404() -> None:
    async with serve_replicas(2) as urls:
        cluster = Cluster({"m": make_pool("m", urls)}, retry=RetryConfig(attempts=2, backoff_base=0.01))
        for u in urls:
            await knob(u, mode="500", count=5)
        try:
            with pytest.raises(APIError) as err:
                async with cluster.open(DispatchRequest(RequestInfo(model="m"), CHAT, BODY)):
                    pass
            assert err.value.status == 502 and err.value.code == "upstream_failed"
            assert "m@r0: status 500" in err.value.message and "m@r1: status 500" in err.value.message
            with pytest.raises(APIError) as err:
                async with cluster.open(DispatchRequest(RequestInfo(model="nope"), CHAT, BODY)):
                    pass
            assert err.value.status == 404 and "Available models: m" in err.value.message
        finally:
            await cluster.aclose()


async def test_degrade_to_a_lighter_model_and_shed_the_lowest_priority() -> None:
    async with serve_replicas(2) as urls:
        rules = {"big": DegradeRule(degrade_to="light", budget_below=0.2, shed_at={2: 0.0})}
        cluster = Cluster(
            {"big": make_pool("big", urls[:1]), "light": make_pool("light", urls[1:])},
            degrade=DegradePolicy(rules),
            retry=FAST_RETRY,
        )
        try:
            info = RequestInfo(model="big", priority=1)
            async with cluster.open(DispatchRequest(info, CHAT, BODY, budget_left=0.05)) as up:
                assert up.model == "light" and up.degraded == "budget: 5% left, served by light"
            async with cluster.open(DispatchRequest(info, CHAT, BODY, budget_left=0.5)) as up:
                assert up.model == "big" and up.degraded is None
            with pytest.raises(APIError) as err:  # class 2 (least important) is shed at any utilisation
                async with cluster.open(DispatchRequest(RequestInfo(model="big", priority=2), CHAT, BODY)):
                    pass
            assert (
                err.value.status == 503
                and err.value.code == "overloaded"
                and "Retry-After" in err.value.headers
            )
        finally:
            await cluster.aclose()


async def test_overload_queues_at_the_gateway_then_times_out_clearly() -> None:
    async with serve_replicas(1) as urls:
        aimd = AIMDConfig(initial=1, min_limit=1, max_limit=1)
        pool = make_pool("m", urls, concurrency=aimd, queue_timeout=10.0)
        cluster = Cluster({"m": pool}, retry=FAST_RETRY)
        order: list[str] = []
        slow = dict(BODY, chunk_delay=0.1)

        async def one(tag: str) -> None:
            async with cluster.open(DispatchRequest(RequestInfo(model="m"), CHAT, slow)) as up:
                order.append(f"{tag} start")
                await up.read()
                order.append(f"{tag} end")

        try:
            await asyncio.gather(one("a"), one("b"))
            assert order == ["a start", "a end", "b start", "b end"]  # b waited for a's slot
            pool.queue_timeout = 0.2
            async with cluster.open(DispatchRequest(RequestInfo(model="m"), CHAT, slow)):
                with pytest.raises(APIError) as err:
                    async with cluster.open(DispatchRequest(RequestInfo(model="m"), CHAT, slow)):
                        pass
            assert err.value.status == 429 and err.value.code == "backend_busy"
            assert (
                "no slot freed within 0.2 s" in err.value.message and err.value.headers["Retry-After"] == "1"
            )
            # a full waiting line refuses at once
            async with cluster.open(DispatchRequest(RequestInfo(model="m"), CHAT, slow)):
                with pytest.raises(APIError) as err:
                    async with cluster.open(
                        DispatchRequest(RequestInfo(model="m"), "/v1/chat/completions", slow, max_queued=0)
                    ):
                        pass
            assert err.value.status == 429 and "waiting line is full (0 requests)" in err.value.message
        finally:
            await cluster.aclose()


async def test_waiters_are_served_by_priority_class_then_arrival() -> None:
    async with serve_replicas(1) as urls:
        pool = make_pool("m", urls, concurrency=AIMDConfig(initial=1, min_limit=1, max_limit=1))
        order: list[str] = []
        holder = pool.acquire(RequestInfo(model="m"))
        await holder.__aenter__()  # take the only slot

        async def wait(tag: str, priority: int) -> None:
            async with pool.acquire(RequestInfo(model="m", priority=priority)):
                order.append(tag)
                await asyncio.sleep(0.01)

        tasks = []
        for tag, prio in [("low-1", 2), ("high", 0), ("low-2", 2), ("mid", 1)]:
            tasks.append(asyncio.create_task(wait(tag, prio)))
            await asyncio.sleep(0.02)  # fix the arrival order
        assert pool.waiting == 4
        await holder.__aexit__(None, None, None)
        await asyncio.gather(*tasks)
        assert order == ["high", "mid", "low-1", "low-2"]


async def test_body_can_be_built_per_served_name() -> None:
    async with serve_replicas(1) as urls:
        cluster = Cluster({"m": make_pool("m", urls, served_model="org/x")}, retry=FAST_RETRY)
        try:

            def body(served: str) -> bytes:
                return json.dumps(dict(BODY, model=served)).encode()

            async with cluster.open(DispatchRequest(RequestInfo(model="m"), CHAT, body)) as up:
                assert chunks_of(await up.read())[0]["model"] == "org/x"
        finally:
            await cluster.aclose()
