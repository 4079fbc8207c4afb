"""Cascades against routers on the profiling suites, with the two bundled models.

Both models answer every suite item once, greedily, with token log-probabilities (through the
official `openai` SDK against two `tokenops engine` processes this script starts, or URLs given).
Strategies are then evaluated on those answers: a greedy answer is the same whether it is asked for
alone or inside a cascade, so one pass prices every threshold. Strategies, cheap model first:

- cascade (log-prob q10 / mean): the cheap model always answers; the answer escalates to the strong
  model when the 10th percentile (or the mean) of its token log-probs is below a threshold, swept
  over every observed value. Cost: the cheap call always, the strong call when escalated; that is
  what `strategy: cascade` with `min_logprob` bills.
- rules router: the default `RuleRouter` scores the request, the top-scored share goes to strong
  (one call per request), as `strategy: route` does.
- random (expectation) and oracle routing.

Reported per strategy: APGR, CPT(50%), CPT(80%), the cost saved at 95% of the strong model's quality
against sending everything to the strong model, and the best quality on its curve (all on the whole
curve, i.e. with the best threshold in hindsight); and `held_out`: the threshold chosen on a seeded
half of the items, then applied to the other half (its quality and the cost it saves there), which
is what an operator who sets `min_logprob` from a profiling run gets. Prices:

- `own`: per parameter count, the bundled pair's prices (SmolLM2-135M 0.135, Gemma 3 270M 0.27 per
  million tokens). The dearer model is the worse one here, so savings are trivially large.
- `ratio`: what-if, the strong model at `--ratio` (10) times the cheap one's price per token, as in a
  usual cheap/strong pair (an 8B and a 70B model); this is the figure that says whether a strategy
  finds the items the cheap model gets wrong.

    PYTHONPATH=src .venv/bin/python benchmarks/cascade_routing.py --per-cell 4 \\
        --out benchmarks/results/cascade_routing.json
    # re-evaluate stored answers without calling the models:
    PYTHONPATH=src .venv/bin/python benchmarks/cascade_routing.py --per-cell 4 \\
        --answers benchmarks/results/cascade_routing.json --out benchmarks/results/cascade_routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tokenops.bench.ports import free_port
from tokenops.fusion.evaluate import (
    Curve,
    apgr,
    cost_saved_at,
    cpt,
    curve_from_scores,
    oracle_curve,
    random_curve,
    split_indices,
)
from tokenops.fusion.profiles import ModelEndpoint, complete
from tokenops.fusion.routers import RuleRouter, features_from_body
from tokenops.fusion.strategies import quantile
from tokenops.fusion.suites import TaskItem, generate_suite

MODELS = {  # name -> (mode, own price per million tokens)
    "smollm2-135m-instruct": ("chat", 0.135),
    "gemma-3-270m": ("completion", 0.27),
}


@dataclass
class Outcome:
    item: str
    category: str
    level: int
    correct: bool
    prompt_tokens: int
    completion_tokens: int
    q10: float  # 10th percentile of the answer's token log-probs (0 when there were none)
    mean_logprob: float
    error: str | None = None


def start_engine(model: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    cmd = [sys.executable, "-c", "from tokenops.cli import app; app()", "engine", "-m", model,
           "--port", str(port), "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"engine {model} exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}"
            )
        try:
            urllib.request.urlopen(url + "/models", timeout=2).read()
            return url, proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"engine {model} did not start within 600 s")


async def answer_all(endpoint: ModelEndpoint, items: list[TaskItem], concurrency: int) -> list[Outcome]:
    client = endpoint.client(1800)
    sem = asyncio.Semaphore(concurrency)

    async def one(item: TaskItem) -> Outcome:
        async with sem:
            try:
                c = await complete(client, endpoint, item.prompt(endpoint.mode), max_tokens=item.max_tokens,
                                   stop=item.stop if endpoint.mode == "completion" else None,
                                   logprobs=True)  # fmt: skip
            except Exception as exc:  # a failed call is a wrong answer, recorded
                return Outcome(
                    item.id, item.category, item.level, False, 0, 0, 0.0, 0.0, f"{type(exc).__name__}: {exc}"
                )
        correct = await asyncio.to_thread(item.is_correct, c.text, endpoint.mode)
        lps = c.token_logprobs
        q10 = quantile(lps, 0.1) if lps else 0.0
        mean = float(np.mean(lps)) if lps else 0.0
        return Outcome(
            item.id, item.category, item.level, correct, c.prompt_tokens, c.completion_tokens, q10, mean
        )

    try:
        return list(await asyncio.gather(*(one(i) for i in items)))
    finally:
        await client.close()


def summarise(curve: Curve, qc: float, qs: float, cost_strong: float) -> dict[str, Any]:
    gap = qs - qc > 1e-12
    saved = cost_saved_at(curve, qs, cost_strong)
    return {
        "apgr": round(apgr(curve, qc, qs), 3) if gap else None,
        "cpt50": cpt(curve, qc, qs, 0.5) if gap else None,
        "cpt80": cpt(curve, qc, qs, 0.8) if gap else None,
        "cost_saved_at_95": round(saved, 3) if saved is not None else None,
        "best_quality": round(float(curve.quality.max()), 3),
    }


def held_out(scores: np.ndarray, q_c: np.ndarray, q_s: np.ndarray, c_c: np.ndarray, c_up: np.ndarray,
             c_s: np.ndarray, seed: int) -> dict[str, Any]:  # fmt: skip
    """A deployable threshold: chosen on one half (the cheapest whose quality reaches 95% of the strong
    model's there), applied to the other half. `c_up` is an item's cost when sent up (a cascade pays
    the cheap call too); the saving is against sending the held-out half to the strong model."""
    train, test = split_indices(len(scores), 0.5, seed)

    def at(idx: np.ndarray, t: float) -> tuple[float, float, float]:
        up = scores[idx] >= t
        quality = float(np.where(up, q_s[idx], q_c[idx]).mean())
        return quality, float(np.where(up, c_up[idx], c_c[idx]).sum()), float(up.mean())

    candidates = [float("inf"), *sorted(set(scores[train].tolist()))]
    target = 0.95 * float(q_s[train].mean())
    fits = [(at(train, t)[1], t) for t in candidates if at(train, t)[0] >= target - 1e-12]
    t = min(fits)[1] if fits else float("-inf")
    quality, cost, share = at(test, t)
    return {
        "threshold": t,
        "test_quality": round(quality, 3),
        "test_quality_strong": round(float(q_s[test].mean()), 3),
        "test_strong_share": round(share, 3),
        "test_cost_saved": round(1 - cost / float(c_s[test].sum()), 3),
    }


def evaluate(cheap: list[Outcome], strong: list[Outcome], items: list[TaskItem], price_cheap: float,
             price_strong: float, seed: int) -> dict[str, Any]:  # fmt: skip
    q_c = np.array([o.correct for o in cheap], dtype=float)
    q_s = np.array([o.correct for o in strong], dtype=float)
    c_c = np.array([(o.prompt_tokens + o.completion_tokens) * price_cheap for o in cheap])
    c_s = np.array([(o.prompt_tokens + o.completion_tokens) * price_strong for o in strong])
    qc, qs, cs = float(q_c.mean()), float(q_s.mean()), float(c_s.sum())
    rules = RuleRouter().score([
        features_from_body("chat", {"messages": [{"role": "user", "content": i.instruction}]})
        for i in items
    ])  # fmt: skip
    # a cascade pays the cheap call on every item: escalating adds the strong call's cost
    scored = {
        "cascade (log-prob q10)": (-np.array([o.q10 for o in cheap]), c_c + c_s),
        "cascade (mean log-prob)": (-np.array([o.mean_logprob for o in cheap]), c_c + c_s),
        "rules router": (rules, c_s),
    }
    curves = {name: curve_from_scores(name, sc, q_c, q_s, c_c, up) for name, (sc, up) in scored.items()}
    curves["random"] = random_curve(q_c, q_s, c_c, c_s)
    curves["oracle"] = oracle_curve(q_c, q_s, c_c, c_s)
    strategies = {name: summarise(c, qc, qs, cs) for name, c in curves.items()}
    for name, (sc, up) in scored.items():
        strategies[name]["held_out"] = held_out(sc, q_c, q_s, c_c, up, c_s, seed)
    return {
        "quality_cheap": round(qc, 3),
        "quality_strong": round(qs, 3),
        "cost_all_cheap": round(float(c_c.sum()), 2),
        "cost_all_strong": round(cs, 2),
        "strategies": strategies,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-cell", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ratio", type=float, default=10.0, help="what-if price ratio strong / cheap")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument(
        "--url", action="append", default=[], help="NAME=URL of a running server (else one is started)"
    )
    ap.add_argument("--answers", help="re-evaluate the answers of an earlier --out file (no model calls)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)

    items = generate_suite(args.seed, per_cell=args.per_cell)
    given = dict(u.split("=", 1) for u in args.url)
    procs: list[subprocess.Popen[bytes]] = []
    answers: dict[str, list[Outcome]] = {}
    started = time.time()
    earlier: dict[str, Any] = {}
    if args.answers:
        with open(args.answers) as f:
            earlier = json.load(f)
        answers = {n: [Outcome(**o) for o in out] for n, out in earlier["per_item"].items()}
        if [o.item for o in next(iter(answers.values()))] != [i.id for i in items]:
            raise SystemExit("--answers holds other items: pass the --seed and --per-cell it was run with")
    try:
        for name, (mode, _) in MODELS.items():
            if name in answers:
                continue
            url = given.get(name)
            if url is None:
                url, proc = start_engine(name)
                procs.append(proc)
            answers[name] = asyncio.run(
                answer_all(ModelEndpoint(name, url, mode=mode), items, args.concurrency)
            )
            for p in procs:  # one engine at a time: the two share the machine's cores
                p.terminate()
                p.wait(timeout=30)
            procs.clear()
    finally:
        for p in procs:
            p.kill()
    quality = {name: float(np.mean([o.correct for o in out])) for name, out in answers.items()}
    worse, better = sorted(MODELS, key=lambda n: quality[n])
    own = {n: p for n, (_, p) in MODELS.items()}
    result = {
        "date": earlier.get("date") or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": earlier.get("machine")
        or f"{platform.machine()}, {os.cpu_count()} cores, load average at start {os.getloadavg()}",
        "items": len(items),
        "seed": args.seed,
        "wall_s": earlier.get("wall_s") or round(time.time() - started, 1),
        "accuracy": {n: round(q, 3) for n, q in quality.items()},
        "errors": {n: sum(o.error is not None for o in out) for n, out in answers.items()},
        # cheap = the worse model, strong = the better one; priced per parameter, then what-if
        "own_prices": evaluate(answers[worse], answers[better], items, own[worse], own[better], args.seed),
        "ratio_prices": evaluate(answers[worse], answers[better], items, 1.0, args.ratio, args.seed),
        "direction": {"cheap": worse, "strong": better, "ratio": args.ratio},
        "per_item": {n: [asdict(o) for o in out] for n, out in answers.items()},
    }
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    summary = {k: v for k, v in result.items() if k != "per_item"}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
