"""The operations hot path alone: authenticate + admit + settle (one ledger row each) on SQLite and
PostgreSQL, with and without a budget on the key's path (a budget adds the reservation transaction).
Sequential latency percentiles, then throughput at `--concurrency` concurrent requests. Prints JSON.

    .venv/bin/python benchmarks/ops_hot_path.py --out /tmp/ops_hot_path.json

PostgreSQL: 127.0.0.1:5432, database `test`, trust auth (each run uses a fresh schema, dropped after).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from tokenops.ops.domain import AdmissionRequest, Outcome, TokenUsage
from tokenops.ops.pricing import Price
from tokenops.ops.service import Operations, OpsSettings

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PRICING = {"m1": Price(input=1.0, output=2.0)}
REQUEST = AdmissionRequest(
    model="m1", prompt_tokens_upper=10, max_tokens=10, context_window=4096, fingerprint="fp"
)


def outcome() -> Outcome:
    usage = TokenUsage.from_openai(10, 10, 0, 0)
    return Outcome(model_served="m1", usage=usage, status="ok", finish_reason="stop", latency_ms=20.0)


async def measure(
    url: str, schema: str | None, budget: bool, sequential: int, total: int, concurrency: int
) -> dict:
    ops = await Operations.open(OpsSettings(database_url=url, database_schema=schema), PRICING)
    try:
        limits = {"budget_micros": 10**15, "budget_period": "month"} if budget else {}
        await ops.create_node(None, "org", limits)
        key, _ = await ops.create_key("org", "k", {"rpm": 10**7, "max_concurrent": 10**5})

        async def one() -> None:
            principal = await ops.authenticate(key)
            admission = await ops.admit(principal, REQUEST)
            await ops.settle(admission, outcome())

        for _ in range(20):  # warm-up: key cache, statement caches, connection pool
            await one()
        latencies = []
        for _ in range(sequential):
            t = time.perf_counter()
            await one()
            latencies.append((time.perf_counter() - t) * 1000)
        latencies.sort()
        gate = asyncio.Semaphore(concurrency)

        async def limited() -> None:
            async with gate:
                await one()

        t = time.perf_counter()
        await asyncio.gather(*(limited() for _ in range(total)))
        return {
            "p50_ms": statistics.median(latencies),
            "p99_ms": latencies[int(len(latencies) * 0.99)],
            f"rps_at_{concurrency}": total / (time.perf_counter() - t),
        }
    finally:
        await ops.close()


async def run(args: argparse.Namespace) -> dict:
    import psycopg

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        for budget in (False, True):
            url = f"sqlite:///{d}/ops{int(budget)}.db"
            results[f"sqlite budget={budget}"] = await measure(
                url, None, budget, args.sequential, args.total, args.concurrency
            )
    if not args.skip_postgres:
        for budget in (False, True):
            schema = f"bench_ops_{uuid.uuid4().hex[:8]}"
            try:
                results[f"postgresql budget={budget}"] = await measure(
                    PG_URL, schema, budget, args.sequential, args.total, args.concurrency
                )
            finally:
                with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as c:
                    c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequential", type=int, default=300)
    ap.add_argument("--total", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--skip-postgres", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = {
        "benchmark": "ops_hot_path",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "params": vars(args) | {"out": str(args.out) if args.out else None},
        "results": asyncio.run(run(args)),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
