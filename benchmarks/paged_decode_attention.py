"""Decode attention alone: `paged_attention` over every layer of one decode step, native kernel vs PyTorch path.

SmolLM2-135M's attention shape (30 layers, 9 query heads, 3 KV heads, head_dim 64, block size 16),
random caches with random non-contiguous block tables, one query per sequence. A "step" is the 30
layers' calls (KV write + attention; the per-step plan is built on the first layer, as in the engine).
The two paths run in interleaved blocks in one process (`kernels.enabled` switched between
them); prints one JSON line with the median ms per step of each and their ratio.

Run:  flock /tmp/bench.lock .venv/bin/python benchmarks/paged_decode_attention.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from tokenops.engine import kernels
from tokenops.engine.attention import paged_attention
from tokenops.engine.context import allocate_kv_caches, build_context

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def one_case(batch: int, context: int, kv_dtype: torch.dtype, window: int | None, steps: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 1
    caches = allocate_kv_caches(LAYERS, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, kv_dtype)
    for k_cache, v_cache in caches:
        for c in (k_cache, v_cache):
            if kv_dtype == torch.int8:
                c.data.random_(-127, 128, generator=g)
                c.scale.fill_(0.01)
            else:
                c.copy_(torch.randn(c.shape, generator=g))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[s * per_seq:(s + 1) * per_seq] for s in range(batch)]
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=g)

    def step() -> None:
        ctx = build_context([1] * batch, [context] * batch, tables, BLOCK, caches)
        t = time.perf_counter()
        for layer in range(LAYERS):
            paged_attention(q, k, v, ctx, layer, HEAD_DIM**-0.5, window)
        return time.perf_counter() - t

    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(repeats):
        for mode in times:
            kernels.enabled = mode == "on"
            step()
            times[mode].append(statistics.median(step() for _ in range(steps)))
    kernels.enabled = True
    ms = {m: round(statistics.median(v) * 1e3, 3) for m, v in times.items()}
    return {"batch": batch, "context": context, "kv": str(kv_dtype).removeprefix("torch."), "window": window,
            "ms_per_step": ms, "speedup": round(ms["off"] / ms["on"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = [(1, 70), (8, 70), (32, 70), (1, 1024), (8, 1024), (1, 4096)]
    results = []
    with torch.inference_mode():
        for kv_dtype in (torch.float32, torch.int8):
            for batch, context in cases:
                results.append(one_case(batch, context, kv_dtype, None, args.steps, args.repeats))
        results.append(one_case(8, 1024, torch.float32, 512, args.steps, args.repeats))
    print(json.dumps({"threads": args.threads, "layers": LAYERS, "results": results,
                      "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
