import asyncio
import logging

import pytest
from aiohttp import web
from ops_helpers import REDIS_URL, open_ops, outcome, request

from tokenops.ops.breaker import InProcessBreaker, SessionBreakerSettings
from tokenops.protocol import APIError


class Clock:
    def __init__(self):
        self.t = 50.0

    def __call__(self):
        return self.t


def test_repeat_breaker_trips_and_cools_down():
    async def main():
        clock = Clock()
        br = InProcessBreaker(SessionBreakerSettings(repeat_limit=3, window_s=10, cooldown_s=30), clock=clock)
        for _ in range(3):
            assert await br.check("s", "same") is None
        reason, left = await br.check("s", "same")
        assert "4 times" in reason and left == 30
        assert await br.check("s", "other") is not None  # the whole session is paused
        assert await br.check("s2", "same") is None  # other sessions are not
        clock.t += 31
        assert await br.check("s", "same") is None
        # repeats spread beyond the window never trip
        for _ in range(10):
            clock.t += 4
            assert await br.check("s3", "x") is None

    asyncio.run(main())


def test_spend_rate_breaker():
    async def main():
        clock = Clock()
        settings = SessionBreakerSettings(spend_limit_micros=100, window_s=60, cooldown_s=5)
        br = InProcessBreaker(settings, clock=clock)
        await br.record_spend("s", 60)
        assert await br.check("s", "a") is None
        await br.record_spend("s", 60)
        reason, _ = await br.check("s", "b")
        assert "spent 120" in reason
        clock.t += 6
        assert await br.check("s", "c") is None

    asyncio.run(main())


def _breaker_flow(target, shared, **kw):
    async def main():
        settings = SessionBreakerSettings(repeat_limit=2, window_s=60, cooldown_s=2, spend_limit_micros=None)
        ops = await open_ops(target, breaker=settings, **kw)
        ops2 = await open_ops(target, breaker=settings, **kw) if shared else ops
        try:
            await ops.create_node(None, "org", {})
            key, _ = await ops.create_key("org", "k", {})
            p = await ops.authenticate(key)
            p2 = await ops2.authenticate(key)
            for o, pr in ((ops, p), (ops2, p2)):
                adm = await o.admit(pr, request(session="agent-1", fingerprint="loop"))
                await o.settle(adm, outcome())
            with pytest.raises(APIError) as e:
                await ops.admit(p, request(session="agent-1", fingerprint="loop"))
            assert e.value.status == 429 and e.value.code == "session_breaker_open"
            assert "agent-1" in e.value.message and e.value.headers["Retry-After"] == "2"
            with pytest.raises(APIError) as e:  # the whole session is paused, on every instance
                await ops2.admit(p2, request(session="agent-1", fingerprint="different"))
            assert e.value.code == "session_breaker_open"
            # no session id: no breaker; another session: unaffected
            for _ in range(4):
                await ops.release(await ops.admit(p, request(fingerprint="loop")))
            await ops.release(await ops.admit(p, request(session="agent-2", fingerprint="loop")))
            await asyncio.sleep(2.1)
            await ops.release(await ops.admit(p, request(session="agent-1", fingerprint="loop")))
        finally:
            await ops.close()
            if shared:
                await ops2.close()

    asyncio.run(main())


def test_breaker_through_operations_in_process(tmp_path):
    _breaker_flow((f"sqlite:///{tmp_path}/ops.db", None), shared=False)


@pytest.mark.redis
def test_breaker_shared_through_redis(tmp_path, redis_prefix):
    _breaker_flow(
        (f"sqlite:///{tmp_path}/ops.db", None), shared=True, redis_url=REDIS_URL, redis_prefix=redis_prefix
    )


def test_soft_threshold_alert_fires_once_with_webhook(tmp_path, caplog):
    async def main():
        received = []

        async def hook(req):
            received.append(await req.json())
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_post("/hook", hook)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        ops = await open_ops(
            (f"sqlite:///{tmp_path}/ops.db", None), alert_webhook=f"http://127.0.0.1:{port}/hook"
        )
        try:
            await ops.create_node(
                None, "org", {"budget_micros": 100, "budget_period": "month", "alert_threshold": 0.5}
            )
            key, _ = await ops.create_key("org", "k", {})
            p = await ops.authenticate(key)
            for _ in range(3):  # 30, 60 (crosses 50), 90
                await ops.settle(
                    await ops.admit(p, request(prompt=10, max_tokens=10)), outcome(prompt=10, output=10)
                )
            await ops.alerts.drain()
            assert len(received) == 1
            alert = received[0]["alert"]
            assert alert["node_path"] == "org" and alert["spent_micros"] == 60
            assert alert["budget_micros"] == 100 and "org" in received[0]["text"]
        finally:
            await ops.close()
            await runner.cleanup()
        assert sum("budget alert" in r.message for r in caplog.records) == 1

    caplog.set_level(logging.WARNING, logger="tokenops.ops.alerts")
    asyncio.run(main())
