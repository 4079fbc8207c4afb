"""From stored profiles to a router evaluation: align two models' outcomes item by item, split them,
train the kNN and learned routers on the training half, score the held-out half with every router;
repeated over several seeded splits, the spread of each metric (`evaluate_splits`). Every text is
embedded once per evaluation (one `MemoEmbed` shared by the routers and the splits).

This module owns only that glue (what `tokenops eval routers` runs); the curve arithmetic lives in
evaluate.py, the routers in routers.py, the storage in profiles.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenops.fusion.evaluate import (
    Evaluation,
    ModelOutcomes,
    QualityGapError,
    evaluate_routers,
    split_indices,
)
from tokenops.fusion.profiles import ItemResult, ProfileStore
from tokenops.fusion.routers import (
    EmbedFn,
    KnnRouter,
    LabelledExample,
    LogisticRouter,
    MemoEmbed,
    RuleRouter,
    default_embed,
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


def _aligned(cheap: list[ItemResult], strong: list[ItemResult]) -> tuple[list[ItemResult], list[ItemResult]]:
    by_id = {r.item_id: r for r in strong}
    pairs = [(c, by_id[c.item_id]) for c in cheap if c.item_id in by_id]
    if len(pairs) < 4:
        raise ValueError(
            f"only {len(pairs)} items were answered by both models; profile both on the same suite and seed"
        )
    return [p[0] for p in pairs], [p[1] for p in pairs]


def evaluate_outcomes(
    *,
    cheap: list[ItemResult],
    strong: list[ItemResult],
    cheap_name: str = "cheap",
    strong_name: str = "strong",
    held_out: float = 0.5,
    seed: int = 0,
    price_ratio: float = 10.0,
    extra_labels: list[LabelledExample] | None = None,
    embed: EmbedFn | None = None,
) -> Evaluation:
    """One seeded split: routers trained on one part, every curve on the held-out part. The two
    models are named by role (keyword-only), never by position."""
    cheap_r, strong_r = _aligned(cheap, strong)
    memo = embed if isinstance(embed, MemoEmbed) else MemoEmbed(embed or default_embed())
    train, test = split_indices(len(cheap_r), held_out, seed)
    train_labels = labels_from_profiles([cheap_r[i] for i in train], [strong_r[i] for i in train])
    train_labels += extra_labels or []
    test_texts = [cheap_r[i].prompt for i in test]
    memo.prime([e.text for e in train_labels] + test_texts)
    scores = {"rules": scores_for(RuleRouter(), test_texts)}
    if train_labels:
        scores["knn"] = scores_for(KnnRouter.fit(train_labels, embed=memo), test_texts)
        scores["learned"] = scores_for(LogisticRouter.fit(train_labels, embed=memo), test_texts)
    return evaluate_routers(
        scores,
        cheap=ModelOutcomes(
            cheap_name,
            np.array([cheap_r[i].correct for i in test], dtype=np.float64),
            item_costs([cheap_r[i] for i in test], 1.0),
        ),
        strong=ModelOutcomes(
            strong_name,
            np.array([strong_r[i].correct for i in test], dtype=np.float64),
            item_costs([strong_r[i] for i in test], price_ratio),
        ),
    )


@dataclass(frozen=True, slots=True)
class Spread:
    """One metric of one router over several splits: mean, standard deviation, and how many splits
    defined it (CPT is undefined on a split whose curve never recovers the share)."""

    mean: float | None
    std: float | None
    defined: int

    @classmethod
    def of(cls, values: list[float | None]) -> Spread:
        got = np.array([v for v in values if v is not None], dtype=np.float64)
        if not len(got):
            return cls(None, None, 0)
        return cls(float(got.mean()), float(got.std()), len(got))


@dataclass(slots=True)
class SplitSpread:
    """APGR, CPT(50%) and CPT(80%) per router (random and oracle included) over several splits.
    `reversed_seeds` are the splits left out because the strong model was worse on their held-out
    part (possible with few items even when it is better overall)."""

    seeds: list[int]
    apgr: dict[str, Spread]
    cpt50: dict[str, Spread]
    cpt80: dict[str, Spread]
    evaluations: list[Evaluation]
    reversed_seeds: list[int]


def evaluate_splits(
    *,
    cheap: list[ItemResult],
    strong: list[ItemResult],
    seeds: list[int] | range = range(5),
    embed: EmbedFn | None = None,
    cheap_name: str = "cheap",
    strong_name: str = "strong",
    **kw: object,
) -> SplitSpread:
    """`evaluate_outcomes` on each seed's split, every text embedded once across all of them.

    Raises `QualityGapError` when the strong model is worse than the cheap one over all the items
    answered by both; a split whose held-out part alone reverses the two is left out and named in
    `reversed_seeds` (a `ValueError` if every split is)."""
    cheap_r, strong_r = _aligned(cheap, strong)
    q_cheap = float(np.mean([r.correct for r in cheap_r]))
    q_strong = float(np.mean([r.correct for r in strong_r]))
    if q_strong < q_cheap - 1e-12:
        raise QualityGapError(
            f"the strong model {strong_name!r} (quality {q_strong:.3f}) is worse than the cheap model "
            f"{cheap_name!r} (quality {q_cheap:.3f}) on the {len(cheap_r)} items both answered: swap them"
        )
    memo = embed if isinstance(embed, MemoEmbed) else MemoEmbed(embed or default_embed())
    evs: list[Evaluation] = []
    reversed_seeds: list[int] = []
    for s in seeds:
        try:
            evs.append(
                evaluate_outcomes(
                    cheap=cheap_r, strong=strong_r, cheap_name=cheap_name, strong_name=strong_name,
                    seed=s, embed=memo, **kw,  # type: ignore[arg-type]
                )
            )  # fmt: skip
        except QualityGapError:
            reversed_seeds.append(s)
    if not evs:
        raise ValueError(
            f"the strong model {strong_name!r} is worse than {cheap_name!r} on the held-out part of every "
            f"split ({len(reversed_seeds)}): evaluate on more items"
        )
    names = [s.name for s in evs[0].summaries]

    def spread(attr: str) -> dict[str, Spread]:
        return {
            n: Spread.of([next(getattr(s, attr) for s in ev.summaries if s.name == n) for ev in evs])
            for n in names
        }

    return SplitSpread(
        [s for s in seeds if s not in reversed_seeds],
        spread("apgr"),
        spread("cpt50"),
        spread("cpt80"),
        evs,
        reversed_seeds,
    )


def stored_results(db_url: str, cheap: str, strong: str) -> tuple[list[ItemResult], list[ItemResult]]:
    """The latest stored profile run of each model, item by item."""
    store = ProfileStore(db_url)
    try:
        cheap_r, strong_r = store.results(cheap), store.results(strong)
    finally:
        store.close()
    for name, rs in ((cheap, cheap_r), (strong, strong_r)):
        if not rs:
            raise ValueError(f"no stored profile for {name!r}: run `tokenops eval run` first")
    return cheap_r, strong_r


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
    cheap_r, strong_r = stored_results(db_url, cheap, strong)
    return evaluate_outcomes(
        cheap=cheap_r,
        strong=strong_r,
        cheap_name=cheap,
        strong_name=strong,
        held_out=held_out,
        seed=seed,
        price_ratio=price_ratio,
        extra_labels=load_jsonl(labels) if labels else None,
        embed=embed,
    )


def evaluate_profile_splits(
    db_url: str,
    cheap: str,
    strong: str,
    *,
    splits: int,
    held_out: float = 0.5,
    price_ratio: float = 10.0,
    labels: str | Path | None = None,
    embed: EmbedFn | None = None,
) -> SplitSpread:
    """`evaluate_splits` on the stored profiles, over the splits of seeds 0 .. splits - 1."""
    cheap_r, strong_r = stored_results(db_url, cheap, strong)
    return evaluate_splits(
        cheap=cheap_r,
        strong=strong_r,
        seeds=range(splits),
        embed=embed,
        cheap_name=cheap,
        strong_name=strong,
        held_out=held_out,
        price_ratio=price_ratio,
        extra_labels=load_jsonl(labels) if labels else None,
    )


def profile_labels(db_url: str, cheap: str, strong: str) -> list[LabelledExample]:
    """Labels for every item both models answered in their latest runs."""
    return labels_from_profiles(*stored_results(db_url, cheap, strong))


def export_labels(examples: list[LabelledExample], path: str | Path) -> Path:
    """Write labels as the JSONL that `load_jsonl` and `make_router(..., labels=)` read."""
    import json

    path = Path(path)
    path.write_text("".join(json.dumps({"prompt": e.text, "cheap_ok": e.cheap_ok}) + "\n" for e in examples))
    return path
