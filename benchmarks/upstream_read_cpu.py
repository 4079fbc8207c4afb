"""CPU per streamed chunk of the cluster's upstream read path, with the read timeout kept by one
`ReadWatchdog` timer per stream (the default) or by aiohttp's `sock_read` timer, which aiohttp cancels
and re-arms on every chunk it reads (how the cluster kept it before; emulated here by setting the
session's per-request `ClientTimeout` and turning the watchdog off).

A bench stub (`tokenops bench stub`, its own process) streams `--tokens` tokens `--itl-ms` apart; this
process reads `--streams` concurrent streams through `Cluster.open` and `Upstream.aiter_bytes`, as the
gateway does, and reports its own CPU time (`time.process_time`) per read over each round. The modes
alternate, `--repeats` processes each, `--rounds` rounds per process after one warm-up round. Prints
JSON (every round, and the median per mode).

    PYTHONPATH=src .venv/bin/python benchmarks/upstream_read_cpu.py
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
import time
from datetime import UTC, datetime

from tokenops.bench.ports import free_port

MODES = ("sock_read", "watchdog")


async def measure(mode: str, url: str, streams: int, tokens: int, rounds: int) -> list[float]:
    import aiohttp

    from tokenops.cluster.dispatch import Cluster, DispatchRequest, RetryConfig
    from tokenops.cluster.policies import RoundRobin
    from tokenops.cluster.pool import ReplicaPool, ReplicaSpec
    from tokenops.cluster.snapshot import RequestInfo

    for _ in range(150):
        try:
            async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
                if r.status == 200:
                    break
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    pool = ReplicaPool("m", [ReplicaSpec(url=url, id="r0")], RoundRobin())
    if mode == "watchdog":
        cluster = Cluster({"m": pool}, retry=RetryConfig(read_timeout=600.0))
    else:
        # no watchdog (read_timeout 0), and the request's ClientTimeout carries sock_read as before
        cluster = Cluster({"m": pool}, retry=RetryConfig(read_timeout=0.0))
        cluster._timeout_for = cluster.retry
        cluster._client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=600.0)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": tokens,
    }

    async def one() -> int:
        n = 0
        async with cluster.open(DispatchRequest(RequestInfo(model="m"), "/v1/chat/completions", body)) as up:
            async for _ in up.aiter_bytes():
                n += 1
        return n

    out = []
    try:
        await asyncio.gather(*(one() for _ in range(streams)))  # warm-up: connections, imports
        for _ in range(rounds):
            c0 = time.process_time()
            reads = sum(await asyncio.gather(*(one() for _ in range(streams))))
            out.append(1e6 * (time.process_time() - c0) / reads)
    finally:
        await cluster.aclose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--itl-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", choices=MODES, help="measure one mode in this process (used by the driver)")
    ap.add_argument("--url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        import uvloop

        print(json.dumps(uvloop.run(measure(args.mode, args.url, args.streams, args.tokens, args.rounds))))
        return
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-c", "from tokenops.cli import app; app()", "bench", "stub", "--port", str(port)]
        + ["--tokens", str(args.tokens), "--ttft-ms", "1", "--itl-ms", str(args.itl_ms), "--model", "m"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    rounds: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for _ in range(args.repeats):
            for mode in MODES:
                cmd = [sys.executable, __file__, "--mode", mode, "--url", f"http://127.0.0.1:{port}"]
                cmd += [
                    "--streams",
                    str(args.streams),
                    "--tokens",
                    str(args.tokens),
                    "--rounds",
                    str(args.rounds),
                ]
                got = json.loads(subprocess.run(cmd, capture_output=True, check=True, text=True).stdout)
                rounds[mode] += got
                print(f"{mode}: " + " / ".join(f"{x:.2f}" for x in got) + " us CPU per read", file=sys.stderr)
    finally:
        stub.terminate()
        stub.wait()
    result = {
        "benchmark": "upstream_read_cpu",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "params": vars(args) | {"loadavg_end": open("/proc/loadavg").read().split()[:3]},
        "us_cpu_per_read": rounds,
        "median_us_cpu_per_read": {m: statistics.median(v) for m, v in rounds.items()},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
