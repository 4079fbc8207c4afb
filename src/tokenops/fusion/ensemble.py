"""Ensembles: several answers, one returned.

This module owns self-consistency with early stopping (draw samples in small rounds, stop as soon as
one normalised answer holds a majority that the remaining samples cannot overturn, or has `agree`
votes: `strategies.Tally`, which the gateway's served routes use too) and best-of-n with a scorer (a function of the text, e.g. a suite checker or a reward). Every
call is returned for metering. Models are reached through `profiles.complete`; it does not decide
when an ensemble is worth its cost (plan.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from tokenops.fusion.profiles import Completion, ModelEndpoint, complete
from tokenops.fusion.strategies import Tally


@dataclass(slots=True)
class EnsembleResult:
    text: str
    votes: int  # samples agreeing with the returned answer (self-consistency) or 1 (best-of-n)
    calls: list[Completion]
    stopped_early: bool = False
    score: float | None = None

    @property
    def cost(self) -> float:
        return sum(c.cost for c in self.calls)


async def self_consistency(
    endpoints: list[ModelEndpoint],
    prompt: str,
    *,
    max_samples: int = 8,
    agree: int = 3,
    round_size: int = 2,
    temperature: float = 0.7,
    max_tokens: int = 64,
    stop: list[str] | None = None,
) -> EnsembleResult:
    """Majority answer over samples drawn round-robin from `endpoints` (one model: self-ensemble;
    several: heterogeneous), stopping once `agree` samples match or the leader cannot be caught."""
    if not endpoints:
        raise ValueError("an ensemble needs at least one model")
    clients = [e.client() for e in endpoints]
    calls: list[Completion] = []
    tally = Tally(max_samples, agree)
    try:
        while batch := tally.next_round(round_size):
            new = await asyncio.gather(*(
                complete(clients[k % len(endpoints)], endpoints[k % len(endpoints)], prompt, max_tokens=max_tokens,
                         stop=stop, temperature=temperature, seed=k + 1)
                for k in range(len(calls), len(calls) + batch)
            ))
            for c in new:
                calls.append(c)
                tally.add(c.text)
    finally:
        for c in clients:
            await c.close()
    first, n = tally.leader()
    return EnsembleResult(calls[first].text, n, calls, stopped_early=len(calls) < max_samples)


async def best_of_n(
    endpoint: ModelEndpoint,
    prompt: str,
    scorer: Callable[[str], float],
    *,
    n: int = 4,
    temperature: float = 0.7,
    max_tokens: int = 64,
    stop: list[str] | None = None,
) -> EnsembleResult:
    """Draw `n` samples and return the one the scorer rates highest (ties: the earliest)."""
    client = endpoint.client()
    try:
        calls = list(await asyncio.gather(*(
            complete(client, endpoint, prompt, max_tokens=max_tokens, stop=stop, temperature=temperature, seed=i + 1)
            for i in range(n)
        )))
    finally:
        await client.close()
    scores = [await asyncio.to_thread(scorer, c.text) for c in calls]
    best = max(range(n), key=lambda i: (scores[i], -i))
    return EnsembleResult(calls[best].text, 1, calls, score=scores[best])
