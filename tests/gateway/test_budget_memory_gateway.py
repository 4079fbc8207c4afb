"""The in-process budget store (budget_store: memory) in a real `tokenops serve` on SQLite, through
the official openai SDK: a SIGKILL in the middle of a load of streams loses no ledger row of an
admitted request (each had its write-ahead row committed before its response started), and the
restarted gateway settles the open ones at start, leaving no reservation and an aggregate equal to
the ledger."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
from pathlib import Path

import httpx
import openai
import pytest
from gateway_harness import ADMIN_KEY, MODEL, free_port
from test_serve import ServeProcess, write_config

from tokenops.bench.stub import StubConfig, run_stub_in_thread


def _db(path: Path, query: str) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        return conn.execute(query).fetchall()


@pytest.mark.timeout(300)
def test_sigkill_mid_load_loses_no_row_and_the_restart_settles_the_open_ones(tmp_path: Path) -> None:
    # streams of ~4.5 s: a kill lands while many are mid-response, even on a loaded machine
    url, stop = run_stub_in_thread(StubConfig(models=[MODEL], output_tokens=30, itl_s=0.15))
    config = write_config(
        tmp_path / "gw.yaml",
        tmp_path / "data",
        url,
        admin_key=ADMIN_KEY,
        admission={"budget_store": "memory"},
    )
    gw = ServeProcess(config, free_port(), tmp_path / "gw.log")
    again = None
    try:
        gw.wait_ready()
        admin = httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {ADMIN_KEY}"})
        limits = {"budget_micros": 10**9, "budget_period": "total"}
        assert admin.post("/admin/tenants", json={"parent": None, "name": "org", "limits": limits}).is_success
        key = admin.post("/admin/keys", json={"node": "org", "name": "k", "limits": {}}).json()["key"]
        started, finished = [0], [0]

        async def one(i: int, client: openai.AsyncOpenAI) -> None:
            try:
                stream = await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"tell me {i}"}],
                    max_tokens=30,
                    stream=True,
                )
                first, done = True, False
                async for chunk in stream:
                    if first:
                        started[0] += 1
                        first = False
                    done = done or any(c.finish_reason for c in chunk.choices)
                finished[0] += done
            except (openai.APIError, httpx.HTTPError):
                pass

        async def killer() -> None:
            while started[0] < 20:
                await asyncio.sleep(0.01)
            os.kill(gw.proc.pid, signal.SIGKILL)

        async def run() -> None:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)
            await asyncio.gather(killer(), *(one(i, client) for i in range(40)))

        asyncio.run(run())
        gw.proc.wait(timeout=10)
        assert gw.proc.returncode == -signal.SIGKILL and started[0] >= 20 and finished[0] < 40
        db = tmp_path / "data" / "tokenops.db"
        assert _db(db, "SELECT count(*) FROM ops_write_ahead")[0][0] >= started[0] - finished[0] > 0

        again = ServeProcess(config, free_port(), tmp_path / "again.log")
        again.wait_ready()  # the start settles the killed run's open admissions
        rows = _db(db, "SELECT admission_id, status, cost_micros FROM ops_ledger")
        statuses = [s for _, s, _ in rows]
        assert len({a for a, _, _ in rows}) == len(rows) >= started[0]  # one row each, none twice
        assert statuses.count("ok") >= finished[0] and "gateway_lost" in statuses
        assert set(statuses) <= {"ok", "gateway_lost"}
        assert _db(db, "SELECT count(*) FROM ops_write_ahead")[0][0] == 0
        spent = _db(db, "SELECT spent_micros, reserved_micros FROM ops_budget_usage")
        assert spent == [(sum(c for _, _, c in rows), 0)]
    finally:
        gw.stop()
        if again is not None:
            again.stop()
        stop()
