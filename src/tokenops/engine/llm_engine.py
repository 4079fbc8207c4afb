"""`LLMEngine`: the synchronous engine loop that ties scheduler, block pool, model runner and sampler.

`add_request` validates and queues a request, `step` runs one iteration (schedule, one forward pass,
sample, update) and returns what each request produced, `abort` finishes a request and frees its
blocks at once, `load` gives the cheap snapshot routers poll. The engine is single-threaded and not
thread-safe: the server drives it from one thread. It knows token ids only; text, stop strings and
HTTP belong to the server.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenops.engine import kernels
from tokenops.engine.block_manager import BlockPool, KVEvent
from tokenops.engine.config import EngineConfig, RequestRejected
from tokenops.engine.kv_cache import kv_dtype_name, resolve_kv_dtype
from tokenops.engine.model_runner import ModelRunner, kv_bytes_per_block
from tokenops.engine.models import CausalLM
from tokenops.engine.models.layers import derived_weight_bytes, use_derived_weights
from tokenops.engine.models.moe import expert_load
from tokenops.engine.quantize import quantize_model, weight_bytes
from tokenops.engine.quantize.common import has_native_bf16
from tokenops.engine.reasoning import ReasoningBudget
from tokenops.engine.sampler import Sampler, make_generator
from tokenops.engine.sampling_params import SamplingParams
from tokenops.engine.scheduler import Scheduler
from tokenops.engine.sequence import Sequence, SequenceStatus, TokenLogprob
from tokenops.engine.speculative.speculator import Speculator

if TYPE_CHECKING:
    from tokenops.engine.loader import LoadedModel

_generate_ids = itertools.count()
logger = logging.getLogger(__name__)

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


@dataclass
class LoadSnapshot:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_usage: float
    tokens_in_flight: int  # tokens (prompt + generated) held by unfinished requests
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_cache_dtype: str = "auto"
    kv_bytes_per_token: int = 0
    kv_evicted_blocks: int = 0  # blocks dropped by KV eviction since start
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    # MoE models: tokens routed to each expert since start, by layer (models.moe.expert_load)
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _apply_reasoning(
    budget: ReasoningBudget, sampled: int | list[int], logprob: TokenLogprob | None
) -> tuple[int | list[int], TokenLogprob | None]:
    """Run the thinking-budget hook over a step's token or accepted speculative run. A run is cut at
    the first token the hook replaces: the drafts after it were conditioned on another token."""
    if isinstance(sampled, int):
        return budget.next_token(sampled, logprob)
    out: list[int] = []
    for token in sampled:
        kept, _ = budget.next_token(token, None)
        out.append(kept)
        if kept != token:
            break
    return out, logprob


class LLMEngine:
    def __init__(self, model: CausalLM, config: EngineConfig, eos_token_ids: list[int] | tuple[int, ...] = (),
                 draft_model: CausalLM | None = None) -> None:
        """`draft_model`: a loaded speculative draft model; when None and the config names one (not
        'self:N'), it is loaded here with the loader, on the engine's device."""
        self.config = config
        self.model = model
        self.model_config = model.config
        self.device = torch.device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        param = next(model.parameters())
        if param.device.type != self.device.type:
            model.to(self.device)
        # in place, after the move so the int8 weights are made on their final device
        quantize_model(model, config.quantization, group_size=config.quantization_group_size)
        use_derived_weights(model, config.derived_weights)
        kernels.ops(self.device)  # build or load the native kernels now, not inside the first request
        kv_dtype = resolve_kv_dtype(
            config.kv_cache_dtype, config.dtype or param.dtype, config.quantization, has_native_bf16(self.device)
        )
        block_size = config.block_size
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            num_blocks = max(1, config.kv_cache_memory_bytes // kv_bytes_per_block(self.model_config, block_size, kv_dtype))
        self.kv_dtype = kv_dtype
        # what the engine holds: the budget above sizes only the KV pool; the derived weight copies
        # (built on first use, up to +120% of float32 weights) are counted here before they exist
        self.memory_bytes = {
            "weights": weight_bytes(model),
            "derived_weights": derived_weight_bytes(model),
            "kv_cache": num_blocks * kv_bytes_per_block(self.model_config, block_size, kv_dtype),
        }
        self.kv_bytes_per_token = kv_bytes_per_block(self.model_config, 1, kv_dtype)
        self.pool = BlockPool(
            num_blocks, block_size, enable_prefix_caching=config.enable_prefix_caching,
            model_id=config.model_id or self.model_config.architecture, event_capacity=config.kv_event_capacity,
        )
        max_len = config.max_model_len or self.model_config.max_position_embeddings
        eos = tuple(eos_token_ids) or tuple(self.model_config.eos_token_ids)
        self.scheduler = Scheduler(config, self.pool, max_len, eos)
        if self.scheduler.eviction is not None:
            need = self.scheduler.eviction.max_blocks_per_sequence(config.max_num_batched_tokens)
            if need > num_blocks:
                raise ValueError(
                    f"kv_eviction needs at least {need} KV blocks for one sequence (sinks + window + one "
                    f"step of max_num_batched_tokens) but the pool has {num_blocks}; "
                    "give the KV cache more memory or shrink window_tokens / max_num_batched_tokens"
                )
        logger.info(
            "KV cache: %d blocks of %d tokens, %s, %d bytes per token (%.1f MiB)%s", num_blocks, block_size,
            str(kv_dtype).removeprefix("torch."), self.kv_bytes_per_token,
            num_blocks * block_size * self.kv_bytes_per_token / 2**20,
            f", eviction {config.kv_eviction}" if config.kv_eviction else "",
        )
        logger.info(
            "memory: %.1f MiB in all (weights %.1f, derived weight copies %.1f, KV cache %.1f)",
            sum(self.memory_bytes.values()) / 2**20,
            *(self.memory_bytes[k] / 2**20 for k in ("weights", "derived_weights", "kv_cache")),
        )
        self.runner = ModelRunner(model, num_blocks, block_size, kv_dtype, self.device)
        self.sampler = Sampler()
        self.speculator = None
        if config.speculative is not None:
            spec = config.speculative
            if spec.method == "draft" and spec.draft_layers is None and draft_model is None:
                from tokenops.engine.loader import load_model

                draft_model = load_model(spec.draft_model, device=str(self.device), dtype=param.dtype).model
            self.speculator = Speculator(spec, self.runner, draft_model)
        self.stats = EngineStats()
        self._requests: dict[str, Sequence] = {}
        self._aborted: list[StepOutput] = []

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, config: EngineConfig) -> LLMEngine:
        if config.gguf_native and not loaded.load_stats.get("gguf_native"):
            # the int4 layers come from the file at load time; a model loaded without them would be
            # quantised again from float weights, silently not what the config asks for
            raise ValueError("gguf_native is set but the model was loaded without it: pass gguf_native=True to load_model")
        if not config.model_id:
            config.model_id = loaded.name
        eos = list(loaded.tokenizer.eos_token_ids) or list(loaded.config.eos_token_ids)
        return cls(loaded.model, config, eos)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0) -> None:
        """Queue a request; raise `RequestRejected` (a 400) if it can never run."""
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
        self.scheduler.add(seq)
        self._requests[request_id] = seq

    def abort(self, request_id: str) -> None:
        """Finish a request now and free its blocks; unknown or finished ids are ignored."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.finish(seq, "abort")
        self.stats.requests_finished += 1
        self._aborted.append(self._output(seq, [], None))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # -- one iteration ------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        outputs, self._aborted = self._aborted, []
        if self.speculator is not None:
            self.speculator.plan(self.scheduler.running, self.max_model_len)
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        if sched.is_empty:
            return outputs
        draft_probs = self.speculator.propose(sched.scheduled) if self.speculator is not None else None
        logits, samplers = self.runner.execute(sched.scheduled)
        sampled: list[int | list[int] | None] = [None] * len(sched.scheduled)
        logprobs: list[TokenLogprob | None] = [None] * len(sched.scheduled)
        if samplers:
            # each sampling entry owns 1 + (its draft tokens) consecutive logits rows
            first_row, plain, row = {}, [], 0
            for i in samplers:
                first_row[i] = row
                row += 1 + sched.scheduled[i].num_lookahead
                if not sched.scheduled[i].num_lookahead:
                    plain.append(i)
            if plain:
                rows = logits if len(plain) == len(samplers) else logits[[first_row[i] for i in plain]]
                seqs = [sched.scheduled[i].seq for i in plain]
                result = self.sampler(rows, [s.params for s in seqs], [s.generator for s in seqs])
                for j, i in enumerate(plain):
                    sampled[i] = result.token_ids[j]
                    logprobs[i] = result.logprobs[j]
            for i in samplers:
                entry = sched.scheduled[i]
                if entry.num_lookahead:
                    rows = logits[first_row[i] : first_row[i] + 1 + entry.num_lookahead]
                    sampled[i] = self.speculator.verify(rows, entry, draft_probs[i])
            for i in samplers:
                seq = sched.scheduled[i].seq
                if seq.reasoning is not None:  # the thinking budget may force the end marker
                    sampled[i], logprobs[i] = _apply_reasoning(seq.reasoning, sampled[i], logprobs[i])
        before = {i: len(sched.scheduled[i].seq.token_ids) for i in samplers}
        self.scheduler.update(sched, sampled)
        self.stats.steps += 1
        self.stats.prefix_queries, self.stats.prefix_hits = self.pool.prefix_queries, self.pool.prefix_hits
        for i in samplers:
            seq = sched.scheduled[i].seq
            new = seq.token_ids[before[i] :]  # tokens after a stop were dropped by the scheduler
            if seq.num_output_tokens == len(new):
                self.stats.prompt_tokens += seq.num_prompt_tokens
            self.stats.generation_tokens += len(new)
            lp = logprobs[i]
            outputs.append(self._output(seq, new, None if lp is None else [lp]))
            if seq.status is SequenceStatus.FINISHED:
                del self._requests[seq.request_id]
                self.stats.requests_finished += 1
        self._record_speculation()
        return outputs

    def _record_speculation(self) -> None:
        if self.speculator is None:
            return
        spec, stats = self.speculator.stats, self.stats
        stats.spec_draft_tokens, stats.spec_accepted_tokens = spec.draft_tokens, spec.accepted_tokens
        stats.spec_verifications = spec.verifications
        stats.spec_acceptance_rate, stats.spec_mean_accepted_length = spec.acceptance_rate, spec.mean_accepted_length

    @staticmethod
    def _output(seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None) -> StepOutput:
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            logprobs=logprobs,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
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
            expert_tokens=expert_load(self.model),
        )

    def drain_kv_events(self) -> list[KVEvent]:
        """KV events (block stored / evicted) since the last call, oldest first."""
        return self.pool.events.drain()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
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
