"""Decode step time with the native per-layer kernels on and off, and each kernel against its torch path.

- `steps`: decode steps of the in-process `LLMEngine` on `--model` (float32) at each batch size,
  `kernels.enabled` toggled between timed blocks of the same engine (interleaved, so load
  from other work on the machine hits both sides alike); median ms per step of each side.
- `ops`: one layer's worth of each fused op at the model's shapes (hidden 576, 9 query / 3 KV heads
  of 64, intermediate 1536), native against the torch path it replaces, interleaved, median us.

Run:  .venv/bin/python benchmarks/engine_native_kernels.py [--model smollm2-135m-instruct] [--batches 1,8,32]
      [--threads 2] [--json out.json]
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

PROMPT = "The history of the lighthouse begins with fires lit on hills to guide ships home. " * 20


def set_native(on: bool) -> None:
    kernels.enabled = on


def step_times(model: str, batches: list[int], repeats: int, steps: int) -> dict[str, dict[str, float]]:
    from tokenops.engine.config import EngineConfig
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.loader import load_model
    from tokenops.engine.sampling_params import SamplingParams

    loaded = load_model(model)
    body = loaded.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=10**5, temperature=0.0, ignore_eos=True)
    out = {}
    for batch in batches:
        engine = LLMEngine.from_loaded(loaded, EngineConfig(max_num_seqs=64, max_model_len=4096))
        for i in range(batch):
            engine.add_request(f"r{i}", body[i : i + 64], params)
        while any(s.num_output_tokens == 0 for s in engine._requests.values()):
            engine.step()
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for on in (False, True):
                set_native(on)
                engine.step()  # first step after a switch is not timed
                t = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[on].append((time.perf_counter() - t) / steps * 1e3)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        out[str(batch)] = {"torch_ms": round(off, 2), "native_ms": round(on, 2), "saved_ms": round(off - on, 2)}
        del engine
    set_native(True)
    return out


def interleaved_us(fns: dict[str, Callable[[], object]], repeats: int = 15, calls: int = 200) -> dict[str, float]:
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
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert kernels.ops() is not None, f"native kernels unavailable: {kernels.build_error()}"
    batches = [int(b) for b in args.batches.split(",")]
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}",
        "threads": args.threads,
        "ops": {str(n): op_times(n) for n in batches},
        "model": args.model,
        "steps": step_times(args.model, batches, args.repeats, args.steps),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
