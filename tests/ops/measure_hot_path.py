"""Measure the ops hot path (authenticate + admit + settle) on SQLite and PostgreSQL, with and without
a budget on the path: sequential latency percentiles and throughput at 50 concurrent requests.
A measuring script, not a test: `.venv/bin/python tests/ops/measure_hot_path.py`."""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
from ops_helpers import open_ops, outcome, request  # noqa: E402

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


async def measure(target, budget: bool, n_seq: int = 300, n_conc: int = 1000, conc: int = 50) -> dict:
    ops = await open_ops(target)
    try:
        settings = {"budget_micros": 10**15, "budget_period": "month"} if budget else {}
        await ops.create_node(None, "org", settings)
        key, _ = await ops.create_key("org", "k", {"rpm": 10**6, "max_concurrent": 10**4})

        async def one():
            p = await ops.authenticate(key)
            adm = await ops.admit(p, request())
            await ops.settle(adm, outcome())

        for _ in range(20):
            await one()
        lat = []
        for _ in range(n_seq):
            t = time.perf_counter()
            await one()
            lat.append((time.perf_counter() - t) * 1000)
        lat.sort()
        sem = asyncio.Semaphore(conc)

        async def limited():
            async with sem:
                await one()

        t = time.perf_counter()
        await asyncio.gather(*(limited() for _ in range(n_conc)))
        rps = n_conc / (time.perf_counter() - t)
        return {"p50_ms": statistics.median(lat), "p99_ms": lat[int(len(lat) * 0.99)], "rps_at_50": rps}
    finally:
        await ops.close()


async def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        for budget in (False, True):
            r = await measure((f"sqlite:///{d}/ops{int(budget)}.db", None), budget)
            print(f"sqlite     budget={budget!s:5}  admit+settle p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  "
                  f"{r['rps_at_50']:.0f} req/s at 50 concurrent")
    for budget in (False, True):
        schema = f"m_ops_{uuid.uuid4().hex[:8]}"
        try:
            r = await measure((PG_URL, schema), budget)
            print(f"postgresql budget={budget!s:5}  admit+settle p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  "
                  f"{r['rps_at_50']:.0f} req/s at 50 concurrent")
        finally:
            with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as c:
                c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


if __name__ == "__main__":
    asyncio.run(main())
