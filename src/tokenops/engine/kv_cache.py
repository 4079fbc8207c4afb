"""KV cache storage: the per-layer key and value tensors, their dtype, their size in bytes and how
many blocks a memory budget holds, and how tokens are written into them and read back.

A layer's keys (and values) are a plain tensor [num_blocks, block_size, kv_heads, head_dim] in a
float dtype (the model's, or bfloat16 / float16 on request: `resolve_kv_dtype`), or a `QuantizedKV`:
int8 values with one float16 scale per (token, kv head), symmetric (scale = max|x| / 127). The scale
is per token rather than per block so that writing a token never rescales its neighbours: a block's
bytes are final once its tokens are written, which is what lets the prefix cache share full blocks
unchanged. A bfloat16 (float16) cache under a float32 model rounds each key and value once, when it
is written; attention widens them back to float32. This module owns the tensors only: which block
belongs to which sequence is the block pool's (`block_pool.py`), what attention gathers and masks is
`attention.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenops.engine import kernels

if TYPE_CHECKING:
    from tokenops.engine.models import ModelConfig

__all__ = [
    "KV_CACHE_DTYPES",
    "QuantizedKV",
    "allocate_kv_caches",
    "allocate_layer",
    "gather_blocks",
    "kv_blocks_for_budget",
    "kv_bytes_per_block",
    "kv_bytes_per_token",
    "kv_dtype_name",
    "resolve_kv_dtype",
    "write_kv",
]

# "auto": see resolve_kv_dtype; "float32" / "bfloat16" / "float16": a plain cache of that dtype
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
# weight modes whose "auto" KV cache is bfloat16 on a CPU with native bf16 (resolve_kv_dtype)
AUTO_BF16_KV_QUANTIZATIONS = ("bf16", "int8_dynamic", "int4")
_SCALE_DTYPE = torch.float16


@dataclass
class QuantizedKV:
    """One layer's keys or values in int8, with a float16 scale per (slot, kv head)."""

    data: torch.Tensor  # int8 [num_blocks, block_size, kv_heads, head_dim]
    scale: torch.Tensor  # float16 [num_blocks, block_size, kv_heads, 1]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        """torch.int8: what `allocate_layer` takes to make this layout again (a draft model's cache)."""
        return self.data.dtype


KVTensor = torch.Tensor | QuantizedKV


def allocate_layer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> KVTensor:
    """Zeroed storage for one layer's keys or values; `dtype=torch.int8` means the quantised layout."""
    if dtype == torch.int8:
        return QuantizedKV(
            torch.zeros(shape, dtype=torch.int8, device=device),
            torch.zeros((*shape[:-1], 1), dtype=_SCALE_DTYPE, device=device),
        )
    return torch.zeros(shape, dtype=dtype, device=device)


def resolve_kv_dtype(
    kv_cache_dtype: str,
    model_dtype: torch.dtype,
    quantization: str | None,
    native_bf16: bool,
    block_kernels: bool = False,
) -> torch.dtype:
    """The cache's storage dtype (`torch.int8` = the quantised layout) for `EngineConfig.kv_cache_dtype`.

    "auto" is the model's dtype, except that a float32 model whose linears run in "bf16",
    "int8_dynamic" or "int4" (`AUTO_BF16_KV_QUANTIZATIONS`) on a CPU with native bf16 (`native_bf16`,
    `quantize.common.has_native_bf16`) gets a bfloat16 cache: those modes already trade float32's
    last bits for speed, and the cache's rounding is lost in their noise (docs/benchmarks.md,
    engine_quality_long.py and engine_kv_dtype_step.py). So does "int4" where its layers run on the
    native block kernels (`block_kernels`, `quantize.common.block_kernels`: AVX2 CPUs too), whose
    kernels widen a bf16 cache in registers. `kv_cache_dtype="float32"` keeps float32 there."""
    if kv_cache_dtype == "auto":
        bf16_here = native_bf16 or (block_kernels and quantization == "int4")
        if model_dtype == torch.float32 and quantization in AUTO_BF16_KV_QUANTIZATIONS and bf16_here:
            return torch.bfloat16
        return model_dtype
    if kv_cache_dtype not in _NAMED:
        choices = ", ".join(map(repr, KV_CACHE_DTYPES))
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; use one of {choices}")
    return _NAMED[kv_cache_dtype]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """'float32', 'bfloat16', 'float16', 'int8': how stats and /v1/load name a cache's storage."""
    return str(dtype).removeprefix("torch.")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take across all layers (int8: values plus scales)."""
    if dtype == torch.int8:
        per_head = head_dim + _SCALE_DTYPE.itemsize
    else:
        per_head = head_dim * dtype.itemsize
    return 2 * num_layers * num_kv_heads * per_head


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values (int8: with its scales)."""
    return block_size * kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, dtype)


def kv_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks `budget_bytes` holds (at least one)."""
    return max(1, budget_bytes // kv_bytes_per_block(config, block_size, dtype))


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[tuple[KVTensor, KVTensor]]:
    """Per layer (keys, values); `dtype=torch.int8` allocates the quantised layout."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (allocate_layer(shape, dtype, device), allocate_layer(shape, dtype, device))
        for _ in range(num_layers)
    ]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, heads, D] float -> (int8 [T, heads, D], float16 scales [T, heads, 1]).

    Symmetric, one scale per (token, head).
    """
    xf = x.float()
    # quantise with the rounded float16 scale, so that dequantising reproduces exactly what was meant
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-7).to(_SCALE_DTYPE)
    q = torch.round(xf / scale.float()).clamp_(-127, 127).to(torch.int8)
    return q, scale


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: KVTensor, v_cache: KVTensor, slots: torch.Tensor
) -> None:
    """Store this step's keys and values [T, kv_heads, D] into their flat slots."""
    native = (
        kernels.ops(k.device) if isinstance(k_cache, QuantizedKV) and not torch.is_grad_enabled() else None
    )
    for x, cache in ((k, k_cache), (v, v_cache)):
        if native is not None:  # quantise and write in one pass, bitwise what the lines below do
            native.quantize_kv_into(x, cache.data, cache.scale, slots)
        elif isinstance(cache, QuantizedKV):
            q, scale = quantize(x)
            cache.data.view(-1, *cache.data.shape[2:]).index_copy_(0, slots, q)
            cache.scale.view(-1, *cache.scale.shape[2:]).index_copy_(0, slots, scale)
        else:
            # flat view: [num_blocks * block_size, kv_heads, head_dim]
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))


def gather_blocks(cache: KVTensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks [len(blocks), block_size, kv_heads, D] in `dtype` (index_select on the block
    dimension is several times faster than per-token advanced indexing)."""
    if isinstance(cache, QuantizedKV):
        return cache.data.index_select(0, blocks).to(dtype) * cache.scale.index_select(0, blocks).to(dtype)
    return cache.index_select(0, blocks).to(dtype)
