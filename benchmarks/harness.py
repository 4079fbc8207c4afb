"""Side-by-side A/B runner: two targets, the same workload, alternating rounds, ratios with their spread.

Each target is a URL of an OpenAI-compatible server, or a shell command that starts one (`{port}`
in it is replaced by a free port, and the harness waits for `/v1/models` to answer). Every round
runs the same seeded workload on both targets, A then B on even rounds and B then A on odd ones, so
drift of the machine (thermal, noisy neighbours, caches) falls on both sides alike. For each metric
it reports the per-round ratio B/A and its median, min, max and interquartile range, plus each
side's median value, as JSON on stdout. This is how the engine is compared with transformers or
llama.cpp, the gateway with LiteLLM, and one balancing policy with another.

    .venv/bin/python benchmarks/harness.py \\
        --a http://127.0.0.1:8001 --b "tokenops bench stub --port {port} --itl-ms 2" \\
        --rounds 5 -n 200 --concurrency 16 --input-len 512 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from typing import Any

from tokenops.bench.compare import METRICS
from tokenops.bench.driver import LoadConfig
from tokenops.bench.metrics import SLO
from tokenops.bench.ports import free_port
from tokenops.bench.runner import WorkloadSpec, run_bench


@dataclass
class Target:
    name: str
    spec: str  # a URL or a command
    model: str
    url: str = ""
    proc: subprocess.Popen | None = None
    _log: Any = None

    def start(self, timeout_s: float) -> None:
        if self.spec.startswith(("http://", "https://")):
            self.url = self.spec.rstrip("/")
            return
        port = free_port()
        cmd = self.spec.replace("{port}", str(port))
        # own process group, so stop() ends the server and anything it started, and nothing else
        # stderr to a file, not a pipe: a chatty server must never block on a full pipe
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            shlex.split(cmd), stdout=subprocess.DEVNULL, stderr=self._log, start_new_session=True
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"target {self.name} exited with {self.proc.returncode}: {err}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"target {self.name} did not answer /v1/models within {timeout_s:.0f}s: {cmd}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = (len(xs) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_rounds(
    rounds: list[dict[str, dict[str, Any]]], metrics: tuple[str, ...] = METRICS
) -> dict[str, Any]:
    """Per metric: each side's median and the ratio B/A's median, min, max and IQR over rounds."""
    out: dict[str, Any] = {}
    for m in metrics:
        a = [r["A"].get(m) for r in rounds]
        b = [r["B"].get(m) for r in rounds]
        if any(not isinstance(v, int | float) for v in a + b):
            continue
        ratios = [vb / va for va, vb in zip(a, b, strict=True) if va]
        row: dict[str, Any] = {"a_median": statistics.median(a), "b_median": statistics.median(b)}
        if ratios:
            row |= {
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "ratio_iqr": _quantile(ratios, 0.75) - _quantile(ratios, 0.25),
                "ratios": ratios,
            }
        out[m] = row
    return out


def run_harness(
    a: Target,
    b: Target,
    cfg: LoadConfig,
    workload: WorkloadSpec,
    *,
    rounds: int = 3,
    slo: SLO | None = None,
    vary_seed: bool = True,
    start_timeout_s: float = 120.0,
    log=None,
) -> dict[str, Any]:
    """Run `rounds` alternating A/B rounds and return the JSON document the script prints."""
    results: list[dict[str, dict[str, Any]]] = []
    try:
        a.start(start_timeout_s)
        b.start(start_timeout_s)
        for i in range(rounds):
            # a fresh seed per round keeps prefix caches from serving later rounds for free
            spec = replace(workload, seed=workload.seed + i) if vary_seed else workload
            order = (a, b) if i % 2 == 0 else (b, a)
            row: dict[str, dict[str, Any]] = {}
            for t in order:
                res = run_bench(replace(cfg, base_url=t.url, model=t.model, seed=spec.seed), spec, slo=slo,
                                include_records=False)  # fmt: skip
                row["A" if t is a else "B"] = res
                if log:
                    log(f"round {i + 1}/{rounds} {t.name}: {res['completed']} ok, {res['failed']} failed, "
                        f"{res['output_throughput']:.1f} tok/s, median TTFT {res['median_ttft_ms']:.1f} ms, "
                        f"median ITL {res['median_itl_ms']:.2f} ms")  # fmt: skip
            results.append(row)
    finally:
        a.stop()
        b.stop()
    strip = ("config", "workload", "throughput_over_time", "records")
    return {
        "a": {"name": a.name, "target": a.spec, "model": a.model},
        "b": {"name": b.name, "target": b.spec, "model": b.model},
        "rounds": rounds,
        "workload": workload.to_json(),
        "load": {k: v for k, v in cfg.to_json().items() if k not in ("base_url", "model")},
        "metrics": summarize_rounds(results),
        "runs": [
            {side: {k: v for k, v in r.items() if k not in strip} for side, r in row.items()}
            for row in results
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="target A: URL, or a command with {port}")
    p.add_argument("--b", required=True, help="target B: URL, or a command with {port}")
    p.add_argument("--a-name", default="A")
    p.add_argument("--b-name", default="B")
    p.add_argument("--model", default="stub", help="model name for both targets")
    p.add_argument("--model-a")
    p.add_argument("--model-b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--same-seed", action="store_true", help="send the same requests every round")
    p.add_argument("--endpoint", default="chat")
    p.add_argument("--workload", default="random")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", default="512")
    p.add_argument("--output-len", default="128")
    p.add_argument("--groups", type=int)
    p.add_argument("--prefix-len", type=int)
    p.add_argument("--turns")
    p.add_argument("--trace", dest="path")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--concurrency", type=int)
    p.add_argument("--rate", type=float)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("-n", "--num-requests", type=int)
    p.add_argument("--duration", type=float)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--slo")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("-o", "--output", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.num_requests is None and args.duration is None:
        args.num_requests = 100
    opts = {k: getattr(args, k) for k in ("input_len", "output_len", "groups", "prefix_len", "turns", "path")}
    workload = WorkloadSpec(
        args.workload, args.seed, args.block_size, {k: v for k, v in opts.items() if v is not None}
    )
    cfg = LoadConfig(
        base_url="", model=args.model, endpoint=args.endpoint, concurrency=args.concurrency, rate=args.rate,
        burstiness=args.burstiness, num_requests=args.num_requests, duration_s=args.duration,
        warmup=args.warmup, ignore_eos=args.ignore_eos, block_size=args.block_size,
    )  # fmt: skip
    a = Target(args.a_name, args.a, args.model_a or args.model)
    b = Target(args.b_name, args.b, args.model_b or args.model)
    out = run_harness(
        a, b, cfg, workload, rounds=args.rounds, slo=SLO.parse(args.slo), vary_seed=not args.same_seed,
        start_timeout_s=args.start_timeout, log=lambda m: print(m, file=sys.stderr),
    )  # fmt: skip
    text = json.dumps(out, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
