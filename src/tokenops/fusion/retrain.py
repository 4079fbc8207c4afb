"""Retraining a route's router from its own traffic: stored cascade outcomes (and, optionally, the
stored profiles of its two models) in, a learned router with a recalibrated strong-share threshold
out.

This module owns `retrain`: the latest outcomes of a route are split (seeded), a `LogisticRouter` is
fitted on the training part plus any profile labels, the held-out part measures how well it and the
router it replaces predict an escalation (log loss, AUC), and the threshold is set to the
(1 - target strong share) quantile of its scores over all the outcomes, which is what the gateway's
calibrator starts from. `tokenops eval retrain` runs it and saves the router where the route's
`router_model` points; a scheduler (cron, a Kubernetes CronJob) runs that command to retrain on a
schedule. It does not record outcomes (outcomes.py) or serve (the gateway loads the file).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenops.fusion.evaluate import split_indices
from tokenops.fusion.outcomes import CascadeOutcome, examples
from tokenops.fusion.routers import (
    EmbedFn,
    LabelledExample,
    LogisticRouter,
    MemoEmbed,
    Router,
    default_embed,
    scores_for,
)


@dataclass(frozen=True, slots=True)
class Fit:
    """How well a router's scores predict an escalation on held-out outcomes."""

    log_loss: float | None  # None for a router whose scores are ranks only
    auc: float | None  # None when the held-out part has one class only


@dataclass(slots=True)
class Retrained:
    router: LogisticRouter
    threshold: float  # the (1 - target share) quantile of its scores over the outcomes
    target_strong_share: float
    trained_on: int
    held_out: int
    new: Fit
    old: Fit | None


def auc(scores: np.ndarray, positive: np.ndarray) -> float | None:
    """P(a random positive scores above a random negative), ties counted half."""
    pos, neg = scores[positive], scores[~positive]
    if not len(pos) or not len(neg):
        return None
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


def fit_quality(router: Router, held: list[LabelledExample]) -> Fit:
    s = scores_for(router, [e.text for e in held])
    y = np.array([not e.cheap_ok for e in held])
    loss = None
    if router.score_kind == "probability":
        p = np.clip(s, 1e-6, 1 - 1e-6)
        loss = float(-np.mean(np.where(y, np.log(p), np.log(1 - p))))
    return Fit(loss, auc(s, y))


def retrain(
    outcomes: list[CascadeOutcome],
    *,
    target_strong_share: float,
    profile_labels: list[LabelledExample] | None = None,
    old: Router | None = None,
    held_out: float = 0.2,
    seed: int = 0,
    embed: EmbedFn | None = None,
    min_outcomes: int = 20,
) -> Retrained:
    if not 0.0 <= target_strong_share <= 1.0:
        raise ValueError(f"target_strong_share must be within [0, 1], got {target_strong_share}")
    if len(outcomes) < min_outcomes:
        raise ValueError(
            f"only {len(outcomes)} cascade outcomes are stored; retraining needs at least {min_outcomes} "
            "(opt tenants in under the route's learn.tenants and let traffic run)"
        )
    labelled = examples(outcomes)
    if len({e.cheap_ok for e in labelled}) < 2:
        raise ValueError("every stored outcome has the same verdict: there is nothing to learn from yet")
    memo = embed if isinstance(embed, MemoEmbed) else MemoEmbed(embed or default_embed())
    train, test = split_indices(len(labelled), held_out, seed)
    train_set = [labelled[i] for i in train] + list(profile_labels or [])
    held = [labelled[i] for i in test]
    router = LogisticRouter.fit(train_set, embed=memo)
    scores = scores_for(router, [e.text for e in labelled])
    threshold = float(np.quantile(scores, 1.0 - target_strong_share))
    router.threshold = threshold
    return Retrained(
        router,
        threshold,
        target_strong_share,
        len(train_set),
        len(held),
        fit_quality(router, held),
        fit_quality(old, held) if old is not None else None,
    )
