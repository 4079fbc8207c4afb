"""Budgets in Redis across two real gateway processes (`tokenops serve`) sharing Redis and
PostgreSQL, through the official openai SDK: a 200-way race split over both never overspends and
writes one ledger row per admitted request; a gateway killed with SIGKILL in the middle of a load of
streams loses no ledger row for a request whose response had started (the other gateway settles its
open admissions from their write-ahead rows) and leaks no reservation."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psycopg
import pytest
import redis
from gateway_harness import (
    ADMIN_KEY,
    MODEL,
    StreamTally,
    budget_race,
    counted_stream,
    kill_when_started,
)
from test_serve import ServeProcess, write_config

from tokenops.bench.ports import free_port
from tokenops.bench.stub import StubConfig, run_stub_in_thread

pytestmark = [pytest.mark.redis, pytest.mark.postgres]

REDIS_URL = "redis://127.0.0.1:6379/0"
PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A fresh PostgreSQL schema and Redis prefix for two gateways, dropped afterwards."""
    schema = f"t_gwb_{uuid.uuid4().hex[:10]}"
    prefix = f"t_gwb:{uuid.uuid4().hex[:10]}:"
    yield {"schema": schema, "prefix": prefix}
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    r = redis.Redis.from_url(REDIS_URL)
    for k in r.scan_iter(match=prefix + "*"):
        r.delete(k)
    r.close()


def _start_pair(stub_url: str, tmp_path: Path, shared: dict[str, Any]) -> list[ServeProcess]:
    procs = []
    for name in ("gw-a", "gw-b"):
        config = write_config(
            tmp_path / f"{name}.yaml",
            tmp_path / name,
            stub_url,
            admin_key=ADMIN_KEY,
            redis_url=REDIS_URL,
            redis_prefix=shared["prefix"],
            database_url=PG_URL,
            database_schema=shared["schema"],
            admission={"instance_id": name, "budget_store": "redis"},
        )
        procs.append(ServeProcess(config, free_port(), tmp_path / f"{name}.log"))
        # one after the other: two first starts on one fresh database race to create the default key
        procs[-1].wait_ready()
    return procs


def _key(url: str, org: str, budget: int) -> str:
    admin = httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN_KEY}"})
    r = admin.post(
        "/admin/tenants",
        json={"parent": None, "name": org, "limits": {"budget_micros": budget, "budget_period": "total"}},
    )
    assert r.status_code == 201, r.text
    r = admin.post("/admin/keys", json={"node": org, "name": "k", "limits": {}})
    assert r.status_code == 201, r.text
    return r.json()["key"]


def _ledger(schema: str) -> list[tuple[str, int, str]]:
    with psycopg.connect(PG_URL) as conn:
        q = f'SELECT admission_id, cost_micros, status FROM "{schema}".ops_ledger'
        return [tuple(r) for r in conn.execute(q).fetchall()]


def _spent(schema: str) -> list[int]:
    with psycopg.connect(PG_URL) as conn:
        return [r[0] for r in conn.execute(f'SELECT spent_micros FROM "{schema}".ops_budget_usage')]


def _held(prefix: str) -> tuple[int, list[int]]:
    r = redis.Redis.from_url(REDIS_URL)
    try:
        reserved = [int(r.hget(k, "reserved")) for k in r.scan_iter(match=prefix + "{bud}:c:*")]
        return r.zcard(prefix + "{bud}:rx"), reserved
    finally:
        r.close()


def _wait(check, timeout: float):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def _admission_prefix(instance: str) -> str:
    return "adm-" + hashlib.blake2b(instance.encode(), digest_size=5).hexdigest() + "-"


@pytest.mark.timeout(300)
def test_200_way_race_over_two_gateway_processes_never_overspends(tmp_path: Path, shared) -> None:
    budget = 1_000  # each request costs ~18 of a 26 worst case: far fewer than 200 fit
    url, stop = run_stub_in_thread(StubConfig(models=[MODEL], output_tokens=8))
    procs = _start_pair(url, tmp_path, shared)
    try:
        key = _key(procs[0].url, "race", budget)
        results = asyncio.run(budget_race([p.url for p in procs], key))
        ok = results.count("ok")
        assert 0 < ok < 200 and results.count("insufficient_quota") == 200 - ok, results
        _wait(lambda: len(_ledger(shared["schema"])) >= ok, 20)
        rows = _ledger(shared["schema"])
        assert len(rows) == ok  # one ledger row per admitted request, none for the refused
        spent = sum(c for _, c, _ in rows)
        assert spent <= budget
        assert _wait(lambda: _spent(shared["schema"]) == [spent], 10)
        assert _held(shared["prefix"]) == (0, [0])
    finally:
        for p in procs:
            p.stop()
        stop()


@pytest.mark.timeout(300)
def test_sigkill_mid_load_loses_no_started_row_and_leaks_no_reservation(tmp_path: Path, shared) -> None:
    # streams of ~4.5 s: a kill lands while many are mid-response, even on a loaded machine
    url, stop = run_stub_in_thread(StubConfig(models=[MODEL], output_tokens=30, itl_s=0.15))
    procs = _start_pair(url, tmp_path, shared)
    a, b = procs
    try:
        key = _key(a.url, "crash", 10**9)
        tally = {"gw-a": StreamTally(), "gw-b": StreamTally()}
        killed = asyncio.Event()

        async def one(i: int, name: str, client: openai.AsyncOpenAI) -> None:
            try:
                await counted_stream(client, i, tally[name])
            except (openai.APIError, httpx.HTTPError):
                assert name == "gw-a" and killed.is_set()

        async def killer() -> None:
            await kill_when_started(a.proc.pid, tally["gw-a"], 20)
            killed.set()

        async def run() -> None:
            ca = openai.AsyncOpenAI(base_url=a.url + "/v1", api_key=key, max_retries=0, timeout=30)
            cb = openai.AsyncOpenAI(base_url=b.url + "/v1", api_key=key, max_retries=0, timeout=30)
            await asyncio.gather(
                killer(), *(one(i, "gw-a", ca) for i in range(40)), *(one(i, "gw-b", cb) for i in range(40))
            )

        asyncio.run(run())
        a.proc.wait(timeout=10)
        assert a.proc.returncode == -signal.SIGKILL
        started = tally["gw-a"].started
        assert tally["gw-b"].finished == 40 and started >= 20 and tally["gw-a"].finished < 40
        # gw-b's sweeper sees gw-a's heartbeat lapse and settles its open admissions
        assert _wait(lambda: _held(shared["prefix"]) == (0, [0]), 40), _held(shared["prefix"])
        pa = _admission_prefix("gw-a")

        def rows_in() -> list | None:
            rows = _ledger(shared["schema"])
            mine = [r for r in rows if r[0].startswith(pa)]
            return rows if len(mine) >= started and len(rows) - len(mine) >= 40 else None

        rows = _wait(rows_in, 40) or _ledger(shared["schema"])
        of_a = [r for r in rows if r[0].startswith(pa)]
        of_b = [r for r in rows if not r[0].startswith(pa)]
        assert len(of_b) == 40 and {s for _, _, s in of_b} == {"ok"}
        # every stream gw-a had started has its row: finished ones billed, the rest settled as lost
        assert len(of_a) >= started
        assert len({r[0] for r in rows}) == len(rows)
        assert {s for _, _, s in of_a} <= {"ok", "gateway_lost", "client_disconnected"}
        # a stream whose last chunk left just before the kill, before its settle ran, is one of them
        assert sum(1 for _, _, s in of_a if s in ("ok", "gateway_lost")) >= started
        assert any(s == "gateway_lost" for _, _, s in of_a)  # the streams cut mid-response
        assert _wait(lambda: _spent(shared["schema"]) == [sum(c for _, c, _ in rows)], 10)
    finally:
        for p in procs:
            p.stop()
        stop()
