"""Fairness under overload: a flooding tenant and a quiet one through a real gateway on loopback in
front of the bench stub (a slow backend held to `--slots` requests in flight), side by side:

- `pool_line`: no admission gate; requests wait in the replica pool's line (by class, then FIFO);
- `fair_gate`: the fair admission gate (`fair_queue.max_in_flight` = the same slots): deficit round
  robin over tenants.

The noisy tenant runs `--noisy` closed-loop workers, the quiet one a single worker with a pause
between requests. Per tenant: requests served, share of all served, latency p50/p99 (the wait for a
slot plus the backend's `--ttft-ms`), refusals. Rounds alternate the order of the peers; the JSON
has each round and the medians over rounds.

    .venv/bin/python benchmarks/fair_admission.py --rounds 3 --seconds 8 --out /tmp/fair.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
from rich.progress import Progress

from tokenops.bench.stub import StubConfig, run_stub_in_thread
from tokenops.config import load_settings
from tokenops.gateway.app import create_app
from tokenops.gateway.connections import uvicorn_options

ADMIN = "bench-admin"
MODEL = "stub-model"


def serve(settings: Any) -> tuple[str, Any]:
    import uvicorn

    app = create_app(settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app, loop="uvloop", log_level="error", access_log=False, **uvicorn_options(settings.connections)
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

    return f"http://127.0.0.1:{port}", stop


def settings_for(peer: str, stub_url: str, data_dir: Path, slots: int) -> Any:
    model: dict[str, Any] = {
        "backends": [stub_url + "/v1"],
        "context_window": 4096,
        "max_inflight": slots,
        "pricing": {"input": 1.0, "output": 2.0},
    }
    extra: dict[str, Any] = {}
    if peer == "fair_gate":
        extra["fair_queue"] = {"max_in_flight": slots, "max_queued_per_tenant": 1000}
    return load_settings(
        None,
        environ={},
        overrides={
            "host": "127.0.0.1",
            "port": 0,
            "data_dir": data_dir,
            "admin_key": ADMIN,
            "models": {MODEL: model},
            "queue": {"classes": [{"max_wait_s": 60, "max_queued": 1000}] * 3},
            **extra,
        },
    )


def new_key(url: str, tenant: str) -> str:
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}) as c:
        c.post("/admin/tenants", json={"parent": None, "name": tenant}).raise_for_status()
        r = c.post("/admin/keys", json={"node": tenant, "name": "k", "limits": {}})
        r.raise_for_status()
        return r.json()["key"]


async def load(url: str, noisy_key: str, quiet_key: str, noisy: int, seconds: float, pause_s: float) -> dict:
    stats: dict[str, dict[str, Any]] = {t: {"lat": [], "refused": 0} for t in ("noisy", "quiet")}

    def client(key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)

    workers = [("noisy", client(noisy_key), 0.0) for _ in range(noisy)] + [
        ("quiet", client(quiet_key), pause_s)
    ]
    end = time.monotonic() + seconds  # from when every client is built

    async def worker(tenant: str, c: openai.AsyncOpenAI, pause: float) -> None:
        async with c:
            while time.monotonic() < end:
                t = time.perf_counter()
                try:
                    await c.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
                    )
                    stats[tenant]["lat"].append((time.perf_counter() - t) * 1000)
                except openai.RateLimitError:
                    stats[tenant]["refused"] += 1
                if pause:
                    await asyncio.sleep(pause)

    await asyncio.gather(*(worker(*w) for w in workers))
    served = sum(len(s["lat"]) for s in stats.values())
    out = {}
    for tenant, s in stats.items():
        lat = sorted(s["lat"])
        out[tenant] = {
            "served": len(lat),
            "share": len(lat) / served if served else 0.0,
            "p50_ms": statistics.median(lat) if lat else None,
            "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
            "refused": s["refused"],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--noisy", type=int, default=16, help="the noisy tenant's concurrent workers")
    ap.add_argument("--pause-ms", type=float, default=200.0, help="the quiet tenant's pause between requests")
    ap.add_argument("--ttft-ms", type=float, default=50.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    url_stub, stop_stub = run_stub_in_thread(
        StubConfig(models=[MODEL], output_tokens=4, ttft_s=args.ttft_ms / 1000)
    )
    peers = ["pool_line", "fair_gate"]
    rounds: list[dict[str, Any]] = []
    try:
        with Progress(transient=True) as progress:
            task = progress.add_task("fair admission", total=args.rounds * len(peers))
            for r in range(args.rounds):
                result: dict[str, Any] = {}
                for peer in peers if r % 2 == 0 else peers[::-1]:
                    with tempfile.TemporaryDirectory() as tmp:
                        url, stop = serve(settings_for(peer, url_stub, Path(tmp), args.slots))
                        try:
                            keys = new_key(url, "noisy"), new_key(url, "quiet")
                            result[peer] = asyncio.run(
                                load(url, *keys, args.noisy, args.seconds, args.pause_ms / 1000)
                            )
                        finally:
                            stop()
                    progress.advance(task)
                rounds.append(result)
    finally:
        stop_stub()

    def med(peer: str, tenant: str, metric: str) -> float | None:
        vals = [r[peer][tenant][metric] for r in rounds if r[peer][tenant][metric] is not None]
        return statistics.median(vals) if vals else None

    report = {
        "benchmark": "fair_admission",
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "median": {
            p: {
                t: {m: med(p, t, m) for m in ("served", "share", "p50_ms", "p99_ms", "refused")}
                for t in ("noisy", "quiet")
            }
            for p in peers
        },
        "rounds": rounds,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
