"""The gateway's upstream HTTP client candidates, each alone against the bench stub: client CPU per
request (this process's user + system time over the requests answered) and requests per second.

Peers, run in alternating rounds in one process: `aiohttp` configured as the cluster's session is
(cluster/dispatch.py: no cookie jar, no decompression, no User-Agent), `httpcore`'s connection
pool, and `raw`: a keep-alive asyncio protocol per connection with the `httptools` response parser
(the least any Python client on this event loop can cost: a floor, not a product). Each request is
the gateway's upstream call for a non-streamed chat request: a streamed answer of `--tokens` tokens
with usage, read to its end. Prints JSON.

    .venv/bin/python benchmarks/upstream_client_cpu.py --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).parent))
from ops_hot_path import TOKENOPS, machine, wait_http  # noqa: E402

from tokenops.bench.ports import free_port  # noqa: E402

MODEL = "m1"
PATH = "/v1/chat/completions"


def process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def measure(one: Callable[[], Awaitable[None]], concurrency: int, duration: float) -> dict:
    done, stop = 0, False

    async def worker() -> None:
        nonlocal done
        while not stop:
            await one()
            done += 1

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    await asyncio.sleep(1.0)  # warm-up: connections opened, code paths warm
    n0, c0, t0 = done, process_cpu(), time.perf_counter()
    await asyncio.sleep(duration)
    n1, c1, t1 = done, process_cpu(), time.perf_counter()
    stop = True
    await asyncio.gather(*tasks)
    n = max(1, n1 - n0)
    return {"rps": n / (t1 - t0), "client_cpu_us_per_request": (c1 - c0) / n * 1e6}


class RawPool:
    """Keep-alive connections with the httptools parser: write the request, wait for the message's end."""

    def __init__(self, host: str, port: int, body: bytes) -> None:
        import httptools

        self.host, self.port, self._free = host, port, []
        head = f"POST {PATH} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        self.request = (head + f"content-length: {len(body)}\r\n\r\n").encode() + body
        pool = self

        class Conn(asyncio.Protocol):
            def __init__(self) -> None:
                self.parser = httptools.HttpResponseParser(self)
                self.done: asyncio.Future | None = None
                self.parts: list[bytes] = []

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport

            def data_received(self, data: bytes) -> None:
                self.parser.feed_data(data)

            def on_body(self, body: bytes) -> None:
                self.parts.append(body)

            def on_message_complete(self) -> None:
                assert self.done is not None
                self.done.set_result(b"".join(self.parts))

            def connection_lost(self, exc: Exception | None) -> None:
                if self.done is not None and not self.done.done():
                    self.done.set_exception(ConnectionError("closed"))
                if self in pool._free:
                    pool._free.remove(self)

        self._conn = Conn

    async def post(self) -> bytes:
        loop = asyncio.get_running_loop()
        if self._free:
            conn = self._free.pop()
        else:
            _, conn = await loop.create_connection(self._conn, self.host, self.port)
        conn.done, conn.parts = loop.create_future(), []
        conn.transport.write(self.request)
        body = await conn.done
        self._free.append(conn)
        return body


async def run(url: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    import aiohttp
    import httpcore

    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": args.tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    headers = {"content-type": "application/json", "x-request-id": "req-1", "x-priority": "0"}
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
        cookie_jar=aiohttp.DummyCookieJar(),
    )
    pool = httpcore.AsyncConnectionPool(max_connections=args.concurrency)
    host, port = url.split("//")[1].split(":")
    raw = RawPool(host, int(port), body)

    async def with_aiohttp() -> None:
        async with session.post(url + PATH, data=body, headers=headers) as r:
            async for _ in r.content.iter_any():
                pass

    async def with_httpcore() -> None:
        async with pool.stream("POST", url + PATH, content=body, headers=headers) as r:
            async for _ in r.aiter_stream():
                pass

    peers = {"aiohttp": with_aiohttp, "httpcore": with_httpcore, "raw": raw.post}
    names = [p for p in args.peers.split(",") if p]
    runs: dict[str, list[dict]] = {}
    try:
        for i in range(args.repeats):
            for name in names if i % 2 == 0 else names[::-1]:
                runs.setdefault(name, []).append(await measure(peers[name], args.concurrency, args.duration))
    finally:
        await session.close()
        await pool.aclose()
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="aiohttp,httpcore,raw")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--machine", default=None)
    args = ap.parse_args()
    load_at_start = os.getloadavg()
    port = free_port()
    cmd = TOKENOPS + ["bench", "stub", "--port", str(port), "--tokens", str(args.tokens), "--model", MODEL]
    stub = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", stub)
        import uvloop

        runs = uvloop.run(run(f"http://127.0.0.1:{port}", args))
    finally:
        stub.terminate()
        stub.wait(timeout=10)
    results = {
        name: {
            "client_cpu_us_per_request_median": statistics.median(r["client_cpu_us_per_request"] for r in rs),
            "rps_median": statistics.median(r["rps"] for r in rs),
            "runs": rs,
        }
        for name, rs in runs.items()
    }
    report = {
        "benchmark": "upstream_client_cpu",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(args.machine, load_at_start),
        "params": vars(args),
        "results": results,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
