"""The live side of a simulator-vs-engine comparison: our engine started as processes with given
knobs, and a workload sent to a PD pair through the cluster's own dispatch (`Cluster.open` with a PD
route, as the gateway serves it). Validation and `tokenops tune --verify-live` use it to produce the
records the simulator's replay is compared with; what is compared, and how, is validation.py's.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from tokenops.bench.metrics import RequestRecord
from tokenops.bench.vllm_process import free_port
from tokenops.cluster.pd import PDPolicy


async def stream_events(up: Any) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """Each SSE data event of a streamed answer (`Cluster.open`'s upstream), parsed, with the
    `time.perf_counter()` of the chunk that completed it."""
    buf = b""
    async for chunk in up.aiter_bytes():
        now = time.perf_counter()
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.removeprefix(b"data: ").strip()
            if data and data != b"[DONE]":
                yield now, orjson.loads(data)


def start_engine(
    args: Sequence[str] = (), threads: int | None = None, preamble: str = "", cpus: set[int] | None = None
) -> tuple[subprocess.Popen, str]:
    """`tokenops engine` (the bundled model unless `args` name another) on a free loopback port;
    returns the process and its URL once /health answers. `threads` caps its torch threads (engines
    sharing the cores each take one, so they do not fight); `preamble` is Python the process runs
    first (a tracer's hooks); `cpus` pins the process (every thread it starts) to those cores."""
    port = free_port()
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    code = (
        f"{preamble}; from tokenops.cli import app; app()"
        if preamble
        else "from tokenops.cli import app; app()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "engine", "--port", str(port), *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with {proc.returncode} (args: {' '.join(args)})")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the engine did not start within 300 s")


@contextmanager
def engines(
    arg_lists: Sequence[Sequence[str]], threads: int | None = None, pin: bool = False
) -> Iterator[list[str]]:
    """Start one engine per argument list; yield their URLs; stop them all on the way out. `pin`
    gives the i-th engine core i (modulo the cores there are), so engines do not migrate or share one."""
    procs: list[subprocess.Popen] = []
    try:
        urls, cores = [], sorted(os.sched_getaffinity(0))
        for i, args in enumerate(arg_lists):
            proc, url = start_engine(args, threads, cpus={cores[i % len(cores)]} if pin else None)
            procs.append(proc)
            urls.append(url)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@dataclass(frozen=True, slots=True)
class LiveRequest:
    """One request of an open-loop run: when it is sent (seconds after the run's start), its prompt
    as token ids (so both worlds see the same prompt length) and how many tokens it generates."""

    at_s: float
    prompt: tuple[int, ...]
    max_tokens: int


def open_loop(n: int, rate: float, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int = 1):
    """`n` requests at Poisson arrivals of `rate` per second, uniform prompt and output lengths."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        prompt = tuple(rng.randrange(100, 10_000) for _ in range(rng.randint(*prompt_len)))
        out.append(LiveRequest(t, prompt, rng.randint(*output_len)))
    return out


def pd_cluster(model: str, prefill: Sequence[str], decode: Sequence[str], policy: PDPolicy):
    """The cluster a gateway builds for a PD model (engines' base URLs), its route's policy swapped in."""
    from tokenops.cluster import ClusterConfig, build_cluster
    from tokenops.config import load_settings

    pd = {"policy": "static", "prefill": [u + "/v1" for u in prefill], "decode": [u + "/v1" for u in decode]}
    settings = load_settings(None, environ={}, overrides={"models": {model: {"pd": pd}}})
    cluster = build_cluster(settings.models, ClusterConfig())
    cluster.pd[model].policy = policy
    return cluster


async def _send(cluster, model: str, block: int, req: LiveRequest, sid: str) -> RequestRecord:
    from tokenops.cluster import DispatchRequest, RequestInfo
    from tokenops.cluster.prefix_index import block_hashes_from_tokens

    prompt = list(req.prompt)
    hashes = tuple(block_hashes_from_tokens(prompt, block))
    info = RequestInfo(model, sid, hashes, block, len(prompt), req.max_tokens)
    body = {
        "model": model, "prompt": prompt, "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    rec = RequestRecord(start=start, end=start, prompt_tokens=len(prompt), session_id=sid)
    try:
        async with cluster.open(DispatchRequest(info, "/completions", body)) as up:
            async for now, msg in stream_events(up):
                if rec.first_byte is None:
                    rec.first_byte = now
                choices = msg.get("choices") or []
                if choices and choices[0].get("text"):
                    rec.chunk_times.append(now)
                if msg.get("usage"):
                    rec.output_tokens = msg["usage"].get("completion_tokens")
    except Exception as e:  # a failed request is a record, as the bench driver keeps it
        rec.success, rec.error = False, f"{type(e).__name__}: {e}"
    rec.end = time.perf_counter()
    if rec.success and not rec.chunk_times:
        rec.success, rec.error = False, "no tokens streamed"
    return rec


async def run_pd(
    prefill: Sequence[str],
    decode: Sequence[str],
    model: str,
    requests: Sequence[LiveRequest],
    policy: PDPolicy,
    block: int = 16,
) -> tuple[list[RequestRecord], float]:
    """Send `requests` open loop through a PD route over the given engines; (records, duration)."""
    cluster = pd_cluster(model, prefill, decode, policy)
    async with httpx.AsyncClient() as client:
        await cluster.poller.poll_once(client)
    cluster.poller.start()
    t0 = time.perf_counter()

    async def one(i: int, req: LiveRequest) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + req.at_s - time.perf_counter()))
        return await _send(cluster, model, block, req, f"live-{i}")

    try:
        records = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    finally:
        await cluster.aclose()
    return list(records), time.perf_counter() - t0
