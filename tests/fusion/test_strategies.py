"""The pure decisions of cascade and ensemble routes: checks, agreement, votes, the self-consistency
tally, verdicts, tiers."""

from __future__ import annotations

import numpy as np
import pytest

from tokenops.fusion.strategies import (
    AnswerCheck,
    CascadePolicy,
    EnsemblePolicy,
    Tally,
    agreement,
    judge_prompt,
    judged_index,
    quantile,
    verdict_is_yes,
    verifier_prompt,
    vote,
)


def test_quantile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 50):
        xs = rng.normal(size=n).tolist()
        for q in (0.0, 0.1, 0.5, 0.9, 1.0):
            assert quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)))


def test_confidence_check_reads_a_low_quantile_of_token_logprobs() -> None:
    check = AnswerCheck(min_logprob=-1.0, logprob_quantile=0.1)
    assert check.wants_logprobs
    assert check.reasons("Paris", [-0.1, -0.2, -0.05], "stop") == []
    # one very unsure token among many sure ones pulls the 10th percentile down
    reasons = check.reasons("Paris", [-0.1] * 5 + [-6.0], "stop")
    assert len(reasons) == 1 and reasons[0].startswith("low confidence: log-prob q0.1")
    assert check.reasons("Paris", [], "stop") == ["low confidence: no log-probs"]
    assert AnswerCheck().reasons("Paris", None, "stop") == []  # the signal is off by default


def test_rule_checks() -> None:
    check = AnswerCheck(
        reject_patterns=(r"(?i)\bi (don't|do not) know\b",), min_chars=2, reject_truncated=True
    )
    assert check.reasons("Paris", None, "stop") == []
    assert check.reasons("I don't know.", None, "stop") == ["matched rule /(?i)\\bi (don't|do not) know\\b/"]
    assert check.reasons(" x ", None, "stop") == ["answer shorter than 2 chars"]
    assert check.reasons("Paris is", None, "length") == ["truncated"]
    with pytest.raises(ValueError, match="not a regular expression"):
        AnswerCheck(reject_patterns=("(",))


def test_cascade_tiers_are_bounded_by_the_escalations_and_may_skip_the_cheap_ones() -> None:
    p = CascadePolicy(("a", "b", "c"), max_escalations=1)
    assert p.tiers() == ("a", "b") and p.tiers("b") == ("b", "c") and p.tiers("zzz") == ("a", "b")
    assert CascadePolicy(("a", "b", "c"), max_escalations=5).tiers() == ("a", "b", "c")
    with pytest.raises(ValueError):
        CascadePolicy(("a",))
    with pytest.raises(ValueError):
        EnsemblePolicy(("a", "b"), aggregate="judge")


def test_vote_normalises_answers_and_ties_go_to_the_latest() -> None:
    assert vote(["Paris.", "paris", "Lyon"]) == (1, 2)
    assert vote(["Paris", "Lyon"]) == (1, 1)  # a tie: the stronger (later) member
    assert vote([None, "Lyon", None]) == (1, 1)  # failed members do not vote
    with pytest.raises(ValueError):
        vote([None, None])


def test_verifier_and_judge_prompts_and_replies() -> None:
    assert "Proposed answer: Paris" in verifier_prompt("Capital of France?", " Paris\n")
    assert verdict_is_yes(" Yes, it is") and verdict_is_yes('"yes"') and not verdict_is_yes("no")
    prompt = judge_prompt("Q?", ["a", "b", "c"])
    assert "Answer 3: c" in prompt and "(1 to 3)" in prompt
    assert (
        judged_index("Answer 2", 3) == 1 and judged_index("7", 3) is None and judged_index("none", 3) is None
    )


def test_agreement_is_the_share_matching_the_first_and_a_failed_sample_disagrees() -> None:
    assert agreement("Paris", ["paris.", "PARIS!"]) == 1.0
    assert agreement("Paris", ["Lyon", "Nice"]) == pytest.approx(1 / 3)
    assert agreement("Paris", ["Paris", None]) == pytest.approx(2 / 3)
    assert agreement("Paris", []) == 1.0  # no samples: nothing against it
    with pytest.raises(ValueError, match="min_agreement"):
        CascadePolicy(("a", "b"), samples=2, min_agreement=0)


def test_tally_stops_at_agree_votes_or_when_the_leader_cannot_be_caught() -> None:
    t = Tally(max_samples=8, agree=3)
    assert t.next_round(2) == 2
    for text in ("42", "41", "42", "42"):
        t.add(text)
    assert t.settled() and t.next_round(2) == 0 and t.leader() == (0, 3)
    # 2 votes to 0 with one sample left: the runner-up can reach 1 at most
    t = Tally(max_samples=3, agree=5)
    t.add("a")
    assert not t.settled()
    t.add("a")
    assert t.settled() and t.leader() == (0, 2)
    # failed samples use up the budget and vote for nothing; ties go to the answer seen first
    t = Tally(max_samples=4, agree=3)
    for text in (None, "b", "a", None):
        t.add(text)
    assert t.settled() and t.leader() == (1, 1)
    with pytest.raises(ValueError):
        Tally(2, 2).leader()


def test_self_consistency_policy_takes_one_model_and_samples_round_robin() -> None:
    p = EnsemblePolicy(("m",), "self_consistency", samples=3)
    assert p.sample_models() == ("m", "m", "m")
    assert EnsemblePolicy(("a", "b"), "self_consistency", samples=3).sample_models() == ("a", "b", "a")
    with pytest.raises(ValueError, match="two models"):
        EnsemblePolicy(("m",), "vote")
    with pytest.raises(ValueError, match="at least 1"):
        EnsemblePolicy(("m",), "self_consistency", agree=0)
