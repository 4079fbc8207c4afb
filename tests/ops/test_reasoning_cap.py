"""The tenant tree's reasoning-budget cap (`max_reasoning_tokens`, migration 0004): validated like the
other settings, inherited down the tree as the smallest cap on the path, carried by the admission,
settable from the CLI; and reasoning tokens billed at the model's reasoning price."""

from __future__ import annotations

import asyncio

import pytest
from ops_helpers import open_ops, outcome, request
from typer.testing import CliRunner

from tokenops.cli import app
from tokenops.ops.pricing import Price, cost_micros
from tokenops.ops.tree import NodeSettings
from tokenops.protocol import APIError


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_cap_must_be_a_non_negative_integer(bad):
    with pytest.raises(APIError) as e:
        NodeSettings(max_reasoning_tokens=bad)
    assert e.value.param == "max_reasoning_tokens" and e.value.status == 400


def test_cap_is_the_smallest_on_the_path(db_target):
    async def main():
        ops = await open_ops(db_target)
        try:
            await ops.create_node(None, "org", {"max_reasoning_tokens": 2000})
            await ops.create_node("org", "lean", {"max_reasoning_tokens": 100})
            await ops.create_node(
                "org", "roomy", {"max_reasoning_tokens": 99999}
            )  # cannot raise the org's cap
            await ops.create_node(None, "free", {})
            caps = {}
            for path in ("org/lean", "org/roomy", "free"):
                plaintext, _ = await ops.create_key(path, "k")
                caps[path] = (
                    await ops.admit(await ops.authenticate(plaintext), request())
                ).max_reasoning_tokens
            assert caps == {"org/lean": 100, "org/roomy": 2000, "free": None}

            # the key's own node may lower it further; clearing a cap takes effect at once
            plaintext, _ = await ops.create_key("org/lean", "zero", {"max_reasoning_tokens": 0})
            principal = await ops.authenticate(plaintext)
            assert (await ops.admit(principal, request())).max_reasoning_tokens == 0
            await ops.update_node("org/lean/zero", {"max_reasoning_tokens": None})
            await ops.update_node("org/lean", {"max_reasoning_tokens": None})
            principal = await ops.authenticate(plaintext)
            assert (await ops.admit(principal, request())).max_reasoning_tokens == 2000
            assert (await ops.node_status("org"))["max_reasoning_tokens"] == 2000
        finally:
            await ops.close()

    asyncio.run(main())


def test_reasoning_is_billed_at_its_own_price(db_target):
    async def main():
        ops = await open_ops(db_target)
        ops.pricing["thinker"] = Price(input=1.0, output=2.0, reasoning=5.0)
        try:
            await ops.create_node(None, "org", {})
            plaintext, _ = await ops.create_key("org", "k")
            principal = await ops.authenticate(plaintext)
            adm = await ops.admit(principal, request(model="thinker"))
            row = await ops.settle(adm, outcome(prompt=10, output=30, reasoning=20, model="thinker"))
            assert (row.output, row.reasoning) == (10, 20)
            assert row.cost_micros == 10 * 1 + 10 * 2 + 20 * 5
            # no reasoning price: reasoning tokens cost what output tokens cost
            assert cost_micros(Price(input=1.0, output=2.0), outcome(10, 30, reasoning=20).usage) == 70
        finally:
            await ops.close()

    asyncio.run(main())


def test_cli_sets_shows_and_clears_the_cap(tmp_path):
    url = f"sqlite:///{tmp_path}/ops.db"
    runner = CliRunner()

    def run(*args):
        return runner.invoke(app, [*args, "--database-url", url], terminal_width=220)

    res = run("tenants", "create", "acme", "--max-reasoning-tokens", "512")
    assert res.exit_code == 0, res.output
    assert "512" in res.output
    res = run("keys", "create", "acme", "ci", "--max-reasoning-tokens", "0")
    assert res.exit_code == 0, res.output
    res = run("tenants", "update", "acme", "--max-reasoning-tokens", "64")
    assert res.exit_code == 0 and "64" in res.output
    res = run("tenants", "update", "acme", "--clear", "max-reasoning-tokens")
    assert res.exit_code == 0 and "64" not in res.output
    res = run("tenants", "create", "bad", "--max-reasoning-tokens", "-5")
    assert res.exit_code != 0 and "max_reasoning_tokens" in res.output
