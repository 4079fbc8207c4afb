"""The engine's speculative step: plan draft lengths, propose drafts, keep a draft model's KV in step,
verify the drafts, count. `LLMEngine.step` calls, in order: `plan` before scheduling (each decoding
sequence asks for `num_lookahead` extra KV slots, which the scheduler grants only when the batch
budget and the pool allow, never by preempting), `propose` after scheduling (drafts fill the
granted slots; a shorter draft gives the rest back), `mirror` after the target's forward pass (a
separate draft model runs the same batch into its own KV cache), and `verify` on the target's
logits of each speculating sequence (one row for its last token plus one per draft). The scheduler
commits the emitted tokens and rolls back the KV slots of rejected drafts. A request opts out with
`SamplingParams.speculative = False`; requests that ask for logprobs decode plainly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenops.engine.context import ForwardContext
from tokenops.engine.kv_cache import allocate_kv_caches
from tokenops.engine.model_runner import ModelRunner
from tokenops.engine.models import CausalLM
from tokenops.engine.sampler import Sampler
from tokenops.engine.scheduler import ScheduledSequence
from tokenops.engine.sequence import Sequence
from tokenops.engine.speculative.config import SpeculativeConfig
from tokenops.engine.speculative.draft_length import DraftLength
from tokenops.engine.speculative.proposers import DraftModelProposer, PromptLookupProposer
from tokenops.engine.speculative.rejection import rejection_sample, verify_greedy


@dataclass
class SpeculativeStats:
    draft_tokens: int = 0  # draft tokens the target verified
    accepted_tokens: int = 0  # of which accepted
    verifications: int = 0  # sequence-steps that verified at least one draft

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: accepted drafts plus the target's own token (vLLM's
        'mean acceptance length'); 1.0 means speculation bought nothing."""
        return 1.0 + self.accepted_tokens / self.verifications if self.verifications else 0.0


class Speculator:
    def __init__(
        self, config: SpeculativeConfig, runner: ModelRunner, draft_model: CausalLM | None = None
    ) -> None:
        """`draft_model`: the loaded separate draft model when `config.draft_model` names one."""
        self.config = config
        self.proposer: PromptLookupProposer | DraftModelProposer
        self._separate_draft = False  # a draft model with a KV cache of its own, which `mirror` fills
        if config.method == "ngram":
            self.proposer = PromptLookupProposer(config.ngram_min, config.ngram_max)
        elif config.draft_layers is not None:
            self.proposer = DraftModelProposer(
                runner.model, config.draft_layers, runner.kv_caches, runner.block_size, runner.device
            )
        else:
            if draft_model is None:
                raise ValueError(f"the draft model {config.draft_model!r} was not loaded")
            target, draft = runner.config, draft_model.config
            if draft.vocab_size != target.vocab_size:
                raise ValueError(
                    f"the draft model's vocabulary ({draft.vocab_size}) differs from the target's "
                    f"({target.vocab_size}); a draft model needs the target's tokenizer"
                )
            k_cache = runner.kv_caches[0][0]
            caches = allocate_kv_caches(
                draft.num_layers,
                k_cache.shape[0],
                runner.block_size,
                draft.num_kv_heads,
                draft.head_dim,
                k_cache.dtype,
                runner.device,
            )
            self.proposer = DraftModelProposer(draft_model, None, caches, runner.block_size, runner.device)
            self._separate_draft = True
        self.stats = SpeculativeStats()

    def plan(self, running: list[Sequence], max_model_len: int) -> None:
        """Set each running sequence's `num_lookahead`: the draft slots it asks for this step."""
        for seq in running:
            seq.num_lookahead = self._lookahead(seq, max_model_len) if seq.num_uncomputed_tokens == 1 else 0

    def _lookahead(self, seq: Sequence, max_model_len: int) -> int:
        p = seq.params
        if not p.speculative or p.logprobs is not None:
            return 0
        if seq.draft_length is None:
            seq.draft_length = DraftLength(self.config)
        # a step emits at most drafts + 1 tokens: never draft past max_tokens or the context window
        room = min(p.max_tokens - seq.num_output_tokens, max_model_len - len(seq.token_ids)) - 1
        return max(0, min(seq.draft_length.next(), room))

    def propose(self, scheduled: list[ScheduledSequence]) -> list[torch.Tensor | None]:
        """Fill the granted draft slots; return each entry's draft probabilities (None when q is
        one-hot or the entry does not speculate), aligned with `scheduled`."""
        q: list[torch.Tensor | None] = [None] * len(scheduled)
        idx = [i for i, e in enumerate(scheduled) if e.num_lookahead]
        if not idx:
            return q
        drafts, probs = self.proposer.propose([scheduled[i] for i in idx])
        for i, d, pr in zip(idx, drafts, probs, strict=True):
            entry = scheduled[i]
            entry.num_new_tokens -= entry.num_lookahead - len(d)
            entry.num_lookahead = len(d)
            entry.draft_token_ids = d
            q[i] = pr
        return q

    def mirror(self, input_ids: torch.Tensor, ctx: ForwardContext) -> None:
        """After the target's forward pass: run a separate draft model over the same batch so its KV
        cache holds every token the target computed (n-gram and self-drafts keep no cache of their own)."""
        if self._separate_draft:
            self.proposer.mirror(input_ids, ctx)

    def verify(
        self, logits: torch.Tensor, entry: ScheduledSequence, draft_probs: torch.Tensor | None
    ) -> list[int]:
        """logits: the target's [1 + k, V] rows for this entry. Returns the tokens to emit."""
        seq, drafts = entry.seq, entry.draft_token_ids
        if seq.params.greedy:
            tokens = verify_greedy(logits, drafts)
        else:
            probs = Sampler.probs(logits, [seq.params] * logits.shape[0])
            tokens = rejection_sample(probs, drafts, draft_probs, seq.generator)
        accepted = len(tokens) - 1
        self.stats.draft_tokens += len(drafts)
        self.stats.accepted_tokens += accepted
        self.stats.verifications += 1
        seq.draft_length.observe(len(drafts), accepted)
        return tokens
