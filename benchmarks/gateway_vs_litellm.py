"""Gateway overhead: tokenops gateway vs LiteLLM proxy, both in front of the same fast stub upstream.

One run starts two bench stubs (`tokenops bench stub`: "fast" answers at once, "paced" streams
`--paced-tokens` tokens, `--paced-ttft-ms` to the first and `--paced-itl-ms` between; 16, 20, 5
by default), a tokenops gateway (`tokenops serve`, SQLite ledger, one key) and a LiteLLM proxy
(`litellm --config`, master key, no database), each in its own process on loopback. A load
driver, in its own process, runs for each target (direct to the stub, tokenops, LiteLLM),
interleaved, `--runs` times:

- throughput: `--concurrency` closed-loop streaming clients on "fast" for `--duration` s: requests/s,
  and the CPU time the target process (with its children) spent per request, read from /proc;
- latency: `--concurrency` concurrent streams on "paced": TTFT and end-to-end p50/p99, and the
  latency each gateway adds over going direct. The streams' starts are spread evenly over one
  stream's length (`--sync-start`: all at once, after which equal-length streams stay in step and
  arrive in bursts of `--concurrency`, which measures burst queueing rather than the path). Each
  request's time is split along TIMELINE on one clock (the driver's aiohttp trace hooks, the
  gateway's `x-tokenops-timing` stamps with `--probes`, the stub's `x-stub-timing`), and the CPU
  per paced request of the stub, the driver and the target is reported;
- inside: the tokenops gateway's own time on the paced requests, from its `tokenops_gateway_*_seconds`
  histograms on /metrics (scraped before and after each paced phase; docs/gateway.md, "Metrics"):
  p50/p99 of pre-upstream, first-byte relay, last-byte relay, their per-request sum ("added") and
  the settle after the last byte, next to the outside difference.

`--cpu-split` pins the gateway (or LiteLLM) to CPU 0 and the stubs and the driver to CPU 1, so
that the target does not compete with the load for CPU; `--skip-throughput` runs the paced phase
only. It prints one JSON document (medians over runs, plus every run) and writes it to `--out`.

    .venv/bin/python benchmarks/gateway_vs_litellm.py --runs 3 --duration 10 \
        --litellm /tmp/litellm-venv/bin/litellm --out /tmp/gateway_bench.json

LiteLLM is installed in its own venv (`python -m venv /tmp/litellm-venv &&
/tmp/litellm-venv/bin/pip install 'litellm[proxy]'`), never in the project's.
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
from datetime import UTC, datetime
from pathlib import Path

from tokenops.bench.ports import free_port

TOKENOPS = [sys.executable, "-c", "from tokenops.cli import app; app()"]
ADMIN_KEY = "bench-admin"
LITELLM_KEY = "sk-bench-master"
PROMPT = [{"role": "user", "content": "Tell me about the history of the printing press in a few sentences."}]


def wait_http(
    url: str, timeout: float, proc: subprocess.Popen | None = None, headers: dict | None = None
) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2, headers=headers).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {timeout} s")


# ---------------------------------------------------------------------------------------------
# load driver (runs in its own process: `--drive`)


def has_content(chunk: bytes) -> bool:
    """True when one of the SSE events in `chunk` carries generated text (not the empty role delta):
    a proxy may forward the role event and the first token in one write."""
    for event in chunk.split(b"\n\n"):
        at = event.find(b'"content":"')
        if at >= 0 and event[at + 11 : at + 12] != b'"':
            return True
    return False


# One request's stamps on one clock, in path order: the driver's own (aiohttp trace hooks), the
# gateway's (`x-tokenops-timing`, with --probes) and the stub's (`x-stub-timing`). perf_counter is
# CLOCK_MONOTONIC on Linux, shared by every process on the host. Each segment runs from the previous
# stamp present to its own: "gw.received" = the driver's post() -> the gateway's endpoint called.
TIMELINE = (
    "client.conn",  # connection ready (pooled or new)
    "client.sent",  # request headers and body written (aiohttp's body-writer task ran)
    "gw.received",  # the gateway's endpoint is called (uvicorn parsed the request, started its task)
    "gw.upstream_sent",  # parsed, key, limits, reservation, routing: handed to aiohttp
    "gw.conn_ready",  # upstream connection ready
    "gw.body_sent",  # upstream request written (aiohttp's body-writer task ran)
    "stub.received",  # the stub's handler is called
    "stub.ready",  # the stub validated the request and returns its stream
    "gw.resp_headers",  # the stub's response headers in at the gateway, parsed
    "gw.upstream_in",  # the first body chunk (the role event) handed to the gateway
    "client.headers",  # response headers in at the driver, parsed
    "client.first_chunk",  # first body read
    "client.first_content",  # the read that carried the first token (after the stub's TTFT)
    "client.end",  # [DONE] read
)


def parse_stamps(value: str | None, prefix: str, out: dict[str, float]) -> None:
    """`name=<perf_counter_ns>,...` pairs into `out` as seconds, names prefixed (0 = not reached)."""
    for part in (value or "").split(","):
        name, _, ns = part.partition("=")
        if ns.isdigit() and int(ns):
            out[f"{prefix}.{name.strip()}"] = int(ns) / 1e9


async def _drive(
    url: str,
    key: str,
    model: str,
    concurrency: int,
    duration: float,
    warmup: float,
    max_tokens: int = 16,
    stagger: float = 0.0,
) -> dict:
    import resource
    from types import SimpleNamespace

    import aiohttp

    body = json.dumps({"model": model, "messages": PROMPT, "max_tokens": max_tokens, "stream": True}).encode()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    e2e: list[float] = []
    ttft: list[float] = []
    # each measured request's time split along TIMELINE (seconds per segment)
    steps: dict[str, list[float]] = {s: [] for s in TIMELINE}
    lag: list[float] = []  # the driver's own event loop: how late a 1 ms sleep woke
    errors = 0
    start = time.perf_counter()
    measure_from = start + stagger + warmup
    stop_at = measure_from + duration
    done_in_window = 0
    completed = 0
    cpu_from: float | None = None
    cpu_to: float | None = None
    window_requests = 0  # requests completed between the CPU readings

    def cpu_now() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    async def stamp(name: str, ctx: SimpleNamespace) -> None:
        st = ctx.trace_request_ctx
        if st is not None and name not in st:
            st[name] = time.perf_counter()

    tc = aiohttp.TraceConfig()
    tc.on_connection_reuseconn.append(lambda s, c, p: stamp("client.conn", c))
    tc.on_connection_create_end.append(lambda s, c, p: stamp("client.conn", c))
    tc.on_request_chunk_sent.append(lambda s, c, p: stamp("client.sent", c))
    tc.on_request_end.append(lambda s, c, p: stamp("client.headers", c))

    async def probe_loop() -> None:
        nonlocal cpu_from, cpu_to
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            t1 = time.perf_counter()
            if measure_from <= t1:
                if cpu_from is None:
                    cpu_from = cpu_now()
                lag.append(max(0.0, t1 - t0 - 0.001))
        cpu_to = cpu_now()

    async def worker(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal errors, done_in_window, completed, window_requests
        # stream i starts i/concurrency of the way through `stagger`: arrivals spread evenly over one
        # stream's length, as independent users' are, rather than 50 at once and in step thereafter
        await asyncio.sleep(stagger * i / concurrency)
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            first = None
            first_chunk = None
            st: dict[str, float] = {}
            try:
                async with session.post(
                    url + "/v1/chat/completions", data=body, headers=headers, trace_request_ctx=st
                ) as resp:
                    if resp.status != 200:
                        errors += 1
                        await resp.read()
                        continue
                    gw_stamps, _, stub_stamps = (resp.headers.get("x-tokenops-timing") or "").partition(";")
                    parse_stamps(gw_stamps, "gw", st)
                    parse_stamps(stub_stamps or resp.headers.get("x-stub-timing"), "stub", st)
                    async for chunk in resp.content.iter_any():
                        if first_chunk is None:
                            first_chunk = time.perf_counter()
                        if first is None and has_content(chunk):
                            first = time.perf_counter()
                        if b"[DONE]" in chunk:
                            break
            except aiohttp.ClientError:
                errors += 1
                continue
            t1 = time.perf_counter()
            completed += 1
            if measure_from <= t1 <= stop_at:
                done_in_window += 1  # throughput: completions inside the window
                window_requests += 1
            if t0 >= measure_from:
                # latency: every request started inside the window (in-flight ones are awaited),
                # so a slow target is not measured only on its fastest requests
                e2e.append(t1 - t0)
                ttft.append((first or t1) - t0)
                st["client.first_chunk"], st["client.end"] = first_chunk or t1, t1
                st["client.first_content"] = first or t1
                prev = t0
                for name in TIMELINE:
                    if name in st:
                        steps[name].append(st[name] - prev)
                        prev = st[name]

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=60), trace_configs=[tc]
    ) as session:
        await asyncio.gather(probe_loop(), *(worker(session, i) for i in range(concurrency)))

    def pct(xs: list[float], q: float) -> float | None:
        if not xs:
            return None
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000

    cpu = (cpu_to - cpu_from) if cpu_from is not None and cpu_to is not None else None
    return {
        "requests": done_in_window,
        "completed_total": completed,
        "errors": errors,
        "rps": done_in_window / duration,
        "e2e_p50_ms": pct(e2e, 0.50),
        "e2e_p99_ms": pct(e2e, 0.99),
        "ttft_p50_ms": pct(ttft, 0.50),
        "ttft_p99_ms": pct(ttft, 0.99),
        "client": {
            # means add up along the timeline (the sum of the segments' means is the mean TTFT/e2e)
            **{f"{name}_mean_ms": 1000 * statistics.fmean(xs) if xs else None for name, xs in steps.items()},
            **{f"{name}_p50_ms": pct(xs, 0.50) for name, xs in steps.items()},
            **{f"{name}_p99_ms": pct(xs, 0.99) for name, xs in steps.items()},
            "loop_lag_p50_ms": pct(lag, 0.50),
            "loop_lag_p99_ms": pct(lag, 0.99),
            # the driver's own CPU over the measured window, per request completed in it
            "cpu_ms_per_request": 1000 * cpu / window_requests
            if cpu is not None and window_requests
            else None,
        },
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))  # fields[1]: ppid
        stats[int(entry)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0.0)
        todo.extend(children.get(p, []))
    return total


# CPUs for each role (`--cpu-split`): None = wherever the scheduler puts it
CPUS: dict[str, set[int] | None] = {"gateway": None, "load": None}


def pinned(role: str):  # noqa: ANN201 - a preexec_fn or None
    """A `preexec_fn` that pins a child (all its threads and children) to its role's CPUs."""
    cpus = CPUS[role]
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def drive(
    url: str,
    key: str,
    model: str,
    concurrency: int,
    duration: float,
    warmup: float,
    max_tokens: int = 16,
    stagger: float = 0.0,
) -> dict:
    """Run the driver in a fresh process so it never shares an interpreter with a target."""
    args = [url, key, model, str(concurrency), str(duration), str(warmup), str(max_tokens), str(stagger)]
    out = subprocess.run(
        [sys.executable, __file__, "--drive", *args],
        check=True,
        capture_output=True,
        text=True,
        preexec_fn=pinned("load"),
    )
    return json.loads(out.stdout)


# ---------------------------------------------------------------------------------------------
# targets


def start_stub(port: int, ttft_ms: float, itl_ms: float, log: Path) -> subprocess.Popen:
    cmd = TOKENOPS + ["bench", "stub", "--port", str(port), "--tokens", "16"]
    cmd += ["--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms), "--model", "fast", "--model", "paced"]
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, preexec_fn=pinned("load"))


def start_tokenops(port: int, fast: str, paced: str, work: Path, probes: bool = False) -> subprocess.Popen:
    import yaml

    models = {
        "fast": {"backends": [fast + "/v1"], "max_inflight": 1024, "pricing": {"input": 0.1, "output": 0.2}},
        "paced": {
            "backends": [paced + "/v1"],
            "max_inflight": 1024,
            "pricing": {"input": 0.1, "output": 0.2},
        },
    }
    cfg = {
        "data_dir": str(work / "tokenops-data"),
        "admin_key": ADMIN_KEY,
        "log_level": "warning",
        "models": models,
    }
    (work / "tokenops.yaml").write_text(yaml.safe_dump(cfg))
    cmd = TOKENOPS + ["serve", "--config", str(work / "tokenops.yaml"), "--port", str(port)]
    if probes:
        cmd.append("--probes")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENOPS_")}
    return subprocess.Popen(
        cmd,
        stdout=(work / "tokenops.log").open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=pinned("gateway"),
    )


def tokenops_key(url: str) -> str:
    import httpx

    h = {"authorization": f"Bearer {ADMIN_KEY}"}
    httpx.post(url + "/admin/tenants", json={"parent": None, "name": "bench"}, headers=h)
    r = httpx.post(
        url + "/admin/keys", json={"node": "bench", "name": f"k{time.time_ns()}", "limits": {}}, headers=h
    )
    r.raise_for_status()
    return r.json()["key"]


def start_litellm(binary: str, port: int, fast: str, paced: str, work: Path) -> subprocess.Popen:
    import yaml

    cfg = {
        "model_list": [
            {
                "model_name": name,
                "litellm_params": {"model": f"openai/{name}", "api_base": url + "/v1", "api_key": "x"},
            }
            for name, url in (("fast", fast), ("paced", paced))
        ],
        "general_settings": {"master_key": LITELLM_KEY},
        "litellm_settings": {"drop_params": True, "set_verbose": False},
    }
    (work / "litellm.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [
        binary,
        "--config",
        str(work / "litellm.yaml"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
    ]
    env = dict(os.environ, LITELLM_LOG="ERROR")
    return subprocess.Popen(
        cmd,
        stdout=(work / "litellm.log").open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=pinned("gateway"),
    )


def litellm_version(binary: str) -> str:
    py = Path(binary).with_name("python")
    try:
        out = subprocess.run(
            [str(py), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


# the gateway's own intervals, by the suffix of their histogram's name; then its diagnostic probes'
# (`tokenops serve --probes`: the event loop's lag and one pass, by process; the upstream call's steps)
INSIDE = ("pre_upstream", "first_byte", "relay_read", "last_byte", "added", "settle")
PROBES = (
    "loop_lag",
    "loop_pass",
    "upstream_connect",
    "upstream_write",
    "upstream_headers",
    "upstream_first_chunk",
)
SCRAPED = INSIDE + PROBES


def scrape_inside(url: str, model: str) -> dict[str, dict]:
    """Cumulative bucket counts and sum of each `tokenops_gateway_<name>_seconds` for `model`."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        name = family.name.removeprefix("tokenops_gateway_").removesuffix("_seconds")
        if name not in SCRAPED:
            continue
        h: dict = {"buckets": {}, "sum": 0.0}
        for sample in family.samples:
            if sample.labels.get("model", model) != model:
                continue
            if sample.name.endswith("_bucket"):
                h["buckets"][float(sample.labels["le"])] = sample.value
            elif sample.name.endswith("_sum"):
                h["sum"] = sample.value
        out[name] = h
    return out


def bucket_quantile(q: float, bounds: list[float], cumulative: list[float]) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket that holds the q-th observation."""
    total = cumulative[-1] if cumulative else 0
    if not total:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, cumulative, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower  # past the last finite bound: report that bound, as Prometheus does
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def inside_figures(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Per interval, over the requests observed between two scrapes: count, mean, p50 and p99 in ms."""
    out = {}
    for name in SCRAPED:
        a, b = after.get(name), before.get(name, {"buckets": {}, "sum": 0.0})
        if a is None:
            continue
        bounds = sorted(a["buckets"])
        cumulative = [a["buckets"][le] - b["buckets"].get(le, 0.0) for le in bounds]
        count = cumulative[-1] if cumulative else 0
        p50, p99 = bucket_quantile(0.5, bounds, cumulative), bucket_quantile(0.99, bounds, cumulative)
        out[name] = {
            "count": int(count),
            "mean_ms": 1000 * (a["sum"] - b["sum"]) / count if count else None,
            "p50_ms": None if p50 is None else 1000 * p50,
            "p99_ms": None if p99 is None else 1000 * p99,
        }
    return out


def median(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument(
        "--litellm", default="/tmp/litellm-venv/bin/litellm", help="the litellm executable (its own venv)"
    )
    ap.add_argument("--skip-litellm", action="store_true")
    # the latency phase: streams paced like a real engine's decode, so the offered load measures the
    # gateway's per-request path, not CPU saturation (the default 16 x 5 ms saturates 2 cores at 50)
    ap.add_argument("--paced-ttft-ms", type=float, default=20.0)
    ap.add_argument("--paced-itl-ms", type=float, default=5.0)
    ap.add_argument("--paced-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--skip-throughput", action="store_true", help="only the paced latency phase (no fast-stub phase)"
    )
    ap.add_argument(
        "--probes",
        action="store_true",
        help="start the gateway with --probes (event-loop lag, upstream call steps) and report them",
    )
    ap.add_argument(
        "--cpu-split",
        action="store_true",
        help="pin the gateway (and LiteLLM) to CPU 0, the stubs and the load driver to CPU 1: direct and "
        "proxied phases then load the driver's and the stub's CPU alike, and the gateway has its own",
    )
    ap.add_argument(
        "--sync-start",
        action="store_true",
        help="start the paced streams all at once (they then stay in step: bursts of 50 arrivals); "
        "default: spread their starts evenly over one stream's length",
    )
    args = ap.parse_args()
    stagger = (
        0.0 if args.sync_start else (args.paced_ttft_ms + args.paced_itl_ms * (args.paced_tokens - 1)) / 1000
    )
    if args.cpu_split:
        CPUS["gateway"], CPUS["load"] = {0}, {1}

    work = Path(tempfile.mkdtemp(prefix="gwbench-"))
    procs: list[subprocess.Popen] = []
    try:
        fast_port, paced_port, gw_port, ll_port = free_port(), free_port(), free_port(), free_port()
        procs.append(start_stub(fast_port, 0, 0, work / "stub-fast.log"))
        procs.append(start_stub(paced_port, args.paced_ttft_ms, args.paced_itl_ms, work / "stub-paced.log"))
        fast, paced = f"http://127.0.0.1:{fast_port}", f"http://127.0.0.1:{paced_port}"
        wait_http(fast + "/health", 30, procs[0])
        wait_http(paced + "/health", 30, procs[1])
        gw = f"http://127.0.0.1:{gw_port}"
        procs.append(start_tokenops(gw_port, fast, paced, work, args.probes))
        wait_http(gw + "/health", 60, procs[-1])
        targets = {"direct": {"fast": (fast, "x"), "paced": (paced, "x")}}
        pids = {"direct": procs[0].pid, "tokenops": procs[2].pid}
        paced_stub = procs[1].pid
        key = tokenops_key(gw)
        targets["tokenops"] = {"fast": (gw, key), "paced": (gw, key)}
        if not args.skip_litellm:
            ll = f"http://127.0.0.1:{ll_port}"
            procs.append(start_litellm(args.litellm, ll_port, fast, paced, work))
            wait_http(ll + "/health/liveliness", 180, procs[-1])
            targets["litellm"] = {"fast": (ll, LITELLM_KEY), "paced": (ll, LITELLM_KEY)}
            pids["litellm"] = procs[-1].pid

        # warm every target up (lazy imports, connection pools, LiteLLM's first slow requests) at
        # the measured concurrency: the gateway's adaptive per-replica limit starts at its initial
        # value (16 by default) and grows with successes, so a first latency window at 50 streams
        # would otherwise measure that ramp (requests queued for a whole paced stream) rather than
        # the steady state that later runs see
        for t in targets.values():
            for model in ("fast", "paced"):
                drive(*t[model], model, args.concurrency, 3, 0, args.paced_tokens if model == "paced" else 16)

        runs: list[dict] = []
        for r in range(args.runs):
            run: dict = {}
            for name, t in targets.items():
                url, k = t["fast"]
                thr: dict = {"rps": None, "cpu_ms_per_request": None, "errors": 0}
                if not args.skip_throughput:
                    before = cpu_seconds(pids[name])
                    thr = drive(url, k, "fast", args.concurrency, args.duration, args.warmup)
                    # CPU the target itself spent per request: robust to a busy machine, unlike req/s
                    thr["cpu_ms_per_request"] = (
                        1000 * (cpu_seconds(pids[name]) - before) / max(1, thr["completed_total"])
                    )
                url, k = t["paced"]
                scrape = name == "tokenops"
                before = scrape_inside(url, "paced") if scrape else None
                cpu_before = {"stub": cpu_seconds(paced_stub), "target": cpu_seconds(pids[name])}
                lat = drive(
                    url, k, "paced", args.concurrency, args.duration, args.warmup, args.paced_tokens, stagger
                )
                # CPU per paced request of each process (warm-up and window together), and per
                # streamed chunk (the tokens, the role event and the finish event)
                n = max(1, lat["completed_total"])
                lat["cpu_ms_per_request"] = {
                    "stub": 1000 * (cpu_seconds(paced_stub) - cpu_before["stub"]) / n,
                    "driver": lat["client"]["cpu_ms_per_request"],
                }
                if name != "direct":
                    lat["cpu_ms_per_request"][name] = (
                        1000 * (cpu_seconds(pids[name]) - cpu_before["target"]) / n
                    )
                lat["cpu_us_per_chunk"] = {
                    p: None if v is None else 1000 * v / (args.paced_tokens + 2)
                    for p, v in lat["cpu_ms_per_request"].items()
                }
                run[name] = {"throughput": thr, "latency": lat}
                if scrape:
                    time.sleep(0.5)  # the last settles are observed after their last byte
                    run[name]["inside"] = inside_figures(before, scrape_inside(url, "paced"))
                    ins = run[name]["inside"]
                    print(
                        f"run {r + 1} tokenops inside "
                        f"(p50/p99 ms over {ins['added']['count']} paced requests): "
                        + ", ".join(
                            f"{m} {ins[m]['p50_ms'] or 0:.3f}/{ins[m]['p99_ms'] or 0:.3f}"
                            for m in SCRAPED
                            if m in ins
                        ),
                        file=sys.stderr,
                    )
                c = lat["client"]
                print(
                    f"run {r + 1} {name}: {thr['rps'] or 0:.0f} req/s, "
                    f"{thr['cpu_ms_per_request'] or 0:.2f} CPU ms/req, "
                    f"paced e2e p50 {lat['e2e_p50_ms'] or 0:.1f} ms p99 {lat['e2e_p99_ms'] or 0:.1f} ms, "
                    f"ttft p50 {lat['ttft_p50_ms'] or 0:.1f}; timeline mean/p50 ms: "
                    + ", ".join(
                        f"{m} {c[m + '_mean_ms']:.2f}/{c[m + '_p50_ms']:.2f}"
                        for m in TIMELINE
                        if c[m + "_p50_ms"] is not None
                    )
                    + f", loop lag {c['loop_lag_p50_ms'] or 0:.2f}/{c['loop_lag_p99_ms'] or 0:.2f}; "
                    "CPU ms/req "
                    + ", ".join(f"{p} {v or 0:.2f}" for p, v in lat["cpu_ms_per_request"].items())
                    + f"; load {open('/proc/loadavg').read().split()[0]}",
                    file=sys.stderr,
                )
            runs.append(run)

        summary: dict = {}
        for name in targets:
            summary[name] = {
                "rps": median([run[name]["throughput"]["rps"] for run in runs]),
                "paced_cpu_ms_per_request": {
                    p: median([run[name]["latency"]["cpu_ms_per_request"][p] for run in runs])
                    for p in runs[0][name]["latency"]["cpu_ms_per_request"]
                },
                "client_ms": {
                    m: median([run[name]["latency"]["client"][m] for run in runs])
                    for m in runs[0][name]["latency"]["client"]
                },
                "cpu_ms_per_request": median([run[name]["throughput"]["cpu_ms_per_request"] for run in runs]),
                "errors": sum(
                    run[name]["throughput"]["errors"] + run[name]["latency"]["errors"] for run in runs
                ),
                **{
                    m: median([run[name]["latency"][m] for run in runs])
                    for m in ("e2e_p50_ms", "e2e_p99_ms", "ttft_p50_ms", "ttft_p99_ms")
                },
            }
        for name in targets:
            if name == "direct":
                continue
            added: dict = {}
            for m in ("e2e_p50_ms", "e2e_p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
                added[m] = median(
                    [
                        run[name]["latency"][m] - run["direct"]["latency"][m]
                        for run in runs
                        if run[name]["latency"][m] is not None and run["direct"]["latency"][m] is not None
                    ]
                )
            summary[name]["added_ms"] = added
            summary[name]["added_per_run_ms"] = {
                m: [
                    None
                    if run[name]["latency"][m] is None or run["direct"]["latency"][m] is None
                    else run[name]["latency"][m] - run["direct"]["latency"][m]
                    for run in runs
                ]
                for m in ("e2e_p50_ms", "e2e_p99_ms", "ttft_p50_ms")
            }
            if name == "tokenops":
                # the gateway's own time, read inside it, next to the outside difference above
                summary[name]["inside_ms"] = {
                    m: {
                        q: median([run[name]["inside"][m][q] for run in runs if m in run[name]["inside"]])
                        for q in ("p50_ms", "p99_ms", "mean_ms")
                    }
                    for m in SCRAPED
                }
        if "litellm" in summary and summary["litellm"]["rps"]:
            summary["tokenops_vs_litellm_throughput"] = summary["tokenops"]["rps"] / summary["litellm"]["rps"]
            # requests/s one core sustains for the gateway process alone, from its CPU per request
            summary["tokenops_vs_litellm_cpu_efficiency"] = (
                summary["litellm"]["cpu_ms_per_request"] / summary["tokenops"]["cpu_ms_per_request"]
            )
        result = {
            "benchmark": "gateway_vs_litellm",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "litellm_version": None if args.skip_litellm else litellm_version(args.litellm),
            "params": {
                "runs": args.runs,
                "duration_s": args.duration,
                "concurrency": args.concurrency,
                "max_tokens": 16,
                "probes": args.probes,
                "cpu_split": args.cpu_split,
                "paced_start": "in step" if args.sync_start else f"spread over {stagger:.3f} s",
                "loadavg_end": open("/proc/loadavg").read().split()[:3],
                "paced_stub": {
                    "ttft_ms": args.paced_ttft_ms,
                    "itl_ms": args.paced_itl_ms,
                    "tokens": args.paced_tokens,
                },
            },
            "summary": summary,
            "runs": runs,
        }
        text = json.dumps(result, indent=2)
        print(text)
        if args.out:
            args.out.write_text(text)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--drive":
        _, _, url, key, model, conc, dur, warm, max_tokens, stagger = sys.argv
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        print(
            json.dumps(
                asyncio.run(
                    _drive(
                        url, key, model, int(conc), float(dur), float(warm), int(max_tokens), float(stagger)
                    )
                )
            )
        )
    else:
        main()
