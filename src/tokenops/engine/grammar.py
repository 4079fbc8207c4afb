"""Grammar-constrained decoding: a request's output follows an llguidance grammar (a JSON schema, a
forced tool call), enforced as a token mask on its logits row before sampling.

`GrammarCompiler` holds the llguidance view of the model's tokenizer (built once, about a second)
and compiles a grammar into a `CompiledGrammar`, which each choice of a request starts as its own
`GrammarState`. Per step, `mask_rows` fills one bitmask row per constrained sequence (in parallel,
on llguidance's thread pool) and sets every disallowed logit of those rows to -inf; the other rows
of the batch are not touched, as in vLLM's structured-output backend. The state then consumes the
token the sampler chose. A finished grammar allows only the end-of-sequence tokens, so the sequence
stops as soon as its output is complete.

For a reasoning model the grammar constrains the answer only, as vLLM's reasoning parser does with
structured output: while a thinking section is open the row is not masked and its tokens do not
advance the grammar; the answer after the end marker is. Before a section is open (a template that
lets the model choose), the mask also allows a single-token start marker.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import llguidance
import llguidance.torch as llg_torch
import torch

from tokenops.engine.config import RequestRejected
from tokenops.engine.reasoning import Phase, ReasoningMarkers, ReasoningParser


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A grammar checked against the tokenizer; `start()` gives a fresh state per choice."""

    matcher: llguidance.LLMatcher
    # a reasoning model's markers and where its generation starts: the grammar waits for the answer
    thinking: tuple[ReasoningMarkers, Phase] | None = None

    def after_thinking(self, markers: ReasoningMarkers, phase: Phase) -> CompiledGrammar:
        """This grammar applied to the answer only, once a thinking section has ended."""
        return self if phase is Phase.ANSWER else replace(self, thinking=(markers, phase))

    def start(self) -> GrammarState:
        thinking = ReasoningParser(*self.thinking) if self.thinking is not None else None
        return GrammarState(self.matcher.deep_copy(), thinking)


class GrammarState:
    """Where one sequence's output stands in its grammar (and in its thinking, before the answer)."""

    __slots__ = ("matcher", "thinking")

    def __init__(self, matcher: llguidance.LLMatcher, thinking: ReasoningParser | None = None) -> None:
        self.matcher = matcher
        self.thinking = thinking  # None once the answer has begun (or for a model that does not think)

    @property
    def masks(self) -> bool:
        """False while a thinking section is open: the thinking is the model's own."""
        return self.thinking is None or self.thinking.phase is not Phase.THINKING

    @property
    def opener(self) -> int | None:
        """A token allowed besides the grammar's: a single-token start marker, before any section."""
        t = self.thinking
        if t is not None and t.phase is Phase.BEFORE and len(t.markers.start) == 1:
            return t.markers.start[0]
        return None

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token (a finished grammar takes only end-of-sequence); thinking
        tokens and the markers around them pass the grammar by."""
        t = self.thinking
        if t is not None:
            if t.phase is Phase.THINKING or token_id == self.opener:
                t.feed(token_id)
                if t.phase is Phase.ANSWER:
                    self.thinking = None
                return
            self.thinking = None  # the model answered without thinking
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token_id)

    @property
    def failed(self) -> str:
        return self.matcher.get_error()


class GrammarCompiler:
    """Compiles grammars for one tokenizer; `vocab_size` is the width of the model's logits."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)

    def compile(self, grammar: str) -> CompiledGrammar:
        """Raises `RequestRejected` (a 400) when the grammar cannot be built for this tokenizer."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestRejected(
                f"The output constraint cannot be built: {matcher.get_error()}",
                param="response_format",
                code="unsupported_json_schema",
            )
        return CompiledGrammar(matcher)


_EXECUTOR: llguidance.LLExecutor | None = None
_BITS = torch.tensor([1 << b for b in range(32)], dtype=torch.int64).to(torch.int32)  # bit 31 wraps


@torch.inference_mode()
def mask_rows(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Set the logits each state's grammar disallows to -inf, in place, on `rows` only (a row whose
    sequence is thinking is left alone)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    masking = [(r, s) for r, s in zip(rows, states, strict=True) if s.masks]
    if not masking:
        return
    rows, states = [r for r, _ in masking], [s for _, s in masking]
    vocab = logits.shape[1]
    bitmask = llg_torch.allocate_token_bitmask(len(rows), vocab)
    llg_torch.fill_next_token_bitmask_par(_EXECUTOR, [(s.matcher, j) for j, s in enumerate(states)], bitmask)
    allowed = (bitmask.unsqueeze(-1) & _BITS).ne(0).reshape(len(rows), -1)[:, :vocab]
    for j, s in enumerate(states):
        if (opener := s.opener) is not None:
            allowed[j, opener] = True
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed.to(logits.device), float("-inf"))
