"""Cascades: answer with the cheapest model, escalate to the next only when cheap signals say so.

This module owns `EscalationPolicy` (the signals and their thresholds: agreement of a few extra
samples, a quantile of the answer's token log-probabilities, an optional verifier model asked "is
this answer correct?") and `run_cascade`, which walks a list of models at most `max_depth` deep and
returns every attempt (each one metered: model, tokens, cost) and which model answered. It speaks to
models through `profiles.complete` (the official `openai` SDK); it does not choose the models of a
cascade (plan.py) or bill (the gateway settles each attempt with the ops layer).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenops.fusion.profiles import Completion, ModelEndpoint, complete
from tokenops.fusion.strategies import (
    VERDICT_TOKENS,
    agreement,
    normalise_answer,
    verdict_is_yes,
    verifier_prompt,
)

__all__ = ["Attempt", "CascadeResult", "EscalationPolicy", "normalise_answer", "run_cascade"]


@dataclass(frozen=True, slots=True)
class EscalationPolicy:
    samples: int = 0  # extra samples drawn at `temperature` to test agreement (0: signal off)
    temperature: float = 0.7
    min_agreement: float = 0.67  # share of all answers (first included) that must match the first
    logprob_quantile: float = 0.1  # e.g. the 10th percentile of the answer's token log-probs ...
    min_logprob: float | None = None  # ... must be at least this (None: signal off)
    verifier: ModelEndpoint | None = None  # asked whether the answer is correct; "no" escalates


@dataclass(slots=True)
class Attempt:
    """One model's try, with everything it cost (extra samples and the verifier's call included)."""

    model: str
    answer: Completion
    calls: list[Completion] = field(default_factory=list)
    accepted: bool = False
    signals: dict[str, float] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)

    @property
    def cost(self) -> float:
        return sum(c.cost for c in self.calls)

    @property
    def tokens(self) -> tuple[int, int]:
        return sum(c.prompt_tokens for c in self.calls), sum(c.completion_tokens for c in self.calls)


@dataclass(slots=True)
class CascadeResult:
    text: str
    model: str  # the model whose answer is returned
    attempts: list[Attempt]

    @property
    def escalations(self) -> int:
        return len(self.attempts) - 1

    @property
    def cost(self) -> float:
        return sum(a.cost for a in self.attempts)


async def _judge(client: Any, endpoint: ModelEndpoint, prompt: str, first: Completion, policy: EscalationPolicy,
                 max_tokens: int, stop: list[str] | None, verifier_client: Any) -> Attempt:
    attempt = Attempt(endpoint.name, first, calls=[first])
    ok = True
    if policy.min_logprob is not None and first.token_logprobs:
        q = float(np.quantile(first.token_logprobs, policy.logprob_quantile))
        attempt.signals["logprob_q"] = q
        if q < policy.min_logprob:
            ok = False
            attempt.reasons.append(f"log-prob q{policy.logprob_quantile:g} {q:.2f} < {policy.min_logprob:g}")
    if policy.samples > 0:
        extra = await asyncio.gather(*(
            complete(client, endpoint, prompt, max_tokens=max_tokens, stop=stop,
                     temperature=policy.temperature, seed=i + 1)
            for i in range(policy.samples)
        ))
        attempt.calls.extend(extra)
        share = agreement(first.text, [c.text for c in extra])
        attempt.signals["agreement"] = share
        if share < policy.min_agreement:
            ok = False
            attempt.reasons.append(f"agreement {share:.2f} < {policy.min_agreement:g}")
    if ok and policy.verifier is not None:
        question = verifier_prompt(prompt, first.text)
        verdict = await complete(verifier_client, policy.verifier, question, max_tokens=VERDICT_TOKENS, stop=["\n"])
        attempt.calls.append(verdict)
        yes = verdict_is_yes(verdict.text)
        attempt.signals["verified"] = 1.0 if yes else 0.0
        if not yes:
            ok = False
            attempt.reasons.append("verifier said no")
    attempt.accepted = ok
    return attempt


async def run_cascade(
    tiers: list[ModelEndpoint],
    prompt: str,
    *,
    policy: EscalationPolicy,
    max_tokens: int = 64,
    stop: list[str] | None = None,
    max_depth: int | None = None,
) -> CascadeResult:
    """Try `tiers` cheapest first; the last tier tried (at most `max_depth` tiers) answers unconditionally."""
    if not tiers:
        raise ValueError("a cascade needs at least one model")
    depth = len(tiers) if max_depth is None else max(1, min(max_depth, len(tiers)))
    want_logprobs = policy.min_logprob is not None
    attempts: list[Attempt] = []
    verifier_client = policy.verifier.client() if policy.verifier else None
    try:
        for i, endpoint in enumerate(tiers[:depth]):
            client = endpoint.client()
            try:
                first = await complete(client, endpoint, prompt, max_tokens=max_tokens, stop=stop, logprobs=want_logprobs)
                if i == depth - 1:
                    attempts.append(Attempt(endpoint.name, first, calls=[first], accepted=True, reasons=["last tier"]))
                    break
                attempt = await _judge(client, endpoint, prompt, first, policy, max_tokens, stop, verifier_client)
            finally:
                await client.close()
            attempts.append(attempt)
            if attempt.accepted:
                break
    finally:
        if verifier_client is not None:
            await verifier_client.close()
    last = attempts[-1]
    return CascadeResult(text=last.answer.text, model=last.model, attempts=attempts)
