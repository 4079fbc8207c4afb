"""The speculative rejection rule is exact: emitted tokens are distributed as the target's.

On a 6-token vocabulary with fixed target logits, the first token emitted by `rejection_sample`
(20,000 seeded trials) must pass a chi-square test against the target's softmax, whatever the draft
distribution q (random, one-hot as in prompt lookup, equal to p, nearly disjoint from p), and so must
the token that `Speculator.verify` emits under a request's temperature and top-k. A rule that always
accepts the draft must fail the same test, which shows the test can fail.
"""

from __future__ import annotations

import pytest
import torch

from tokenops.engine.sampler import Sampler
from tokenops.engine.sampling_params import SamplingParams
from tokenops.engine.scheduler import ScheduledSequence
from tokenops.engine.sequence import Sequence
from tokenops.engine.speculative.config import SpeculativeConfig
from tokenops.engine.speculative.draft_length import DraftLength
from tokenops.engine.speculative.rejection import rejection_sample, verify_greedy
from tokenops.engine.speculative.speculator import Speculator

V = 6
TRIALS = 20_000
TARGET_LOGITS = torch.tensor(
    [
        [1.2, 0.3, -0.5, 2.0, 0.0, -1.0],
        [0.1, 1.5, 0.2, -0.3, 0.8, 0.0],
        [0.0, 0.0, 1.0, 0.5, -0.5, 0.3],
        [0.4, -0.2, 0.9, 0.1, 1.1, -0.7],
    ]
)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed `counts` against `probs` (bins with probability 0 must be empty)."""
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token with target probability 0 was emitted"
    expected = n * probs[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def first_token_counts(
    p: torch.Tensor,
    q: torch.Tensor | None,
    k: int,
    seed: int,
    rule=rejection_sample,
    one_hot_draft: list[int] | None = None,
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(TRIALS):
        if one_hot_draft is not None:
            drafts = one_hot_draft[:k]
        else:
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        counts[rule(p, drafts, q, g)[0]] += 1
    return counts


def random_q(seed: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(k, V, generator=g) * 1.5, dim=-1)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("q_kind", ["random", "equal", "far"])
def test_first_token_follows_the_target_for_any_draft_distribution(k: int, q_kind: str) -> None:
    p = torch.softmax(TARGET_LOGITS, dim=-1)
    if q_kind == "random":
        q = random_q(7, k)
    elif q_kind == "equal":
        q = p[:k].clone()
    else:  # mass where the target has little
        q = torch.softmax(-3 * TARGET_LOGITS[:k], dim=-1)
    counts = first_token_counts(p, q, k, seed=11)
    assert chi_square_p(counts, p[0]) > 1e-3


@pytest.mark.parametrize("draft", [[3, 1, 2], [5, 5, 5]])  # the target's favourite, then an unlikely one
def test_first_token_follows_the_target_for_a_deterministic_draft(draft: list[int]) -> None:
    p = torch.softmax(TARGET_LOGITS, dim=-1)
    counts = first_token_counts(p, None, 3, seed=12, one_hot_draft=draft)
    assert chi_square_p(counts, p[0]) > 1e-3


def test_a_rule_that_always_accepts_fails_the_same_check() -> None:
    p = torch.softmax(TARGET_LOGITS, dim=-1)
    q = random_q(7, 1)

    def always_accept(p, drafts, q, g):
        return drafts

    counts = first_token_counts(p, q, 1, seed=13, rule=always_accept)
    assert chi_square_p(counts, p[0]) < 1e-6


def test_verify_respects_temperature_and_top_k() -> None:
    params = SamplingParams(temperature=0.7, top_k=3, seed=5, max_tokens=8)
    seq = Sequence("r", [1, 2, 3], params)
    seq.generator = torch.Generator().manual_seed(5)
    speculator = Speculator(SpeculativeConfig("ngram"), runner=None)  # prompt lookup needs no model
    logits = TARGET_LOGITS[:3]
    target = Sampler.probs(logits[:1], [params])[0]
    seq.draft_length = DraftLength(speculator.config)
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(TRIALS):
        entry = ScheduledSequence(seq, 3, 2, [3, 4])  # last token + two prompt-lookup drafts
        counts[speculator.verify(logits, entry, None)[0]] += 1
    assert chi_square_p(counts, target) > 1e-3
    assert speculator.stats.draft_tokens == 2 * TRIALS


def test_greedy_verification_accepts_while_the_argmax_agrees() -> None:
    best = TARGET_LOGITS.argmax(dim=-1).tolist()  # [3, 1, 2, 4]
    assert verify_greedy(TARGET_LOGITS, best[:3]) == best
    assert verify_greedy(TARGET_LOGITS, [best[0], 0, best[2]]) == [best[0], best[1]]
    assert verify_greedy(TARGET_LOGITS[:1], []) == [best[0]]
