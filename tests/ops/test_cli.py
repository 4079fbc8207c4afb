import asyncio
import json

from ops_helpers import open_ops, outcome, request
from typer.testing import CliRunner

from tokenops.cli import app


def test_cli_tenants_keys_usage_on_the_database(tmp_path):
    url = f"sqlite:///{tmp_path}/ops.db"
    runner = CliRunner()

    def run(*args):
        res = runner.invoke(app, [*args, "--database-url", url], terminal_width=200)
        return res

    assert run("tenants", "create", "acme", "--budget", "2.5", "--period", "day").exit_code == 0
    assert run("tenants", "create", "acme/search", "--rpm", "60", "--models", "m1").exit_code == 0
    res = run("keys", "create", "acme/search", "ci")
    assert res.exit_code == 0, res.output
    plaintext = next(line for line in res.output.splitlines() if line.startswith("tok-"))
    res = run("keys", "list")
    assert "acme/search/ci" in res.output and plaintext not in res.output and plaintext[:10] in res.output
    res = run("tenants", "update", "acme/search", "--clear", "rpm", "--tpm", "5000")
    assert res.exit_code == 0 and "5000" in res.output
    res = run("tenants", "create", "missing/x")
    assert res.exit_code == 1 and "No tenant node 'missing'" in res.output

    async def traffic():
        ops = await open_ops((url, None))
        try:
            p = await ops.authenticate(plaintext)
            assert p.node_path == ("acme", "search", "ci")
            for _ in range(2):
                await ops.settle(await ops.admit(p, request()), outcome(prompt=10, output=10))
        finally:
            await ops.close()

    asyncio.run(traffic())
    res = run("tenants", "show", "acme")
    assert "spent 0.00006" in res.output and "2.5" in res.output
    res = run("usage", "--by", "tenant,model", "--json")
    rows = json.loads(res.output)
    assert rows[0]["tenant"] == "acme" and rows[0]["requests"] == 2 and rows[0]["cost_micros"] == 60
    res = run("usage", "--by", "key,day")
    assert res.exit_code == 0 and "usage" in res.output
    res = run("usage", "--by", "colour")
    assert res.exit_code != 0
    key_id = next(
        line.split()[2]
        for line in run("keys", "create", "acme", "other").output.splitlines()
        if line.startswith("key id")
    )
    res = run("keys", "revoke", key_id)
    assert res.exit_code == 0 and "revoked" in res.output
    assert "revoked" in run("keys", "list").output
    res = run("keys", "create", "acme", "auditor", "--admin-read")
    reader = next(line for line in res.output.splitlines() if line.startswith("tok-"))
    assert res.exit_code == 0 and "admin:read" in run("keys", "list", "--under", "acme").output

    async def scoped():
        ops = await open_ops((url, None))
        try:
            assert (await ops.admin_reader(reader)).name == "auditor"
            assert await ops.admin_reader(plaintext) is None
        finally:
            await ops.close()

    asyncio.run(scoped())


def test_cli_sets_several_alert_thresholds(tmp_path):
    url = f"sqlite:///{tmp_path}/ops.db"
    runner = CliRunner()

    def run(*args):
        return runner.invoke(app, [*args, "--database-url", url], env={"COLUMNS": "200"})

    res = run("tenants", "create", "acme", "--budget", "1", "--alert-threshold", "0.5,0.8,1")
    assert res.exit_code == 0, res.output
    assert "50%,80%,100%" in run("tenants", "list").output
    assert run("tenants", "update", "acme", "--alert-threshold", "0.9").exit_code == 0
    res = run("tenants", "create", "bad", "--alert-threshold", "half")
    assert res.exit_code == 1 and "fractions" in res.output

    async def read():
        ops = await open_ops((url, None))
        try:
            return (await ops.get_node("acme")).settings
        finally:
            await ops.close()

    s = asyncio.run(read())
    assert s.alert_thresholds == [0.5, 0.8, 1.0] and s.alert_levels() == [0.5, 0.8, 0.9, 1.0]
