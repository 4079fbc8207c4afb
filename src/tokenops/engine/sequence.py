"""Per-request state inside the engine: tokens, progress through the KV cache, blocks, and outcome.

A `Sequence` is plain data. The scheduler moves it between WAITING, RUNNING and FINISHED, the block
pool fills its `block_table`, the model runner reads it to build the batch. The invariant that ties
them together: `token_ids[:num_computed_tokens]` have their K/V in the cache, and the sequence needs
a new token sampled exactly when every token it holds is computed.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenops.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenops.engine.grammar import GrammarState
    from tokenops.engine.reasoning import ReasoningBudget
    from tokenops.engine.speculative.draft_length import DraftLength

_arrivals = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob) of the k most likely tokens, best first


class Sequence:
    __slots__ = (
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "params",
        "priority",
        "arrival",
        "status",
        "num_computed_tokens",
        "block_table",
        "block_hashes",
        "num_cached_tokens",
        "finish_reason",
        "generator",
        "num_preemptions",
        "reasoning",
        "kv_gap_start",
        "kv_gap_len",
        "num_lookahead",
        "draft_length",
        "grammar",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params or SamplingParams()
        self.priority = priority
        self.arrival = next(_arrivals)  # strictly increasing: ties in priority go first-come first-served
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # chained hashes of the leading full blocks already registered in the prefix cache
        self.block_hashes: list[int] = []
        self.num_cached_tokens = -1  # set when first scheduled; -1 = not yet known
        self.finish_reason: str | None = None
        self.generator: torch.Generator | None = None
        self.num_preemptions = 0
        self.reasoning: ReasoningBudget | None = None  # set when the request has a thinking budget
        # KV eviction: tokens [kv_gap_start, kv_gap_start + kv_gap_len) have no KV any more (whole
        # blocks dropped from block_table); 0 length = nothing evicted
        self.kv_gap_start = 0
        self.kv_gap_len = 0
        # speculative decoding: draft slots asked for this step, and the adaptive draft length
        self.num_lookahead = 0
        self.draft_length: DraftLength | None = None
        self.grammar: GrammarState | None = None  # set when the output is grammar-constrained

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Smaller = more important: priority first (lower number wins), then earlier arrival."""
        return (self.priority, self.arrival)
