"""The tenant tree's history budget for `/v1/responses` sessions (`max_history_tokens`, migration
0009): validated like the other settings, the smallest on a key's path, forgotten with the key cache
when a node changes, and settable from the CLI. The gateway test that compacts a session by it is in
tests/gateway/test_responses.py."""

from __future__ import annotations

import asyncio

import pytest
from ops_helpers import open_ops
from typer.testing import CliRunner

from tokenops.cli import app
from tokenops.ops.tree import NodeSettings
from tokenops.protocol import APIError


@pytest.mark.parametrize("bad", [0, 63, -1, 100.5, "200", True])
def test_budget_must_be_an_integer_of_at_least_64(bad):
    with pytest.raises(APIError) as e:
        NodeSettings(max_history_tokens=bad)
    assert e.value.param == "max_history_tokens" and e.value.status == 400


def test_budget_is_the_smallest_on_the_path(db_target):
    async def main():
        ops = await open_ops(db_target)
        try:
            await ops.create_node(None, "org", {"max_history_tokens": 2000})
            await ops.create_node("org", "lean", {"max_history_tokens": 500})
            await ops.create_node("org", "roomy", {"max_history_tokens": 50_000})  # cannot loosen it
            await ops.create_node(None, "free", {})
            budgets = {}
            for path in ("org/lean", "org/roomy", "free"):
                plaintext, _ = await ops.create_key(path, "k")
                budgets[path] = await ops.history_budget(await ops.authenticate(plaintext))
            assert budgets == {"org/lean": 500, "org/roomy": 2000, "free": None}

            plaintext, _ = await ops.create_key("org/lean", "tight", {"max_history_tokens": 100})
            principal = await ops.authenticate(plaintext)
            assert await ops.history_budget(principal) == 100
            await ops.update_node("org/lean/tight", {"max_history_tokens": None})
            await ops.update_node("org/lean", {"max_history_tokens": None})
            assert await ops.history_budget(await ops.authenticate(plaintext)) == 2000
            assert (await ops.node_status("org"))["max_history_tokens"] == 2000
        finally:
            await ops.close()

    asyncio.run(main())


def test_cli_sets_shows_and_clears_the_budget(tmp_path):
    url = f"sqlite:///{tmp_path}/ops.db"
    runner = CliRunner()

    def run(*args):
        return runner.invoke(app, [*args, "--database-url", url], env={"COLUMNS": "200"})

    res = run("tenants", "create", "acme", "--max-history-tokens", "4096")
    assert res.exit_code == 0, res.output
    assert "4096" in res.output
    res = run("keys", "create", "acme", "ci", "--max-history-tokens", "512")
    assert res.exit_code == 0, res.output
    res = run("tenants", "update", "acme", "--max-history-tokens", "777")
    assert res.exit_code == 0 and "777" in res.output
    res = run("tenants", "list")
    assert res.exit_code == 0 and "777" in res.output and "512" in res.output
    res = run("tenants", "update", "acme", "--clear", "max-history-tokens")
    assert res.exit_code == 0 and "777" not in res.output
    res = run("tenants", "create", "bad", "--max-history-tokens", "10")
    assert res.exit_code != 0 and "max_history_tokens" in res.output
