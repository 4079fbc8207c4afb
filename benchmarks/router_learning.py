"""Routers judged on held-out items over several seeded splits, and a router retrained on cascade
outcomes against the one it replaces.

Data: the per-item correctness of two real models on our profiling suites (seed 0, 4 items per
category x level cell, 72 items), stored by `benchmarks/cascade_routing.py` in
benchmarks/results/cascade_routing.json: Gemma 3 270M (the worse, here "cheap") and SmolLM2-135M
(the better, "strong"), priced 1 : `--ratio` per token. No public per-question evaluation logs ship
in a PyPI package we could find offline, so our suites are the labelled set.

For each split (half the items are traffic, half held out), routers score the held-out half:

- rules: the default rule router, no training;
- knn / learned (profiles): trained on the traffic half's true labels (cheap right, or strong wrong);
- knn / learned (outcomes): trained on what a cascade on the traffic half would have stored: the
  cheap tier's answer accepted when the 10th percentile of its token log-probs is at least the
  traffic half's median (an operator's `min_logprob`), escalated otherwise -- noisy labels, what
  `learn:` records and `tokenops eval retrain` trains on;
- random (expectation) and oracle.

Reported per router: APGR, CPT(50%), CPT(80%) as mean and standard deviation over the splits, and
the quality at a 30% strong share. Every text is embedded once (one `MemoEmbed`).

    PYTHONPATH=src .venv/bin/python benchmarks/router_learning.py --splits 10
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from tokenops.fusion.evaluate import ModelOutcomes, evaluate_routers, split_indices
from tokenops.fusion.routers import (
    KnnRouter,
    LabelledExample,
    LogisticRouter,
    MemoEmbed,
    RuleRouter,
    default_embed,
    scores_for,
)
from tokenops.fusion.suites import generate_suite

RESULTS = Path(__file__).parent / "results" / "cascade_routing.json"


def at_share(curve: Any, share: float) -> float:
    return float(np.interp(share, curve.share, curve.quality))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--splits", type=int, default=10)
    ap.add_argument("--ratio", type=float, default=10.0, help="strong / cheap price per token")
    ap.add_argument("--answers", default=str(RESULTS))
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    started = time.time()
    data = json.loads(Path(args.answers).read_text())
    cheap_name, strong_name = data["direction"]["cheap"], data["direction"]["strong"]
    items = generate_suite(data["seed"], per_cell=4)
    cheap = data["per_item"][cheap_name]
    strong = data["per_item"][strong_name]
    assert [o["item"] for o in cheap] == [i.id for i in items], "the stored answers are of other items"
    texts = [i.instruction for i in items]
    q_c = np.array([o["correct"] for o in cheap], dtype=float)
    q_s = np.array([o["correct"] for o in strong], dtype=float)
    c_c = np.array([o["prompt_tokens"] + o["completion_tokens"] for o in cheap], dtype=float)
    c_s = np.array([o["prompt_tokens"] + o["completion_tokens"] for o in strong], dtype=float) * args.ratio
    q10 = np.array([o["q10"] for o in cheap], dtype=float)
    truth = [bool(c or not s) for c, s in zip(q_c, q_s, strict=True)]
    embed = MemoEmbed(default_embed())
    embed.prime(texts)

    per_router: dict[str, dict[str, list[float | None]]] = {}
    for seed in range(args.splits):
        train, test = split_indices(len(items), 0.5, seed)
        min_logprob = float(np.median(q10[train]))
        true_labels = [LabelledExample(texts[i], truth[i]) for i in train]
        outcome_labels = [LabelledExample(texts[i], bool(q10[i] >= min_logprob)) for i in train]
        test_texts = [texts[i] for i in test]
        scores = {"rules": scores_for(RuleRouter(), test_texts)}
        for source, labels in (("profiles", true_labels), ("outcomes", outcome_labels)):
            scores[f"knn ({source})"] = scores_for(KnnRouter.fit(labels, embed=embed), test_texts)
            scores[f"learned ({source})"] = scores_for(LogisticRouter.fit(labels, embed=embed), test_texts)
        ev = evaluate_routers(
            scores,
            cheap=ModelOutcomes(cheap_name, q_c[test], c_c[test]),
            strong=ModelOutcomes(strong_name, q_s[test], c_s[test]),
        )
        curves = {c.name: c for c in ev.curves}
        for s in ev.summaries:
            row = per_router.setdefault(s.name, {"apgr": [], "cpt50": [], "cpt80": [], "q_at_30": []})
            row["apgr"].append(s.apgr)
            row["cpt50"].append(s.cpt50)
            row["cpt80"].append(s.cpt80)
            row["q_at_30"].append(at_share(curves[s.name], 0.3))

    def spread(values: list[float | None]) -> dict[str, Any]:
        got = np.array([v for v in values if v is not None], dtype=float)
        if not len(got):
            return {"mean": None, "std": None, "defined": 0}
        return {"mean": round(float(got.mean()), 3), "std": round(float(got.std()), 3), "defined": len(got)}

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average at start {os.getloadavg()}",
        "data": f"{args.answers} ({len(items)} items, cheap {cheap_name} q={q_c.mean():.3f}, "
        f"strong {strong_name} q={q_s.mean():.3f}, price ratio {args.ratio:g})",
        "splits": args.splits,
        "held_out_per_split": len(items) - len(split_indices(len(items), 0.5, 0)[0]),
        "texts_embedded": embed.embedded,
        "routers": {name: {k: spread(v) for k, v in row.items()} for name, row in per_router.items()},
        "wall_s": round(time.time() - started, 1),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
