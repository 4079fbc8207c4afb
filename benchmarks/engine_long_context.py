"""Passkey retrieval on SmolLM2-135M with full KV against sink+window KV eviction: accuracy and memory.

The task (the passkey test of Mohtashami & Jaggi, used by StreamingLLM): a five-digit key is hidden
in a long repetitive filler text at a chosen depth (10%, 50%, 90% of the context); the prompt ends
by asking for it, and the model's greedy continuation (8 tokens) must contain the key. Each
(context length, depth) cell runs `--keys` different keys. Modes:
- full: every token's KV kept (the pool is sized to hold the whole context);
- evict: `kv_eviction = {sink_tokens, window_tokens}`: the middle of the context is dropped as
  the prompt is prefilled in chunks of `--chunk` tokens.

Memory: the most KV blocks the request held at once (sampled after every engine step) and the
bytes they stand for. Expected from the method, and what this measures: eviction keeps what is in
the window (a key near the end) and forgets the middle; memory stays flat as the context grows.

Run:  .venv/bin/python benchmarks/engine_long_context.py [--lengths 1024,2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import time

import torch

from tokenops.engine.config import EngineConfig, KVEvictionConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.loader import load_model
from tokenops.engine.sampling_params import SamplingParams

INTRO = "There is an important pass key hidden inside a lot of irrelevant text. Find it and remember it.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


def build_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """Token ids of about `length` tokens with the needle at `depth` (0..1) of the filler."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    head, needle, question, filler = enc(INTRO), enc(NEEDLE.format(key=key)), enc(QUESTION), enc(FILLER)
    room = length - len(head) - len(needle) - len(question)
    body = (filler * (room // len(filler) + 1))[:room]
    # cut the filler at a sentence boundary near the depth, so the needle reads as its own sentence
    at = int(room * depth) // len(filler) * len(filler)
    return head + body[:at] + needle + body[at:] + question


def run(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], int]:
    engine.add_request("q", prompt, SamplingParams(temperature=0.0, max_tokens=8))
    seq = engine._requests["q"]  # noqa: SLF001 - a benchmark reads the block table it measures
    out: list[int] = []
    most = 0
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
        if not seq.is_finished:
            most = max(most, len(seq.block_table))
    return out, most


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--keys", type=int, default=3)
    ap.add_argument("--sink-tokens", type=int, default=4)
    ap.add_argument("--window-tokens", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    bs = 16
    common = dict(block_size=bs, max_num_batched_tokens=args.chunk, kv_cache_dtype=args.kv_cache_dtype)
    eviction = KVEvictionConfig(args.sink_tokens, args.window_tokens)
    engines = {
        "full": LLMEngine(loaded.model, EngineConfig(num_kv_blocks=max(lengths) // bs + 4, **common)),
        "evict": LLMEngine(
            loaded.model, EngineConfig(num_kv_blocks=max(lengths) // bs + 4, kv_eviction=eviction, **common)
        ),
    }
    per_token = engines["full"].kv_bytes_per_token
    rng = random.Random(0)
    result: dict = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.threads} thread(s)",
        "load_average_start": os.getloadavg(),
        "args": vars(args),
        "kv_bytes_per_token": per_token,
        "cells": [],
    }
    for length in lengths:
        for depth in depths:
            keys = [rng.randrange(10000, 100000) for _ in range(args.keys)]
            cell = {"length": length, "depth": depth}
            for mode, engine in engines.items():
                hits, most, answers = 0, 0, []
                t0 = time.perf_counter()
                for key in keys:
                    out, held = run(engine, build_prompt(tok, length, depth, key))
                    text = tok.decode(out)
                    hits += str(key) in text
                    most = max(most, held)
                    answers.append(text.strip())
                cell[mode] = {
                    "accuracy": hits / len(keys),
                    "max_kv_blocks": most,
                    "max_kv_mib": most * bs * per_token / 2**20,
                    "seconds": round(time.perf_counter() - t0, 1),
                    "answers": answers,
                }
            result["cells"].append(cell)
            print(
                f"len {length:>5} depth {depth:.1f}: full {cell['full']['accuracy']:.2f} "
                f"({cell['full']['max_kv_mib']:.1f} MiB)  evict {cell['evict']['accuracy']:.2f} "
                f"({cell['evict']['max_kv_mib']:.1f} MiB)  {cell['evict']['answers'][0]!r}",
                flush=True,
            )
    for mode in engines:
        cells = result["cells"]
        result[f"{mode}_accuracy"] = sum(c[mode]["accuracy"] for c in cells) / len(cells)
    result["load_average_end"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
