"""Decode attention alone: `paged_attention` over every layer of one decode step, native kernel vs
PyTorch path.

SmolLM2-135M's attention shape (30 layers, 9 query heads, 3 KV heads, head_dim 64, block size 16),
random caches with random non-contiguous block tables, one query per sequence. A "step" is the 30
layers' calls (KV write + attention; the per-step plan is built on the first layer, as in the engine).
The two paths run in interleaved blocks in one process (`kernels.enabled` switched between
them); prints one JSON line with the median ms per step of each and their ratio.

`--against REV`: instead, the kernel alone (`tokenops::paged_decode_attention`, one layer, no KV
write) as built from this tree vs as built from git revision REV (its paged_attention.cpp compiled
under another op namespace), interleaved in one process, at batch 1 / 8 / 32 with lengths drawn
from 64-1 100 keys and 32 x 70 keys, SmolLM2 (9 / 3 heads, head_dim 64) and Gemma 3 270M (4 / 1
heads, head_dim 256, window 512) shapes, bfloat16 / float32 / int8 caches: median us per call.

`--against REV --step BATCH,CONTEXT [--kv-dtype float32|int8] [--hot]`: the two kernels over one
decode step's 30 layers of bf16 (or float32, int8) cache (keys read from memory, as in the engine;
`--hot`: one layer's cache 30 times, read from L2 / L3), per layer (thread CPU time at one thread,
wall time at more), and whether they agree bitwise.

Run:  flock /tmp/bench.lock .venv/bin/python benchmarks/paged_decode_attention.py [--threads 2]
      flock /tmp/bench.lock .venv/bin/python benchmarks/paged_decode_attention.py --against de17765
      flock /tmp/bench.lock .venv/bin/python benchmarks/paged_decode_attention.py --against e08764d \\
          --step 32,330
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from kernel_revision import build_revision  # same folder: the revision's kernel built on the side

from tokenops.engine import kernels
from tokenops.engine.attention import paged_attention
from tokenops.engine.context import build_context
from tokenops.engine.kv_cache import allocate_kv_caches

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def one_case(
    batch: int, context: int, kv_dtype: torch.dtype, window: int | None, steps: int, repeats: int
) -> dict:
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
    tables = [perm[s * per_seq : (s + 1) * per_seq] for s in range(batch)]
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
    return {
        "batch": batch,
        "context": context,
        "kv": str(kv_dtype).removeprefix("torch."),
        "window": window,
        "ms_per_step": ms,
        "speedup": round(ms["off"] / ms["on"], 2),
    }


def kernel_case(
    ops: dict, lens: list[int], shape: tuple, kv_dtype: torch.dtype, calls: int, repeats: int
) -> dict:
    heads, kv_heads, head_dim, window = shape
    g = torch.Generator().manual_seed(0)
    per = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(per) + 1
    ((kc, vc),) = allocate_kv_caches(1, num_blocks, BLOCK, kv_heads, head_dim, kv_dtype)
    if kv_dtype == torch.int8:
        for c in (kc, vc):
            c.data.random_(-127, 128, generator=g)
            c.scale.fill_(0.01)
        caches = (kc.data, vc.data, kc.scale, vc.scale)
    else:
        kc.copy_(torch.randn(kc.shape, generator=g))
        vc.copy_(torch.randn(vc.shape, generator=g))
        caches = (kc, vc, None, None)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(per), dtype=torch.long)
    i = 0
    for s, p in enumerate(per):
        tables[s, :p] = perm[i : i + p]
        i += p
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    if kv_dtype == torch.bfloat16:
        q = q.bfloat16()
    lens_t = torch.tensor(lens)

    def call(op: object) -> torch.Tensor:
        return op.paged_decode_attention(q, *caches, tables, lens_t, None, window or 0, head_dim**-0.5)

    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeats):
        for name, op in ops.items():
            call(op)
            t = time.perf_counter()
            for _ in range(calls):
                call(op)
            times[name].append((time.perf_counter() - t) / calls)
    return {name: round(statistics.median(v) * 1e6, 1) for name, v in times.items()}


def against(rev: str, repeats: int) -> list[dict]:
    import random

    ops = {rev: build_revision(rev, "paged_attention.cpp"), "this tree": kernels.ops()}
    rng = random.Random(0)
    results = []
    for kv_dtype in (torch.bfloat16, torch.float32, torch.int8):
        for model, shape in (("smollm2", (HEADS, KV_HEADS, HEAD_DIM, None)), ("gemma3", (4, 1, 256, 512))):
            for batch in (1, 8, 32, 32):
                lens = [70] * 32 if len(results) % 4 == 3 else [rng.randint(64, 1100) for _ in range(batch)]
                us = kernel_case(ops, lens, shape, kv_dtype, max(20, 400 // batch), repeats)
                results.append(
                    {
                        "kv": str(kv_dtype).removeprefix("torch."),
                        "model": model,
                        "batch": batch,
                        "keys": sum(lens),
                        "us_per_call": us,
                        "speedup": round(us[rev] / us["this tree"], 2),
                    }
                )
                print(json.dumps(results[-1]), flush=True)
    return results


def against_step(
    rev: str, batch: int, context: int, repeats: int, kv_dtype: torch.dtype, hot: bool = False
) -> dict:
    """Both kernels over a whole decode step's 30 layers of cache (SmolLM2's shape, each sequence's
    blocks consecutive as the engine allocates them), so the keys come from memory as in the engine,
    not from a cache one layer's worth would fit in: median us per layer. `hot`: the first layer's
    cache 30 times instead (one layer's cache stays in L2 / L3), which separates the arithmetic from
    the reads from memory."""
    ops = {rev: build_revision(rev, "paged_attention.cpp"), "this tree": kernels.ops()}
    per = -(-context // BLOCK)
    caches = []
    g = torch.Generator().manual_seed(0)
    for k_cache, v_cache in allocate_kv_caches(LAYERS, batch * per + 1, BLOCK, KV_HEADS, HEAD_DIM, kv_dtype):
        if kv_dtype == torch.int8:
            for c in (k_cache, v_cache):
                c.data.random_(-127, 128, generator=g)
                c.scale.copy_(torch.rand(c.scale.shape, generator=g) * 0.02)
            caches.append((k_cache.data, v_cache.data, k_cache.scale, v_cache.scale))
        else:
            k_cache.normal_(generator=g)
            v_cache.normal_(generator=g)
            caches.append((k_cache, v_cache, None, None))
    if hot:
        caches = caches[:1] * LAYERS
    tables = torch.arange(batch * per).view(batch, per)
    q = torch.randn(batch, HEADS, HEAD_DIM)
    lens = torch.full((batch,), context)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter  # the pool's too
    times: dict[str, list[float]] = {name: [] for name in ops}
    outs = {}
    for _ in range(repeats):
        for name, op in ops.items():
            t = clock()
            for k_cache, v_cache, k_scale, v_scale in caches:
                outs[name] = op.paged_decode_attention(
                    q, k_cache, v_cache, k_scale, v_scale, tables, lens, None, 0, HEAD_DIM**-0.5
                )
            times[name].append((clock() - t) / LAYERS)
    us = {name: round(statistics.median(v) * 1e6) for name, v in times.items()}
    return {
        "kv": str(kv_dtype).removeprefix("torch."),
        "batch": batch,
        "context": context,
        "cache": "one layer's, hot" if hot else "30 layers', from memory",
        "us_per_layer": us,
        "speedup": round(us[rev] / us["this tree"], 2),
        "bitwise_equal": torch.equal(*outs.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--against", metavar="REV", help="the kernel alone: this tree vs git revision REV")
    ap.add_argument(
        "--step",
        metavar="BATCH,CONTEXT",
        help="with --against: one decode step's 30 layers over BATCH sequences of CONTEXT keys "
        "instead of the per-shape table",
    )
    ap.add_argument(
        "--kv-dtype", default="bfloat16", choices=["bfloat16", "float32", "int8"], help="--step's cache"
    )
    ap.add_argument("--hot", action="store_true", help="--step over one layer's cache 30 times (hot)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.against and args.step:
        batch, context = (int(x) for x in args.step.split(","))
        with torch.inference_mode():
            kv_dtype = getattr(torch, args.kv_dtype)
            result = against_step(args.against, batch, context, max(args.repeats, 7), kv_dtype, args.hot)
        print(json.dumps(result | {"threads": args.threads, "load_average": os.getloadavg()}))
        return
    if args.against:
        with torch.inference_mode():
            results = against(args.against, max(args.repeats, 7))
        print(
            json.dumps(
                {
                    "threads": args.threads,
                    "against": args.against,
                    "results": results,
                    "load_average": os.getloadavg(),
                }
            )
        )
        return
    cases = [(1, 70), (8, 70), (32, 70), (1, 1024), (8, 1024), (1, 4096)]
    results = []
    with torch.inference_mode():
        for kv_dtype in (torch.float32, torch.int8):
            for batch, context in cases:
                results.append(one_case(batch, context, kv_dtype, None, args.steps, args.repeats))
        results.append(one_case(8, 1024, torch.float32, 512, args.steps, args.repeats))
    print(
        json.dumps(
            {"threads": args.threads, "layers": LAYERS, "results": results, "load_average": os.getloadavg()}
        )
    )


if __name__ == "__main__":
    main()
