"""`LLMEngine`: the synchronous engine loop over scheduler, block pool, model runner and sampler.

`add_request` validates and queues a request, `step` runs one iteration (schedule, run the model
once, sample or verify, update the sequences) and returns what each request produced, `abort`
finishes a request and frees its blocks at once, `load` gives the cheap snapshot routers poll. The
engine is single-threaded and not thread-safe: the server drives it from one thread. It knows token
ids only; text, stop strings and HTTP belong to the server, and building its parts to `builder.py`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenops.engine.block_pool import KVEvent
from tokenops.engine.builder import build_engine_parts
from tokenops.engine.config import EngineConfig, RequestRejected
from tokenops.engine.grammar import mask_rows
from tokenops.engine.kv_cache import kv_dtype_name
from tokenops.engine.kv_transfer import (
    Hold,
    KVHolds,
    KVImport,
    KVLayout,
    TransferStats,
    block_nbytes,
    import_block,
)
from tokenops.engine.load import LoadSnapshot
from tokenops.engine.models import CausalLM
from tokenops.engine.models.moe import expert_load
from tokenops.engine.reasoning import ReasoningBudget
from tokenops.engine.sampler import Sampler, make_generator
from tokenops.engine.sampling_params import SamplingParams
from tokenops.engine.sampling_rows import SamplingRows
from tokenops.engine.scheduler import SchedulerOutput
from tokenops.engine.sequence import Sequence, SequenceStatus, TokenLogprob

if TYPE_CHECKING:
    from tokenops.engine.loader import LoadedModel

_generate_ids = itertools.count()

__all__ = ["EngineStats", "LLMEngine", "LoadSnapshot", "RequestRejected", "StepOutput", "TokenLogprob"]


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]  # tokens produced in this step (0 or more)
    logprobs: list[TokenLogprob] | None  # one per new token when the request asked for logprobs
    finished: bool
    finish_reason: str | None  # "stop" (eos / stop token), "length", "abort"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache (final once prefill is done)
    num_transferred_tokens: int = 0  # of those, tokens whose KV a peer engine sent for this request
    kv_hold: Hold | None = None  # a finished request's prompt blocks, pinned for a peer's pull


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # prompt tokens of requests whose prefill completed
    generation_tokens: int = 0
    prefix_queries: int = 0  # tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found
    preemptions: int = 0
    steps: int = 0
    requests_finished: int = 0
    # speculative decoding (zero when it is off)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0


@dataclass(slots=True)
class StepTokens:
    """What a step chose per scheduled entry: a token, an accepted speculative run, or None (no
    sample: a prefill chunk that stops mid-prompt), with the logprob of a plain token when asked."""

    tokens: list[int | list[int] | None]
    logprobs: list[TokenLogprob | None]


class LLMEngine:
    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        draft_model: CausalLM | None = None,
    ) -> None:
        """`draft_model`: a loaded speculative draft model; when None and the config names one (not
        'self:N'), the builder loads it on the engine's device."""
        parts = build_engine_parts(model, config, eos_token_ids, draft_model)
        self.config = config
        self.model = model
        self.model_config = model.config
        self.device = parts.device
        self.kv_dtype = parts.kv_dtype
        self.kv_bytes_per_token = parts.kv_bytes_per_token
        self.memory_bytes = parts.memory_bytes
        self.pool = parts.pool
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.speculator = parts.speculator
        self.sampler = Sampler()
        self.stats = EngineStats()
        self.transfer_stats = TransferStats()
        self.kv_holds = KVHolds(self.pool, config.kv_hold_timeout_s, self.transfer_stats)
        self.kv_layout = KVLayout(
            config.model_id or self.model_config.architecture,
            kv_dtype_name(self.kv_dtype),
            self.pool.block_size,
            self.model_config.num_layers,
            self.model_config.num_kv_heads,
            self.model_config.head_dim,
        )
        self._hold_on_finish: set[str] = set()
        self._imported: dict[str, set[int]] = {}  # request id -> hashes of the blocks imported for it
        self._transferred: dict[str, int] = {}
        self._requests: dict[str, Sequence] = {}
        self._aborted: list[StepOutput] = []

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, config: EngineConfig) -> LLMEngine:
        if config.gguf_native and not loaded.load_stats.get("gguf_native"):
            # the int4 layers come from the file at load time; a model loaded without them would be
            # quantised again from float weights, silently not what the config asks for
            raise ValueError(
                "gguf_native is set but the model was loaded without it: pass gguf_native=True to load_model"
            )
        if not config.model_id:
            config.model_id = loaded.name
        eos = list(loaded.tokenizer.eos_token_ids) or list(loaded.config.eos_token_ids)
        return cls(loaded.model, config, eos)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    # -- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        *,
        hold_kv: bool = False,
        kv_import: KVImport | None = None,
    ) -> None:
        """Queue a request; raise `RequestRejected` (a 400) if it can never run.

        `hold_kv`: when it finishes, pin its full prompt blocks for a peer's pull (`StepOutput.kv_hold`).
        `kv_import`: blocks of this prompt a peer sent, registered in the prefix cache first."""
        if request_id in self._requests:
            raise RequestRejected(f"request id {request_id!r} is already in use", param="request_id")
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty; send at least one token", param="prompt")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})", param="prompt")
        seq = Sequence(request_id, prompt_token_ids, params, priority)
        if params.seed is not None:
            seq.generator = make_generator(params.seed, self.device)
        if params.reasoning is not None:
            seq.reasoning = ReasoningBudget(params.reasoning)
        if params.grammar is not None:
            seq.grammar = params.grammar.start()
        # the import first: one that fails (ValueError) leaves no request behind
        imported = self.import_kv(prompt_token_ids, kv_import) if kv_import is not None else None
        self.scheduler.add(seq)
        self._requests[request_id] = seq
        if hold_kv:
            self._hold_on_finish.add(request_id)
        if imported is not None:
            self._imported[request_id] = imported

    def import_kv(self, token_ids: list[int], kv: KVImport) -> set[int]:
        """Register a peer's blocks of `token_ids` (full blocks from `kv.start_block` on) in the pool's
        prefix cache; return the hashes of those written (blocks already cached here are skipped).
        A block whose hash is not the one these tokens give is never registered, nor any after it.
        Payloads of the wrong size register nothing (ValueError)."""
        nbytes = block_nbytes(self.runner.kv_caches)
        if len(kv.payloads) != len(kv.hashes) or any(len(p) != nbytes for p in kv.payloads):
            raise ValueError(f"a KV import takes one payload of {nbytes} bytes per hash")
        placed = self.pool.import_chain(token_ids, kv.start_block, kv.hashes)
        for bid, i in placed:
            import_block(self.runner.kv_caches, bid, kv.payloads[i])
        self.transfer_stats.blocks_received += len(placed)
        return {kv.hashes[i] for _, i in placed}

    def abort(self, request_id: str) -> None:
        """Finish a request now and free its blocks; unknown or finished ids are ignored."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return
        self._hold_on_finish.discard(request_id)
        self._imported.pop(request_id, None)
        self._transferred.pop(request_id, None)
        self.scheduler.finish(seq, "abort")
        self.stats.requests_finished += 1
        self._aborted.append(self._output(seq, [], None))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # -- one iteration ------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        outputs, self._aborted = self._aborted, []
        batch = self._schedule()
        if batch.is_empty:
            return outputs
        if self._imported:
            self._count_transferred(batch.scheduled)
        draft_probs = self.speculator.propose(batch.scheduled) if self.speculator is not None else None
        input_ids, ctx, rows = self.runner.prepare(batch.scheduled)
        logits = self.runner.run(input_ids, ctx, rows)
        if self.speculator is not None:
            self.speculator.mirror(input_ids, ctx)
        chosen = self._sample(batch, logits, rows, draft_probs)
        outputs.extend(self._update(batch, rows, chosen))
        return outputs

    def _schedule(self) -> SchedulerOutput:
        if self.speculator is not None:  # draft slots are asked for before the batch is built
            self.speculator.plan(self.scheduler.running, self.max_model_len)
        batch = self.scheduler.schedule()
        self.stats.preemptions += len(batch.preempted)
        return batch

    def _sample(
        self,
        batch: SchedulerOutput,
        logits: torch.Tensor | None,
        rows: SamplingRows,
        draft_probs: list[torch.Tensor | None] | None,
    ) -> StepTokens:
        """Plain entries sample together (grammar-constrained rows masked first); speculating entries
        verify their drafts; then each thinking budget may replace what was chosen."""
        chosen = StepTokens([None] * len(batch.scheduled), [None] * len(batch.scheduled))
        if not rows:
            return chosen
        constrained = [i for i in rows.plain if batch.scheduled[i].seq.grammar is not None]
        if constrained:
            mask_rows(
                logits,
                [rows.first_row[i] for i in constrained],
                [batch.scheduled[i].seq.grammar for i in constrained],
            )
        for i, (token, logprob) in rows.sample_plain(self.sampler, logits, batch.scheduled).items():
            chosen.tokens[i], chosen.logprobs[i] = token, logprob
        for i in rows.speculating:
            entry = batch.scheduled[i]
            verified = rows.draft_rows(logits, i, entry.num_lookahead)
            chosen.tokens[i] = self.speculator.verify(verified, entry, draft_probs[i])
        for i in rows.entries:
            budget = batch.scheduled[i].seq.reasoning
            if budget is not None:  # the thinking budget may force the end marker
                chosen.tokens[i], chosen.logprobs[i] = budget.apply(chosen.tokens[i], chosen.logprobs[i])
        for i in constrained:
            batch.scheduled[i].seq.grammar.accept(chosen.tokens[i])
        return chosen

    def _update(self, batch: SchedulerOutput, rows: SamplingRows, chosen: StepTokens) -> list[StepOutput]:
        """Commit the chosen tokens (the scheduler drops those after a stop), count, report."""
        before = {i: len(batch.scheduled[i].seq.token_ids) for i in rows.entries}
        self.scheduler.update(batch, chosen.tokens)
        self.stats.steps += 1
        self.stats.prefix_queries, self.stats.prefix_hits = self.pool.prefix_queries, self.pool.prefix_hits
        outputs = []
        for i in rows.entries:
            seq = batch.scheduled[i].seq
            new = seq.token_ids[before[i] :]
            if seq.num_output_tokens == len(new):
                self.stats.prompt_tokens += seq.num_prompt_tokens
            self.stats.generation_tokens += len(new)
            lp = chosen.logprobs[i]
            out = self._output(seq, new, None if lp is None else [lp])
            outputs.append(out)
            if seq.status is SequenceStatus.FINISHED:
                del self._requests[seq.request_id]
                self.stats.requests_finished += 1
                self._transferred.pop(seq.request_id, None)
                if seq.request_id in self._hold_on_finish:
                    self._hold_on_finish.discard(seq.request_id)
                    out.kv_hold = self.kv_holds.hold(seq.request_id, seq.token_ids[: seq.num_prompt_tokens])
        self._record_speculation()
        return outputs

    def _count_transferred(self, scheduled: list) -> None:
        """At a request's admission, how many of its cached prompt tokens came from imported blocks."""
        bs = self.pool.block_size
        for entry in scheduled:
            seq = entry.seq
            imported = self._imported.get(seq.request_id)
            if imported is None or seq.num_cached_tokens < 0:
                continue
            del self._imported[seq.request_id]
            reused = seq.block_hashes[: seq.num_cached_tokens // bs]
            self._transferred[seq.request_id] = bs * sum(h in imported for h in reused)

    def _record_speculation(self) -> None:
        if self.speculator is None:
            return
        spec, stats = self.speculator.stats, self.stats
        stats.spec_draft_tokens, stats.spec_accepted_tokens = spec.draft_tokens, spec.accepted_tokens
        stats.spec_verifications = spec.verifications
        stats.spec_acceptance_rate, stats.spec_mean_accepted_length = (
            spec.acceptance_rate,
            spec.mean_accepted_length,
        )

    def _output(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None) -> StepOutput:
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            logprobs=logprobs,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_transferred_tokens=self._transferred.get(seq.request_id, 0),
        )

    # -- observability ------------------------------------------------------------------------

    def load(self) -> LoadSnapshot:
        pool = self.pool
        self.stats.prefix_queries, self.stats.prefix_hits = pool.prefix_queries, pool.prefix_hits
        return LoadSnapshot(
            running=len(self.scheduler.running),
            waiting=self.scheduler.num_waiting,
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_total=pool.num_blocks,
            kv_usage=pool.usage,
            tokens_in_flight=sum(len(s.token_ids) for s in self._requests.values()),
            prefix_cache_queries=pool.prefix_queries,
            prefix_cache_hits=pool.prefix_hits,
            kv_cache_dtype=kv_dtype_name(self.kv_dtype),
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_evicted_blocks=self.scheduler.num_evicted_blocks,
            spec_draft_tokens=self.stats.spec_draft_tokens,
            spec_accepted_tokens=self.stats.spec_accepted_tokens,
            spec_acceptance_rate=self.stats.spec_acceptance_rate,
            spec_mean_accepted_length=self.stats.spec_mean_accepted_length,
            preemptions=self.stats.preemptions,
            at=time.time(),
            expert_tokens=expert_load(self.model),
        )

    def drain_kv_events(self) -> list[KVEvent]:
        """KV events (block stored / evicted) since the last call, oldest first."""
        return self.pool.events.drain()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Convenience for tests and scripts: run `prompts` to completion, return their output ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(_generate_ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.new_token_ids)
        return [out[rid] for rid in ids]
