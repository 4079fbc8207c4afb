"""Many requests with one system prompt at once: the prefix cache against computing every prompt whole.

`--concurrency` requests arrive together, each a common system prompt of `--system-tokens` tokens
followed by a distinct user turn of `--user-tokens` (the texts of engine_vs_peers.py), `--output-tokens`
greedy tokens each, EOS ignored. Two in-process engines run the same prompts, interleaved within
each repeat: the prefix cache on (the default: one request prefills the system prompt, the others
reuse its blocks) and off (every request computes its whole prompt, as a server without a prefix
cache does). Per engine: steps, prompt tokens computed, TTFT p50 / p90 and the level's wall time
(torch at `--threads`), and the paired ratio of the two per repeat.

Run:  PYTHONPATH=src .venv/bin/python benchmarks/engine_shared_prompt.py [--concurrency 32]
      [--system-tokens 256] [--user-tokens 64] [--repeats 5] [--threads 2]
Prints JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from engine_vs_peers import make_prompts, paired_ratios, percentile, run_ours  # noqa: E402


def run_level(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """One level through `run_ours`, with the engine's steps and the prompt tokens it computed."""
    steps0, hits0 = engine.stats.steps, engine.pool.prefix_hits
    ttft, _, wall = run_ours(engine, prompts, max_tokens)
    return {
        "wall_s": wall,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "steps": engine.stats.steps - steps0,
        "prompt_tokens_computed": sum(map(len, prompts)) - (engine.pool.prefix_hits - hits0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from rich.progress import Progress

    from tokenops.engine.config import EngineConfig, resolve_dtype
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.loader import load_model

    torch.set_num_threads(args.threads)
    engines: dict[str, Any] = {}
    for name, caching in (("prefix_cache", True), ("no_prefix_cache", False)):
        loaded = load_model(args.model, dtype=resolve_dtype("float32"))  # fresh: quantisation works in place
        engines[name] = LLMEngine.from_loaded(
            loaded,
            EngineConfig(
                max_num_seqs=args.concurrency,
                max_num_batched_tokens=512,
                max_model_len=2048,
                quantization=None if args.quantization == "none" else args.quantization,
                enable_prefix_caching=caching,
            ),
        )
    tok = loaded.tokenizer
    for engine in engines.values():
        run_level(engine, make_prompts(tok, "warm", 4, 32), 4)

    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    loads = [os.getloadavg()[0]]
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    with Progress(transient=True) as progress:
        task = progress.add_task("levels", total=args.repeats * len(engines))
        for rep in range(args.repeats):
            # a fresh system prompt per repeat, so the cache holds nothing from the last one
            system = make_prompts(tok, f"system{rep}", 1, args.system_tokens)[0]
            users = make_prompts(tok, f"user{rep}", args.concurrency, args.user_tokens)
            prompts = [system + u for u in users]
            order = list(engines) if rep % 2 == 0 else list(reversed(engines))
            for name in order:
                runs[name].append(run_level(engines[name], prompts, args.output_tokens))
                progress.advance(task)
            loads.append(os.getloadavg()[0])

    def med(name: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[name]), 3)

    keys = ("wall_s", "ttft_p50_s", "ttft_p90_s", "steps", "prompt_tokens_computed")
    paired = {
        key: round(paired_ratios(runs["no_prefix_cache"], runs["prefix_cache"], key)["median"], 2)
        for key in ("wall_s", "ttft_p50_s", "ttft_p90_s")
    }
    print(
        json.dumps(
            {
                "model": args.model,
                "quantization": args.quantization,
                "threads": args.threads,
                "concurrency": args.concurrency,
                "system_tokens": args.system_tokens,
                "user_tokens": args.user_tokens,
                "output_tokens": args.output_tokens,
                "started": started,
                "median": {name: {k: med(name, k) for k in keys} for name in engines},
                "no_cache_over_cache_paired_median": paired,
                "runs": {n: [{k: round(v, 3) for k, v in r.items()} for r in rs] for n, rs in runs.items()},
                "load_average": loads,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
