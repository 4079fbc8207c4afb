"""Live vs simulated: our engine under an open-loop workload, then the same requests in the simulator
calibrated on that engine; p50/p99 TTFT and TPOT and output throughput side by side.

    flock /tmp/bench.lock .venv/bin/python benchmarks/sim_validation.py [--url URL] [--requests 120]

Without --url it starts `tokenops engine` (the bundled model) on a free loopback port. Prints JSON:
the fitted profile, the live and simulated summaries' compared keys and their relative errors.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx

from tokenops.bench.driver import LoadConfig, run_load
from tokenops.bench.workloads import make_workload
from tokenops.sim.calibrate import calibrate
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.validation import validate


def start_engine() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from tokenops.cli import app; app()", "engine", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--profile-out")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_engine()
    try:
        load = httpx.get(url + "/v1/load", timeout=5).json()
        perf = calibrate(url, args.model, f"{args.model}-validation", f"calibrate --url {url}")
        if args.profile_out:
            perf.save(args.profile_out)
        cfg = LoadConfig(base_url=url, model=args.model, endpoint="completions", rate=args.rate,
                         num_requests=args.requests, ignore_eos=True, seed=1)  # fmt: skip
        wl = make_workload("random", seed=1, input_len="uniform:32,256", output_len="uniform:16,64")
        live = run_load(cfg, wl)
        shape = EngineShape(num_kv_blocks=int(load.get("kv_blocks_total") or 4096))
        out = validate(live.records, live.duration_s, perf, shape)
        out["profile"] = perf.to_dict()
        out["load"] = os.getloadavg()
        out["requests"] = args.requests
        out["rate"] = args.rate
        print(json.dumps(out, indent=2, default=str))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
