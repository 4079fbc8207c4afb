"""Speculative decoding on SmolLM2-135M: plain vs prompt lookup vs self-draft, in one run.

Tasks are input-grounded, the kind speculation is for: edit a given paragraph (copy it with a few
words changed) and rewrite given code (copy it with changes). Each request is run alone (batch 1)
and, with `--batch`, all tasks together, through `LLMEngine` with greedy decoding and a fixed output
length cap. Variants share the loaded weights and interleave within each repeat (plain, ngram,
draft, plain, ...) so a change in the machine's load hits all of them; figures are medians over
`--repeats`, speedups are taken per repeat against that repeat's plain run, then the median.
Reported per variant: output tokens/s (end to end, prefill included), decode tokens/s (after the
first token), draft acceptance rate and mean accepted length, and whether the greedy output is
token-for-token identical to plain decoding (`identical`; an assertion of the report, not a test).

Run:  .venv/bin/python benchmarks/engine_speculative.py [--repeats 3] [--threads 1] [--json out.json]
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
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.loader import load_model
from tokenops.engine.sampling_params import SamplingParams

PARAGRAPH = (
    "The history of the lighthouse begins with fires lit on hills to guide ships home. Later, towers "
    "of stone carried lanterns, then mirrors, then the great Fresnel lenses that bent light into beams "
    "visible for miles. Keepers trimmed wicks, polished brass and logged the weather every hour. "
    "Storms tested them; some towers fell, others stood for centuries. Today most lights are automatic, "
    "yet people still visit them to climb the stairs and look out over the water."
)
CODE = """def total_price(items, tax):
    total = 0
    for item in items:
        price = item["price"]
        quantity = item["quantity"]
        total = total + price * quantity
    total = total + total * tax
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
"""
TASKS = {
    "edit_paragraph": "Rewrite the following paragraph word for word, but replace every 'lighthouse' "
    "with 'beacon' and every 'towers' with 'structures'. Output only the rewritten paragraph.\n\n"
    + PARAGRAPH,
    "copy_paragraph": "Repeat the following text exactly, then stop.\n\n" + PARAGRAPH,
    "rewrite_code": "Rename the variable 'total' to 'amount' in this Python code and output the full "
    "code.\n\n```python\n" + CODE + "```",
}


def variants(draft_layers: int, k: int) -> dict[str, dict | None]:
    return {
        "plain": None,
        "ngram": {"method": "ngram", "num_tokens": k},
        f"draft_self{draft_layers}": {
            "method": "draft",
            "draft_model": f"self:{draft_layers}",
            "num_tokens": k,
        },
    }


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Run `prompts` together to completion; token ids, timings and speculation counters."""
    spec = engine.speculator.stats if engine.speculator else None
    drafted0, accepted0, verif0 = (
        (spec.draft_tokens, spec.accepted_tokens, spec.verifications) if spec else (0, 0, 0)
    )
    ids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    first: dict[str, float] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter()
            out[o.request_id].extend(o.new_token_ids)
    wall = time.perf_counter() - t0
    n_out = sum(len(v) for v in out.values())
    decode_wall = wall - (max(first.values()) - t0)
    result = {
        "tokens": [out[r] for r in ids],
        "output_tokens": n_out,
        "output_tok_s": n_out / wall,
        "decode_tok_s": (n_out - len(ids)) / decode_wall if decode_wall > 0 else 0.0,
    }
    if spec:
        d, a, v = spec.draft_tokens - drafted0, spec.accepted_tokens - accepted0, spec.verifications - verif0
        result["acceptance_rate"] = a / d if d else 0.0
        result["mean_accepted_length"] = 1 + a / v if v else 0.0
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--num-tokens", type=int, default=6, help="most draft tokens per step (k)")
    ap.add_argument("--draft-layers", type=int, default=16)
    ap.add_argument("--batch", action="store_true", help="also run all tasks together in one batch")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model("smollm2-135m-instruct")
    tok = loaded.tokenizer
    prompts = {
        name: tok.encode(
            tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False
        )
        for name, text in TASKS.items()
    }
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    engines = {
        name: LLMEngine.from_loaded(
            loaded, EngineConfig(num_kv_blocks=256, enable_prefix_caching=False, speculative=spec)
        )
        for name, spec in variants(args.draft_layers, args.num_tokens).items()
    }
    workloads = {f"b1/{name}": [p] for name, p in prompts.items()}
    if args.batch:
        workloads[f"b{len(prompts)}/all"] = list(prompts.values())
    for eng in engines.values():  # warm-up
        run(eng, [prompts["copy_paragraph"][:64]], SamplingParams(max_tokens=8, temperature=0))

    samples: dict[str, dict[str, list[dict]]] = {w: {v: [] for v in engines} for w in workloads}
    for _ in range(args.repeats):
        for w, batch in workloads.items():
            for v, eng in engines.items():
                samples[w][v].append(run(eng, batch, params))

    report: dict = {}
    all_identical = True
    for w, per_variant in samples.items():
        ref_tokens = per_variant["plain"][0]["tokens"]
        rows = {}
        for v, runs in per_variant.items():
            identical = all(r["tokens"] == ref_tokens for r in runs)
            all_identical &= identical
            row = {
                "output_tok_s": round(statistics.median(r["output_tok_s"] for r in runs), 2),
                "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in runs), 2),
                "speedup": round(
                    statistics.median(
                        r["output_tok_s"] / p["output_tok_s"]
                        for r, p in zip(runs, per_variant["plain"], strict=True)
                    ),
                    3,
                ),
                "output_tokens": runs[0]["output_tokens"],
                "identical": identical,
            }
            if "acceptance_rate" in runs[0]:
                row["acceptance_rate"] = round(statistics.median(r["acceptance_rate"] for r in runs), 3)
                row["mean_accepted_length"] = round(
                    statistics.median(r["mean_accepted_length"] for r in runs), 3
                )
            rows[v] = row
        report[w] = rows
    result = {
        "benchmark": "engine_speculative",
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"{args.threads} thread(s)",
        "model": "smollm2-135m-instruct (float32)",
        "args": vars(args),
        "greedy_outputs_identical": all_identical,
        "results": report,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
