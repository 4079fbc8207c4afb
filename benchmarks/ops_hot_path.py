"""The budget hot path: a budgeted tenant's requests per second with the budget in the database (one
guarded aggregate row per node and period, `admission.budget_store: database`), in Redis
(`budget_store: redis`: Lua counters, the ledger written in batches) and in the gateway's memory
(`budget_store: memory`: one gateway alone on its database, the ledger and write-ahead rows written
in batches), side by side in one run.

Two layers, both on PostgreSQL (127.0.0.1:5432, database `test`, a fresh schema per peer) and Redis
(127.0.0.1:6379, a fresh prefix per peer):
- `gateway`: one bench stub upstream (`tokenops bench stub`, answers at once), two `tokenops serve`
  replicas sharing Redis and PostgreSQL (one for `memory`), a closed-loop driver (aiohttp,
  `--concurrency` requests in flight spread over the replicas, non-streaming) for `--duration`
  seconds after a warm-up; also `unbudgeted` (the same key without a budget: the gateway's own
  ceiling here);
- `ops`: authenticate + admit + settle alone, two `Operations` in this process (as two gateways
  would; one for `memory`), `--total` requests at `--concurrency`, no HTTP.
Every peer is checked after its run: ledger rows == requests answered, spent == sum of their cost.
Each run reports the CPU and run-queue wait per request of every component (net of what it spends
idle), and the rate this machine's cores bound the whole setup to. Prints JSON; `--repeats` rounds
of every peer in alternating order, the median reported with every run's figure.

    .venv/bin/python benchmarks/ops_hot_path.py --out /tmp/ops_hot_path.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from tokenops.bench.ports import free_port

PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/0"
TOKENOPS = [sys.executable, "-c", "from tokenops.cli import app; app()"]
ADMIN_KEY = "bench-admin"
MODEL = "m1"
BUDGET = 10**15  # never binds: every request pays the full check and reservation
PEERS = {
    "database": ("database", True),
    "redis": ("redis", True),
    "memory": ("memory", True),
    "unbudgeted": ("redis", False),
}


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {timeout} s")


class Fresh:
    """A fresh PostgreSQL schema and Redis prefix, removed on exit."""

    def __enter__(self) -> Fresh:
        self.schema = f"bench_ops_{uuid.uuid4().hex[:8]}"
        self.prefix = f"bench_ops:{uuid.uuid4().hex[:8]}:"
        return self

    def __exit__(self, *exc: object) -> None:
        import psycopg
        import redis

        with psycopg.connect(PG_DSN, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
        r = redis.Redis.from_url(REDIS_URL)
        for k in r.scan_iter(match=self.prefix + "*"):
            r.delete(k)
        r.close()

    def ledger(self) -> tuple[int, int]:
        import psycopg

        with psycopg.connect(PG_DSN) as c:
            q = f'SELECT count(*), coalesce(sum(cost_micros), 0) FROM "{self.schema}".ops_ledger'
            n, cost = c.execute(q).fetchone()
        return int(n), int(cost)


def machine(kind: str | None, load_at_start: tuple[float, float, float]) -> dict:
    """What a report records of the machine: its kind, cores, platform and the load around the run."""
    return {
        "kind": kind,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_at_start": load_at_start,
        "loadavg_at_end": os.getloadavg(),
    }


# ---------------------------------------------------------------------------------------- gateway


def start_gateways(work: Path, stub: str, fresh: Fresh, store: str) -> list[tuple[str, subprocess.Popen]]:
    import yaml

    out = []
    # the in-process store is for a gateway alone on its database: one replica
    for name in ("gw-a",) if store == "memory" else ("gw-a", "gw-b"):
        cfg = {
            "data_dir": str(work / name),
            "admin_key": ADMIN_KEY,
            "log_level": "warning",
            "redis_url": REDIS_URL,
            "redis_prefix": fresh.prefix,
            "database_url": PG_DSN,
            "database_schema": fresh.schema,
            "admission": {"instance_id": name, "budget_store": store},
            "models": {
                MODEL: {
                    "backends": [stub + "/v1"],
                    "max_inflight": 4096,
                    "pricing": {"input": 1, "output": 2},
                }
            },
        }
        path = work / f"{name}-{fresh.schema}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENOPS_")}
        log = (work / f"{name}-{fresh.schema}.log").open("wb")
        cmd = TOKENOPS + ["serve", "--config", str(path), "--port", str(port)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc)  # one after the other: the first creates the schema
        out.append((url, proc))
    return out


def make_key(url: str, budgeted: bool) -> str:
    import httpx

    h = {"authorization": f"Bearer {ADMIN_KEY}"}
    limits = {"budget_micros": BUDGET, "budget_period": "month"} if budgeted else {}
    r = httpx.post(
        url + "/admin/tenants", json={"parent": None, "name": "bench", "limits": limits}, headers=h
    )
    r.raise_for_status()
    r = httpx.post(url + "/admin/keys", json={"node": "bench", "name": "k", "limits": {}}, headers=h)
    r.raise_for_status()
    return r.json()["key"]


def pids_of(name: str) -> list[int]:
    """Processes whose command name is `name` (redis-server, postgres)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().split(" (", 1)[1].split(")", 1)[0] == name:
                out.append(int(stat.parent.name))
        except (OSError, IndexError):
            pass
    return out


def schedstat(pids: list[int]) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) summed over these processes' threads (Linux
    schedstat): CPU is what a component costs; the run-queue wait is what the machine's other load
    took from it. A component whose CPU plus run-queue wait fill the window is starved, not idle."""
    cpu = wait = 0
    for pid in pids:
        for f in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            try:
                on, queued, _ = f.read_text().split()
            except (OSError, ValueError):
                continue
            cpu, wait = cpu + int(on), wait + int(queued)
    return cpu, wait


class Components:
    """CPU and run-queue wait per request of each process group of a run, over its timed window.
    Redis and PostgreSQL are whole servers: on a shared machine their figures include other users'."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = {**groups, "redis": pids_of("redis-server"), "postgres": pids_of("postgres")}
        self._start: dict[str, tuple[int, int]] = {}

        self.idle_ms_per_s: dict[str, float] = {}

    def start(self) -> None:
        self.groups["postgres"] = pids_of("postgres")  # backends opened since
        self._start = {g: schedstat(p) for g, p in self.groups.items()}
        self._t = time.perf_counter()

    async def measure_idle(self, seconds: float) -> None:
        """CPU each group spends per second with no request (pollers, heartbeats; other users of
        the shared servers): subtracted from a run's CPU, so a slow run is not charged per request
        for time that passes."""
        self.start()
        await asyncio.sleep(seconds)
        elapsed = time.perf_counter() - self._t
        self.idle_ms_per_s = {
            g: (schedstat(p)[0] - self._start[g][0]) / 1e6 / elapsed for g, p in self.groups.items()
        }

    def per_request(self, n: int) -> dict[str, dict[str, float]]:
        out, n = {}, max(1, n)
        elapsed = time.perf_counter() - self._t
        for g, pids in self.groups.items():
            cpu, wait = schedstat(pids)
            cpu0, wait0 = self._start[g]
            busy = max(0.0, (cpu - cpu0) / 1e6 - self.idle_ms_per_s.get(g, 0.0) * elapsed)
            out[g] = {
                "cpu_ms": busy / n,
                "idle_cpu_ms_per_s": self.idle_ms_per_s.get(g, 0.0),
                "runq_wait_ms": (wait - wait0) / 1e6 / n,
            }
        return out


def cpu_bound_rps(components: dict[str, dict[str, float]]) -> float:
    """What this machine's cores could answer per second if every component had only its own CPU
    cost per request and nothing else ran: the ceiling the core count puts on the wall-clock rate."""
    total = sum(c["cpu_ms"] for c in components.values())
    return (os.cpu_count() or 1) * 1000 / total if total else float("inf")


async def drive(
    urls: list[str], key: str, concurrency: int, duration: float, warmup: float, components: Components
) -> dict:
    import aiohttp

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}
    headers = {"authorization": f"Bearer {key}"}
    counts = {"ok": 0, "error": 0, "answered": 0}
    latencies: list[float] = []
    measuring = False
    stop = False

    async def worker(session: aiohttp.ClientSession, i: int) -> None:
        url = urls[i % len(urls)] + "/v1/chat/completions"
        while not stop:
            t = time.perf_counter()
            async with session.post(url, json=body, headers=headers) as r:
                await r.read()
                status = r.status
            counts["answered"] += status == 200
            if measuring:
                counts["ok" if status == 200 else "error"] += 1
                latencies.append((time.perf_counter() - t) * 1000)

    await components.measure_idle(2.0)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(worker(session, i)) for i in range(concurrency)]
        await asyncio.sleep(warmup)
        measuring = True
        t = time.perf_counter()
        components.start()
        await asyncio.sleep(duration)
        measuring = False
        elapsed = time.perf_counter() - t
        per_request = components.per_request(counts["ok"])
        stop = True
        await asyncio.gather(*tasks)
    latencies.sort()
    return {
        "rps": counts["ok"] / elapsed,
        "errors": counts["error"],
        "answered": counts["answered"],  # warm-up included: what the ledger must hold
        # CPU per request, load-independent where wall-clock rates are not on a shared machine
        "gateway_cpu_ms_per_request": per_request["gateways"]["cpu_ms"],
        "components": per_request,
        "cpu_bound_rps": cpu_bound_rps(per_request),
        "p50_ms": statistics.median(latencies) if latencies else None,
        "p99_ms": latencies[int(len(latencies) * 0.99)] if latencies else None,
    }


def gateway_peer(
    work: Path, stub: str, stub_pid: int, store: str, budgeted: bool, args: argparse.Namespace
) -> dict:
    with Fresh() as fresh:
        gws = start_gateways(work, stub, fresh, store)
        try:
            urls = [u for u, _ in gws]
            key = make_key(urls[0], budgeted)
            components = Components(
                {"gateways": [p.pid for _, p in gws], "stub": [stub_pid], "load generator": [os.getpid()]}
            )
            result = asyncio.run(drive(urls, key, args.concurrency, args.duration, args.warmup, components))
        finally:
            for _, proc in gws:
                proc.terminate()
            for _, proc in gws:
                proc.wait(timeout=30)
        rows, cost = fresh.ledger()  # every gateway stopped cleanly: all rows flushed
        result["ledger_rows"] = rows
        result["ledger_cost_micros"] = cost
        return result


# -------------------------------------------------------------------------------------------- ops


async def ops_peer(store: str, budgeted: bool, args: argparse.Namespace) -> dict:
    from tokenops.ops.domain import AdmissionRequest, Outcome, TokenUsage
    from tokenops.ops.pricing import Price
    from tokenops.ops.service import Operations, OpsSettings

    req = AdmissionRequest(model=MODEL, prompt_tokens_upper=10, max_tokens=10, context_window=4096)
    pricing = {MODEL: Price(input=1.0, output=2.0)}
    with Fresh() as fresh:

        def settings(name: str) -> OpsSettings:
            return OpsSettings(
                database_url=PG_URL,
                database_schema=fresh.schema,
                redis_url=REDIS_URL,
                redis_prefix=fresh.prefix,
                instance_id=name,
                budget_store=store,
            )

        a = await Operations.open(settings("ops-a"), pricing)
        # the in-process store is for one gateway alone on its database: one Operations
        b = a if store == "memory" else await Operations.open(settings("ops-b"), pricing)
        try:
            limits = {"budget_micros": BUDGET, "budget_period": "month"} if budgeted else {}
            await a.create_node(None, "bench", limits)
            key, _ = await a.create_key("bench", "k")

            async def one(ops: Operations) -> None:
                adm = await ops.admit(await ops.authenticate(key), req)
                usage = TokenUsage.from_openai(10, 8)
                await ops.settle(adm, Outcome(model_served=MODEL, usage=usage, status="ok", latency_ms=1.0))

            for i in range(40):  # warm-up: key caches, statements, pools
                await one((a, b)[i % 2])
            gate = asyncio.Semaphore(args.concurrency)
            latencies: list[float] = []

            async def limited(i: int) -> None:
                async with gate:
                    t = time.perf_counter()
                    await one((a, b)[i % 2])
                    latencies.append((time.perf_counter() - t) * 1000)

            components = Components({"ops process": [os.getpid()]})
            await components.measure_idle(2.0)
            t = time.perf_counter()
            components.start()
            await asyncio.gather(*(limited(i) for i in range(args.total)))
            elapsed = time.perf_counter() - t
            per_request = components.per_request(args.total)
        finally:
            await a.close()
            if b is not a:
                await b.close()
        latencies.sort()
        rows, cost = fresh.ledger()
        return {
            "rps": args.total / elapsed,
            "p50_ms": statistics.median(latencies),
            "p99_ms": latencies[int(len(latencies) * 0.99)],
            "answered": args.total + 40,
            "process_cpu_ms_per_request": per_request["ops process"]["cpu_ms"],
            "components": per_request,
            "cpu_bound_rps": cpu_bound_rps(per_request),
            "ledger_rows": rows,
            "ledger_cost_micros": cost,
        }


# ------------------------------------------------------------------------------------------- main


def summarise(runs: list[dict]) -> dict:
    cpu = [r.get("gateway_cpu_ms_per_request", r.get("process_cpu_ms_per_request")) for r in runs]
    names = runs[0]["components"]
    return {
        "rps_median": statistics.median(r["rps"] for r in runs),
        "cpu_ms_per_request_median": statistics.median(cpu),
        # what the gateways' (or this process's) CPU alone would sustain on one free core each
        "rps_per_core_median": 1000 / statistics.median(cpu),
        "components_median": {
            name: {
                k: statistics.median(r["components"][name][k] for r in runs)
                for k in ("cpu_ms", "idle_cpu_ms_per_s", "runq_wait_ms")
            }
            for name in names
        },
        "cpu_bound_rps_median": statistics.median(r["cpu_bound_rps"] for r in runs),
        "p50_ms_median": statistics.median(r["p50_ms"] for r in runs if r["p50_ms"] is not None),
        "runs": runs,
    }


def main() -> None:
    from rich.console import Console

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="gateway,ops", help="comma-separated: gateway, ops")
    ap.add_argument("--peers", default="database,redis,memory,unbudgeted")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--duration", type=float, default=10.0, help="gateway layer: seconds measured")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--total", type=int, default=3000, help="ops layer: requests per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--machine", default=None, help="the machine kind, recorded with the figures")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    console = Console(stderr=True)
    load_at_start = os.getloadavg()
    layers = [x for x in args.layers.split(",") if x]
    peers = [p for p in args.peers.split(",") if p]
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        stub = None
        if "gateway" in layers:
            port = free_port()
            cmd = TOKENOPS + ["bench", "stub", "--port", str(port), "--tokens", "8", "--model", MODEL]
            stub = subprocess.Popen(cmd, stdout=(work / "stub.log").open("wb"), stderr=subprocess.STDOUT)
            wait_http(f"http://127.0.0.1:{port}/v1/models", stub)
        try:
            runs: dict[str, list[dict]] = {}
            for i in range(args.repeats):  # rounds of every peer, in alternating order: a change in
                # the machine's load during the run falls on every peer alike
                for layer in layers:
                    order = peers if i % 2 == 0 else peers[::-1]
                    for peer in order:
                        if layer == "ops" and peer == "unbudgeted":
                            continue
                        store, budgeted = PEERS[peer]
                        console.log(f"{layer} {peer}: run {i + 1}/{args.repeats}")
                        if layer == "gateway":
                            run = gateway_peer(
                                work, f"http://127.0.0.1:{port}", stub.pid, store, budgeted, args
                            )
                        else:
                            run = asyncio.run(ops_peer(store, budgeted, args))
                        console.log(
                            f"  {run['rps']:.0f} req/s, {run['answered']} answered, "
                            f"{run['ledger_rows']} ledger rows"
                        )
                        runs.setdefault(f"{layer} {peer}", []).append(run)
            results = {name: summarise(r) for name, r in runs.items()}
        finally:
            if stub is not None:
                stub.terminate()
                stub.wait(timeout=10)
    for layer in layers:
        db, hot = results.get(f"{layer} database"), results.get(f"{layer} redis")
        if db and hot:
            results[f"{layer} speed-up"] = {"redis_over_database": hot["rps_median"] / db["rps_median"]}
    report = {
        "benchmark": "ops_hot_path",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(args.machine, load_at_start),
        "params": vars(args) | {"out": str(args.out) if args.out else None},
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
