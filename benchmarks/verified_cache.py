"""The semantic cache with and without its verifier: hit rate on paraphrases, false hits on hard
negatives, and what the verifier costs per hit.

The set is the generated one of `benchmarks/cache_vs_gptcache.py` (no public paraphrase set with hard
negatives ships in a PyPI package we could find offline): intent families whose hard negatives differ
from the stored prompt in a number, a negation, a named entity, or a lowercase topic (another intent
in the same words, which no cheap guard sees). Each run stores every family's prompts in one scope,
then asks every query; a hit is correct when the served entry means the same as the query.

The verifier is the bundled SmolLM2-135M-Instruct under `tokenops engine` (started here), asked one
yes/no question per guard-passing candidate (`max_tokens: 1`, top log-probabilities); its cost per
hit is the tokens it read and wrote over the correct hits it let through (tokens, not seconds: this
script measures no time, so it needs no benchmark lock). Thresholds: the default (0.85)
and a looser one (0.75), where the guards alone let more through.

    PYTHONPATH=src .venv/bin/python benchmarks/verified_cache.py --per-family 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from cache_vs_gptcache import _answer, _req, build_set, score  # noqa: E402
from cascade_routing import start_engine  # noqa: E402

from tokenops.cache import CacheConfig, CacheScope, ResponseCache  # noqa: E402
from tokenops.embeddings import shared_embedder  # noqa: E402

SCOPE = CacheScope(tenant="t", model="m")


def _total(counter: Any) -> float:
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


async def run(
    threshold: float, verifier_url: str | None, stored: list[Any], queries: list[Any]
) -> dict[str, Any]:
    verifier = {"base_url": verifier_url, "model": "smollm2-135m-instruct"} if verifier_url else None
    cache = ResponseCache(
        CacheConfig(similarity_threshold=threshold, verifier=verifier), embedder=shared_embedder
    )
    for p in stored:
        await cache.store(SCOPE, _req(p.text), _answer(p.meaning))
    served: list[str | None] = []
    for q in queries:
        hit = await cache.lookup(SCOPE, _req(q.text))
        served.append(hit.body["choices"][0]["message"]["content"] if hit else None)
    out = score(queries, served)
    m = cache.metrics
    correct = sum(c["correct_hits"] for c in out["by_category"].values())
    calls = _total(m.verifier_calls)
    if verifier_url:
        out["verifier"] = {
            "calls": int(calls),
            "tokens": int(_total(m.verifier_tokens)),
            "tokens_per_call": round(_total(m.verifier_tokens) / calls, 1) if calls else None,
            "tokens_per_correct_hit": round(_total(m.verifier_tokens) / correct, 1) if correct else None,
        }
    await cache.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-family", type=int, default=3)
    ap.add_argument(
        "--url", help="a running OpenAI-compatible verifier (else the bundled SmolLM2 is started)"
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    started = time.time()
    stored, queries = build_set(args.seed, args.per_family)
    shared_embedder().embed([p.text for p in stored + queries])  # load once, outside the timings
    proc = None
    url = args.url
    if url is None:
        url, proc = start_engine("smollm2-135m-instruct")
    try:
        runs = {}
        for t in (0.75, 0.85):
            runs[f"guards, threshold {t}"] = asyncio.run(run(t, None, stored, queries))
            runs[f"guards + verifier, threshold {t}"] = asyncio.run(run(t, url, stored, queries))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average at start {os.getloadavg()}",
        "set": f"generated (cache_vs_gptcache.build_set seed {args.seed}, {args.per_family} per family): "
        f"{len(stored)} stored, {len(queries)} queries",
        "verifier": "smollm2-135m-instruct (tokenops engine, Q4_1 GGUF)" if args.url is None else args.url,
        "runs": runs,
        "wall_s": round(time.time() - started, 1),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
