"""What grammar-constrained decoding costs per token, on SmolLM2-135M, in one run.

Variants, interleaved within each repeat so a change in the machine's load hits all of them, at 1
and at `--batch` concurrent requests (greedy, fixed output length); figures are medians over
`--repeats`, ratios the median of per-repeat ratios:

- plain: no grammar;
- grammar: every request under a JSON schema (a list of at least 500 {name, age} objects, so no
  request can finish its grammar within `--max-tokens`: every token is masked);
- mixed: half the batch under the grammar, half plain (the mask applies to its rows only).

Also the mask's own cost, per constrained row and step: llguidance filling the bitmask and the
-inf fill of the logits row (`grammar.mask_rows`), timed over the same token sequences.

Run:  .venv/bin/python benchmarks/structured_output_mask.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time

import torch

from tokenops.engine.config import EngineConfig
from tokenops.engine.grammar import GrammarCompiler, mask_rows
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.loader import load_model
from tokenops.engine.sampling_params import SamplingParams
from tokenops.structured_output import output_spec

SCHEMA = {
    "type": "array",
    "minItems": 500,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
}
QUESTION = "List people with their names and ages as JSON."


def decode_run(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[float, list]:
    """Output tokens/s after every request has its first token (decode only), and the outputs."""
    rids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, p, sp in zip(rids, prompts, params, strict=True):
        engine.add_request(rid, p, sp)
    out: dict[str, list[int]] = {r: [] for r in rids}
    t_first = None
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        if t_first is None and all(out[r] for r in rids):
            t_first = time.perf_counter()
    return sum(len(v) - 1 for v in out.values()) / (time.perf_counter() - t_first), [out[r] for r in rids]


def mask_cost_us(compiled, outputs: list[list[int]], vocab: int, rows: int) -> float:
    """Microseconds per constrained row and step in `mask_rows`, replaying `outputs` `rows` at a time."""
    states = [compiled.start() for _ in range(rows)]
    logits = torch.zeros(rows, vocab)
    steps = min(len(o) for o in outputs)
    t0 = time.perf_counter()
    for k in range(steps):
        mask_rows(logits, list(range(rows)), states)
        for j, s in enumerate(states):
            s.accept(outputs[j % len(outputs)][k])
    return (time.perf_counter() - t0) / (steps * rows) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    engine = LLMEngine.from_loaded(
        loaded,
        EngineConfig(max_num_seqs=args.batch, max_num_batched_tokens=1024, enable_prefix_caching=False),
    )
    vocab = engine.model_config.vocab_size
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok.backend.to_str(), vocab, list(tok.eos_token_ids))
    tokenizer_s = time.perf_counter() - t0
    fmt = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}
    t0 = time.perf_counter()
    compiled = compiler.compile(output_spec(None, None, fmt).grammar)
    compile_ms = (time.perf_counter() - t0) * 1e3
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": QUESTION}]), add_special_tokens=False
    )

    def params(constrained: bool) -> SamplingParams:
        return SamplingParams(
            temperature=0.0,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            grammar=compiled if constrained else None,
        )

    layouts = {
        (1, "plain"): [False],
        (1, "grammar"): [True],
        (args.batch, "plain"): [False] * args.batch,
        (args.batch, "grammar"): [True] * args.batch,
        (args.batch, "mixed"): [j % 2 == 0 for j in range(args.batch)],
    }
    for flags in layouts.values():  # warm-up
        decode_run(engine, [prompt] * len(flags), [params(f) for f in flags])
    tok_s: dict[tuple[int, str], list[float]] = {k: [] for k in layouts}
    outputs: dict[tuple[int, str], list] = {}
    load_start = os.getloadavg()
    for _ in range(args.repeats):
        for key, flags in layouts.items():
            rate, outs = decode_run(engine, [prompt] * len(flags), [params(f) for f in flags])
            tok_s[key].append(rate)
            outputs[key] = outs
    load_end = os.getloadavg()

    constrained_out = outputs[(1, "grammar")]
    text = tok.decode(constrained_out[0])
    mask_us = {
        rows: statistics.median(mask_cost_us(compiled, constrained_out, vocab, rows) for _ in range(3))
        for rows in (1, args.batch)
    }
    ratio = {
        f"{rows}x{name}": statistics.median(
            a / b for a, b in zip(tok_s[(rows, name)], tok_s[(rows, "plain")], strict=True)
        )
        for rows, name in layouts
    }
    mixed_plain_rows_equal = all(
        outputs[(args.batch, "mixed")][j] == outputs[(args.batch, "plain")][j]
        for j in range(1, args.batch, 2)
    )
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.threads} thread(s)",
        "load_average_start_end": [list(load_start), list(load_end)],
        "model": args.model,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "grammar_tokenizer_build_s": round(tokenizer_s, 3),
        "grammar_compile_ms": round(compile_ms, 2),
        "decode_tok_s_median": {f"{r}x{n}": round(statistics.median(v), 2) for (r, n), v in tok_s.items()},
        "decode_ratio_vs_plain": {k: round(v, 3) for k, v in ratio.items()},
        "decode_tok_s_per_repeat": {f"{r}x{n}": [round(x, 2) for x in v] for (r, n), v in tok_s.items()},
        "mask_us_per_row_step": {str(k): round(v, 1) for k, v in mask_us.items()},
        "mixed_plain_rows_equal_plain": mixed_plain_rows_equal,
        "constrained_output_head": text[:80],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
