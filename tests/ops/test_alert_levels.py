"""Alerts against a real webhook server on loopback: several thresholds per node, each fired once per
period and not again after a restart; the spend-rate alert once per node per hour; a Slack-compatible
body; a failing webhook neither fails the request nor stops the others, and its secret path is never
logged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from ops_helpers import open_ops, outcome, request

from tokenops.ops.alerts import SpendRateRule


@asynccontextmanager
async def webhook_server() -> AsyncIterator[tuple[str, list[dict]]]:
    """A receiver at /hook that records every body, and /broken/<secret> that answers 500."""
    received: list[dict] = []

    async def hook(req: web.Request) -> web.Response:
        received.append(await req.json())
        return web.json_response({"ok": True})

    async def broken(req: web.Request) -> web.Response:
        return web.Response(status=500, text="no")

    app = web.Application()
    app.router.add_post("/hook", hook)
    app.router.add_post("/broken/{secret}", broken)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        await runner.cleanup()


def _slack_shaped(body: dict) -> None:
    assert isinstance(body["text"], str) and body["text"]
    assert body["blocks"][0]["type"] == "header" and body["blocks"][1]["text"]["type"] == "mrkdwn"


def test_every_threshold_fires_once_per_period_even_across_a_restart(db_target, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="tokenops.ops.alerts")

    async def main() -> None:
        async with webhook_server() as (base, received):
            hooks = [f"{base}/hook", f"{base}/broken/T000-SECRET"]
            ops = await open_ops(db_target, alert_webhooks=hooks)
            try:
                await ops.create_node(
                    None,
                    "acme",
                    {"budget_micros": 100, "budget_period": "month", "alert_thresholds": [0.5, 0.8, 1.0]},
                )
                key, _ = await ops.create_key("acme", "k", {})
                p = await ops.authenticate(key)
                for _ in range(4):  # 25 each: 25, 50 (crosses 50%), 75, 100 (crosses 80% and 100%)
                    await ops.settle(
                        await ops.admit(p, request(prompt=5, max_tokens=10)), outcome(prompt=5, output=10)
                    )
                await ops.alerts.drain()
            finally:
                await ops.close()
            levels = [(b["alert"]["threshold"], b["alert"]["spent_micros"]) for b in received]
            assert levels == [(0.5, 50), (0.8, 100), (1.0, 100)]
            for body in received:
                _slack_shaped(body)
            assert "acme" in received[0]["blocks"][0]["text"]["text"]

            # a restart with a raised budget: 125 of 200 is past 50% again, but that alert has fired
            ops = await open_ops(db_target, alert_webhooks=hooks)
            try:
                await ops.update_node("acme", {"budget_micros": 200})
                p = await ops.authenticate(key)
                await ops.settle(
                    await ops.admit(p, request(prompt=5, max_tokens=10)), outcome(prompt=5, output=10)
                )
                await ops.alerts.drain()
            finally:
                await ops.close()
            assert len(received) == 3

    asyncio.run(main())
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "webhook to 127.0.0.1 failed: HTTP 500" in logged
    assert "SECRET" not in logged


def test_spend_rate_fires_once_per_node_per_hour(tmp_path) -> None:
    now = [3600.0 * 500_000 + 60 * 5]  # five minutes into an hour

    async def main() -> None:
        async with webhook_server() as (base, received):
            ops = await open_ops(
                (f"sqlite:///{tmp_path}/ops.db", None),
                alert_webhooks=[f"{base}/hook"],
                spend_rate=SpendRateRule(multiple=3.0, window_minutes=3),
            )
            ops.spend_rates.clock = lambda: now[0]
            try:
                await ops.create_node(None, "acme", {})
                key, _ = await ops.create_key("acme", "agent", {})
                p = await ops.authenticate(key)

                async def spend() -> None:  # 25 micro-units
                    await ops.settle(
                        await ops.admit(p, request(prompt=5, max_tokens=10)), outcome(prompt=5, output=10)
                    )

                for _ in range(3):  # the history: 25 a minute for three minutes
                    await spend()
                    now[0] += 60
                for _ in range(3):  # 25, 50, 75 in this minute: not above 3 x 25
                    await spend()
                await ops.alerts.drain()
                assert received == []
                await spend()  # 100 > 75: the runaway signal, for the tenant and the key's own node
                await spend()  # still runaway, same hour: not again
                await ops.alerts.drain()
            finally:
                await ops.close()
            assert sorted(b["alert"]["node_path"] for b in received) == ["acme", "acme/agent"]
            for body in received:
                _slack_shaped(body)
                assert body["alert"]["kind"] == "spend_rate" and body["alert"]["spent_micros"] == 100
                assert body["alert"]["budget_micros"] == 75 and "spend-rate alert" in body["text"]

    asyncio.run(main())
