"""Cascades and ensembles against a real loopback server: a cheap model that is confident and
consistent on easy questions and unsure and erratic on hard ones, a strong model that is right."""

from __future__ import annotations

import asyncio

import pytest

from tokenops.fusion.cascade import EscalationPolicy, normalise_answer, run_cascade
from tokenops.fusion.ensemble import best_of_n, self_consistency
from tokenops.fusion.profiles import ModelEndpoint


def cheap(prompt: str, temperature: float, seed: int | None) -> tuple[str, list[float]]:
    if "easy" in prompt:
        return "Paris.", [-0.01, -0.05]
    if temperature > 0:
        return f"guess {seed}", [-2.0, -2.5]
    return "Lyon", [-0.3, -2.9]


def strong(prompt: str, temperature: float, seed: int | None) -> tuple[str, list[float]]:
    return "Right answer", [-0.01]


def verifier(prompt: str, temperature: float, seed: int | None) -> tuple[str, list[float]]:
    return ("yes" if "Proposed answer: Paris" in prompt else "no"), [-0.1]


@pytest.fixture
def tiers(scripted_server):
    url, calls = scripted_server({"cheap": cheap, "strong": strong, "verifier": verifier})
    return [ModelEndpoint("cheap", url, input_price=1, output_price=1),
            ModelEndpoint("strong", url, mode="completion", input_price=10, output_price=10)], url, calls


def test_logprob_signal(tiers) -> None:
    eps, _, calls = tiers
    policy = EscalationPolicy(min_logprob=-1.0, logprob_quantile=0.1)
    easy = asyncio.run(run_cascade(eps, "an easy question", policy=policy))
    assert (easy.model, easy.text, easy.escalations) == ("cheap", "Paris.", 0)
    hard = asyncio.run(run_cascade(eps, "a hard question", policy=policy))
    assert (hard.model, hard.text, hard.escalations) == ("strong", "Right answer", 1)
    first = hard.attempts[0]
    assert not first.accepted and first.signals["logprob_q"] < -1.0 and "log-prob" in first.reasons[0]
    # every attempt is metered: the cheap try costs, and so does the strong one
    assert first.cost > 0 and hard.cost == pytest.approx(first.cost + hard.attempts[1].cost)
    assert hard.cost > easy.cost
    assert len(calls) == 3


def test_agreement_signal(tiers) -> None:
    eps, _, calls = tiers
    policy = EscalationPolicy(samples=2, min_agreement=0.67)
    easy = asyncio.run(run_cascade(eps, "easy one", policy=policy))
    assert easy.model == "cheap" and easy.attempts[0].signals["agreement"] == 1.0
    assert len(easy.attempts[0].calls) == 3
    hard = asyncio.run(run_cascade(eps, "hard one", policy=policy))
    assert hard.model == "strong" and hard.attempts[0].signals["agreement"] == pytest.approx(1 / 3)
    assert [c["temperature"] for c in calls[-4:-1]].count(0.7) == 2


def test_verifier_and_depth(tiers) -> None:
    eps, url, _ = tiers
    policy = EscalationPolicy(verifier=ModelEndpoint("verifier", url))
    assert asyncio.run(run_cascade(eps, "easy", policy=policy)).model == "cheap"
    hard = asyncio.run(run_cascade(eps, "hard", policy=policy))
    assert hard.model == "strong" and hard.attempts[0].reasons == ["verifier said no"]
    assert len(hard.attempts[0].calls) == 2  # the answer and the verifier's call are both metered
    # depth 1: the cheap model answers, whatever the signals say
    capped = asyncio.run(run_cascade(eps, "hard", policy=policy, max_depth=1))
    assert capped.model == "cheap" and capped.escalations == 0
    with pytest.raises(ValueError):
        asyncio.run(run_cascade([], "x", policy=policy))


def test_normalise_answer() -> None:
    assert normalise_answer("\n  Paris.\nbecause") == normalise_answer("paris") == "paris"


def test_self_consistency_stops_early(scripted_server) -> None:
    def voter(prompt: str, temperature: float, seed: int | None) -> tuple[str, list[float]]:
        return ("42" if (seed or 0) % 4 != 3 else "41"), [-0.1]

    url, calls = scripted_server({"m": voter})
    ep = ModelEndpoint("m", url)
    r = asyncio.run(self_consistency([ep], "q", max_samples=8, agree=3, round_size=2))
    assert r.text == "42" and r.votes == 3 and r.stopped_early
    assert len(r.calls) == len(calls) == 4  # seeds 1..4: 42, 42, 41, 42
    # the leader cannot be caught: stop before max_samples even without `agree` votes
    r2 = asyncio.run(self_consistency([ep], "q", max_samples=3, agree=5, round_size=1))
    assert r2.text == "42" and len(r2.calls) == 2


def test_best_of_n_with_a_checker(scripted_server) -> None:
    def sampler(prompt: str, temperature: float, seed: int | None) -> tuple[str, list[float]]:
        return f"{10 + (seed or 0)}", [-0.1]

    url, _ = scripted_server({"m": sampler})
    r = asyncio.run(best_of_n(ModelEndpoint("m", url), "What is 6 + 7?", lambda t: float(t.strip() == "13"), n=4))
    assert r.text == "13" and r.score == 1.0 and len(r.calls) == 4
