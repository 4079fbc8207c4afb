"""Live vs simulated: our engine under an open-loop workload, then the same requests in the simulator
calibrated on that engine; p50/p99 TTFT and TPOT and output throughput side by side.

    flock /tmp/bench.lock .venv/bin/python benchmarks/sim_validation.py [--replicas 2] [--requests 60]

It starts `--replicas` `tokenops engine` processes (the bundled model) on free loopback ports (with
two or more, each limited to one torch thread so they share the cores without fighting), warms each
(an engine's first request pays over a second of one-time setup), calibrates on the first and, with
two or more, measures how much slower it steps while the others are busy (the replicas share the
host's cores; the simulator takes that as `host_contention`), drives the load with the bench driver
(with several engines, requests go to them in turn, the round robin the simulator then replays with
the live `RoundRobin` policy), and prints JSON: the fitted profile, the compared keys and their
errors (also without the contention term, `compare_without_contention`), and each request's live and
simulated TTFT and TPOT with its replica (`pairs`, `by_replica`), so a systematic difference can be
traced to prompt length, time, concurrency or one replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime

import httpx

from tokenops.bench.driver import LoadConfig, LoadDriver
from tokenops.bench.workloads import make_workload
from tokenops.cluster.policies import RoundRobin
from tokenops.sim.calibrate import calibrate, measure_contention, warm
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.validation import validate


def start_engine(threads: int | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    proc = subprocess.Popen(
        [sys.executable, "-c", "from tokenops.cli import app; app()", "engine", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("the engine did not start")


class TurnDriver(LoadDriver):
    """The bench driver sending each request to the next engine in turn (a client-side round robin)."""

    def __init__(self, cfg: LoadConfig, urls: list[str]) -> None:
        super().__init__(cfg)
        self.urls = [u.rstrip("/") + "/v1/completions" for u in urls]
        self.sent = 0

    async def send(self, http, *args, **kwargs):
        self.url = self.urls[self.sent % len(self.urls)]  # read before send's first await
        self.sent += 1
        return await super().send(http, *args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3, help="calibration repeats")
    ap.add_argument("--profile-out")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    began = datetime.now(UTC).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    threads = 1 if args.replicas > 1 else None
    procs = []
    try:
        urls = []
        for _ in range(args.replicas):
            proc, url = start_engine(threads)
            procs.append(proc)
            urls.append(url)
        load = httpx.get(urls[0] + "/v1/load", timeout=5).json()
        for url in urls:
            asyncio.run(warm(url, args.model))
        perf = calibrate(urls[0], args.model, f"{args.model}-validation", f"calibrate --url {urls[0]}",
                         repeats=args.repeats)  # fmt: skip
        contention = {"slowdown": 1.0}
        if args.replicas > 1:
            contention = asyncio.run(measure_contention(urls[0], urls[1:], args.model))
        # the slowdown was measured with every other replica busy; the term is per busy neighbour
        host_contention = max(0.0, contention["slowdown"] - 1.0) / max(1, args.replicas - 1)
        if args.profile_out:
            perf.save(args.profile_out)
        cfg = LoadConfig(base_url=urls[0], model=args.model, endpoint="completions", rate=args.rate,
                         num_requests=args.requests, ignore_eos=True, seed=1)  # fmt: skip
        wl = make_workload("random", seed=1, input_len="uniform:32,256", output_len="uniform:16,64")
        live = asyncio.run(TurnDriver(cfg, urls).run(wl))
        shape = EngineShape(num_kv_blocks=int(load.get("kv_blocks_total") or 4096))
        policy = RoundRobin() if args.replicas > 1 else None
        out = validate(live.records, live.duration_s, perf, shape, args.replicas, policy, host_contention)
        if host_contention:
            plain = validate(live.records, live.duration_s, perf, shape, args.replicas, RoundRobin())
            out["compare_without_contention"] = plain["compare"]
        out["host_contention"] = host_contention
        out["contention"] = contention
        out["by_replica"] = by_replica(out["pairs"], args.replicas)
        out["profile"] = perf.to_dict()
        out.update(replicas=args.replicas, requests=args.requests, rate=args.rate, began_utc=began,
                   ended_utc=datetime.now(UTC).isoformat(timespec="seconds"), load_start=load_start,
                   load_end=os.getloadavg(), machine=_cpu())  # fmt: skip
        text = json.dumps(out, indent=2, default=str)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


def by_replica(pairs: list[dict], replicas: int) -> dict[str, dict[str, float]]:
    """Per live replica (requests went out in turn): the median simulated / live TTFT and TPOT."""
    out = {}
    for k in range(replicas):
        rows = [p for i, p in enumerate(pairs) if i % replicas == k]
        if rows:
            out[f"live-{k}"] = {
                "requests": len(rows),
                "sim_replicas": sorted({str(p["sim_replica"]) for p in rows}),
                "median_ttft_ratio": statistics.median(p["sim_ttft_ms"] / p["live_ttft_ms"] for p in rows),
                "median_tpot_ratio": statistics.median(p["sim_tpot_ms"] / p["live_tpot_ms"] for p in rows),
            }
    return out


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


if __name__ == "__main__":
    main()
