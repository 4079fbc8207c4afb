"""Our engine's server against vLLM's CPU server, one after the other, through `tokenops bench run`.

The serving form of the comparison (engine_vs_peers.py drives both with its own clients): each
server gets the same seeded random workload through `run_bench`, the library call behind
`tokenops bench run --input-len 256 --output-len 128 --ignore-eos`, n = 6 / 24 / 96 requests at
concurrency 1 / 8 / 32 (`--requests-per-level`, `--concurrency`), streaming chat requests, EOS
ignored. Every level has its own seed, so no level reuses another's prompts from a server's prefix
cache. Servers start, load and (vLLM) compile before any timing and are warmed on every level's
batch size; with `--lock PATH` the timed part of each server takes that file's flock, so vLLM's
minutes of start-up stay outside the lock. Each server runs at its best setting on this CPU: ours
with `--quantization auto`, vLLM in its fastest dtype (`best_cpu_dtype()`), compiled.

Run:  .venv/bin/python benchmarks/serving_vs_vllm.py --lock /tmp/bench.lock \\
          --json benchmarks/results/serving_vs_vllm.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_vs_peers import EngineProcess  # benchmarks/ is on the path when run as a script

from tokenops.bench.bench_lock import bench_lock
from tokenops.bench.driver import LoadConfig
from tokenops.bench.runner import WorkloadSpec, run_bench
from tokenops.bench.vllm_process import VLLMServer, best_cpu_dtype, vllm_missing

KEYS = (
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "completed",
    "failed",
)


def level(
    url: str, model: str, concurrency: int, n: int, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    cfg = LoadConfig(
        base_url=url,
        model=model,
        concurrency=concurrency,
        num_requests=n,
        seed=seed,
        ignore_eos=True,
        timeout_s=1800,
    )
    spec = WorkloadSpec(
        "random", seed, options={"input_len": str(args.input_len), "output_len": str(args.output_len)}
    )
    result = run_bench(cfg, spec, include_records=False)
    return {k: result.get(k) for k in KEYS} | {"duration_s": result.get("duration")}


def stamp() -> dict[str, Any]:
    return {"utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "load": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests-per-level", default="6,24,96", help="n at each concurrency level")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--ours",
        action="append",
        default=None,
        help="NAME=OPTIONS: one of our servers, `tokenops engine` with these extra options "
        "(repeatable; default: ours=--quantization auto, its best weight format on this CPU: "
        "`tokenops engine` alone defaults to float32 weights; `--ours ''` runs vLLM alone)",
    )
    ap.add_argument(
        "--vllm-dtype", default=best_cpu_dtype(), help="default: vLLM's fastest on this CPU; '' skips vLLM"
    )
    ap.add_argument(
        "--vllm-binding",
        choices=("cores", "auto"),
        default="cores",
        help="vLLM's OpenMP threads: on the first --threads cores, or vLLM's own default (auto), which "
        "keeps a core for its front end",
    )
    ap.add_argument("--vllm-kv-cache-gib", type=int, default=2)
    ap.add_argument("--vllm-args", default="", help="extra options of vLLM's server, space-separated")
    ap.add_argument("--lock", default=None, help="flock this file while a server is timed")
    ap.add_argument("--json", default="benchmarks/results/serving_vs_vllm.json")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.requests_per_level.split(",")]
    ours = [spec.partition("=") for spec in (args.ours or ["ours=--quantization auto"]) if spec]

    servers: dict[str, Any] = {}
    if args.vllm_dtype:
        if reason := vllm_missing():
            print(f"vLLM skipped: {reason}", file=sys.stderr)
        else:
            name = f"vllm-{args.vllm_dtype}" + ("" if args.vllm_binding == "cores" else "-bindauto")
            servers[name] = VLLMServer(
                dtype=args.vllm_dtype,
                threads=args.threads,
                cores=None if args.vllm_binding == "cores" else "auto",
                kv_cache_gib=args.vllm_kv_cache_gib,
                max_model_len=2048,
                max_num_seqs=max(levels),
                extra_args=args.vllm_args.split(),
                log_path=Path(tempfile.gettempdir()) / "serving_vs_vllm-vllm.log",
            ).start()
    for name, _, extra in ours:
        servers[name] = EngineProcess(
            ["--model", args.model, "--max-num-seqs", str(max(levels)), *extra.split()]
        )

    results: dict[str, Any] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    try:
        for name, server in servers.items():
            print(f"waiting for {name} ...", file=sys.stderr)
            t0 = time.monotonic()
            server.wait_ready(1800)
            ready_s = time.monotonic() - t0
            model = server.served_name if isinstance(server, VLLMServer) else args.model
            # warm-up outside the lock: every level's batch size once, short outputs
            for c in levels:
                warm = argparse.Namespace(input_len=args.input_len, output_len=8)
                level(server.url, model, c, c, warm, seed=10_000 + c)
            with bench_lock(args.lock):
                start = stamp()
                runs = {}
                for c, n in zip(levels, counts, strict=True):
                    print(f"{name}: {n} requests at concurrency {c}", file=sys.stderr)
                    runs[f"c{c}"] = level(server.url, model, c, n, args, seed=c)
                end = stamp()
            results[name] = {
                "start": start,
                "end": end,
                "ready_after_s": ready_s,
                "command": server.command() if isinstance(server, VLLMServer) else server.cmd,
                "levels": runs,
            }
            server.stop()
            print(json.dumps({name: results[name]["levels"]}, indent=1), file=sys.stderr)
    finally:
        for server in servers.values():
            server.stop()

    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "workload": {"input_len": args.input_len, "output_len": args.output_len, "ignore_eos": True},
        "concurrency": levels,
        "requests": counts,
        "threads": args.threads,
        "results": results,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
