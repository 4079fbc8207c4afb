"""Scheduled retraining of a learning route: a round waits for enough new outcomes, retrains, and
serves the new router (with its threshold, saved for a restart) only when it predicts the held-out
escalations at least as well as the serving one; outcomes read from a real SQLite store."""

from __future__ import annotations

import hashlib

import numpy as np

from tokenops.fusion.outcomes import CascadeOutcome, OutcomeStore
from tokenops.fusion.plan import RouteConfig
from tokenops.fusion.relearn import Relearner, RetrainSchedule
from tokenops.fusion.routers import LogisticRouter, RouteFeatures, RuleRouter

from .test_outcomes import _traffic


def _store(tmp_path, outcomes: list[CascadeOutcome]) -> OutcomeStore:
    store = OutcomeStore(f"sqlite:///{tmp_path / 'o.db'}")
    store.record(outcomes)
    return store


def test_a_round_waits_for_new_outcomes_then_swaps_in_a_better_router(tmp_path, embedder) -> None:
    traffic = _traffic()
    store = _store(tmp_path, traffic[:10])
    route = RouteConfig(
        "careful", "cheap", "strong", RuleRouter(), target_strong_share=0.4, strategy="cascade"
    )
    saved = tmp_path / "router.npz"
    relearner = Relearner(
        route, RetrainSchedule(min_new_outcomes=20, held_out=0.3), store, save_to=saved, embed=embedder.embed
    )
    first = relearner.run_round()
    assert (first.result, first.outcomes) == ("waiting", 10) and isinstance(route.router, RuleRouter)

    store.record(traffic[10:])
    second = relearner.run_round()
    assert second.result == "swapped", second.reason
    assert isinstance(route.router, LogisticRouter) and route.router is second.retrained.router
    assert route.calibrator.threshold == second.retrained.threshold  # the router's own threshold
    reloaded = LogisticRouter.load(saved, embed=embedder.embed)  # what a restarted gateway serves
    assert reloaded.threshold == second.retrained.threshold
    hard = [RouteFeatures.of("Implement a red-black tree in Rust with deletion and tests.")]
    easy = [RouteFeatures.of("What is the capital of Portugal?")]
    assert reloaded.score(hard)[0] > reloaded.score(easy)[0]

    third = relearner.run_round()  # nothing new since: no retraining
    assert third.result == "waiting" and route.router is second.retrained.router
    store.close()


class _Oracle:
    """Scores every stored question by its recorded verdict: no retrained router can beat it."""

    name = "oracle"
    score_kind = "rank"

    def __init__(self, outcomes: list[CascadeOutcome]) -> None:
        self.escalated = {o.prompt: not o.cheap_ok for o in outcomes}

    def score(self, requests: list[RouteFeatures]) -> np.ndarray:
        return np.array([float(self.escalated.get(r.text, 0.5)) for r in requests])


def test_a_router_worse_on_held_out_outcomes_is_not_served(tmp_path, embedder) -> None:
    # verdicts that follow no pattern in the text: the retrained router cannot match the oracle
    texts = [f"Question number {i} about topic {i % 7}." for i in range(60)]
    noisy = [
        CascadeOutcome("acme", "careful", "cheap", t, hashlib.sha256(t.encode()).digest()[0] % 2 == 0)
        for t in texts
    ]
    store = _store(tmp_path, noisy)
    oracle = _Oracle(noisy)
    route = RouteConfig("careful", "cheap", "strong", oracle, target_strong_share=0.3, strategy="cascade")
    before = route.calibrator
    saved = tmp_path / "router.npz"
    r = Relearner(route, RetrainSchedule(min_new_outcomes=20), store, save_to=saved, embed=embedder.embed)
    result = r.run_round()
    assert result.result == "kept" and "below the serving router's 1.000" in result.reason
    assert route.router is oracle and route.calibrator is before and not saved.exists()
    store.close()
