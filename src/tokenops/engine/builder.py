"""Building an engine's parts from a model and an `EngineConfig`, in the order they depend on.

`build_engine_parts` sets torch's threads, moves the model to its device and quantises it there,
builds (or loads) the native kernels, picks the KV cache's dtype and sizes the pool from the memory
budget, makes the block pool, scheduler and model runner, and loads the speculative draft model
when the config names one. `LLMEngine` calls it once, at construction, and keeps what it returns;
this module runs nothing per step and holds no state of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenops.engine import kernels
from tokenops.engine.block_pool import BlockPool
from tokenops.engine.config import EngineConfig
from tokenops.engine.kv_cache import kv_blocks_for_budget, kv_bytes_per_block, resolve_kv_dtype
from tokenops.engine.model_runner import ModelRunner
from tokenops.engine.models import CausalLM
from tokenops.engine.models.layers import derived_weight_bytes, use_derived_weights
from tokenops.engine.models.moe import quantize_experts
from tokenops.engine.quantize import quantize_model, weight_bytes
from tokenops.engine.quantize.common import block_kernels, has_native_bf16
from tokenops.engine.scheduler import Scheduler
from tokenops.engine.speculative.speculator import Speculator

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    device: torch.device
    kv_dtype: torch.dtype
    kv_bytes_per_token: int
    memory_bytes: dict[str, int]  # what the engine holds: weights, derived weight copies, KV cache
    pool: BlockPool
    scheduler: Scheduler
    runner: ModelRunner
    speculator: Speculator | None


def build_engine_parts(
    model: CausalLM,
    config: EngineConfig,
    eos_token_ids: list[int] | tuple[int, ...] = (),
    draft_model: CausalLM | None = None,
) -> EngineParts:
    """`draft_model`: a loaded speculative draft model; when None and the config names one (not
    'self:N'), it is loaded here with the loader, on the engine's device."""
    device = torch.device(config.device)
    model_dtype = next(model.parameters()).dtype
    _prepare_model(model, config, device)
    kv_dtype = resolve_kv_dtype(
        config.kv_cache_dtype,
        config.dtype or model_dtype,
        config.quantization,
        has_native_bf16(device),
        block_kernels(device),
    )
    block_size = config.block_size
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        num_blocks = kv_blocks_for_budget(model.config, block_size, kv_dtype, config.kv_cache_memory_bytes)
    # the budget above sizes only the KV pool; the derived weight copies (built on first use) are
    # counted here before they exist
    memory_bytes = {
        "weights": weight_bytes(model),
        "derived_weights": derived_weight_bytes(model),
        "kv_cache": num_blocks * kv_bytes_per_block(model.config, block_size, kv_dtype),
    }
    kv_bytes_per_token = kv_bytes_per_block(model.config, 1, kv_dtype)
    pool = BlockPool(
        num_blocks,
        block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        model_id=config.model_id or model.config.architecture,
        event_capacity=config.kv_event_capacity,
    )
    max_len = config.max_model_len or model.config.max_position_embeddings
    eos = tuple(eos_token_ids) or tuple(model.config.eos_token_ids)
    scheduler = Scheduler(config, pool, max_len, eos)
    if scheduler.eviction is not None:
        budget = max(config.max_num_batched_tokens, config.max_prefill_step_tokens)
        step_tokens = min(budget, config.max_chunk_tokens or budget)
        need = scheduler.eviction.max_blocks_per_sequence(step_tokens)
        if need > num_blocks:
            raise ValueError(
                f"kv_eviction needs at least {need} KV blocks for one sequence (sinks + window + one "
                f"step of max_num_batched_tokens) but the pool has {num_blocks}; "
                "give the KV cache more memory or shrink window_tokens / max_num_batched_tokens"
            )
    _log_sizes(config, num_blocks, kv_dtype, kv_bytes_per_token, memory_bytes)
    runner = ModelRunner(model, num_blocks, block_size, kv_dtype, device)
    speculator = None
    if config.speculative is not None:
        spec = config.speculative
        if spec.method == "draft" and spec.draft_layers is None and draft_model is None:
            from tokenops.engine.loader import load_model

            draft_model = load_model(spec.draft_model, device=str(device), dtype=model_dtype).model
        speculator = Speculator(spec, runner, draft_model)
    return EngineParts(
        device, kv_dtype, kv_bytes_per_token, memory_bytes, pool, scheduler, runner, speculator
    )


def _prepare_model(model: CausalLM, config: EngineConfig, device: torch.device) -> None:
    """Threads, device, weight format and kernels: everything the first request must not wait for."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    if next(model.parameters()).device.type != device.type:
        model.to(device)
    # in place, after the move so the int8 weights are made on their final device
    quantize_model(model, config.quantization, group_size=config.quantization_group_size)
    quantize_experts(model, config.quantization, group_size=config.quantization_group_size)
    use_derived_weights(model, config.derived_weights)
    kernels.ops(device)  # build or load the native kernels now, not inside the first request


def _log_sizes(
    config: EngineConfig,
    num_blocks: int,
    kv_dtype: torch.dtype,
    kv_bytes_per_token: int,
    memory_bytes: dict[str, int],
) -> None:
    logger.info(
        "KV cache: %d blocks of %d tokens, %s, %d bytes per token (%.1f MiB)%s",
        num_blocks,
        config.block_size,
        str(kv_dtype).removeprefix("torch."),
        kv_bytes_per_token,
        num_blocks * config.block_size * kv_bytes_per_token / 2**20,
        f", eviction {config.kv_eviction}" if config.kv_eviction else "",
    )
    logger.info(
        "memory: %.1f MiB in all (weights %.1f, derived weight copies %.1f, KV cache %.1f)",
        sum(memory_bytes.values()) / 2**20,
        *(memory_bytes[k] / 2**20 for k in ("weights", "derived_weights", "kv_cache")),
    )
