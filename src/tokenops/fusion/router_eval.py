"""From stored profiles to a router evaluation: align two models' outcomes item by item, split them,
train the kNN and learned routers on the training half, score the held-out half with every router.

This module owns only that glue (what `tokenops eval routers` runs); the curve arithmetic lives in
evaluate.py, the routers in routers.py, the storage in profiles.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tokenops.fusion.evaluate import Evaluation, evaluate_routers, split_indices
from tokenops.fusion.profiles import ItemResult, ProfileStore
from tokenops.fusion.routers import (
    EmbedFn,
    KnnRouter,
    LabelledExample,
    LogisticRouter,
    RuleRouter,
    labels_from_profiles,
    load_jsonl,
    scores_for,
)


def item_costs(results: list[ItemResult], weight: float) -> np.ndarray:
    """Recorded cost per item, or tokens x `weight` when the run recorded no prices."""
    costs = np.array([r.cost for r in results], dtype=np.float64)
    if costs.sum() > 0:
        return costs
    return np.array([(r.prompt_tokens + r.completion_tokens) * weight for r in results], dtype=np.float64)


def evaluate_outcomes(
    cheap: list[ItemResult],
    strong: list[ItemResult],
    *,
    held_out: float = 0.5,
    seed: int = 0,
    price_ratio: float = 10.0,
    extra_labels: list[LabelledExample] | None = None,
    embed: EmbedFn | None = None,
) -> Evaluation:
    by_id = {r.item_id: r for r in strong}
    pairs = [(c, by_id[c.item_id]) for c in cheap if c.item_id in by_id]
    if len(pairs) < 4:
        raise ValueError(
            f"only {len(pairs)} items were answered by both models; profile both on the same suite and seed"
        )
    cheap_r = [p[0] for p in pairs]
    strong_r = [p[1] for p in pairs]
    train, test = split_indices(len(pairs), held_out, seed)
    train_labels = labels_from_profiles([cheap_r[i] for i in train], [strong_r[i] for i in train])
    train_labels += extra_labels or []
    test_texts = [cheap_r[i].prompt for i in test]
    scores = {"rules": scores_for(RuleRouter(), test_texts)}
    if train_labels:
        scores["knn"] = scores_for(KnnRouter(train_labels, embed=embed), test_texts)
        scores["learned"] = scores_for(LogisticRouter.fit(train_labels, embed=embed), test_texts)
    q_c = np.array([cheap_r[i].correct for i in test], dtype=np.float64)
    q_s = np.array([strong_r[i].correct for i in test], dtype=np.float64)
    c_c = item_costs([cheap_r[i] for i in test], 1.0)
    c_s = item_costs([strong_r[i] for i in test], price_ratio)
    return evaluate_routers(scores, q_c, q_s, c_c, c_s)


def evaluate_profiles(
    db_url: str,
    cheap: str,
    strong: str,
    *,
    held_out: float = 0.5,
    seed: int = 0,
    price_ratio: float = 10.0,
    labels: str | Path | None = None,
    embed: EmbedFn | None = None,
) -> Evaluation:
    store = ProfileStore(db_url)
    try:
        cheap_r, strong_r = store.results(cheap), store.results(strong)
    finally:
        store.close()
    for name, rs in ((cheap, cheap_r), (strong, strong_r)):
        if not rs:
            raise ValueError(f"no stored profile for {name!r}: run `tokenops eval run` first")
    extra = load_jsonl(labels) if labels else None
    return evaluate_outcomes(
        cheap_r,
        strong_r,
        held_out=held_out,
        seed=seed,
        price_ratio=price_ratio,
        extra_labels=extra,
        embed=embed,
    )


def profile_labels(db_url: str, cheap: str, strong: str) -> list[LabelledExample]:
    """Labels for every item both models answered in their latest runs."""
    store = ProfileStore(db_url)
    try:
        return labels_from_profiles(store.results(cheap), store.results(strong))
    finally:
        store.close()


def export_labels(examples: list[LabelledExample], path: str | Path) -> Path:
    """Write labels as the JSONL that `load_jsonl` and `make_router(..., labels=)` read."""
    import json

    path = Path(path)
    path.write_text("".join(json.dumps({"prompt": e.text, "cheap_ok": e.cheap_ok}) + "\n" for e in examples))
    return path
