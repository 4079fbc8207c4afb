"""Concurrency leases are renewed while their requests run, so a short lease neither frees a live
request's slot nor blocks a tenant long after its gateway died; Retry-After says which case it is."""

import asyncio
import uuid

import pytest
import redis
from ops_helpers import REDIS_URL

from tokenops.ops.limits import MAX_HOLD_S, InProcessLimits, LimitNode, RedisLimits, _Renewer

NODE = LimitNode(7, "org/k", rpm=None, tpm=None, max_concurrent=1)


def test_a_running_request_keeps_its_slot_past_the_lease_in_process():
    async def main():
        lim = InProcessLimits(concurrency_lease_s=0.6)
        try:
            assert await lim.acquire("a", [NODE], 10) is None
            await asyncio.sleep(1.2)  # two leases long: without renewal the slot would be free
            refused = await lim.acquire("b", [NODE], 10)
            assert refused is not None and refused.limit == "max_concurrent"
            assert refused.retry_after_header == "1"  # a live holder: its slot frees when it ends
            await lim.settle("a", [NODE], 10, 10)
            assert await lim.acquire("b", [NODE], 10) is None
        finally:
            await lim.close()

    asyncio.run(main())


@pytest.mark.redis
def test_a_dead_gateways_lease_expires_and_retry_after_says_when():
    prefix = f"tokenops:test:{uuid.uuid4().hex[:8]}:"
    lease = 4.0

    async def main():
        alive = RedisLimits(REDIS_URL, prefix, concurrency_lease_s=lease)
        other = RedisLimits(REDIS_URL, prefix, concurrency_lease_s=lease)
        try:
            assert await alive.acquire("gw-a:1", [NODE], 10) is None
            await asyncio.sleep(lease * 1.3)  # renewed meanwhile: still held
            live = await other.acquire("gw-b:1", [NODE], 10)
            assert live is not None and live.retry_after_s == 1.0
            await alive._renew(alive._renewer.due())  # its last renewal, then it dies: no settle
            await alive.close()
            # stale once two renewals were missed (2/3 of the lease), expired after the whole lease
            await asyncio.sleep(lease * 0.83)
            dead = await other.acquire("gw-b:1", [NODE], 10)
            assert dead is not None and dead.limit == "max_concurrent"
            # the truth: the slot frees when the dead lease runs out, under a third of the lease from now
            assert 0 < dead.retry_after_s < lease / 3 + 0.2
            assert dead.frees_by_s == pytest.approx(dead.retry_after_s)
            await asyncio.sleep(dead.retry_after_s + 0.1)
            assert await other.acquire("gw-b:1", [NODE], 10) is None
            await other.settle("gw-b:1", [NODE], 10, 10)
        finally:
            await other.close()

    try:
        asyncio.run(main())
    finally:
        r = redis.Redis.from_url(REDIS_URL)
        for k in r.scan_iter(match=prefix + "*"):
            r.delete(k)


def test_an_admission_never_settled_stops_being_renewed():
    now = [0.0]

    async def renew(_held):
        return None

    async def main():
        renewer = _Renewer(30.0, renew, clock=lambda: now[0])
        renewer.hold("leaked", [NODE])
        renewer.hold("fresh", [LimitNode(8, "org/j", None, None, None)])  # holds no lease: not tracked
        assert set(renewer.due()) == {"leaked"}
        now[0] = MAX_HOLD_S + 1
        renewer.hold("new", [NODE])
        assert set(renewer.due()) == {"new"}  # the leaked one is let expire
        await renewer.close()

    asyncio.run(main())
