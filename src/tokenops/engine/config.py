"""Engine configuration and the typed refusals the engine raises at its edge.

`EngineConfig` holds the knobs of the engine core (KV pool, batching limits, prefix caching, device
and dtype); it is validated once, at construction. `RequestRejected` is raised by `add_request` for a
request that could never run (too long for the model or the KV pool, bad sampling values); the server
maps it to an OpenAI-format 400. Model and tokenizer settings live with the model loader, not here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenops.engine.kv_cache import KV_CACHE_DTYPES
from tokenops.engine.quantize import MODES as QUANTIZATION_MODES
from tokenops.engine.quantize import auto_quantization, dynamic_int8_unavailable
from tokenops.engine.quantize.common import has_bf16_tiles
from tokenops.engine.speculative.config import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

_KV_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


@dataclass
class KVEvictionConfig:
    """Attention sinks + recent window (tokenops.engine.kv_eviction): the KV a long sequence keeps."""

    sink_tokens: int = 4
    window_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.sink_tokens < 0:
            raise ValueError("kv_eviction.sink_tokens must be >= 0")
        if self.window_tokens < 1:
            raise ValueError("kv_eviction.window_tokens must be >= 1")


# `max_prefill_step_tokens` where the CPU has AMX (docs/benchmarks.md, engine_prefill_profile.py)
PREFILL_STEP_TOKENS_AMX = 1024


@dataclass
class EngineConfig:
    block_size: int = 16
    # KV pool: an explicit block count, or sized from a memory budget (both K and V, all layers)
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 512 * 2**20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # most tokens one prefill takes in a step; None = the whole budget. Under a budget larger than it,
    # a burst of prompts is admitted several per step while a long prompt still runs in chunks
    # (the simulator's EngineShape.max_chunk_tokens)
    max_chunk_tokens: int | None = None
    # the budget of a step in which no running sequence is one token from sampling (no decode whose
    # inter-token latency a long step would stretch): its first prefill may take up to this many
    # tokens in one chunk, so a prompt of up to this length is one causal chunk instead of several.
    # At or below max_num_batched_tokens it changes nothing. None: PREFILL_STEP_TOKENS_AMX where bf16
    # runs on AMX's tiles (`has_bf16_tiles`: long chunks attend there), else (and under kv_eviction) the step
    # budget (on AVX2 one long chunk measured slower: docs/engine-core.md)
    max_prefill_step_tokens: int | None = None
    # context window; None = the model's max_position_embeddings (also capped by the KV pool)
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    device: str = "cpu"
    # KV cache dtype; None = the model's parameter dtype
    dtype: torch.dtype | str | None = None
    # seeds the prefix-cache hash chain so that blocks of different models never match
    model_id: str = ""
    # bounded buffer of KV events (block stored / evicted) that the server drains
    kv_event_capacity: int = 10_000
    # blocks pinned for a decode engine's pull are released after this long if it never pulls them
    kv_hold_timeout_s: float = 60.0
    # torch intra-op threads for this process; None leaves torch's default. On a shared, busy
    # machine 1 is far faster than 2 (OpenMP threads wait on each other when descheduled).
    num_threads: int | None = None
    # quantisation of the linear layers, applied once at engine start: None, "int8", "int4" (weight-only)
    # or "int8_dynamic" (W8A8: int8 weights and per-step int8 activations, fbgemm, CPU only; the
    # fastest at batches of 8-32) or "bf16" (weights held as bf16, float32 activations for decode rows,
    # oneDNN bf16 for larger batches) (tokenops.engine.quantize; the embedding / tied lm_head stay in
    # full precision; "bf16" gives the head a bf16 copy); "auto" = the mode measured nearest the fastest
    # at every batch size on this CPU's feature set, resolved at construction (quantize.auto.AUTO_TABLE)
    quantization: str | None = None
    # int4: input columns sharing one scale and offset (32, 64 or 128); 32 keeps SmolLM2 near float32
    quantization_group_size: int = 32
    # int4 only, GGUF models: the loader builds the linear layers from the file's Q4_0 / Q4_1 / Q4_K
    # blocks as they are (group 32, no dequantise / re-quantise, no dequantisation cache) and
    # quantises the other types at load time (tokenops.engine.gguf_quant); pass it to load_model
    gguf_native: bool = False
    # CPU float32: keep oneDNN-prepacked / transposed copies of the linear weights (faster decode,
    # above all on the vocabulary projection; costs one more copy of the weights in memory)
    derived_weights: bool = True
    # KV cache storage: "float32", "bfloat16", "float16" (a plain cache of that dtype; attention still
    # computes in float32), "int8" (int8 with per-(token, head) scales), or "auto" = the model's dtype,
    # except bfloat16 for a float32 model with quantization "bf16" / "int8_dynamic" on a CPU with
    # native bf16 (kv_cache.resolve_kv_dtype); "fp32" / "bf16" / "fp16" are accepted as aliases
    kv_cache_dtype: str = "auto"
    # opt-in eviction of the middle of long sequences; None keeps every token's KV
    kv_eviction: KVEvictionConfig | dict | None = None
    # speculative decoding, off by default: a SpeculativeConfig, or its dict / JSON / method name
    # ({"method": "ngram", "num_tokens": 4}; {"method": "draft", "draft_model": "self:8"})
    speculative: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_chunk_tokens is not None and self.max_chunk_tokens < 1:
            raise ValueError("max_chunk_tokens must be >= 1")
        if self.max_prefill_step_tokens is None:
            # (not under KV eviction, whose pool is sized for one step of the budget beside the window)
            on = has_bf16_tiles(self.device) and self.kv_eviction is None
            self.max_prefill_step_tokens = PREFILL_STEP_TOKENS_AMX if on else self.max_num_batched_tokens
        if self.max_prefill_step_tokens < 1:
            raise ValueError("max_prefill_step_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if self.dtype is not None:
            self.dtype = resolve_dtype(self.dtype)
        if self.quantization == "auto":  # resolved here, so everything downstream sees a concrete mode
            self.quantization = auto_quantization(self.device)
        if self.quantization not in (None, *QUANTIZATION_MODES):
            raise ValueError(
                f"unknown quantization {self.quantization!r}; use one of "
                f"{', '.join(map(repr, QUANTIZATION_MODES))}, 'auto' or None"
            )
        if self.quantization == "int8_dynamic" and (reason := dynamic_int8_unavailable(self.device)):
            raise ValueError(reason)
        if self.quantization_group_size not in (32, 64, 128):
            raise ValueError(
                f"quantization_group_size must be 32, 64 or 128, not {self.quantization_group_size}"
            )
        if self.gguf_native and (self.quantization != "int4" or self.quantization_group_size != 32):
            raise ValueError(
                "gguf_native builds int4 layers from the GGUF file's 32-weight blocks: "
                "it needs quantization='int4' with quantization_group_size=32"
            )
        self.kv_cache_dtype = _KV_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; "
                f"use one of {', '.join(map(repr, KV_CACHE_DTYPES))}"
            )
        if isinstance(self.kv_eviction, dict):
            unknown = set(self.kv_eviction) - {"sink_tokens", "window_tokens"}
            if unknown:
                raise ValueError(
                    f"unknown kv_eviction keys {sorted(unknown)}; use sink_tokens, window_tokens"
                )
            self.kv_eviction = KVEvictionConfig(**self.kv_eviction)
        if self.speculative is not None:
            self.speculative = SpeculativeConfig.from_value(self.speculative)


class RequestRejected(ValueError):
    """A request the engine can never run. `code` and `param` follow OpenAI's error fields."""

    def __init__(self, message: str, *, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class ContextLengthExceeded(RequestRejected):
    """The prompt (plus at least one generated token) does not fit the context window or the KV pool."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(
            f"The prompt has {prompt_tokens} tokens but this engine's context window is {limit} tokens "
            "(room must remain for at least one generated token). Shorten the prompt.",
            code="context_length_exceeded",
            param="messages",
        )
        self.prompt_tokens = prompt_tokens
        self.limit = limit
