"""Decode steps with the int4 Llama layers as native calls against the same layers op by op.

One in-process `LLMEngine` (SmolLM2-135M, `--quantization`, default int4; prefix caching off, so
both paths compute the same prompts), `--rows` requests of 64 distinct prompt tokens and 48 greedy
output tokens (EOS ignored) at a time, the two paths alternated `--rounds` times. `--against
op-by-op` (default): every layer op by op (`LlamaDecoderLayer.one_call`); `--against per-layer`:
each layer its own native call instead of a step's consecutive layers in one
(`LlamaForCausalLM.one_call_runs`). Reported per row count: the median wall time of a decode step
per round and path, the ratio of the medians, and whether both paths generated the same tokens.
Prints JSON (and writes it to --json).

Run:  flock /tmp/bench.lock .venv/bin/python benchmarks/engine_one_call.py [--rows 1,8,32] \
          [--against op-by-op|per-layer] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--against", choices=["op-by-op", "per-layer"], default="op-by-op")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tokenops.engine.config import EngineConfig, resolve_dtype
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.loader import load_model
    from tokenops.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
    from tokenops.engine.sampling_params import SamplingParams

    loaded = load_model(args.model, dtype=resolve_dtype("float32"))
    config = EngineConfig(
        max_num_seqs=64, max_model_len=2048, quantization=args.quantization, enable_prefix_caching=False
    )
    engine = LLMEngine.from_loaded(loaded, config)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    results = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        steps: dict[bool, list[float]] = {True: [], False: []}
        tokens: dict[bool, dict[int, list[int]]] = {}
        for k in range(args.rounds):
            for one_call in (True, False):
                if args.against == "op-by-op":
                    LlamaDecoderLayer.one_call = one_call
                else:
                    LlamaForCausalLM.one_call_runs = one_call
                ids = {f"{rows}-{k}-{one_call}-{i}": i for i in range(rows)}
                for rid, i in ids.items():
                    engine.add_request(rid, [100 + 7 * i + j for j in range(64)], params)
                walls, out = [], {i: [] for i in range(rows)}
                while engine.has_unfinished():
                    t0 = time.perf_counter()
                    for o in engine.step():
                        out[ids[o.request_id]].extend(o.new_token_ids)
                    walls.append(time.perf_counter() - t0)
                steps[one_call].append(statistics.median(walls[2:]))  # decode steps only
                tokens.setdefault(one_call, out)
        on, off = statistics.median(steps[True]), statistics.median(steps[False])
        results[rows] = {
            "one_call_step_ms": [round(s * 1e3, 2) for s in steps[True]],
            "baseline_step_ms": [round(s * 1e3, 2) for s in steps[False]],
            "baseline_over_one_call": round(off / on, 3),
            "same_tokens": tokens[True] == tokens[False],
        }
    LlamaDecoderLayer.one_call = True
    LlamaForCausalLM.one_call_runs = True
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average": list(os.getloadavg()),
        },
        "model": args.model,
        "quantization": args.quantization,
        "baseline": args.against,
        "rows": results,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
