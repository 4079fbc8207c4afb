"""Routers judged on held-out items over several seeded splits, trained on true labels and on what
cascades would have recorded, with the reasons a router retrained on cascade outcomes does or does
not beat the rule router: how noisy the outcome labels are, how many it needs, and whether its
strong-share threshold holds on new traffic.

Data: the per-item correctness and token log-probs of two real models on our profiling suites,
stored by `benchmarks/cascade_routing.py` (one or more `--answers` files, each one suite seed; the
default is benchmarks/results/cascade_routing.json): Gemma 3 270M (the worse, here "cheap") and
SmolLM2-135M (the better, "strong"), priced 1 : `--ratio` per token. No public per-question
evaluation logs ship in a PyPI package we could find offline, so our suites are the labelled set.

Each split puts half the distinct questions in the traffic part and half in the held-out part (a
question asked twice never sits on both sides). Routers score the held-out part:

- rules: the default rule router, no training;
- knn / learned / learned+rules (profiles): trained on the traffic part's true labels (cheap right,
  or strong wrong); "learned" on the text features alone, "learned+rules" with the rule router's
  score as one more feature (`LogisticRouter.fit`'s default, what `tokenops eval retrain` fits);
- the same three (outcomes): trained on what a cascade on the traffic part would have stored: the
  cheap tier's answer accepted when the 10th percentile of its token log-probs is at least the
  traffic part's median (an operator's `min_logprob`), escalated otherwise -- what `learn:` records
  and `tokenops eval retrain` trains on;
- random (expectation) and oracle.

Reported per router: APGR, CPT(50%), CPT(80%) as mean and standard deviation over the splits, and
the quality at a 30% strong share, and each trained router's APGR minus the rule router's on the
same split. Then the diagnosis, averaged over the splits:

- `outcome_labels`: how the recorded verdicts compare with the truth on the traffic part (an
  escalation of an item the strong model also gets wrong teaches the router to escalate in vain);
- `learning_curve`: APGR of the learned routers trained on the first n traffic items (seeded order)
  for growing n;
- `threshold`: the learned+rules (outcomes) router's threshold set to the (1 - 30%) quantile of its
  traffic scores, as `tokenops eval retrain --target-strong-share 0.3` sets it: the strong share and
  quality it gives on the held-out part, beside the rule router at the same share.

Every text is embedded once (one `MemoEmbed`).

    PYTHONPATH=src .venv/bin/python benchmarks/router_learning.py --splits 10 \\
        --answers benchmarks/results/cascade_routing.json \\
        --answers benchmarks/results/cascade_routing_seed1.json
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
from tokenops.fusion.suites import CATEGORIES, LEVELS, generate_suite

RESULTS = Path(__file__).parent / "results" / "cascade_routing.json"
TARGET_SHARE = 0.3


def at_share(curve: Any, share: float) -> float:
    return float(np.interp(share, curve.share, curve.quality))


def load(paths: list[str]) -> dict[str, Any]:
    """The items of every answers file, cheap and strong named by the first file's direction."""
    texts: list[str] = []
    cheap: list[dict[str, Any]] = []
    strong: list[dict[str, Any]] = []
    names: tuple[str, str] | None = None
    for path in paths:
        data = json.loads(Path(path).read_text())
        per_cell = data.get("per_cell") or data["items"] // (len(CATEGORIES) * len(LEVELS))
        items = generate_suite(data["seed"], per_cell=per_cell)
        pair = (data["direction"]["cheap"], data["direction"]["strong"])
        names = names or pair
        c, s = data["per_item"][names[0]], data["per_item"][names[1]]
        if [o["item"] for o in c] != [i.id for i in items]:
            raise SystemExit(f"{path}: the stored answers are of other items")
        texts += [i.instruction for i in items]
        cheap += c
        strong += s
    assert names is not None
    return {"names": names, "texts": texts, "cheap": cheap, "strong": strong}


def paired(per_router: dict[str, dict[str, list[float | None]]]) -> dict[str, np.ndarray]:
    """Each trained router's APGR minus the rule router's on the same split (splits where both are
    defined): the splits are shared, so the difference varies far less than either APGR."""
    rules = per_router["rules"]["apgr"]
    out = {}
    for name, row in per_router.items():
        if name in ("rules", "random", "oracle"):
            continue
        both = [(a, r) for a, r in zip(row["apgr"], rules, strict=True) if a is not None and r is not None]
        out[name] = np.array([a - r for a, r in both])
    return out


def question_split(texts: list[str], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Half the distinct questions for traffic, half held out; every copy of a question on one side."""
    distinct = list(dict.fromkeys(texts))
    train_q, _ = split_indices(len(distinct), 0.5, seed)
    traffic = {distinct[i] for i in train_q}
    side = np.array([t in traffic for t in texts])
    return np.flatnonzero(side), np.flatnonzero(~side)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--splits", type=int, default=10)
    ap.add_argument("--ratio", type=float, default=10.0, help="strong / cheap price per token")
    ap.add_argument("--answers", action="append", help="cascade_routing.py --out file(s)")
    ap.add_argument("--sizes", default="12,24,36,48,72,96", help="training items for the learning curve")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    started = time.time()
    data = load(args.answers or [str(RESULTS)])
    cheap_name, strong_name = data["names"]
    texts, cheap, strong = data["texts"], data["cheap"], data["strong"]
    q_c = np.array([o["correct"] for o in cheap], dtype=float)
    q_s = np.array([o["correct"] for o in strong], dtype=float)
    c_c = np.array([o["prompt_tokens"] + o["completion_tokens"] for o in cheap], dtype=float)
    c_s = np.array([o["prompt_tokens"] + o["completion_tokens"] for o in strong], dtype=float) * args.ratio
    q10 = np.array([o["q10"] for o in cheap], dtype=float)
    truth = np.array([bool(c or not s) for c, s in zip(q_c, q_s, strict=True)])  # cheap good enough
    embed = MemoEmbed(default_embed())
    embed.prime(texts)
    rules_all = scores_for(RuleRouter(), texts)

    per_router: dict[str, dict[str, list[float | None]]] = {}
    noise: dict[str, list[float]] = {}
    curve_points: dict[str, dict[int, list[float]]] = {}
    threshold_rows: dict[str, list[float]] = {}
    sizes = [int(s) for s in args.sizes.split(",")]
    for seed in range(args.splits):
        train, test = question_split(texts, seed)
        min_logprob = float(np.median(q10[train]))
        accepted = q10 >= min_logprob  # what the cascade would have recorded, traffic part only used
        true_labels = [LabelledExample(texts[i], bool(truth[i])) for i in train]
        outcome_labels = [LabelledExample(texts[i], bool(accepted[i])) for i in train]
        test_texts = [texts[i] for i in test]
        cheap_out = ModelOutcomes(cheap_name, q_c[test], c_c[test])
        strong_out = ModelOutcomes(strong_name, q_s[test], c_s[test])
        scores = {"rules": rules_all[test]}
        for source, labels in (("profiles", true_labels), ("outcomes", outcome_labels)):
            scores[f"knn ({source})"] = scores_for(KnnRouter.fit(labels, embed=embed), test_texts)
            scores[f"learned ({source})"] = scores_for(
                LogisticRouter.fit(labels, embed=embed, rules_prior=False), test_texts
            )
            scores[f"learned+rules ({source})"] = scores_for(
                LogisticRouter.fit(labels, embed=embed), test_texts
            )
        ev = evaluate_routers(scores, cheap=cheap_out, strong=strong_out)
        curves = {c.name: c for c in ev.curves}
        for s in ev.summaries:
            row = per_router.setdefault(s.name, {"apgr": [], "cpt50": [], "cpt80": [], "q_at_30": []})
            row["apgr"].append(s.apgr)
            row["cpt50"].append(s.cpt50)
            row["cpt80"].append(s.cpt80)
            row["q_at_30"].append(at_share(curves[s.name], TARGET_SHARE))

        # how the recorded verdicts compare with the truth on the traffic part
        esc = ~accepted[train]
        helped = (q_c[train] == 0) & (q_s[train] == 1)
        for key, value in (
            ("escalated_share", esc.mean()),
            ("escalations_the_strong_model_also_got_wrong", (esc & (q_s[train] == 0)).sum() / esc.sum()),
            ("escalations_of_a_right_cheap_answer", (esc & (q_c[train] == 1)).sum() / esc.sum()),
            ("escalations_that_helped", (esc & helped).sum() / esc.sum()),
            ("items_that_needed_the_strong_model", helped.mean()),
            ("of_those_escalated", (esc & helped).sum() / max(helped.sum(), 1)),
            ("labels_agreeing_with_the_truth", (accepted[train] == truth[train]).mean()),
        ):
            noise.setdefault(key, []).append(float(value))

        # learning curve: the first n traffic items, in a seeded order
        order = np.random.default_rng(1000 + seed).permutation(len(train))
        for n in sizes:
            if n > len(train):
                continue
            pick = order[:n]
            for source, labels in (("profiles", true_labels), ("outcomes", outcome_labels)):
                subset = [labels[j] for j in pick]
                if len({e.cheap_ok for e in subset}) < 2:
                    continue
                for kind, prior in (("learned", False), ("learned+rules", True)):
                    router = LogisticRouter.fit(subset, embed=embed, rules_prior=prior)
                    sc = {kind: scores_for(router, test_texts)}
                    got = evaluate_routers(sc, cheap=cheap_out, strong=strong_out).summaries[0].apgr
                    if got is not None:
                        curve_points.setdefault(f"{kind} ({source})", {}).setdefault(n, []).append(got)

        # the retrained router's threshold, set on the traffic part, applied to the held-out part
        router = LogisticRouter.fit(outcome_labels, embed=embed)
        threshold = float(np.quantile(scores_for(router, [texts[i] for i in train]), 1 - TARGET_SHARE))
        up = scores["learned+rules (outcomes)"] >= threshold
        share = float(up.mean())
        threshold_rows.setdefault("held_out_strong_share", []).append(share)
        threshold_rows.setdefault("held_out_quality", []).append(
            float(np.where(up, q_s[test], q_c[test]).mean())
        )
        threshold_rows.setdefault("rules_quality_at_that_share", []).append(at_share(curves["rules"], share))

    def spread(values: list[float | None]) -> dict[str, Any]:
        got = np.array([v for v in values if v is not None], dtype=float)
        if not len(got):
            return {"mean": None, "std": None, "defined": 0}
        return {"mean": round(float(got.mean()), 3), "std": round(float(got.std()), 3), "defined": len(got)}

    train0, test0 = question_split(texts, 0)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average at start {os.getloadavg()}",
        "data": f"{', '.join(args.answers or [str(RESULTS)])} ({len(texts)} items, "
        f"{len(set(texts))} distinct questions; cheap {cheap_name} q={q_c.mean():.3f}, "
        f"strong {strong_name} q={q_s.mean():.3f}, "
        f"price ratio {args.ratio:g})",
        "splits": args.splits,
        "items_per_split": {"traffic": len(train0), "held_out": len(test0)},
        "texts_embedded": embed.embedded,
        "routers": {name: {k: spread(v) for k, v in row.items()} for name, row in per_router.items()},
        "apgr_minus_rules_per_split": {
            name: {**spread(list(d)), "splits_above_rules": int((d > 0).sum())}
            for name, d in paired(per_router).items()
        },
        "outcome_labels": {k: spread(v) for k, v in noise.items()},
        "learning_curve": {
            name: {str(n): spread(v) for n, v in sorted(points.items())}
            for name, points in curve_points.items()
        },
        "threshold": {
            "target_strong_share": TARGET_SHARE,
            **{k: spread(v) for k, v in threshold_rows.items()},
        },
        "wall_s": round(time.time() - started, 1),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
