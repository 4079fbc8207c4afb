"""Prefill attention alone: `paged_attention` for one query chunk on a cached prefix, native kernel
vs PyTorch path.

One sequence, one layer: a chunk of `chunk` new tokens on `prefix` cached ones (random keys, random
non-contiguous blocks of 16), SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim
64) or Gemma 3 270M's (4 heads, 1 KV head, head_dim 256, sliding window 512). A call is what one
layer costs: KV write + attention (the per-step plan is rebuilt every call, as on a step's first
layer). The PyTorch path gathers the prefix's blocks and builds an explicit mask (or, for a first
chunk on a float cache, runs causal SDPA on the chunk's own keys); the native path is
`tokenops::paged_prefill_attention` forced on for every chunk (`NATIVE_FIRST_CHUNK_MAX`,
`BF16_SDPA_MIN_QUERIES` and `BF16_SDPA_MIN_QUERIES_CACHED` lifted; `--dot-amx off`: the kernel's bf16
dot path on vdpbf16ps where it would use AMX's tiles),
so the table shows where each wins. The two run in interleaved blocks in one process; prints one
JSON line: median us per call of each and their ratio.

`--ttft MODEL`: instead, engine_vs_peers's cached-prefix case on a real engine: TTFT of a prompt
whose first ~1,000 tokens are in the prefix cache (and of a cold one), prefill attention all native
(`BF16_SDPA_MIN_QUERIES` lifted), as shipped (where the CPU has AMX and the kernel no tiles, long
chunks on a bf16 cache in bf16 SDPA; with the tiles every chunk native, the same as all native), and
all PyTorch (`attention._prefill_native` switched); every other kernel, decode
attention included, as configured; alternating per repeat with fresh prompts. `--quantization bf16`
gives the bf16-weight engine (bf16 KV where the CPU has native bf16).

Run:  flock /tmp/bench.lock .venv/bin/python benchmarks/paged_prefill_attention.py \\
          [--threads 2] [--model smollm2|gemma3]
      flock /tmp/bench.lock .venv/bin/python benchmarks/paged_prefill_attention.py \\
          --ttft smollm2-135m-instruct [--dtype bfloat16] [--quantization bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from tokenops.engine import attention, kernels
from tokenops.engine.attention import paged_attention
from tokenops.engine.context import build_context
from tokenops.engine.kv_cache import allocate_kv_caches

SHAPES = {"smollm2": (9, 3, 64, None), "gemma3": (4, 1, 256, 512)}
BLOCK = 16


def one_case(shape, chunk: int, prefix: int, kv_dtype: torch.dtype, calls: int, repeats: int) -> dict:
    heads, kv_heads, head_dim, window = shape
    g = torch.Generator().manual_seed(0)
    length = prefix + chunk
    per_seq = -(-length // BLOCK)
    num_blocks = per_seq + 1
    ((k_cache, v_cache),) = allocate_kv_caches(1, num_blocks, BLOCK, kv_heads, head_dim, kv_dtype)
    for c in (k_cache, v_cache):
        if kv_dtype == torch.int8:
            c.data.random_(-127, 128, generator=g)
            c.scale.fill_(0.01)
        else:
            c.copy_(torch.randn(c.shape, generator=g))
    table = torch.randperm(num_blocks, generator=g)[:per_seq].tolist()
    dtype = torch.float32 if kv_dtype == torch.int8 else kv_dtype
    q = torch.randn(chunk, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(chunk, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(chunk, kv_heads, head_dim, generator=g).to(dtype)

    def timed() -> float:
        t = time.perf_counter()
        for _ in range(calls):
            ctx = build_context([chunk], [length], [table], BLOCK, [(k_cache, v_cache)])
            paged_attention(q, k, v, ctx, 0, head_dim**-0.5, window)
        return (time.perf_counter() - t) / calls

    times: dict[str, list[float]] = {"native": [], "torch": []}
    for _ in range(repeats):
        for mode in times:
            kernels.enabled = mode == "native"
            timed()
            times[mode].append(timed())
    kernels.enabled = True
    us = {m: round(statistics.median(v) * 1e6, 1) for m, v in times.items()}
    return {
        "chunk": chunk,
        "prefix": prefix,
        "kv": str(kv_dtype).removeprefix("torch."),
        "us_per_call": us,
        "speedup": round(us["torch"] / us["native"], 2),
    }


def ttft(
    model: str,
    dtype: str,
    prefix_tokens: int,
    repeats: int,
    quantization: str | None = None,
    tail_tokens: int = 9,
) -> dict:
    from tokenops.engine.config import EngineConfig, resolve_dtype
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.loader import load_model
    from tokenops.engine.sampling_params import SamplingParams

    loaded = load_model(model, dtype=resolve_dtype(dtype))
    engine = LLMEngine.from_loaded(
        loaded, EngineConfig(max_num_batched_tokens=512, max_model_len=2048, quantization=quantization)
    )
    vocab = loaded.tokenizer.vocab_size if hasattr(loaded.tokenizer, "vocab_size") else 32000
    g = torch.Generator().manual_seed(0)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    native_prefill = attention._prefill_native
    bf16_min = attention.BF16_SDPA_MIN_QUERIES, attention.BF16_SDPA_MIN_QUERIES_CACHED

    def first_token_s(prompt: list[int]) -> float:
        t = time.perf_counter()
        engine.generate([prompt], one)
        return time.perf_counter() - t

    def ids(n: int) -> list[int]:
        return torch.randint(100, min(vocab, 30000), (n,), generator=g).tolist()

    modes = ("native", "shipped", "torch")
    times: dict[str, dict[str, list[float]]] = {m: {"cached": [], "cold": []} for m in modes}
    first_token_s(ids(prefix_tokens + tail_tokens))  # warm-up
    for _ in range(repeats):
        for mode, t in times.items():
            attention._prefill_native = native_prefill if mode != "torch" else (lambda *_: False)
            mins = (1 << 30, 1 << 30) if mode == "native" else bf16_min
            attention.BF16_SDPA_MIN_QUERIES, attention.BF16_SDPA_MIN_QUERIES_CACHED = mins
            prefix = ids(prefix_tokens)
            t["cold"].append(first_token_s(ids(prefix_tokens) + ids(tail_tokens)))
            first_token_s(prefix + ids(tail_tokens))  # puts the prefix in the cache
            t["cached"].append(first_token_s(prefix + ids(tail_tokens)))
    attention._prefill_native = native_prefill
    attention.BF16_SDPA_MIN_QUERIES, attention.BF16_SDPA_MIN_QUERIES_CACHED = bf16_min
    ms = {m: {k: round(statistics.median(v) * 1e3, 1) for k, v in t.items()} for m, t in times.items()}
    return {
        "model": model,
        "dtype": dtype,
        "quantization": quantization,
        "kv_cache_dtype": engine.load().kv_cache_dtype,
        "prefix_tokens": prefix_tokens,
        "tail_tokens": tail_tokens,
        "ttft_ms": ms,  # time / native's time: above 1 native is faster
        **{
            f"{k}_{m}_over_native": round(ms[m][k] / ms["native"][k], 2)
            for m in ("shipped", "torch")
            for k in ("cached", "cold")
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--kv", default="float32,bfloat16,int8", help="comma-separated KV cache dtypes")
    ap.add_argument("--chunks", default="16,64,128,256,512")
    ap.add_argument("--prefixes", default="0,250,1000")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ttft", metavar="MODEL", help="measure cached-prefix TTFT on this model instead")
    ap.add_argument("--dtype", default="float32", help="with --ttft: the engine's dtype")
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument(
        "--tail-tokens",
        type=int,
        default=9,
        help="with --ttft: new tokens after the prefix (a turn's message)",
    )
    ap.add_argument("--quantization", default=None, help="with --ttft: the engine's weight format")
    ap.add_argument(
        "--dot-amx",
        choices=("on", "off"),
        default="on",
        help="off: the kernel's bf16 dot path without AMX's tiles (where the build has them)",
    )
    args = ap.parse_args()
    native = kernels.ops()
    if native is not None:
        native.set_prefill_bf16_amx(args.dot_amx == "on")
    torch.set_num_threads(args.threads)
    if args.ttft:
        res = ttft(
            args.ttft, args.dtype, args.prefix_tokens, args.repeats, args.quantization, args.tail_tokens
        )
        dot_amx = native is not None and native.prefill_bf16_amx()
        print(
            json.dumps({"threads": args.threads, "dot_amx": dot_amx, **res, "load_average": os.getloadavg()})
        )
        return
    # the kernel for every chunk: measure where it wins
    attention.NATIVE_FIRST_CHUNK_MAX = attention.BF16_SDPA_MIN_QUERIES = 1 << 30
    attention.BF16_SDPA_MIN_QUERIES_CACHED = 1 << 30
    results = []
    with torch.inference_mode():
        for kv in args.kv.split(","):
            for prefix in map(int, args.prefixes.split(",")):
                for chunk in map(int, args.chunks.split(",")):
                    calls = max(2, 4096 // (chunk + prefix // 4))
                    results.append(
                        one_case(SHAPES[args.model], chunk, prefix, getattr(torch, kv), calls, args.repeats)
                    )
                    print(json.dumps(results[-1]), flush=True)
    print(
        json.dumps(
            {
                "threads": args.threads,
                "model": args.model,
                "dot_amx": native is not None and native.prefill_bf16_amx(),
                "results": results,
                "load_average": os.getloadavg(),
            }
        )
    )


if __name__ == "__main__":
    main()
