"""Best-of-n against one answer, on the profiling suites, with the bundled SmolLM2-135M-Instruct.

Per item, three answers through the fusion executor (`fusion.sdk_port.run_plan`, the gateway's own
decisions over the official openai SDK) against one `tokenops engine` started here:

- greedy: one greedy answer (what a plain request gets);
- first sample: the first of the n samples (what one sampled request gets);
- best-of-n (mean log-prob): one call with `n` samples at `--temperature`, the sample with the
  highest mean token log-probability kept (`aggregate: best_of_n`, `scorer: logprob`).

Reported: accuracy of each (the suite's checkers), the oracle (any of the n samples right), tokens
billed per item (best-of-n bills every sample: the prompt once, all samples' completions), and the
engine's prefix-cache hit share during the best-of-n calls (its n choices share one prefill). The
same n samples are asked for again (same seed) to see the ones best-of-n did not return.

An item whose call fails (a timeout on a starved machine) is counted under `failed` and left out;
each item's row is printed to stderr as it completes.

    PYTHONPATH=src .venv/bin/python benchmarks/best_of_n.py --per-cell 2 --n 4 \
        --categories knowledge,arithmetic,extraction,format
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from cascade_routing import start_engine  # noqa: E402

from tokenops.fusion.executor import choice_text  # noqa: E402
from tokenops.fusion.plan import Plan  # noqa: E402
from tokenops.fusion.profiles import ModelEndpoint  # noqa: E402
from tokenops.fusion.sdk_port import run_plan  # noqa: E402
from tokenops.fusion.strategies import EnsemblePolicy  # noqa: E402
from tokenops.fusion.suites import CATEGORIES, check_output, generate_suite  # noqa: E402
from tokenops.protocol import APIError  # noqa: E402

MODEL = "smollm2-135m-instruct"


def prefix_stats(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    got = {"queries": 0.0, "hits": 0.0}
    for line in text.splitlines():
        for key in got:
            if line.startswith(f"tokenops_engine_prefix_cache_{key}_total"):
                got[key] = float(line.split()[-1])
    return got["queries"], got["hits"]


async def evaluate(
    url: str, per_cell: int, n: int, temperature: float, seed: int, categories: list[str]
) -> dict[str, Any]:
    items = generate_suite(seed, per_cell=per_cell, categories=categories)
    eps = {MODEL: ModelEndpoint(MODEL, url)}
    policy = EnsemblePolicy((MODEL,), "best_of_n", samples=n, temperature=temperature)
    plan = Plan((MODEL,), "bench", "ensemble", route="bench")
    rows = []
    failed: list[str] = []
    queried = hit = 0.0
    for item in items:
        try:
            greedy = await run_plan(
                Plan((MODEL,), "direct"), None, eps, item.instruction, max_tokens=item.max_tokens
            )
            q0, h0 = prefix_stats(url)
            best = await run_plan(plan, policy, eps, item.instruction, max_tokens=item.max_tokens)
        except APIError as exc:  # a call past its timeout on a starved machine: counted, not fatal
            failed.append(f"{item.id}: {exc}")
            print(f"{item.id}: failed ({exc})", file=sys.stderr, flush=True)
            continue
        q1, h1 = prefix_stats(url)
        queried, hit = queried + q1 - q0, hit + h1 - h0
        # the unpicked samples are not returned: ask for the same n again to see them all
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=url, api_key="none")
        every = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": item.instruction}], n=n,
            temperature=temperature, seed=1, max_tokens=item.max_tokens,
        )  # fmt: skip
        await client.close()
        samples = [choice_text(c.model_dump()) for c in every.choices]
        usage = best.answer.usage or {}
        plain = greedy.answer.usage or {}
        rows.append({
            "greedy": check_output(item, greedy.text),
            "first_sample": check_output(item, samples[0]),
            "best_of_n": check_output(item, best.text),
            "any_sample": any(check_output(item, s) for s in samples),
            "greedy_tokens": plain.get("prompt_tokens", 0) + plain.get("completion_tokens", 0),
            "best_tokens": usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0),
        })  # fmt: skip
        print(f"{item.id}: {rows[-1]}", file=sys.stderr, flush=True)

    def mean(key: str) -> float:
        return round(sum(float(r[key]) for r in rows) / len(rows), 3)

    if not rows:
        raise SystemExit(f"every item failed: {failed}")
    return {
        "items": len(rows),
        "failed": failed,
        "accuracy": {k: mean(k) for k in ("greedy", "first_sample", "best_of_n", "any_sample")},
        "tokens_per_item": {"greedy": mean("greedy_tokens"), "best_of_n": mean("best_tokens")},
        # of the prompt tokens best-of-n's calls looked up: the n - 1 siblings reuse the first's blocks
        "best_of_n_prefix_cache_hit_share": round(hit / queried, 3) if queried else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-cell", type=int, default=2)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--categories", default=",".join(CATEGORIES), help="comma-separated suite categories")
    ap.add_argument("--url")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    started = time.time()
    proc = None
    url = args.url
    if url is None:
        url, proc = start_engine(MODEL)
    try:
        result = asyncio.run(
            evaluate(url, args.per_cell, args.n, args.temperature, args.seed, args.categories.split(","))
        )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average at start {os.getloadavg()}",
        "model": MODEL,
        "n": args.n,
        "temperature": args.temperature,
        "categories": args.categories.split(","),
        **result,
        "wall_s": round(time.time() - started, 1),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
