"""The fusion executor driven through the openai SDK against a real loopback server: a cheap model
that is confident and consistent on easy questions and unsure and erratic on hard ones, a strong
model that is right. The decisions are the gateway's; only the port differs."""

from __future__ import annotations

import asyncio

import pytest

from tokenops.fusion.plan import Plan
from tokenops.fusion.profiles import ModelEndpoint
from tokenops.fusion.sdk_port import run_plan
from tokenops.fusion.strategies import AnswerCheck, CascadePolicy, EnsemblePolicy, normalise_answer


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


CASCADE = Plan(("cheap", "strong"), "test", "cascade", route="r")


@pytest.fixture
def tiers(scripted_server):
    url, calls = scripted_server({"cheap": cheap, "strong": strong, "verifier": verifier})
    endpoints = {
        "cheap": ModelEndpoint("cheap", url, input_price=1, output_price=1),
        "strong": ModelEndpoint("strong", url, mode="completion", input_price=10, output_price=10),
        "verifier": ModelEndpoint("verifier", url),
    }
    return endpoints, calls


def test_logprob_signal(tiers) -> None:
    eps, calls = tiers
    policy = CascadePolicy(("cheap", "strong"), AnswerCheck(min_logprob=-1.0, logprob_quantile=0.1))
    easy = asyncio.run(run_plan(CASCADE, policy, eps, "an easy question"))
    assert (easy.answer.model, easy.text, easy.calls) == ("cheap", "Paris.", 1)
    assert easy.record.trace == ["cheap(accepted)"]
    hard = asyncio.run(run_plan(CASCADE, policy, eps, "a hard question"))
    assert (hard.answer.model, hard.text, hard.calls) == ("strong", "Right answer", 2)
    rejected = hard.record.trace[0]
    assert rejected.startswith("cheap(rejected: low confidence: log-prob q0.1 ")
    assert rejected.endswith("< -1)")
    # every call is priced: the rejected cheap try costs, and so does the strong one
    first = hard.record.side[0]
    assert first.usage and hard.cost > 10 * 3 / 1e6 and hard.cost > easy.cost > 0
    assert len(calls) == 3


def test_agreement_signal(tiers) -> None:
    eps, calls = tiers
    policy = CascadePolicy(("cheap", "strong"), samples=2, min_agreement=0.67)
    easy = asyncio.run(run_plan(CASCADE, policy, eps, "easy one"))
    assert easy.answer.model == "cheap" and easy.record.trace == ["cheap(accepted)"]
    assert easy.calls == 3
    hard = asyncio.run(run_plan(CASCADE, policy, eps, "hard one"))
    assert hard.answer.model == "strong"
    assert hard.record.trace[0] == "cheap(rejected: agreement 0.33 < 0.67)"
    assert [c["temperature"] for c in calls[-4:-1]].count(0.7) == 2


def test_verifier_and_depth(tiers) -> None:
    eps, _ = tiers
    policy = CascadePolicy(("cheap", "strong"), verifier="verifier")
    assert asyncio.run(run_plan(CASCADE, policy, eps, "easy")).answer.model == "cheap"
    hard = asyncio.run(run_plan(CASCADE, policy, eps, "hard"))
    assert hard.answer.model == "strong"
    assert hard.record.trace[0] == "cheap(rejected: verifier verifier said no)"
    assert hard.calls == 3  # the cheap answer, the verifier's call and the strong answer are all priced
    # a one-model plan: the cheap model answers, whatever the signals say
    capped = asyncio.run(run_plan(Plan(("cheap",), "direct"), None, eps, "hard"))
    assert capped.answer.model == "cheap" and capped.calls == 1 and capped.record.trace == []
    with pytest.raises(ValueError):
        CascadePolicy(())


def test_normalise_answer() -> None:
    assert normalise_answer("\n  Paris.\nbecause") == normalise_answer("paris") == "paris"


def test_self_consistency_stops_early(scripted_server) -> None:
    def voter(prompt: str, temperature: float, seed: int | None) -> tuple[str, list[float]]:
        return ("42" if (seed or 0) % 4 != 3 else "41"), [-0.1]

    url, calls = scripted_server({"m": voter})
    eps = {"m": ModelEndpoint("m", url)}
    plan = Plan(("m",), "test", "ensemble", route="r")
    policy = EnsemblePolicy(("m",), "self_consistency", samples=8, agree=3, round_size=2)
    r = asyncio.run(run_plan(plan, policy, eps, "q"))
    assert r.text == "42" and r.record.trace == ["m(answered, 3 of 4 votes, stopped early (max 8))"]
    assert r.calls == len(calls) == 4  # seeds 1..4: 42, 42, 41, 42
    # the leader cannot be caught: stop before the most samples even without `agree` votes
    few = EnsemblePolicy(("m",), "self_consistency", samples=3, agree=5, round_size=1)
    r2 = asyncio.run(run_plan(plan, few, eps, "q"))
    assert r2.text == "42" and r2.calls == 2


def test_a_vote_across_models(tiers) -> None:
    eps, _ = tiers
    plan = Plan(("cheap", "strong", "verifier"), "test", "ensemble", route="r")
    r = asyncio.run(run_plan(plan, EnsemblePolicy(("cheap", "strong", "verifier")), eps, "hard"))
    # three different answers: the tie goes to the latest member
    assert r.answer.model == "verifier" and r.calls == 3
    assert "verifier(answered, 1 of 3 votes)" in r.record.trace


def sampler(prompt: str, temperature: float, seed: int | None) -> tuple[str, list[float]]:
    # choice k of one call has seed 1 + k; the third choice (seed 3) is the confident one
    k = seed or 0
    return f"answer {k}", ([-0.05, -0.1] if k == 3 else [-1.0 - k / 10, -2.0])


def picker(prompt: str, temperature: float, seed: int | None) -> tuple[str, list[float]]:
    if prompt.startswith("Question:") and "Proposed answer" in prompt:  # verifier
        return ("yes" if "answer 2" in prompt else "no"), [-0.1]
    return "4", [-0.1]  # judge: the fourth answer


@pytest.fixture
def best_of_n(scripted_server):
    url, calls = scripted_server({"sampler": sampler, "picker": picker})
    eps = {
        "sampler": ModelEndpoint("sampler", url, input_price=1, output_price=2),
        "picker": ModelEndpoint("picker", url, input_price=5, output_price=5),
    }
    return eps, calls


BEST = Plan(("sampler",), "best", "ensemble", route="b")


def test_best_of_n_one_call_highest_mean_logprob_every_sample_billed(best_of_n) -> None:
    eps, calls = best_of_n
    policy = EnsemblePolicy(("sampler",), "best_of_n", samples=4, temperature=0.9)
    run = asyncio.run(run_plan(BEST, policy, eps, "pick one please"))
    assert [(c["model"], c["n"], c["temperature"]) for c in calls] == [("sampler", 4, 0.9)]  # one call, n=4
    assert run.text == "answer 3" and len(run.answer.choices()) == 1 and run.answer.choices()[0]["index"] == 0
    assert run.record.trace == ["sampler(answered, sample 3 of 4, highest mean log-prob)"]
    assert run.record.outcomes.count(("sampler", "not_picked")) == 3
    # the prompt once (3 words x 1), every sample's 2 tokens (4 x 2 x 2): all samples are metered
    assert run.answer.usage["completion_tokens"] == 8
    assert run.cost == pytest.approx((3 * 1 + 8 * 2) / 1e6)


def test_best_of_n_verifier_and_judge_scorers(best_of_n) -> None:
    eps, calls = best_of_n
    by_verifier = EnsemblePolicy(("sampler",), "best_of_n", samples=4, scorer="verifier", verifier="picker")
    run = asyncio.run(run_plan(BEST, by_verifier, eps, "pick one please"))
    assert run.text == "answer 2" and "verifier said yes to 1" in run.record.trace[0]
    assert len(run.record.side) == 4 and run.cost > (3 + 16) / 1e6  # four verdicts billed beside the samples
    by_judge = EnsemblePolicy(("sampler",), "best_of_n", samples=4, scorer="judge", judge="picker")
    run = asyncio.run(run_plan(BEST, by_judge, eps, "pick one please"))
    assert run.text == "answer 4" and "picked by judge picker" in run.record.trace[0]  # its "4"
    assert [c["n"] for c in calls][-2:] == [4, 1]


def test_best_of_n_policy_validation_and_worst_case() -> None:
    from tokenops.ops.pricing import Price

    with pytest.raises(ValueError, match="exactly one"):
        EnsemblePolicy(("a", "b"), "best_of_n")
    with pytest.raises(ValueError, match="needs a verifier"):
        EnsemblePolicy(("a",), "best_of_n", scorer="verifier")
    prices = {"a": Price(input=1, output=2), "v": Price(input=5, output=5)}
    plain = EnsemblePolicy(("a",), "best_of_n", samples=4).worst_case(prices.__getitem__)
    assert (plain.price.input, plain.price.output, plain.extra_prompt_tokens) == (1, 8, 0)  # prompt once
    checked = EnsemblePolicy(("a",), "best_of_n", samples=4, scorer="verifier", verifier="v")
    wc = checked.worst_case(prices.__getitem__)
    assert (wc.price.input, wc.price.output) == (1 + 4 * 5, 8 + 4 * 5) and wc.extra_prompt_tokens > 0
