"""Routers: one interface that scores a request by how likely the cheap model's answer falls short.

This module owns `RouteFeatures` (what a router may look at: the prompt text, its length, the
declared task, whether tools are present, the tenant), the `Router` protocol (`score(features) ->
array in [0, 1]`, higher means "needs the strong model"), and three routers behind it: `RuleRouter`
(rules on request features), `KnnRouter` (nearest labelled examples in MiniLM embedding space) and
`LogisticRouter` (a logistic regression on embeddings plus a few features, trained from profiling
outcomes or a user's labelled JSONL, predicting whether the cheap model is good enough). Every
router is built the same way, `Router.fit(examples, embed=...)`, and says what its scores are
(`score_kind`): "probability" (a calibrated P(cheap answer not good enough)) or "rank" (only the
order means anything). It also turns profiling outcomes into labels. It does not pick a threshold
(calibration.py) or name models (plan.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from tokenops.fusion.profiles import ItemResult

EmbedFn = Callable[[list[str]], np.ndarray]
ScoreKind = Literal["probability", "rank"]


class MemoEmbed:
    """An `EmbedFn` that embeds each distinct text once: an evaluation hands the same one to every
    router, so training and held-out texts go through the encoder a single time."""

    def __init__(self, embed: EmbedFn) -> None:
        self._embed = embed
        self._vectors: dict[str, np.ndarray] = {}
        self.embedded = 0  # texts sent to the encoder

    def prime(self, texts: Iterable[str]) -> None:
        """Embed every new text among `texts` now, in one batch."""
        new = list(dict.fromkeys(t for t in texts if t not in self._vectors))
        if new:
            for t, v in zip(new, self._embed(new), strict=True):
                self._vectors[t] = v
            self.embedded += len(new)

    def __call__(self, texts: list[str]) -> np.ndarray:
        self.prime(texts)
        if not texts:
            return np.zeros((0, 0))
        return np.stack([self._vectors[t] for t in texts])


def default_embed() -> EmbedFn:
    """The shared MiniLM embedder (built on first use, one per process)."""
    from tokenops.embeddings import shared_embedder

    return lambda texts: shared_embedder().embed(texts)


@dataclass(frozen=True, slots=True)
class RouteFeatures:
    """What a router sees of a request."""

    text: str  # the last user message (chat) or the prompt (completion)
    prompt_chars: int = 0  # all prompt text, for length rules
    messages: int = 1
    tools: bool = False
    task: str | None = None  # declared by the client (metadata.task or x-tokenops-task)
    tenant: str | None = None

    @classmethod
    def of(cls, text: str, **kw: Any) -> RouteFeatures:
        return cls(text=text, prompt_chars=kw.pop("prompt_chars", len(text)), **kw)


def features_from_body(
    kind: str, body: dict[str, Any], tenant: str | None = None, task: str | None = None
) -> RouteFeatures:
    """Features of an OpenAI request body (chat or completion)."""
    if kind == "chat":
        msgs = [m for m in body.get("messages") or [] if isinstance(m, dict)]

        def text_of(m: dict[str, Any]) -> str:
            c = m.get("content")
            if isinstance(c, str):
                return c
            if isinstance(c, list):
                return "".join(p.get("text", "") for p in c if isinstance(p, dict))
            return ""

        users = [text_of(m) for m in msgs if m.get("role") == "user"]
        text = users[-1] if users else (text_of(msgs[-1]) if msgs else "")
        chars = sum(len(text_of(m)) for m in msgs)
        n = len(msgs)
    else:
        p = body.get("prompt")
        text = (
            p if isinstance(p, str) else (p[0] if isinstance(p, list) and p and isinstance(p[0], str) else "")
        )
        chars, n = len(text), 1
    meta = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    return RouteFeatures(
        text=text,
        prompt_chars=chars,
        messages=n,
        tools=bool(body.get("tools")),
        task=task or (str(meta["task"]) if meta.get("task") else None),
        tenant=tenant,
    )


class Router(Protocol):
    name: str
    score_kind: ScoreKind  # "probability": calibrated P(cheap not good enough); "rank": order only

    @classmethod
    def fit(cls, examples: list[LabelledExample], *, embed: EmbedFn | None = None) -> Router:
        """A router trained on labelled examples (the rule router ignores them)."""
        ...

    def score(self, requests: list[RouteFeatures]) -> np.ndarray:
        """One score in [0, 1] per request: the higher, the more the strong model is needed."""
        ...


# ---------------------------------------------------------------------------------------------
# Rules


@dataclass(slots=True)
class Rule:
    """A request matching every given condition gets `score` (first matching rule wins)."""

    score: float
    min_chars: int | None = None
    max_chars: int | None = None
    tools: bool | None = None
    tasks: frozenset[str] | None = None
    tenants: frozenset[str] | None = None
    contains: tuple[str, ...] = ()  # any of these substrings (lower case) in the text

    def matches(self, f: RouteFeatures) -> bool:
        if self.min_chars is not None and f.prompt_chars < self.min_chars:
            return False
        if self.max_chars is not None and f.prompt_chars > self.max_chars:
            return False
        if self.tools is not None and f.tools != self.tools:
            return False
        if self.tasks is not None and f.task not in self.tasks:
            return False
        if self.tenants is not None and f.tenant not in self.tenants:
            return False
        if self.contains and not any(s in f.text.lower() for s in self.contains):
            return False
        return True


def default_rules() -> list[Rule]:
    """Cost-first defaults: tool calls, code and long prompts go strong; short plain questions cheap."""
    return [
        Rule(1.0, tools=True),
        Rule(0.9, tasks=frozenset({"code", "reasoning", "math"})),
        Rule(0.8, contains=("python", "function", "```", "json")),
        Rule(0.7, min_chars=2000),
        Rule(0.2, max_chars=200),
    ]


class RuleRouter:
    """Hand-written rules: the scores order requests by the rules' guess, they are no probabilities."""

    name = "rules"
    score_kind: ScoreKind = "rank"

    def __init__(self, rules: list[Rule] | None = None, default: float = 0.5) -> None:
        self.rules = default_rules() if rules is None else rules
        self.default = default

    @classmethod
    def fit(cls, examples: list[LabelledExample], *, embed: EmbedFn | None = None) -> RuleRouter:
        """The default rules: they learn nothing from examples (kept so every router trains alike)."""
        return cls()

    def score(self, requests: list[RouteFeatures]) -> np.ndarray:
        out = np.full(len(requests), self.default, dtype=np.float64)
        for i, f in enumerate(requests):
            for rule in self.rules:
                if rule.matches(f):
                    out[i] = rule.score
                    break
        return out


# ---------------------------------------------------------------------------------------------
# Labelled examples


@dataclass(frozen=True, slots=True)
class LabelledExample:
    text: str
    cheap_ok: bool  # the cheap model's answer was good enough


def labels_from_profiles(cheap: list[ItemResult], strong: list[ItemResult]) -> list[LabelledExample]:
    """Per item answered by both models: the cheap model is good enough when it is at least as
    right as the strong one (where neither is right, the strong model would not have helped)."""
    by_id = {r.item_id: r for r in strong}
    return [
        LabelledExample(c.prompt, c.correct or not by_id[c.item_id].correct)
        for c in cheap
        if c.item_id in by_id
    ]


def load_jsonl(path: str | Path) -> list[LabelledExample]:
    """A user's labelled file: one `{"prompt": "...", "cheap_ok": true}` object per line."""
    out: list[LabelledExample] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            out.append(LabelledExample(str(obj["prompt"]), bool(obj["cheap_ok"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f'{path}:{n}: expected {{"prompt": str, "cheap_ok": bool}} ({exc})') from None
    return out


# ---------------------------------------------------------------------------------------------
# Semantic kNN


# candidate k for the kNN router, chosen by leave-one-out validation on the training examples
KNN_K_CANDIDATES = (1, 3, 5, 8, 13, 21, 34)


class KnnRouter:
    """Score = similarity-weighted share of the k nearest labelled examples where the cheap model
    failed: a local frequency, i.e. an estimate of P(cheap not good enough), with k chosen by
    leave-one-out Brier score on the examples (`fit`)."""

    name = "knn"
    score_kind: ScoreKind = "probability"

    def __init__(self, examples: list[LabelledExample], *, k: int = 8, embed: EmbedFn | None = None) -> None:
        if not examples:
            raise ValueError("the kNN router needs at least one labelled example")
        self.embed = embed or default_embed()
        self.k = min(k, len(examples))
        self.vectors = self.embed([e.text for e in examples])
        self.needs_strong = np.array([0.0 if e.cheap_ok else 1.0 for e in examples])
        self.validation: dict[int, float] = {}  # k -> leave-one-out Brier score, when fitted

    @classmethod
    def fit(
        cls,
        examples: list[LabelledExample],
        *,
        embed: EmbedFn | None = None,
        candidates: Iterable[int] = KNN_K_CANDIDATES,
    ) -> KnnRouter:
        """The router with the k (among `candidates`) whose leave-one-out predictions on `examples`
        have the lowest Brier score; ties go to the smaller k."""
        router = cls(examples, k=1, embed=embed)
        n = len(examples)
        ks = sorted({min(k, n - 1) for k in candidates if k >= 1} - {0}) or [1]
        if n < 2:
            return router
        sims = router.vectors @ router.vectors.T
        np.fill_diagonal(sims, -np.inf)  # leave each example out of its own neighbours
        order = np.argsort(-sims, axis=1)
        for k in ks:
            idx = order[:, :k]
            w = np.maximum(np.take_along_axis(sims, idx, axis=1), 0.0) + 1e-6
            p = (w * router.needs_strong[idx]).sum(axis=1) / w.sum(axis=1)
            router.validation[k] = float(np.mean((p - router.needs_strong) ** 2))
        router.k = min(router.validation, key=lambda k: (router.validation[k], k))
        return router

    def score(self, requests: list[RouteFeatures]) -> np.ndarray:
        if not requests:
            return np.zeros(0)
        q = self.embed([f.text for f in requests])
        sims = q @ self.vectors.T
        idx = np.argpartition(-sims, self.k - 1, axis=1)[:, : self.k]
        top = np.take_along_axis(sims, idx, axis=1)
        w = np.maximum(top, 0.0) + 1e-6  # cosine can be negative; far examples count for little
        return (w * self.needs_strong[idx]).sum(axis=1) / w.sum(axis=1)


# ---------------------------------------------------------------------------------------------
# Learned: logistic regression


def _side_features(f: RouteFeatures) -> list[float]:
    return [math.log1p(f.prompt_chars) / 10.0, 1.0 if f.tools else 0.0, math.log1p(f.messages) / 3.0]


# the rule router's score enters the learned router as one feature, scaled to weigh like a few
# embedding directions under the same L2 penalty
RULES_PRIOR_SCALE = 3.0


class LogisticRouter:
    """P(cheap answer not good enough) from a logistic regression on [embedding, side features], and,
    with `rules_prior`, the default rule router's score: with few labels the router then starts
    from the rules' order and learns where the traffic says they are wrong."""

    name = "learned"
    score_kind: ScoreKind = "probability"

    def __init__(
        self, weights: np.ndarray, bias: float, *, embed: EmbedFn | None = None, rules_prior: bool = False
    ) -> None:
        self.w = weights
        self.b = bias
        self.embed = embed or default_embed()
        self.rules_prior = RuleRouter() if rules_prior else None
        self.threshold: float | None = None  # calibrated with the weights, when saved with one

    def _x(self, requests: list[RouteFeatures]) -> np.ndarray:
        emb = self.embed([f.text for f in requests])
        side = np.array([_side_features(f) for f in requests], dtype=np.float64).reshape(len(requests), -1)
        parts = [emb.astype(np.float64), side]
        if self.rules_prior is not None:
            parts.append(RULES_PRIOR_SCALE * self.rules_prior.score(requests)[:, None])
        return np.hstack(parts)

    def score(self, requests: list[RouteFeatures]) -> np.ndarray:
        if not requests:
            return np.zeros(0)
        z = self._x(requests) @ self.w + self.b
        return 1.0 / (1.0 + np.exp(-z))

    @classmethod
    def fit(
        cls,
        examples: list[LabelledExample],
        *,
        embed: EmbedFn | None = None,
        rules_prior: bool = True,
        l2: float = 1e-2,
        epochs: int = 500,
        lr: float = 0.5,
    ) -> LogisticRouter:
        """Full-batch gradient descent on the class-balanced log loss (the classes are often lopsided),
        then the intercept moved back by the log prior odds, so the scores are probabilities under
        the training data's base rate again (balancing trains as if both classes were equally likely).
        `rules_prior=False` fits the text features alone."""
        if not examples:
            raise ValueError("the learned router needs labelled examples")
        router = cls(np.zeros(0), 0.0, embed=embed, rules_prior=rules_prior)
        x = router._x([RouteFeatures.of(e.text) for e in examples])
        y = np.array([0.0 if e.cheap_ok else 1.0 for e in examples])
        pos = y.mean()
        sw = (
            np.where(y == 1.0, 0.5 / max(pos, 1e-9), 0.5 / max(1.0 - pos, 1e-9))
            if 0.0 < pos < 1.0
            else np.ones_like(y)
        )
        w = np.zeros(x.shape[1])
        b = float(np.log((pos + 1e-3) / (1.0 - pos + 1e-3)))
        n = len(y)
        for _ in range(epochs):
            p = 1.0 / (1.0 + np.exp(-(x @ w + b)))
            g = sw * (p - y) / n
            w -= lr * (x.T @ g + l2 * w)
            b -= lr * float(g.sum())
        if 0.0 < pos < 1.0:
            b += float(np.log(pos / (1.0 - pos)))
        router.w, router.b = w, b
        return router

    def save(self, path: str | Path, *, threshold: float | None = None) -> None:
        """The weights, whether the rules are a feature, and the strong-share threshold calibrated
        with them (retrain.py), if any."""
        extra = {"threshold": np.array([threshold])} if threshold is not None else {}
        if self.rules_prior is not None:
            extra["rules_prior"] = np.array([1.0])
        np.savez(path, w=self.w, b=np.array([self.b]), **extra)

    @classmethod
    def load(cls, path: str | Path, *, embed: EmbedFn | None = None) -> LogisticRouter:
        data = np.load(path)
        router = cls(data["w"], float(data["b"][0]), embed=embed, rules_prior="rules_prior" in data)
        router.threshold = float(data["threshold"][0]) if "threshold" in data else None
        return router


def scores_for(router: Router, texts: Iterable[str]) -> np.ndarray:
    return router.score([RouteFeatures.of(t) for t in texts])


def make_router(
    kind: str,
    *,
    labels: str | Path | None = None,
    model_path: str | Path | None = None,
    examples: list[LabelledExample] | None = None,
    embed: EmbedFn | None = None,
) -> Router:
    """A router by name, as a config would name it: "rules"; "knn" (trained on `labels`, a JSONL
    file, and `examples`, e.g. read from the stored profiles and cascade outcomes); "learned" (a
    saved `model_path` .npz, or trained now on the same labels)."""
    if kind == "rules":
        return RuleRouter()
    if kind == "learned" and model_path is not None and Path(model_path).is_file():
        return LogisticRouter.load(model_path, embed=embed)
    if kind in ("knn", "learned"):
        train = (load_jsonl(labels) if labels is not None else []) + list(examples or [])
        if not train:
            raise ValueError(
                f"the {kind} router needs labels: a labelled JSONL file, stored profiles or cascade "
                "outcomes" + (", or a saved model (.npz)" if kind == "learned" else "")
            )
        return (KnnRouter if kind == "knn" else LogisticRouter).fit(train, embed=embed)
    raise ValueError(f"unknown router {kind!r}; choose rules, knn or learned")
