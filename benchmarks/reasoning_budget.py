"""What a reasoning budget costs the engine and the server per token, on SmolLM2-135M, in one run.

SmolLM2 does not think, so the run configures `<think>`/`</think>` as markers (several tokens each
in its vocabulary) and ends every prompt with `<think>\\n`: generation starts inside a thinking
section, as under DeepSeek-R1's template. Variants, interleaved within each repeat so a change in the
machine's load hits all of them; figures are medians over `--repeats`, ratios the median of
per-repeat ratios:

- plain: no reasoning fields (the engine path is the one it was before reasoning budgets);
- hook: `max_reasoning_tokens` far above `max_tokens`, so the forced-token hook and its parser run
  on every token but never force (the pure per-token overhead; output must equal plain's);
- budget: a budget of `--budget` tokens, so the end marker is forced mid-answer (output must have
  exactly `--budget` reasoning tokens).

Engine: decode output tokens/s through `LLMEngine` at `--batch` concurrent requests (greedy, EOS
ignored, fixed output length). Server side: microseconds per token to turn output ids into text,
one `OutputText` (plain) against the reasoning parser feeding two (the split of reasoning_content
and content), over the tokens the budget variant produced.

Run:  .venv/bin/python benchmarks/reasoning_budget.py [--repeats 5] [--json out.json]
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
from tokenops.engine.detokenizer import OutputText
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.loader import load_model
from tokenops.engine.reasoning import Phase, ReasoningBudget, ReasoningMarkers, ReasoningParser, ReasoningSpec
from tokenops.engine.sampling_params import SamplingParams

QUESTIONS = [
    "Why is the sky blue?",
    "How do tides work?",
    "What makes bread rise?",
    "Why do leaves change colour in autumn?",
    "How does a refrigerator keep food cold?",
    "Why is the sea salty?",
    "How do birds know where to migrate?",
    "What causes thunder?",
]


def decode_run(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, list[list[int]]]:
    rids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        engine.add_request(rid, p, params)
    out: dict[str, list[int]] = {r: [] for r in rids}
    t_first = None
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        if t_first is None and all(out[r] for r in rids):
            t_first = time.perf_counter()
    t1 = time.perf_counter()
    return sum(len(v) - 1 for v in out.values()) / (t1 - t_first), [out[r] for r in rids]


def text_cost_us(
    tokenizer, prompt: list[int], outputs: list[list[int]], markers: ReasoningMarkers | None
) -> float:
    """Microseconds per token to produce the response text, token by token as the server does."""
    n = 0
    t0 = time.perf_counter()
    for ids in outputs:
        content = OutputText(tokenizer, prompt)
        if markers is None:
            for t in ids:
                content.add([t])
            content.finish()
        else:
            parser = ReasoningParser(markers, Phase.THINKING)
            reasoning = OutputText(tokenizer, prompt)
            for t in ids:
                r, c = parser.split([t])
                reasoning.add(r)
                content.add(c)
            reasoning.finish()
            content.finish()
        n += len(ids)
    return (time.perf_counter() - t0) / n * 1e6


def hook_cost_us(outputs: list[list[int]], spec: ReasoningSpec) -> float:
    """Microseconds per token spent in the engine's forced-token hook (`ReasoningBudget.next_token`)."""
    n = 0
    t0 = time.perf_counter()
    for ids in outputs:
        budget = ReasoningBudget(spec)
        for t in ids:
            budget.next_token(t, None)
        n += len(ids)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    markers = ReasoningMarkers.from_strings(tok, "<think>", "</think>")
    engine = LLMEngine.from_loaded(
        loaded,
        EngineConfig(max_num_seqs=args.batch, max_num_batched_tokens=1024, enable_prefix_caching=False),
    )
    prompts = []
    for i in range(args.batch):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        prompts.append(tok.encode(tok.apply_chat_template(messages) + "<think>\n", add_special_tokens=False))

    def params(budget: int | None) -> SamplingParams:
        spec = None if budget is None else ReasoningSpec(markers, Phase.THINKING, budget)
        return SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, reasoning=spec)

    variants = {"plain": None, "hook": 10 * args.max_tokens, "budget": args.budget}
    decode_run(engine, prompts, params(None))  # warm-up
    tok_s: dict[str, list[float]] = {v: [] for v in variants}
    outputs: dict[str, list[list[int]]] = {}
    load_start = os.getloadavg()
    for _ in range(args.repeats):
        for name, budget in variants.items():
            rate, outs = decode_run(engine, prompts, params(budget))
            tok_s[name].append(rate)
            outputs[name] = outs
    load_end = os.getloadavg()

    counts = []
    for ids in outputs["budget"]:
        p = ReasoningParser(markers, Phase.THINKING)
        p.split(ids)
        counts.append(p.reasoning_tokens)
    text_plain = statistics.median(text_cost_us(tok, prompts[0], outputs["budget"], None) for _ in range(5))
    text_split = statistics.median(
        text_cost_us(tok, prompts[0], outputs["budget"], markers) for _ in range(5)
    )
    hook_us = statistics.median(
        hook_cost_us(outputs["plain"], ReasoningSpec(markers, Phase.THINKING, 10 * args.max_tokens))
        for _ in range(5)
    )
    ratio = {
        name: statistics.median(a / b for a, b in zip(tok_s[name], tok_s["plain"], strict=True))
        for name in variants
    }
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.threads} thread(s)",
        "load_average_start_end": [list(load_start), list(load_end)],
        "model": args.model,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "budget": args.budget,
        "repeats": args.repeats,
        "end_marker_tokens": len(markers.end),
        "decode_tok_s_median": {k: round(statistics.median(v), 2) for k, v in tok_s.items()},
        "decode_ratio_vs_plain": {k: round(v, 3) for k, v in ratio.items()},
        "decode_tok_s_per_repeat": {k: [round(x, 2) for x in v] for k, v in tok_s.items()},
        # the engine step costs batch / tok_s seconds; the hook costs this per token
        "hook_us_per_token": round(hook_us, 2),
        "hook_output_equals_plain": outputs["hook"] == outputs["plain"],
        "budget_reasoning_tokens": counts,
        "text_us_per_token": {"plain": round(text_plain, 2), "split": round(text_split, 2)},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
