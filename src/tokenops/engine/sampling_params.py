"""Per-request sampling parameters, validated once when the request is built.

The sampler reads these; the scheduler reads `max_tokens`, `stop_token_ids` and `ignore_eos` to decide
when a sequence finishes. Stop *strings* are not here: they need detokenised text and belong to the
server's incremental detokenizer, which aborts the request when one matches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenops.engine.config import RequestRejected

if TYPE_CHECKING:
    from tokenops.engine.grammar import CompiledGrammar
    from tokenops.engine.reasoning import ReasoningSpec


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    seed: int | None = None  # per-request generator: same seed -> same tokens, whatever the batch
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: chosen token's logprob plus k top alternatives
    # thinking budget: the engine forces the end marker once the section holds this many tokens
    reasoning: ReasoningSpec | None = None
    speculative: bool = True  # False: this request never speculates, even when the engine does
    # structured output: each token is drawn from what this grammar allows (never speculates)
    grammar: CompiledGrammar | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestRejected("max_tokens must be at least 1.", param="max_tokens")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise RequestRejected("temperature must be >= 0.", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestRejected("top_p must be in (0, 1].", param="top_p")
        if self.top_k == 0 or self.top_k < -1:
            raise RequestRejected("top_k must be -1 (off) or a positive integer.", param="top_k")
        if self.logprobs is not None and self.logprobs < 0:
            raise RequestRejected("logprobs must be >= 0.", param="logprobs")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.grammar is not None:
            self.speculative = False  # drafts are not checked against the grammar

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
