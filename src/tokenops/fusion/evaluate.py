"""Router evaluation: cost-quality curves on a held-out split, against random and oracle routing.

This module owns the arithmetic of routing quality. Given, per held-out item, the router's score and
the quality and cost of the cheap and the strong model's answers, it sweeps the share of items sent
to the strong model (highest scores first) and reports the curve, APGR (the average over strong
shares of the performance gap recovered, (q - q_cheap) / (q_strong - q_cheap), trapezoid rule on a
0..1 grid), CPT(x) (the smallest strong share that recovers x of the gap), and the cost saved at a
given fraction of the strong model's quality. Random routing is the expectation (a straight line),
the oracle sends to the strong model exactly the items where it is better. It renders a table and a
matplotlib PNG; it does not run models or routers.

The oracle's PGR can exceed 1: where the two models complement each other (the cheap one is right
on items the strong one gets wrong), routing each item to the model that is right beats the strong
model alone, so the oracle's APGR is an upper bound above 1 rather than a score out of 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# the curves every evaluation adds: a user's router may not take their names
RESERVED_CURVES = frozenset({"random", "oracle"})


class QualityGapError(ValueError):
    """The "strong" model is worse than the cheap one on the evaluated items: PGR would be negative
    and every metric meaningless. Swap the two models, or evaluate on items where the dearer one
    is better."""


@dataclass(frozen=True, slots=True)
class ModelOutcomes:
    """One model's per-item outcomes on the evaluated items: quality (0..1, e.g. correct or not) and
    cost, aligned item by item with the other model's."""

    name: str
    quality: np.ndarray
    cost: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "quality", np.asarray(self.quality, dtype=np.float64))
        object.__setattr__(self, "cost", np.asarray(self.cost, dtype=np.float64))
        if self.quality.shape != self.cost.shape or self.quality.ndim != 1:
            raise ValueError(f"{self.name}: quality and cost must be 1-d arrays of the same length")


@dataclass(frozen=True, slots=True)
class Curve:
    name: str
    share: np.ndarray  # strong-call share, 0..1
    quality: np.ndarray  # mean quality at that share
    cost: np.ndarray  # total cost at that share


@dataclass(frozen=True, slots=True)
class Summary:
    name: str
    apgr: float | None  # None when the strong model is not better than the cheap one (no gap to recover)
    cpt50: float | None
    cpt80: float | None
    cost_saved_at_95: float | None  # fraction of the all-strong cost saved at 95% of its quality
    best_quality: float = (
        0.0  # the highest quality anywhere on the curve (above both models when they complement)
    )


def curve_from_scores(
    name: str,
    scores: np.ndarray,
    q_cheap: np.ndarray,
    q_strong: np.ndarray,
    c_cheap: np.ndarray,
    c_strong: np.ndarray,
) -> Curve:
    """Send the k highest-scored items to the strong model, k = 0..n (ties broken by item order)."""
    n = len(scores)
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    dq = (q_strong - q_cheap)[order]
    dc = (c_strong - c_cheap)[order]
    quality = (q_cheap.sum() + np.concatenate([[0.0], np.cumsum(dq)])) / max(n, 1)
    cost = c_cheap.sum() + np.concatenate([[0.0], np.cumsum(dc)])
    return Curve(name, np.arange(n + 1) / max(n, 1), quality, cost)


def oracle_curve(
    q_cheap: np.ndarray, q_strong: np.ndarray, c_cheap: np.ndarray, c_strong: np.ndarray
) -> Curve:
    # the items where the strong model helps most first; items it does not help come last
    gain = (q_strong - q_cheap) * 1e6 - (c_strong - c_cheap)
    return curve_from_scores("oracle", gain, q_cheap, q_strong, c_cheap, c_strong)


def random_curve(
    q_cheap: np.ndarray, q_strong: np.ndarray, c_cheap: np.ndarray, c_strong: np.ndarray
) -> Curve:
    n = len(q_cheap)
    share = np.arange(n + 1) / max(n, 1)
    quality = (1 - share) * q_cheap.mean() + share * q_strong.mean()
    cost = (1 - share) * c_cheap.sum() + share * c_strong.sum()
    return Curve("random", share, quality, cost)


def pgr(curve: Curve, q_cheap: float, q_strong: float) -> np.ndarray:
    """Performance gap recovered at each point of the curve."""
    gap = q_strong - q_cheap
    if abs(gap) < 1e-12:
        return np.ones_like(curve.quality)
    return (curve.quality - q_cheap) / gap


def apgr(curve: Curve, q_cheap: float, q_strong: float) -> float:
    y = pgr(curve, q_cheap, q_strong)
    x = curve.share
    return float(np.sum((y[1:] + y[:-1]) * np.diff(x)) / 2.0)


def cpt(curve: Curve, q_cheap: float, q_strong: float, recovered: float) -> float | None:
    """Smallest strong-call share whose quality recovers `recovered` of the gap (None: never)."""
    y = pgr(curve, q_cheap, q_strong)
    hit = np.nonzero(y >= recovered - 1e-12)[0]
    return float(curve.share[hit[0]]) if len(hit) else None


def cost_saved_at(curve: Curve, q_strong: float, cost_strong: float, fraction: float = 0.95) -> float | None:
    """1 - (cheapest cost on the curve reaching `fraction` of the strong model's quality) /
    (all-strong cost)."""
    ok = np.nonzero(curve.quality >= fraction * q_strong - 1e-12)[0]
    if not len(ok) or cost_strong <= 0:
        return None
    return float(1.0 - curve.cost[ok].min() / cost_strong)


@dataclass(slots=True)
class Evaluation:
    curves: list[Curve]
    summaries: list[Summary]
    q_cheap: float
    q_strong: float
    cost_cheap: float
    cost_strong: float
    n: int


def evaluate_routers(
    router_scores: dict[str, np.ndarray], *, cheap: ModelOutcomes, strong: ModelOutcomes
) -> Evaluation:
    """Every router's curve and summary on the same items, with random and oracle beside them.

    Raises `QualityGapError` when the strong model is worse than the cheap one (a zero gap leaves
    APGR and CPT undefined, None), and `ValueError` when a router is named like a built-in curve or
    its scores do not match the items."""
    reserved = RESERVED_CURVES & router_scores.keys()
    if reserved:
        raise ValueError(
            f"router name(s) {sorted(reserved)} collide with the built-in curves; rename your router(s)"
        )
    if len(cheap.quality) != len(strong.quality):
        raise ValueError(f"{cheap.name} has {len(cheap.quality)} items, {strong.name} {len(strong.quality)}")
    for name, s in router_scores.items():
        if len(s) != len(cheap.quality):
            raise ValueError(f"router {name!r} scored {len(s)} items, expected {len(cheap.quality)}")
    q_cheap, q_strong, c_cheap, c_strong = cheap.quality, strong.quality, cheap.cost, strong.cost
    if q_strong.mean() < q_cheap.mean() - 1e-12:
        raise QualityGapError(
            f"the strong model {strong.name!r} (quality {q_strong.mean():.3f}) is worse than the cheap "
            f"model {cheap.name!r} (quality {q_cheap.mean():.3f}) on these {len(q_cheap)} items: the gap "
            "to recover is negative. Swap cheap and strong, or evaluate on items where the dearer model "
            "is better."
        )
    curves = [
        curve_from_scores(name, s, q_cheap, q_strong, c_cheap, c_strong) for name, s in router_scores.items()
    ]
    curves += [
        random_curve(q_cheap, q_strong, c_cheap, c_strong),
        oracle_curve(q_cheap, q_strong, c_cheap, c_strong),
    ]
    qc, qs, cs = float(q_cheap.mean()), float(q_strong.mean()), float(c_strong.sum())
    gap = qs - qc > 1e-12  # with no gap there is nothing to recover: PGR is undefined
    summaries = [
        Summary(
            c.name,
            apgr(c, qc, qs) if gap else None,
            cpt(c, qc, qs, 0.5) if gap else None,
            cpt(c, qc, qs, 0.8) if gap else None,
            cost_saved_at(c, qs, cs),
            float(c.quality.max()),
        )
        for c in curves
    ]
    return Evaluation(curves, summaries, qc, qs, float(c_cheap.sum()), cs, len(q_cheap))


def split_indices(n: int, held_out: float = 0.5, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) index arrays, a seeded permutation."""
    perm = np.random.default_rng(seed).permutation(n)
    k = int(round(n * (1 - held_out)))
    return np.sort(perm[:k]), np.sort(perm[k:])


def table(ev: Evaluation) -> list[list[str]]:
    """Rows: router, APGR, CPT(50%), CPT(80%), cost saved at 95% of the strong model's quality,
    best quality."""

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{round(100 * x) + 0:.0f}%"  # + 0 turns -0 into 0

    return [
        [
            s.name,
            "-" if s.apgr is None else f"{s.apgr:.3f}",
            pct(s.cpt50),
            pct(s.cpt80),
            pct(s.cost_saved_at_95),
            pct(s.best_quality),
        ]
        for s in ev.summaries
    ]


def plot(ev: Evaluation, path: str | Path, title: str = "cost-quality") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for c in ev.curves:
        style = "--" if c.name in ("random", "oracle") else "-"
        a1.plot(c.share, c.quality, style, label=c.name)
        a2.plot(c.cost, c.quality, style, label=c.name)
    for ax in (a1, a2):
        ax.axhline(ev.q_strong, color="grey", lw=0.5)
        ax.axhline(ev.q_cheap, color="grey", lw=0.5)
        ax.set_ylabel("quality (mean accuracy)")
        ax.legend(fontsize=8)
    a1.set_xlabel("share of requests on the strong model")
    a2.set_xlabel("total cost")
    fig.suptitle(f"{title} (n={ev.n} held-out items)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
