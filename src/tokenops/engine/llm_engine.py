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
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from tokenops.engine.block_manager import BlockPool, KVEvent
from tokenops.engine.config import EngineConfig, RequestRejected
from tokenops.engine.model_runner import ModelRunner, kv_bytes_per_block
from tokenops.engine.models import CausalLM
from tokenops.engine.models.layers import use_derived_weights
from tokenops.engine.quantize import quantize_model
from tokenops.engine.reasoning import ReasoningBudget
from tokenops.engine.sampler import Sampler, make_generator
from tokenops.engine.sampling_params import SamplingParams
from tokenops.engine.scheduler import Scheduler
from tokenops.engine.sequence import Sequence, SequenceStatus, TokenLogprob

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

    def to_dict(self) -> dict:
        return asdict(self)


class LLMEngine:
    def __init__(self, model: CausalLM, config: EngineConfig, eos_token_ids: list[int] | tuple[int, ...] = ()) -> None:
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
        kv_dtype = torch.int8 if config.kv_cache_dtype == "int8" else (config.dtype or param.dtype)
        block_size = config.block_size
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            num_blocks = max(1, config.kv_cache_memory_bytes // kv_bytes_per_block(self.model_config, block_size, kv_dtype))
        self.kv_dtype = kv_dtype
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
        self.runner = ModelRunner(model, num_blocks, block_size, kv_dtype, self.device)
        self.sampler = Sampler()
        self.stats = EngineStats()
        self._requests: dict[str, Sequence] = {}
        self._aborted: list[StepOutput] = []

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, config: EngineConfig) -> LLMEngine:
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
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        if sched.is_empty:
            return outputs
        logits, samplers = self.runner.execute(sched.scheduled)
        sampled: list[int | None] = [None] * len(sched.scheduled)
        logprobs: list[TokenLogprob | None] = [None] * len(sched.scheduled)
        if samplers:
            seqs = [sched.scheduled[i].seq for i in samplers]
            result = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
            for j, i in enumerate(samplers):
                sampled[i] = result.token_ids[j]
                logprobs[i] = result.logprobs[j]
                if seqs[j].reasoning is not None:  # the thinking budget may force the end marker
                    sampled[i], logprobs[i] = seqs[j].reasoning.next_token(sampled[i], logprobs[i])
        self.scheduler.update(sched, sampled)
        self.stats.steps += 1
        self.stats.prefix_queries, self.stats.prefix_hits = self.pool.prefix_queries, self.pool.prefix_hits
        for i in samplers:
            seq = sched.scheduled[i].seq
            if seq.num_output_tokens == 1:
                self.stats.prompt_tokens += seq.num_prompt_tokens
            self.stats.generation_tokens += 1
            lp = logprobs[i]
            outputs.append(self._output(seq, [sampled[i]], None if lp is None else [lp]))
            if seq.status is SequenceStatus.FINISHED:
                del self._requests[seq.request_id]
                self.stats.requests_finished += 1
        return outputs

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
            kv_cache_dtype=self.config.kv_cache_dtype,
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_evicted_blocks=self.scheduler.num_evicted_blocks,
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
