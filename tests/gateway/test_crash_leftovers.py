"""Crash leftovers: a gateway killed mid-request leaves its budget reservation (in the ledger
database) and its concurrency lease (in Redis) behind; the same instance, started again, releases
both at once, so the tenant is not blocked for `reservation_ttl_s` / `concurrency_lease_s`, which
the config sets."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import redis
from gateway_harness import MODEL

from tokenops.config import load_settings
from tokenops.gateway.app import open_operations
from tokenops.ops.domain import AdmissionRequest
from tokenops.ops.tree import NodeSettings

REDIS = "redis://127.0.0.1:6379/0"


def _settings(data_dir: Path, prefix: str, instance: str | None, **admission: object):
    return load_settings(
        None,
        environ={},
        overrides={
            "port": 0,
            "data_dir": data_dir,
            "redis_url": REDIS,
            "redis_prefix": prefix,
            "models": {
                MODEL: {"backends": ["http://127.0.0.1:9/v1"], "pricing": {"input": 1.0, "output": 2.0}}
            },
            "admission": {"instance_id": instance, **admission},
        },
    )


def test_the_config_sets_the_ttls(tmp_path: Path) -> None:
    s = _settings(tmp_path, "x:", "gw-a", reservation_ttl_s=120, concurrency_lease_s=60)
    assert (s.admission.reservation_ttl_s, s.admission.concurrency_lease_s, s.instance_id) == (
        120,
        60,
        "gw-a",
    )
    assert _settings(tmp_path, "x:", None).instance_id is None  # port 0: no stable instance


@pytest.mark.parametrize("restarted_as", ["gw-a", "gw-b"])
def test_a_restarted_instance_releases_what_its_killed_run_held(tmp_path: Path, restarted_as: str) -> None:
    prefix = f"tokenops:test:{uuid.uuid4().hex[:8]}:"

    async def main() -> tuple[str, int, int, str]:
        ops = await open_operations(_settings(tmp_path, prefix, "gw-a"))
        org = await ops.create_node(None, "crash", NodeSettings(max_concurrent=1, budget_micros=6_000))
        key, _ = await ops.create_key(org.path, "k")
        principal = await ops.authenticate(key)
        req = AdmissionRequest(model=MODEL, prompt_tokens_upper=100, max_tokens=2000, context_window=8192)
        await ops.admit(principal, req)
        # the gateway is killed here: no settle, nothing closed that would release
        await ops.limits.close()
        ops.db.dispose()

        again = await open_operations(_settings(tmp_path, prefix, restarted_as))
        try:
            principal = await again.authenticate(key)
            try:
                admission = await again.admit(principal, req)
            except Exception as exc:  # noqa: BLE001 - the refusal is the outcome under test
                return "refused", getattr(exc, "status", 0), 0, getattr(exc, "message", "")
            await again.release(admission)
            return "admitted", 200, admission.max_output_tokens, ""
        finally:
            await again.close()

    try:
        outcome, status, max_out, code = asyncio.run(main())
    finally:
        r = redis.Redis.from_url(REDIS)
        for k in r.scan_iter(match=prefix + "*"):
            r.delete(k)
    if restarted_as == "gw-a":
        # 4,100 micros reserved of 6,000: a leftover reservation would cut max_tokens by the budget
        assert outcome == "admitted" and max_out == 2000  # the whole budget and the slot are free again
    else:  # another instance must not touch a live gateway's holds: the lease still blocks
        assert outcome == "refused" and status == 429, code
        # the refusal says when the leftover lease frees the slot at the latest (the default 30 s)
        assert "at the latest in 30 s" in code or "at the latest in 29 s" in code, code
