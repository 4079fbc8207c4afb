"""The in-process budget store (budget_store: memory) in a real `tokenops serve` on SQLite, through
the official openai SDK: a 200-way race never overspends and writes one ledger row per admitted
request; a SIGKILL in the middle of a load of streams loses no ledger row of an
admitted request (each had its write-ahead row committed before its response started), and the
restarted gateway settles the open ones at start, leaving no reservation and an aggregate equal to
the ledger."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest
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


def _db(path: Path, query: str) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        return conn.execute(query).fetchall()


def _serve(tmp_path: Path, stub_url: str, name: str = "gw") -> tuple[Path, ServeProcess]:
    config = write_config(
        tmp_path / f"{name}.yaml",
        tmp_path / "data",
        stub_url,
        admin_key=ADMIN_KEY,
        admission={"budget_store": "memory"},
    )
    return config, ServeProcess(config, free_port(), tmp_path / f"{name}.log")


def _key(gw: ServeProcess, budget: int) -> str:
    admin = httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {ADMIN_KEY}"})
    limits = {"budget_micros": budget, "budget_period": "total"}
    assert admin.post("/admin/tenants", json={"parent": None, "name": "org", "limits": limits}).is_success
    return admin.post("/admin/keys", json={"node": "org", "name": "k", "limits": {}}).json()["key"]


def _wait(check, timeout: float):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


@pytest.mark.timeout(300)
def test_200_way_race_through_the_gateway_never_overspends(tmp_path: Path) -> None:
    budget = 1_000  # each request costs ~18 of a 26 worst case: far fewer than 200 fit
    url, stop = run_stub_in_thread(StubConfig(models=[MODEL], output_tokens=8))
    _, gw = _serve(tmp_path, url)
    try:
        gw.wait_ready()
        results = asyncio.run(budget_race([gw.url], _key(gw, budget)))
        ok = results.count("ok")
        assert 0 < ok < 200 and results.count("insufficient_quota") == 200 - ok, results
        db = tmp_path / "data" / "tokenops.db"
        # the ledger and the aggregate are written in batches: wait for every admitted request's row
        rows = _wait(
            lambda: (
                r if len(r := _db(db, "SELECT admission_id, cost_micros FROM ops_ledger")) >= ok else None
            ),
            20,
        )
        assert rows is not None and len(rows) == ok == len({a for a, _ in rows})  # one each, none refused
        spent = sum(c for _, c in rows)
        assert 0 < spent <= budget
        usage = "SELECT spent_micros, reserved_micros FROM ops_budget_usage"
        assert _wait(lambda: _db(db, usage) == [(spent, 0)], 10), _db(db, usage)
        assert _wait(lambda: _db(db, "SELECT count(*) FROM ops_write_ahead") == [(0,)], 10)
    finally:
        gw.stop()
        stop()


@pytest.mark.timeout(300)
def test_sigkill_mid_load_loses_no_row_and_the_restart_settles_the_open_ones(tmp_path: Path) -> None:
    # streams of ~4.5 s: a kill lands while many are mid-response, even on a loaded machine
    url, stop = run_stub_in_thread(StubConfig(models=[MODEL], output_tokens=30, itl_s=0.15))
    config, gw = _serve(tmp_path, url)
    again = None
    try:
        gw.wait_ready()
        key = _key(gw, 10**9)
        tally = StreamTally()

        async def one(i: int, client: openai.AsyncOpenAI) -> None:
            with contextlib.suppress(openai.APIError, httpx.HTTPError):
                await counted_stream(client, i, tally)

        async def run() -> None:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)
            await asyncio.gather(
                kill_when_started(gw.proc.pid, tally, 20), *(one(i, client) for i in range(40))
            )

        asyncio.run(run())
        gw.proc.wait(timeout=10)
        assert gw.proc.returncode == -signal.SIGKILL and tally.started >= 20 and tally.finished < 40
        db = tmp_path / "data" / "tokenops.db"
        assert _db(db, "SELECT count(*) FROM ops_write_ahead")[0][0] >= tally.started - tally.finished > 0

        again = ServeProcess(config, free_port(), tmp_path / "again.log")
        again.wait_ready()  # the start settles the killed run's open admissions
        rows = _db(db, "SELECT admission_id, status, cost_micros FROM ops_ledger")
        statuses = [s for _, s, _ in rows]
        assert len({a for a, _, _ in rows}) == len(rows) >= tally.started  # one row each, none twice
        assert statuses.count("ok") >= tally.finished and "gateway_lost" in statuses
        assert set(statuses) <= {"ok", "gateway_lost"}
        assert _db(db, "SELECT count(*) FROM ops_write_ahead")[0][0] == 0
        spent = _db(db, "SELECT spent_micros, reserved_micros FROM ops_budget_usage")
        assert spent == [(sum(c for _, _, c in rows), 0)]
    finally:
        gw.stop()
        if again is not None:
            again.stop()
        stop()
