"""CPU time of 32-row decode steps with a float32 against a bfloat16 KV cache, per weight mode.

The engine_vs_peers.py load (SmolLM2-135M, 32 requests of 64 prompt tokens, 32 output tokens): one in-process
`LLMEngine` per (weight mode, KV dtype), all prefilled first, then their decode steps interleaved
round-robin (step i of every engine runs at the same context length, 64 + i, and under the same
machine load). Reported per engine: the median thread CPU time (`time.thread_time`, torch at one
thread by default, so it is the whole step's work) and wall time of the 32 decode steps, and from
torch.profiler over a second round of steps the share of `tokenops::paged_prefill_attention`.
Prints JSON (and writes it to --json).

Run:  flock /tmp/bench.lock .venv/bin/python benchmarks/engine_kv_dtype_step.py [--weights bf16,int8_dynamic]
      [--kv-cache-dtypes float32,bfloat16] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

PROMPT = "The history of the lighthouse begins with fires lit on hills to guide ships home. " * 20
ATTENTION_OPS = ("tokenops::paged_prefill_attention", "tokenops::paged_decode_attention")


def prefilled(engine: Any, body: list[int], rows: int, tag: str) -> None:
    from tokenops.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=10**4, temperature=0.0, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"{tag}-{i}", body[i : i + 64], params)
    while any(s.num_output_tokens == 0 for s in engine._requests.values()):
        engine.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="bf16,int8_dynamic")
    ap.add_argument("--kv-cache-dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument(
        "--rounds", type=int, default=2, help="fresh batches per engine (each: --steps decode steps)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from torch.profiler import ProfilerActivity, profile

    from tokenops.engine.config import EngineConfig
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.loader import load_model

    load_at_start = os.getloadavg()
    engines: dict[str, Any] = {}
    tokenizer = None
    for w in args.weights.split(","):
        for kv in args.kv_cache_dtypes.split(","):
            loaded = load_model(args.model)  # a fresh copy each: quantisation replaces linears in place
            tokenizer = loaded.tokenizer
            engines[f"{w}/kv-{kv}"] = LLMEngine.from_loaded(
                loaded,
                EngineConfig(max_num_seqs=args.rows, max_model_len=2048, quantization=w, kv_cache_dtype=kv),
            )
    body = tokenizer.encode(PROMPT)
    cpu: dict[str, list[float]] = {k: [] for k in engines}
    wall: dict[str, list[float]] = {k: [] for k in engines}
    with torch.inference_mode():
        for r in range(args.rounds + 1):  # round 0 warms every engine up, untimed
            for e in engines.values():
                prefilled(e, body, args.rows, f"r{r}")
            for _ in range(args.steps):
                for name, e in engines.items():
                    t, w0 = time.thread_time(), time.perf_counter()
                    e.step()
                    if r:
                        cpu[name].append(time.thread_time() - t)
                        wall[name].append(time.perf_counter() - w0)
            for e in engines.values():
                for rid in list(e._requests):
                    e.abort(rid)
                e.step()
        share: dict[str, float] = {}
        attention_ms: dict[str, float] = {}
        for name, e in engines.items():
            prefilled(e, body, args.rows, "prof")
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(8):
                    e.step()
            total = sum(x.self_cpu_time_total for x in prof.key_averages())
            att = sum(x.self_cpu_time_total for x in prof.key_averages() if x.key in ATTENTION_OPS)
            share[name] = round(100 * att / total, 1)
            attention_ms[name] = round(att / 8 / 1e3, 2)
            for rid in list(e._requests):
                e.abort(rid)
            e.step()
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": args.threads,
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),
        },
        "model": args.model,
        "rows": args.rows,
        "prompt_tokens": 64,
        "decode_steps": args.steps,
        "rounds": args.rounds,
        "kv_storage": {k: e.load().kv_cache_dtype for k, e in engines.items()},
        "kv_bytes_per_token": {k: e.kv_bytes_per_token for k, e in engines.items()},
        "step_cpu_ms_median": {k: round(statistics.median(v) * 1e3, 2) for k, v in cpu.items()},
        "step_wall_ms_median": {k: round(statistics.median(v) * 1e3, 2) for k, v in wall.items()},
        "attention_share_pct_profiled": share,
        "attention_ms_per_step_profiled": attention_ms,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
