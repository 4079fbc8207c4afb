"""The semantic layer's decision: which stored prompt, if any, is close enough to answer this one.

This module owns the match rule: among a scope's nearest entries above the cosine threshold, best
first, serve the first whose prompt agrees with the query on every guard (numbers, negations,
entities) and, when a verifier is configured, that the verifier confirms asks the same thing (at
most `max_checks` verifier calls per lookup); report every veto so the metrics show what was
caught. It also owns the embedding step of the request path (`QueryEmbedder`): a small memo so
`store` after a missed `lookup` does not embed the same text twice, the token-length check that keeps
prompts longer than the embedder's window out of the semantic layer, and the hop to a worker thread
so the event loop never runs the encoder.
It does not search or store (the index does).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from tokenops.cache.guards import Signature, disagreement
from tokenops.cache.index import CacheEntry
from tokenops.cache.verifier import PairVerifier, Verdict

if TYPE_CHECKING:  # torch loads only when the semantic layer is used
    from tokenops.embeddings import SentenceEmbedder


log = logging.getLogger("tokenops.cache")


@lru_cache(maxsize=4096)
def signature(text: str) -> Signature:
    return Signature.of(text)


@dataclass(slots=True)
class Match:
    entry: CacheEntry | None
    similarity: float = 0.0
    vetoes: list[str] = field(default_factory=list)  # guards (or "verifier") that refused closer candidates
    verdicts: list[Verdict] = field(default_factory=list)  # the verifier's calls, for its cost


def guarded(
    query: str, candidates: Sequence[tuple[CacheEntry, float]], threshold: float, guards: Sequence[str]
) -> tuple[list[tuple[CacheEntry, float]], list[str]]:
    """The candidates at or above `threshold` that every guard accepts (best first), and the vetoes."""
    q = signature(query)
    vetoes: list[str] = []
    passed: list[tuple[CacheEntry, float]] = []
    for entry, sim in candidates:
        if sim < threshold or entry.text is None:
            continue
        veto = disagreement(q, signature(entry.text), guards)
        if veto is None:
            passed.append((entry, sim))
        else:
            vetoes.append(veto)
    return passed, vetoes


def choose(
    query: str, candidates: Sequence[tuple[CacheEntry, float]], threshold: float, guards: Sequence[str]
) -> Match:
    """The best candidate at or above `threshold` that every guard accepts (candidates best first)."""
    q = signature(query)
    vetoes: list[str] = []
    for entry, sim in candidates:
        if sim < threshold or entry.text is None:
            continue
        veto = disagreement(q, signature(entry.text), guards)
        if veto is None:
            return Match(entry, sim, vetoes)
        vetoes.append(veto)
    return Match(None, 0.0, vetoes)


async def choose_verified(
    query: str,
    candidates: Sequence[tuple[CacheEntry, float]],
    threshold: float,
    guards: Sequence[str],
    verifier: PairVerifier,
    max_checks: int = 1,
) -> Match:
    """`choose`, then the verifier asked about the guard-passing candidates, best first, until one
    is confirmed or `max_checks` were asked."""
    passed, vetoes = guarded(query, candidates, threshold, guards)
    verdicts: list[Verdict] = []
    for entry, sim in passed[:max_checks]:
        assert entry.text is not None  # guarded() skips entries without text
        verdict = await verifier.verify(entry.text, query)
        verdicts.append(verdict)
        if verdict.same:
            return Match(entry, sim, vetoes, verdicts)
        vetoes.append("verifier")
    return Match(None, 0.0, vetoes, verdicts)


class QueryEmbedder:
    """Embeds last-message texts for the cache, off the event loop, with a small memo of recent texts."""

    def __init__(self, load: Callable[[], SentenceEmbedder], max_tokens: int, memo_size: int = 1024) -> None:
        self._load = load  # called on first use
        self._embedder: SentenceEmbedder | None = None
        self._unavailable = False
        self._load_lock = threading.Lock()
        self.max_tokens = max_tokens
        self._memo: OrderedDict[str, np.ndarray | None] = OrderedDict()
        self._memo_size = memo_size
        self._memo_lock = threading.Lock()  # the memo is read on the event loop, written by worker threads

    def _remembered(self, text: str) -> tuple[bool, np.ndarray | None]:
        with self._memo_lock:
            if text not in self._memo:
                return False, None
            self._memo.move_to_end(text)
            return True, self._memo[text]

    def _remember(self, text: str, vec: np.ndarray | None) -> None:
        with self._memo_lock:
            self._memo[text] = vec
            if len(self._memo) > self._memo_size:
                self._memo.popitem(last=False)

    def embedder(self) -> SentenceEmbedder | None:
        """The embedder, loaded on first use; None (and the semantic layer off) if it cannot load."""
        with self._load_lock:
            if self._embedder is None and not self._unavailable:
                try:
                    self._embedder = self._load()
                except Exception:
                    log.exception("the sentence embedder cannot load; the cache runs its exact layer only")
                    self._unavailable = True
            return self._embedder

    def embed_now(self, text: str) -> np.ndarray | None:
        """The text's unit vector, or None if it is longer than the embedder's window (exact layer only)."""
        known, vec = self._remembered(text)
        if known:
            return vec
        e = self.embedder()
        if e is None:
            return None
        # a prompt the encoder would cut must not match on its prefix alone
        n = e.token_count(text) if len(text) > self.max_tokens - 2 else 0
        vec = None if n is None or n > self.max_tokens else e.embed([text])[0]
        self._remember(text, vec)
        return vec

    async def embed(self, text: str) -> np.ndarray | None:
        known, vec = self._remembered(text)
        if known:
            return vec
        return await asyncio.to_thread(self.embed_now, text)
