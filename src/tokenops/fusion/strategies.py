"""The knobs of multi-model routes, their decisions and their worst-case price, with no I/O.

This module owns `CascadePolicy` (the ordered models, how many escalations, and the checker that
accepts or rejects an answer: a log-probability quantile, rules on the text, agreement of a few
extra samples, an optional verifier model), `EnsemblePolicy` (the members and the aggregation:
majority vote, a judge model, self-consistency with early stopping, or best-of-n with a scorer), the
`WorstCasePrice` each one is admitted at, and the pure steps they need: normalising an answer for
comparison, checking one, measuring agreement, voting, the self-consistency tally, scoring best-of-n
samples by their mean token log-probability, writing the verifier's and the judge's prompts and
reading their replies. The executor (executor.py) calls these; nothing here knows about HTTP or the
ledger.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from tokenops.ops.pricing import Price

Aggregate = Literal["vote", "judge", "self_consistency", "best_of_n"]
# how best-of-n picks one of its samples
Scorer = Literal["logprob", "verifier", "judge"]

# the most a verdict or a judgement needs: "yes", "no", or a candidate's number
VERDICT_TOKENS = 4
# a verifier's or judge's own words around the question and answers, plus its verdict: added to the
# prompt bound of a route that calls one, so the reservation stays an upper bound
HELPER_PROMPT_TOKENS = 96

PriceOf = Callable[[str], Price]


@dataclass(frozen=True, slots=True)
class WorstCasePrice:
    """What a multi-model route is admitted at: a price whose rates are the sums of its steps'
    rates (a verifier or judge also reads the answers, so its input rate is added to the output
    rate), and the extra prompt tokens of its helper calls."""

    price: Price
    extra_prompt_tokens: int = 0


def normalise_answer(text: str) -> str:
    """What two answers must share to agree: the first non-empty line, lower case, no punctuation."""
    for line in text.strip().splitlines():
        if line.strip():
            return re.sub(r"[^\w\s.-]", "", line.strip().lower()).strip(" .")
    return ""


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile with linear interpolation (numpy's default), without importing numpy on the
    gateway's request path."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class AnswerCheck:
    """Cheap signals that reject an answer; every signal that is set must pass.

    `min_logprob`: the `logprob_quantile` of the answer's token log-probabilities (e.g. its 10th
    percentile) must be at least this; an answer without log-probabilities fails it (the backend
    did not report them, so confidence is unknown). `reject_patterns`: regular expressions that
    reject an answer they match anywhere (refusals, "I don't know"). `min_chars`: shorter
    (stripped) answers are rejected. `reject_truncated`: an answer cut by `max_tokens` is rejected.
    """

    min_logprob: float | None = None
    logprob_quantile: float = 0.1
    reject_patterns: tuple[str, ...] = ()
    min_chars: int = 1
    reject_truncated: bool = False
    _compiled: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.logprob_quantile <= 1:
            raise ValueError(f"logprob_quantile must be within [0, 1], got {self.logprob_quantile}")
        try:
            compiled = tuple(re.compile(p) for p in self.reject_patterns)
        except re.error as exc:
            raise ValueError(f"reject pattern {exc.pattern!r} is not a regular expression: {exc}") from None
        object.__setattr__(self, "_compiled", compiled)

    @property
    def wants_logprobs(self) -> bool:
        return self.min_logprob is not None

    def reasons(
        self, text: str, token_logprobs: Sequence[float] | None, finish_reason: str | None
    ) -> list[str]:
        """Why the answer is rejected; empty when it is accepted."""
        out: list[str] = []
        if self.min_logprob is not None:
            if not token_logprobs:
                out.append("low confidence: no log-probs")
            else:
                q = quantile(token_logprobs, self.logprob_quantile)
                if q < self.min_logprob:
                    out.append(
                        f"low confidence: log-prob q{self.logprob_quantile:g} {q:.2f} < {self.min_logprob:g}"
                    )
        stripped = text.strip()
        if len(stripped) < self.min_chars:
            out.append(f"answer shorter than {self.min_chars} chars")
        for pattern in self._compiled:
            if pattern.search(text):
                out.append(f"matched rule /{pattern.pattern[:40]}/")
                break
        if self.reject_truncated and finish_reason == "length":
            out.append("truncated")
        return out


@dataclass(frozen=True, slots=True)
class CascadePolicy:
    """Try `models` in order; each answer but the last one tried is checked, a rejection escalates
    to the next model, at most `max_escalations` times. An answer that passed `check` is then
    tested for agreement when `samples` > 0 (that many extra answers from the same model at
    `temperature`; fewer than `min_agreement` of all answers matching the first escalates), then
    `verifier` (a model name) is asked yes/no about it."""

    models: tuple[str, ...]
    check: AnswerCheck = field(default_factory=AnswerCheck)
    max_escalations: int = 1
    verifier: str | None = None
    samples: int = 0
    min_agreement: float = 0.67
    temperature: float = 0.7

    def __post_init__(self) -> None:
        if len(self.models) < 2:
            raise ValueError("a cascade needs at least two models")
        if self.max_escalations < 1:
            raise ValueError("max_escalations must be at least 1")
        if self.samples < 0:
            raise ValueError("samples must be at least 0")
        if not 0 < self.min_agreement <= 1:
            raise ValueError(f"min_agreement must be within (0, 1], got {self.min_agreement}")

    def tiers(self, start: str | None = None) -> tuple[str, ...]:
        """The models tried, from `start` (the router may skip the cheap ones), bounded by the depth."""
        models = self.models[self.models.index(start) :] if start in self.models else self.models
        return models[: self.max_escalations + 1]

    def worst_case(self, price_of: PriceOf, strong: str) -> WorstCasePrice:
        """Every step of the dearer of the two tier lists the router can choose (cheap first, or
        from `strong` on), with the agreement samples and the verifier's calls."""
        sums = []
        for tiers in (self.tiers(), self.tiers(strong)):
            inp = sum(price_of(m).max_input_rate for m in tiers)
            out = sum(price_of(m).max_output_rate for m in tiers)
            for m in tiers[:-1]:  # agreement samples: the answer's prompt and max_tokens again
                inp += self.samples * price_of(m).max_input_rate
                out += self.samples * price_of(m).max_output_rate
            if self.verifier is not None:  # asked about every answer but the last
                v = price_of(self.verifier)
                checked = len(tiers) - 1
                inp += checked * max(v.max_input_rate, v.max_output_rate)
                out += checked * v.max_input_rate
            sums.append((inp, out))
        inp, out = max(s[0] for s in sums), max(s[1] for s in sums)
        return WorstCasePrice(Price(input=inp, output=out), HELPER_PROMPT_TOKENS if self.verifier else 0)


@dataclass(frozen=True, slots=True)
class EnsemblePolicy:
    """Ask every model in `models` at once; return the majority answer (`vote`) or the one `judge`
    picks (`judge`). Vote ties go to the answer of the latest model in `models` (list them cheapest
    first, so the strongest breaks ties). `self_consistency` instead draws up to `samples` answers
    at `temperature` round-robin over `models` (one model: a self-ensemble), `round_size` at a
    time, and stops once `agree` match or the leader cannot be caught (`Tally`). `best_of_n` asks
    `models[0]` once for `samples` choices at `temperature` (one call: the shared prompt is
    prefilled once) and `scorer` picks one: the highest mean token log-probability, the first the
    `verifier` model says yes to, or the one `judge` picks."""

    models: tuple[str, ...]
    aggregate: Aggregate = "vote"
    judge: str | None = None
    samples: int = 8
    agree: int = 3
    round_size: int = 2
    temperature: float = 0.7
    scorer: Scorer = "logprob"
    verifier: str | None = None

    def __post_init__(self) -> None:
        if self.aggregate == "best_of_n":
            if len(self.models) != 1:
                raise ValueError("best-of-n samples one model: give exactly one")
            if self.samples < 2:
                raise ValueError("best-of-n needs samples >= 2")
            if self.scorer == "verifier" and not self.verifier:
                raise ValueError("best-of-n with scorer 'verifier' needs a verifier model")
            if self.scorer == "judge" and not self.judge:
                raise ValueError("best-of-n with scorer 'judge' needs a judge model")
            return
        if self.aggregate == "self_consistency":
            if not self.models:
                raise ValueError("self-consistency needs a model")
            if min(self.samples, self.agree, self.round_size) < 1:
                raise ValueError("samples, agree and round_size must be at least 1")
        elif len(self.models) < 2:
            raise ValueError("an ensemble needs at least two models")
        if self.aggregate == "judge" and not self.judge:
            raise ValueError("aggregate 'judge' needs a judge model")

    def sample_models(self) -> tuple[str, ...]:
        """The model of each self-consistency sample, in order (the most that may be drawn)."""
        return tuple(self.models[i % len(self.models)] for i in range(self.samples))

    def worst_case(self, price_of: PriceOf) -> WorstCasePrice:
        """Every member (self-consistency: every sample, though it usually stops early), and the
        judge, who reads every member's answer."""
        if self.aggregate == "best_of_n":
            return self._best_of_n_worst_case(price_of)
        members = self.sample_models() if self.aggregate == "self_consistency" else self.models
        inp = sum(price_of(m).max_input_rate for m in members)
        out = sum(price_of(m).max_output_rate for m in members)
        if self.aggregate == "judge" and self.judge is not None:
            j = price_of(self.judge)
            inp += max(j.max_input_rate, j.max_output_rate)
            out += len(self.models) * j.max_input_rate  # every member's answer is in the judge's prompt
            return WorstCasePrice(Price(input=inp, output=out), HELPER_PROMPT_TOKENS)
        return WorstCasePrice(Price(input=inp, output=out))

    def _best_of_n_worst_case(self, price_of: PriceOf) -> WorstCasePrice:
        """One prompt, `samples` answers; a verifier reads the question and one answer per sample,
        a judge the question and every answer."""
        m = price_of(self.models[0])
        inp, out = m.max_input_rate, self.samples * m.max_output_rate
        if self.scorer == "verifier" and self.verifier is not None:
            v = price_of(self.verifier)
            inp += self.samples * max(v.max_input_rate, v.max_output_rate)
            out += self.samples * v.max_input_rate
        elif self.scorer == "judge" and self.judge is not None:
            j = price_of(self.judge)
            inp += max(j.max_input_rate, j.max_output_rate)
            out += self.samples * j.max_input_rate
        else:
            return WorstCasePrice(Price(input=inp, output=out))
        return WorstCasePrice(Price(input=inp, output=out), HELPER_PROMPT_TOKENS)


def mean_logprob(token_logprobs: Sequence[float]) -> float:
    """A sample's length-normalised confidence; -inf without log-probs (it loses to any that has them)."""
    return sum(token_logprobs) / len(token_logprobs) if token_logprobs else float("-inf")


def vote(answers: Sequence[str | None]) -> tuple[int, int]:
    """(index of the returned answer, votes for it) over normalised answers; None marks a member
    that failed. Ties go to the latest member among the tied answers."""
    keys = [normalise_answer(a) if a is not None else None for a in answers]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        raise ValueError("no answer to vote on")
    top = max(counts.values())
    best = max(i for i, k in enumerate(keys) if k is not None and counts[k] == top)
    return best, top


def agreement(first: str, others: Sequence[str | None]) -> float:
    """The share of all answers (`first` included) whose normalised form matches the first's; a
    sample that failed (None) counts as disagreeing, since it says nothing for the answer."""
    key = normalise_answer(first)
    same = sum(1 for o in others if o is not None and normalise_answer(o) == key)
    return (1 + same) / (1 + len(others))


@dataclass(slots=True)
class Tally:
    """Self-consistency's running count: samples are added in rounds; it is settled once the leading
    normalised answer has `agree` votes or more votes than the runner-up could reach with every
    sample still allowed. A failed sample (None) uses up a sample and votes for nothing."""

    max_samples: int
    agree: int
    drawn: int = 0
    votes: Counter[str] = field(default_factory=Counter)
    first_of: dict[str, int] = field(default_factory=dict)  # each answer's first sample

    def add(self, text: str | None) -> None:
        if text is not None:
            key = normalise_answer(text)
            self.votes[key] += 1
            self.first_of.setdefault(key, self.drawn)
        self.drawn += 1

    def next_round(self, round_size: int) -> int:
        """How many samples to draw now (0: stop)."""
        return 0 if self.settled() else min(round_size, self.max_samples - self.drawn)

    def settled(self) -> bool:
        if self.drawn >= self.max_samples:
            return True
        if not self.votes:
            return False
        (_, n), *rest = self.votes.most_common(2) + [("", 0)]
        return n >= self.agree or n > rest[0][1] + self.max_samples - self.drawn

    def leader(self) -> tuple[int, int]:
        """(index of the first sample giving the leading answer, its votes); ties go to the answer
        seen first. Raises ValueError when no sample answered."""
        if not self.votes:
            raise ValueError("no answer to count")
        top = max(self.votes.values())
        return min(self.first_of[k] for k, v in self.votes.items() if v == top), top


def verifier_prompt(question: str, answer: str) -> str:
    return (
        f"Question: {question.strip()}\nProposed answer: {answer.strip()}\n"
        "Is the proposed answer correct? Reply with yes or no.\nReply:"
    )


def verdict_is_yes(text: str) -> bool:
    return text.strip().lower().lstrip("\"'*").startswith("yes")


def judge_prompt(question: str, answers: Sequence[str]) -> str:
    numbered = "\n".join(f"Answer {i + 1}: {a.strip()}" for i, a in enumerate(answers))
    return (
        f"Question: {question.strip()}\n{numbered}\n"
        f"Which answer is best? Reply with its number (1 to {len(answers)}) only.\nReply:"
    )


def judged_index(text: str, n: int) -> int | None:
    """The 0-based answer the judge picked, or None when its reply names no valid number."""
    m = re.search(r"\d+", text)
    if m is None:
        return None
    k = int(m.group()) - 1
    return k if 0 <= k < n else None
