"""Each native per-layer kernel against the torch path it replaces, at a model's shapes.

One layer's worth of each fused op at SmolLM2-135M's shapes (hidden 576, 9 query / 3 KV heads of 64,
intermediate 1536), native against torch, interleaved, median us per call. Whole decode steps with
the kernels on and off: `engine_decode_modes.py --native on,off`.

Run:  .venv/bin/python benchmarks/engine_native_kernels.py [--batches 1,8,32] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenops.engine import kernels
from tokenops.engine.models.layers import RMSNorm, RotaryEmbedding, rope_inv_freq, silu_and_mul


def set_native(on: bool) -> None:
    kernels.enabled = on


def interleaved_us(
    fns: dict[str, Callable[[], object]], repeats: int = 15, calls: int = 200
) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            fn()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - t) / calls * 1e6)
    return {name: round(statistics.median(v), 1) for name, v in samples.items()}


def with_native(on: bool, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        set_native(on)
        return fn()

    return run


def op_times(n: int) -> dict[str, dict[str, float]]:
    """One layer's fused ops over n rows at SmolLM2-135M's shapes, torch path against native."""
    hidden, heads, kv_heads, d, inter = 576, 9, 3, 64, 1536
    norm = RMSNorm(hidden, 1e-5)
    rotary = RotaryEmbedding(rope_inv_freq(d, 100000.0))
    x, residual = torch.randn(n, hidden), torch.randn(n, hidden)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d)
    gate_up = torch.randn(n, 2 * inter)

    def rope_q_k(native: bool) -> Callable[[], object]:
        set_native(native)
        rope = rotary(torch.arange(100, 100 + n), torch.float32)  # once per step for all layers: not timed

        def run() -> object:
            q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
            return rope(q.view(n, heads, d), k.view(n, kv_heads, d))

        return run

    sides = ("torch", "native")
    with torch.inference_mode():
        result = {
            "add_rms_norm": interleaved_us(
                {f"{s}_us": with_native(s == "native", lambda: norm.forward_add(x, residual)) for s in sides}
            ),
            "rope_q_k": interleaved_us({f"{s}_us": rope_q_k(s == "native") for s in sides}),
            "silu_and_mul": interleaved_us(
                {f"{s}_us": with_native(s == "native", lambda: silu_and_mul(gate_up)) for s in sides}
            ),
        }
    set_native(True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert kernels.ops() is not None, f"native kernels unavailable: {kernels.build_error()}"
    batches = [int(b) for b in args.batches.split(",")]
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
        f"torch {torch.__version__}",
        "threads": args.threads,
        "ops": {str(n): op_times(n) for n in batches},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
