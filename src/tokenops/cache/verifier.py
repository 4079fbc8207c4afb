"""The semantic cache's last check: a small model confirms that two questions ask the same thing.

Embeddings and the guards catch what they can see (numbers, negations, entities); what is left
(another intent in the same words, "convert" vs "explain") is a language judgement. This module owns
`PairVerifier` (the protocol the cache calls), `Verdict` (yes or no, P(yes), and what the call cost)
and `LogprobVerifier`, which asks any OpenAI-compatible chat model (the bundled SmolLM2 under
`tokenops engine`, or a model the gateway serves) one question with `max_tokens: 1` and reads the
probabilities of "yes" and "no" among the top log-probabilities of its one token: P(yes) =
p(yes) / (p(yes) + p(no)). A failed or unreadable call is a no: a miss costs one backend call, a
false hit a wrong answer. It does not search, guard or store (semantic.py, guards.py, the index).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("tokenops.cache")

# the top alternatives read from the verdict token: enough for " yes", "Yes", "YES" and the no's
TOP_LOGPROBS = 10


@dataclass(frozen=True, slots=True)
class Verdict:
    same: bool
    p_yes: float  # P(yes) among yes/no; 0 when the call failed
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    error: str | None = None


class PairVerifier(Protocol):
    async def verify(self, cached: str, query: str) -> Verdict:
        """Whether an answer to `cached` also answers `query`."""
        ...


def pair_prompt(cached: str, query: str) -> str:
    return (
        "Do these two questions ask for exactly the same answer? Different numbers, names, a negation "
        "or a different task mean they do not.\n"
        f"Question A: {cached.strip()}\nQuestion B: {query.strip()}\n"
        "Answer yes or no."
    )


def p_yes_from_top(top: list[tuple[str, float]]) -> float | None:
    """P(yes) among yes/no from one token's top (token, log-prob) pairs; None if neither is there."""
    yes = no = 0.0
    for token, logprob in top:
        word = token.strip().strip(".!,\"'").lower()
        if word == "yes":
            yes += math.exp(logprob)
        elif word == "no":
            no += math.exp(logprob)
    return yes / (yes + no) if yes + no > 0 else None


class LogprobVerifier:
    """A yes/no judgement from a chat model's first-token log-probabilities (greedy, one token)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str = "none",
        min_p_yes: float = 0.5,
        timeout_s: float = 10.0,
        client: Any = None,
    ) -> None:
        if not 0.0 < min_p_yes < 1.0:
            raise ValueError(f"min_p_yes must be within (0, 1), got {min_p_yes}")
        self.model = model
        self.min_p_yes = min_p_yes
        if client is None:
            from openai import AsyncOpenAI

            client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)
        self._client = client

    async def verify(self, cached: str, query: str) -> Verdict:
        from openai import OpenAIError

        start = time.perf_counter()
        try:
            resp = await self._client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": pair_prompt(cached, query)}],
                max_tokens=1,
                temperature=0.0,
                logprobs=True,
                top_logprobs=TOP_LOGPROBS,
            )
        except OpenAIError as exc:
            log.warning("the cache verifier failed (%s); the candidate is refused", exc)
            return Verdict(False, 0.0, seconds=time.perf_counter() - start, error=type(exc).__name__)
        seconds = time.perf_counter() - start
        usage = resp.usage
        tokens = (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
        content = (
            (resp.choices[0].logprobs.content or []) if resp.choices and resp.choices[0].logprobs else []
        )
        top = [(t.token, t.logprob) for t in content[0].top_logprobs] if content else []
        if content and not top:  # a backend that returns only the chosen token
            top = [(content[0].token, content[0].logprob)]
        p = p_yes_from_top(top)
        if p is None:
            return Verdict(False, 0.0, *tokens, seconds, error="no yes/no among the top tokens")
        return Verdict(p >= self.min_p_yes, p, *tokens, seconds)

    async def aclose(self) -> None:
        await self._client.close()
