"""Routers on constructed data with known answers: easy requests (small talk, simple facts) the cheap
model handles, hard ones (code, proofs, multi-step maths) it does not."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenops.fusion.profiles import ItemResult
from tokenops.fusion.routers import (
    KnnRouter,
    LabelledExample,
    LogisticRouter,
    RouteFeatures,
    Rule,
    RuleRouter,
    features_from_body,
    labels_from_profiles,
    load_jsonl,
    scores_for,
)

EASY = [f"What is the capital of {c}?" for c in ("France", "Spain", "Italy", "Japan", "Egypt", "Peru")] + [
    "Say hello to my friend.",
    "What colour is the sky?",
    "Translate 'cat' into French.",
    "How many days are in a week?",
    "Name a fruit that is yellow.",
    "What is the opposite of hot?",
]
HARD = [
    "Write a Python function that parses a CSV file and returns the average of each numeric column.",
    "Prove that there are infinitely many prime numbers.",
    "Implement a thread-safe LRU cache in Java with generics and unit tests.",
    "Solve the system of equations 3x + 2y = 7 and 5x - y = 4 and explain every step.",
    "Write a SQL query that returns the second highest salary per department using window functions.",
    "Derive the gradient of the softmax cross-entropy loss with respect to the logits.",
    "Refactor this recursive Fibonacci function in Rust to use memoization and iterators.",
    "Prove that the square root of 2 is irrational.",
    "Write a bash script that finds duplicate files by checksum in a directory tree.",
    "Compute the integral of x^2 * e^x from 0 to 1 step by step.",
    "Implement Dijkstra's shortest path algorithm in C++ with a priority queue.",
    "Show that every bounded monotone sequence of real numbers converges.",
]
EASY_TEST = ["What is the capital of Germany?", "Say good morning to my neighbour.", "What colour is grass?"]
HARD_TEST = [
    "Write a Python class implementing a binary search tree with insert and delete.",
    "Prove that the sum of the first n odd numbers is n squared.",
    "Implement quicksort in Go and analyse its complexity.",
]


def _examples() -> list[LabelledExample]:
    return [LabelledExample(t, True) for t in EASY] + [LabelledExample(t, False) for t in HARD]


def test_rule_router_on_request_features() -> None:
    router = RuleRouter()
    tools = features_from_body(
        "chat", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}
    )
    short = features_from_body("chat", {"messages": [{"role": "user", "content": "hi"}]})
    code = features_from_body(
        "chat", {"messages": [{"role": "user", "content": "write a python function " * 20}]}
    )
    task = features_from_body("completion", {"prompt": "x" * 500, "metadata": {"task": "math"}})
    long = RouteFeatures.of("a" * 3000)
    s = router.score([tools, short, code, task, long, RouteFeatures.of("b" * 500)])
    assert s.tolist() == [1.0, 0.2, 0.8, 0.9, 0.7, 0.5]
    tenant_rule = RuleRouter([Rule(0.95, tenants=frozenset({"vip"}))], default=0.1)
    assert tenant_rule.score(
        [RouteFeatures.of("x", tenant="vip"), RouteFeatures.of("x", tenant="free")]
    ).tolist() == [0.95, 0.1]


def test_features_from_chat_body_use_last_user_message() -> None:
    f = features_from_body(
        "chat",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "first"}]},
                {"role": "assistant", "content": None},
                {"role": "user", "content": "second"},
            ]
        },
        tenant="acme",
    )
    assert (f.text, f.messages, f.tenant, f.prompt_chars) == ("second", 4, "acme", len("be brief") + 5 + 6)


def test_knn_router_separates_easy_from_hard(embedder) -> None:
    router = KnnRouter(_examples(), k=5, embed=embedder.embed)
    easy, hard = scores_for(router, EASY_TEST), scores_for(router, HARD_TEST)
    assert easy.max() < 0.5 < hard.min(), (easy, hard)


def test_learned_router_separates_easy_from_hard_and_round_trips(embedder, tmp_path) -> None:
    router = LogisticRouter.fit(_examples(), embed=embedder.embed)
    easy, hard = scores_for(router, EASY_TEST), scores_for(router, HARD_TEST)
    assert easy.max() < hard.min(), (easy, hard)
    assert np.all((0 < easy) & (easy < 1))
    router.save(tmp_path / "r.npz")
    again = LogisticRouter.load(tmp_path / "r.npz", embed=embedder.embed)
    np.testing.assert_allclose(scores_for(again, HARD_TEST), hard)


def test_learned_router_with_the_rules_as_a_feature_sees_what_text_cannot(embedder, tmp_path) -> None:
    # the rules read the declared task, which the embedding of the text does not see
    plain = LogisticRouter.fit(_examples(), embed=embedder.embed, rules_prior=False)
    router = LogisticRouter.fit(_examples(), embed=embedder.embed)
    question = "What is 17 times 23?"
    asked, declared = RouteFeatures.of(question), RouteFeatures.of(question, task="math")
    assert plain.score([declared])[0] == pytest.approx(plain.score([asked])[0])
    assert router.score([declared])[0] > router.score([asked])[0] + 0.05
    easy, hard = scores_for(router, EASY_TEST), scores_for(router, HARD_TEST)
    assert easy.max() < hard.min(), (easy, hard)
    router.save(tmp_path / "r.npz", threshold=0.4)
    again = LogisticRouter.load(tmp_path / "r.npz", embed=embedder.embed)
    assert again.rules_prior is not None and again.threshold == pytest.approx(0.4)
    np.testing.assert_allclose(again.score([declared, asked]), router.score([declared, asked]))
    plain.save(tmp_path / "plain.npz")
    assert LogisticRouter.load(tmp_path / "plain.npz", embed=embedder.embed).rules_prior is None


def test_labels_from_profiles_and_jsonl(tmp_path) -> None:
    def r(item: str, ok: bool) -> ItemResult:
        return ItemResult("m", item, "c", 1, f"prompt {item}", ok, "", 1, 1, 0.0, 0.0)

    cheap = [r("a", True), r("b", False), r("c", False), r("only-cheap", False)]
    strong = [r("a", True), r("b", True), r("c", False)]
    labels = labels_from_profiles(cheap, strong)
    # b: the strong model helps; c: neither is right, so the cheap one is as good as it gets
    assert [(e.text, e.cheap_ok) for e in labels] == [
        ("prompt a", True),
        ("prompt b", False),
        ("prompt c", True),
    ]

    path = tmp_path / "labels.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt": t, "cheap_ok": ok}) for t, ok in [("x", True), ("y", False)]) + "\n\n"
    )
    assert [(e.text, e.cheap_ok) for e in load_jsonl(path)] == [("x", True), ("y", False)]
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="labels.jsonl:1"):
        load_jsonl(path)


def test_make_router_by_name(embedder, tmp_path) -> None:
    from tokenops.fusion.routers import make_router

    path = tmp_path / "l.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": e.text, "cheap_ok": e.cheap_ok}) for e in _examples()))
    assert make_router("rules").name == "rules"
    knn = make_router("knn", labels=path, embed=embedder.embed)
    learned = make_router("learned", labels=path, embed=embedder.embed)
    assert isinstance(learned, LogisticRouter)
    learned.save(tmp_path / "m.npz")
    assert make_router("learned", model_path=tmp_path / "m.npz", embed=embedder.embed).name == "learned"
    assert scores_for(knn, HARD_TEST).min() > 0.5
    for bad in (lambda: make_router("knn"), lambda: make_router("learned"), lambda: make_router("magic")):
        with pytest.raises(ValueError):
            bad()


def test_every_router_trains_with_fit_and_says_what_its_scores_are(embedder) -> None:
    kinds = {}
    for cls in (RuleRouter, KnnRouter, LogisticRouter):
        router = cls.fit(_examples(), embed=embedder.embed)
        kinds[router.name] = router.score_kind
        assert router.score([RouteFeatures.of(t) for t in HARD_TEST]).shape == (3,)
    assert kinds == {"rules": "rank", "knn": "probability", "learned": "probability"}


def test_knn_k_is_chosen_by_validation(embedder) -> None:
    # one noisy label in each cluster: a single neighbour copies the noise, more neighbours vote it down
    examples = _examples()
    noisy = [LabelledExample(EASY[0], False), LabelledExample(HARD[0], True)]
    router = KnnRouter.fit(examples[1:12] + examples[13:] + noisy, embed=embedder.embed)
    assert router.k == min(router.validation, key=lambda k: (router.validation[k], k))
    assert router.k > 1 and router.validation[router.k] < router.validation[1]
    easy, hard = scores_for(router, EASY_TEST), scores_for(router, HARD_TEST)
    assert easy.max() < 0.5 < hard.min(), (easy, hard)


def test_learned_scores_are_probabilities_at_the_base_rate(embedder) -> None:
    # a quarter of the examples need the strong model: the mean predicted probability follows
    examples = [LabelledExample(t, True) for t in EASY + EASY_TEST + HARD[:6]] + [
        LabelledExample(t, False) for t in HARD[6:]
    ]
    router = LogisticRouter.fit(examples, embed=embedder.embed)
    p = scores_for(router, [e.text for e in examples])
    base = np.mean([not e.cheap_ok for e in examples])
    assert abs(p.mean() - base) < 0.1, (p.mean(), base)


def test_an_evaluation_embeds_every_text_once(embedder) -> None:
    from tokenops.fusion.router_eval import evaluate_splits

    seen: list[str] = []

    def counting(texts: list[str]) -> np.ndarray:
        seen.extend(texts)
        return embedder.embed(texts)

    def r(i: int, text: str, ok: bool) -> ItemResult:
        return ItemResult("m", f"i{i}", "c", 1, text, ok, "", 10, 5, 0.0, 0.0)

    texts = EASY + HARD
    cheap = [r(i, t, t in EASY) for i, t in enumerate(texts)]
    strong = [r(i, t, True) for i, t in enumerate(texts)]
    spread = evaluate_splits(cheap=cheap, strong=strong, seeds=range(3), embed=counting)
    assert sorted(seen) == sorted(texts)  # three splits, two trained routers: one pass over the texts
    assert set(spread.apgr) == {"rules", "knn", "learned", "random", "oracle"}
    assert spread.apgr["random"].mean == pytest.approx(0.5) and spread.apgr["random"].std == pytest.approx(0)
    assert spread.apgr["learned"].defined == 3


def _letters_embed(texts: list[str]) -> np.ndarray:
    """A stand-in embedder: letter counts, unit length (enough for kNN and the logistic router)."""
    out = np.array([[t.lower().count(c) + 1e-3 for c in "abcdefghijklmnopqrstuvwxyz"] for t in texts])
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def test_splits_skip_a_held_out_part_that_reverses_the_models_and_refuse_a_reversed_pair() -> None:
    from tokenops.fusion.evaluate import QualityGapError, split_indices
    from tokenops.fusion.router_eval import evaluate_splits

    def r(i: int, ok: bool) -> ItemResult:
        return ItemResult("m", f"i{i}", "c", 1, (EASY + HARD)[i], ok, "", 10, 5, 0.0, 0.0)

    # the strong model is better overall (13 of 24 right against 11) but right on other items
    cheap = [r(i, i < 11) for i in range(24)]
    strong = [r(i, i >= 11) for i in range(24)]
    strong_right = [sum(i >= 11 for i in split_indices(24, 0.5, s)[1]) for s in range(10)]
    reversing = [s for s, n in enumerate(strong_right) if n < 6]  # of 12 held out: strong worse
    gaining = [s for s, n in enumerate(strong_right) if n > 6]  # strong better (6: a tie, no gap)
    assert reversing and gaining
    spread = evaluate_splits(cheap=cheap, strong=strong, seeds=range(10), embed=_letters_embed)
    assert spread.reversed_seeds == reversing and len(spread.evaluations) == 10 - len(reversing)
    assert spread.apgr["random"].defined == len(gaining)  # a tied split leaves APGR undefined
    with pytest.raises(QualityGapError, match="'weak' .* is worse than the cheap model 'big'"):
        evaluate_splits(
            cheap=strong, strong=cheap, cheap_name="big", strong_name="weak", embed=_letters_embed
        )
