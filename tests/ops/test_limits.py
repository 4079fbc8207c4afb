import asyncio

import pytest
from ops_helpers import REDIS_URL, open_ops, outcome, request

from tokenops.ops.limits import InProcessLimits, LimitNode
from tokenops.protocol import APIError


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_in_process_rpm_tpm_concurrency_with_a_clock():
    async def main():
        clock = Clock()
        lim = InProcessLimits(clock=clock)
        org = LimitNode(1, "org", rpm=3, tpm=None, max_concurrent=None)
        key = LimitNode(2, "org/k", rpm=None, tpm=600, max_concurrent=2)
        path = [org, key]
        assert await lim.acquire("a", path, 100) is None
        assert await lim.acquire("b", path, 100) is None
        r = await lim.acquire("c", path, 100)
        assert r.limit == "max_concurrent" and r.node_path == "org/k"
        await lim.settle("a", path, 100, 40)  # frees a slot and refunds 60 tokens
        assert await lim.acquire("c", path, 100) is None
        r = await lim.acquire("d", path, 100)
        assert r.limit == "rpm" and r.node_path == "org" and r.retry_after_s == pytest.approx(60)
        clock.t += 30
        r = await lim.acquire("d", path, 100)
        assert r.retry_after_s == pytest.approx(30)
        assert r.retry_after_header == "30"
        clock.t += 31
        await lim.settle("b", path, 100, 100)
        await lim.settle("c", path, 100, 100)
        # bucket: 600 - 240 used, + 61 s of refill at 10 tokens/s -> full again (600)
        r = await lim.acquire("e", path, 601)
        assert r.limit == "tpm" and r.retry_after_s == pytest.approx(0.1)
        assert await lim.acquire("e", path, 600) is None
        r = await lim.acquire("f", path, 50)
        assert r.limit == "tpm" and r.retry_after_s == pytest.approx(5.0)

    asyncio.run(main())


def test_admit_refuses_with_429_retry_after_naming_limit_and_node(tmp_path):
    async def main():
        ops = await open_ops((f"sqlite:///{tmp_path}/ops.db", None))
        try:
            await ops.create_node(None, "org", {"rpm": 2})
            key, _ = await ops.create_key("org", "k", {"max_concurrent": 1, "tpm": 3000})
            p = await ops.authenticate(key)
            a = await ops.admit(p, request(prompt=10, max_tokens=None, window=1010))
            assert a.max_output_tokens == 1000  # max_tokens None: up to the context window
            with pytest.raises(APIError):  # ... but never past the TPM
                await ops.admit(p, request(prompt=10, max_tokens=None, window=5000))
            with pytest.raises(APIError) as e:
                await ops.admit(p, request())
            assert e.value.status == 429 and e.value.code == "rate_limit_exceeded"
            assert "org/k" in e.value.message and "max_concurrent" in e.value.message
            assert int(e.value.headers["Retry-After"]) >= 1
            await ops.settle(a, outcome(prompt=10, output=10))
            b = await ops.admit(p, request())
            await ops.settle(b, outcome())
            with pytest.raises(APIError) as e:
                await ops.admit(p, request())
            assert "'org'" in e.value.message and "rpm = 2" in e.value.message
            assert 55 <= int(e.value.headers["Retry-After"]) <= 60
            with pytest.raises(APIError) as e:
                await ops.admit(p, request(prompt=5000))
            assert e.value.status == 429 and "tpm" in e.value.message
        finally:
            await ops.close()

    asyncio.run(main())


@pytest.mark.redis
def test_two_instances_sharing_redis_hold_a_combined_rpm_exactly(tmp_path, redis_prefix):
    async def main():
        url = f"sqlite:///{tmp_path}/ops.db"
        a = await open_ops((url, None), redis_url=REDIS_URL, redis_prefix=redis_prefix)
        b = await open_ops((url, None), redis_url=REDIS_URL, redis_prefix=redis_prefix)
        try:
            await a.create_node(None, "org", {"rpm": 25})
            key, _ = await a.create_key("org", "k", {"max_concurrent": 1000})
            pa, pb = await a.authenticate(key), await b.authenticate(key)

            async def one(i):
                ops, p = (a, pa) if i % 2 else (b, pb)
                try:
                    adm = await ops.admit(p, request())
                except APIError as e:
                    assert e.status == 429 and "'org'" in e.message and "rpm" in e.message
                    assert int(e.headers["Retry-After"]) >= 1
                    return 0
                await ops.settle(adm, outcome())
                return 1

            results = await asyncio.gather(*(one(i) for i in range(80)))
            assert sum(results) == 25
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


@pytest.mark.redis
def test_redis_tpm_and_concurrency_shared(tmp_path, redis_prefix):
    async def main():
        url = f"sqlite:///{tmp_path}/ops.db"
        a = await open_ops((url, None), redis_url=REDIS_URL, redis_prefix=redis_prefix)
        b = await open_ops((url, None), redis_url=REDIS_URL, redis_prefix=redis_prefix)
        try:
            await a.create_node(None, "org", {"tpm": 100, "max_concurrent": 2})
            key, _ = await a.create_key("org", "k", {})
            pa, pb = await a.authenticate(key), await b.authenticate(key)
            x = await a.admit(pa, request(prompt=10, max_tokens=20))  # 30 tokens
            y = await b.admit(pb, request(prompt=10, max_tokens=20))  # 60
            with pytest.raises(APIError) as e:
                await a.admit(pa, request(prompt=10, max_tokens=5))
            assert "max_concurrent" in e.value.message
            await a.settle(x, outcome(prompt=10, output=0))  # uses 10 of 30: refund 20
            with pytest.raises(APIError) as e:
                await b.admit(pb, request(prompt=10, max_tokens=60))  # 70 > ~60 left
            assert "tpm" in e.value.message
            z = await b.admit(pb, request(prompt=10, max_tokens=40))  # 50 fits
            await b.settle(y, outcome(prompt=10, output=20))
            await b.settle(z, outcome(prompt=10, output=40))
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())
