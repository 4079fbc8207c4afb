"""Attention over a paged KV cache: `paged_attention` writes a step's keys and values into their slots,
then attends each query to its sequence's whole KV history (sliding windows, int8 and widened bf16
caches, evicted gaps included), with results equal to dense causal attention. What depends only on
the batch's shape (row layout, blocks to read, masks) is worked out once per step in an
`_AttentionPlan` cached on the `ForwardContext` and reused by every layer. On CPU with the native
kernels one `tokenops::paged_prefill_attention` call per layer reads keys where they lie through the
block table (kernels/csrc/paged_attention.cpp); otherwise, and as the reference the kernel is tested
against, decode rows gather their blocks whole into a padded view under a length mask and prefill
chunks use causal or explicit masks. Every query reads its keys back from the cache, so a token's
output does not depend on whether its prefix came from this chunk, an earlier one or the prefix
cache; the exception is a bf16 cache on a CPU with native bf16, where long chunks attend in bf16 for
speed (queries and softmax weights rounded to bf16), so their outputs differ from a short chunk's by
bf16 rounding: the kernel takes chunks of at least 32 queries in bf16 dot products
(`torch.ops.tokenops.prefill_bf16_dot()` says whether the build has that path), on AMX's tiles where
the CPU has them (`prefill_bf16_amx()`); where it has AMX but the kernel was built without the tiles,
chunks of at least `BF16_SDPA_MIN_QUERIES` queries (`BF16_SDPA_MIN_QUERIES_CACHED` over a cached
prefix) go to SDPA in bf16 instead.
This module owns no storage (`kv_cache.py`) and no block accounting (`block_pool.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenops.engine import kernels
from tokenops.engine.context import ForwardContext
from tokenops.engine.kv_cache import KVTensor, QuantizedKV, gather_blocks, write_kv
from tokenops.engine.quantize.common import has_bf16_tiles


@dataclass
class _Prefill:
    rows: slice  # this sequence's query rows in the flat batch
    num_queries: int
    length: int  # absolute KV length after this step
    kv_len: int  # keys actually held (length minus evicted tokens)
    blocks: torch.Tensor | None  # block ids to gather; None: attend to the chunk's own k/v (starts at 0)
    gap: tuple[int, int] = (0, 0)  # evicted (start, length) in tokens
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)  # window -> mask
    dtype: torch.dtype | None = None  # what SDPA computes in; None: the queries' dtype


@dataclass
class _AttentionPlan:
    decode_rows: slice | torch.Tensor | None = None
    decode_tables: torch.Tensor | None = None  # [S, nb] block ids of the decoding sequences
    num_decode: int = 0
    decode_lens: torch.Tensor | None = None  # [S] keys held per sequence
    decode_max_len: int = 0
    decode_gaps: torch.Tensor | None = None  # [S, 2] evicted (start, length); None when nothing evicted
    decode_masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    prefills: list[_Prefill] = field(default_factory=list)  # the chunks the PyTorch path attends
    native: object | None = None  # torch.ops.tokenops when the native kernel runs this step
    # the sequences the native kernel attends (all decodes, the prefill chunks `_prefill_native` picks)
    native_args: tuple[torch.Tensor, ...] | None = (
        None  # block tables, query starts, query lengths, kept lengths
    )
    native_gaps: torch.Tensor | None = None  # [S', 2]; None when nothing evicted
    native_rows: slice | torch.Tensor | None = None  # their rows; None: every row of the batch
    _decode_blocks: torch.Tensor | None = None

    def decode_blocks(self) -> torch.Tensor:
        """[S * nb] block ids, row-major: what the PyTorch path gathers."""
        if self._decode_blocks is None:
            self._decode_blocks = self.decode_tables.reshape(-1)
        return self._decode_blocks

    def decode_mask(self, window: int | None) -> torch.Tensor | None:
        if window not in self.decode_masks:
            lens = self.decode_lens
            pos = torch.arange(self.decode_max_len, device=lens.device)
            if window is None and lens.shape[0] == 1:
                mask = None  # one sequence, gathered to exactly its length
            else:
                mask = pos[None, :] < lens[:, None]
                if window is not None:
                    kpos, qpos = pos[None, :], lens[:, None] - 1
                    if self.decode_gaps is not None:  # absolute positions across the gap
                        start, gap = self.decode_gaps[:, :1], self.decode_gaps[:, 1:]
                        kpos, qpos = kpos + (kpos >= start) * gap, qpos + gap
                    mask &= kpos > (qpos - window)
                mask = mask[:, None, None, :]  # [S, 1, 1, L]
            self.decode_masks[window] = mask
        return self.decode_masks[window]


# A first prefill chunk on a float cache (nothing to gather) can also go to SDPA on its own keys,
# whose blocked GEMMs should win once chunks are long enough; measured up to 512 queries
# (benchmarks/paged_prefill_attention.py, docs/benchmarks.md) the native kernel was as fast or faster
# everywhere, so only chunks longer than that (more than the default step budget) keep SDPA.
NATIVE_FIRST_CHUNK_MAX = 512
NATIVE_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # and int8 (QuantizedKV)


# Where the kernel's bf16 dot path runs on AMX's tiles (a native build on an AMX-BF16 CPU), every
# prefill chunk on a bf16 cache attends natively: ahead of SDPA over a prefix and on long first
# chunks, and one call for all of a step's chunks (paged_prefill_attention.py,
# engine_prefill_profile.py). Else, on a bf16 cache where the CPU has AMX (a kernel built for an older
# target, or its tiles switched off), prefill chunks of at least this many queries go to SDPA in
# bf16 (oneDNN's bf16 tile kernels: several times the native float32 kernel's speed on long chunks;
# with AVX512-BF16 alone the native kernel, with its own bf16 dot-product path, wins); and chunks over
# a cached prefix (a conversation's next turn) from BF16_SDPA_MIN_QUERIES_CACHED, where SDPA's GEMMs
# over the prefix win sooner. Shorter ones, decodes among them, stay native: many short first chunks
# of a batch attend in one native call, which beats one SDPA call per sequence; first chunks of up to
# about 170 queries attend faster natively too, and below int4's GEMM threshold (160 rows on AMX-INT8)
# a native attention keeps each layer one native call (engine_prefill_profile.py, docs/benchmarks.md).
BF16_SDPA_MIN_QUERIES = 160
BF16_SDPA_MIN_QUERIES_CACHED = 32


def _bf16_sdpa_chunk(n: int, cached: int) -> bool:
    """Whether a chunk of n queries over `cached` earlier keys on a bf16 cache goes to SDPA in bf16
    where the CPU has AMX."""
    return n >= (BF16_SDPA_MIN_QUERIES_CACHED if cached > 0 else BF16_SDPA_MIN_QUERIES)


def _prefill_native(
    n: int, cached: int, quantized: bool, bf16_sdpa: bool = False, kernel_tiles: bool = False
) -> bool:
    """Whether the native kernel attends a prefill chunk of n queries over `cached` earlier keys
    (`bf16_sdpa`: the cache is bf16 and SDPA can compute in bf16 natively; `kernel_tiles`: the
    kernel's bf16 dot path runs on AMX's tiles, ahead of SDPA from a prefix of any length and on
    long first chunks, and keeps a step's chunks in one call)."""
    if kernel_tiles:
        return True
    if bf16_sdpa and _bf16_sdpa_chunk(n, cached):
        return False
    return cached > 0 or quantized or n <= NATIVE_FIRST_CHUNK_MAX


def _plan(ctx: ForwardContext) -> _AttentionPlan:
    plan = ctx.attn_plan
    if plan is not None:
        return plan
    plan = _AttentionPlan()
    bs = ctx.block_size
    device = ctx.block_tables.device
    gaps = ctx.kv_gaps or [(0, 0)] * ctx.num_seqs
    quantized = bool(ctx.kv_caches) and isinstance(ctx.kv_caches[0][0], QuantizedKV)
    native = None if torch.is_grad_enabled() else kernels.ops(device)  # autograd sees torch ops
    if (
        native is not None
        and not quantized
        and ctx.kv_caches
        and ctx.kv_caches[0][0].dtype not in NATIVE_KV_DTYPES
    ):
        native = None  # e.g. a float64 cache: the kernel reads float32 / bf16 / f16 / int8 only
    # bf16 cache on a CPU with AMX: long prefill chunks attend in bf16 (queries rounded to bf16, as
    # vLLM's CPU build does), reading keys as stored instead of widening them
    bf16_cache = bool(ctx.kv_caches) and ctx.kv_caches[0][0].dtype == torch.bfloat16
    bf16_sdpa = bf16_cache and has_bf16_tiles(device)
    # the kernel's own bf16 dot path on AMX's tiles (head_dim a multiple of its 64-column value pass,
    # at most 256: dot_chunk in paged_attention.cpp): then every prefill chunk attends natively (a
    # model with more than 48 query heads per KV head would take the kernel's exact path instead)
    kernel_tiles = (
        bf16_sdpa
        and native is not None
        and ctx.kv_caches[0][0].shape[-1] in (64, 128, 192, 256)
        and native.prefill_bf16_amx()
    )
    decode_seqs: list[int] = []
    native_seqs: list[int] = []  # sequences the native kernel attends, in batch order
    starts: list[int] = []
    row = 0
    for s, (n, length) in enumerate(zip(ctx.query_lens, ctx.context_lens, strict=True)):
        starts.append(row)
        if n == 1:
            decode_seqs.append(s)
            if native is not None:
                native_seqs.append(s)
        elif native is not None and _prefill_native(n, length - n, quantized, bf16_sdpa, kernel_tiles):
            native_seqs.append(s)
        else:
            kv_len = length - gaps[s][1]
            blocks = ctx.block_tables[s, : -(-kv_len // bs)] if length > n or quantized else None
            p = _Prefill(slice(row, row + n), n, length, kv_len, blocks, gaps[s])
            if bf16_sdpa and _bf16_sdpa_chunk(n, length - n):
                p.dtype = torch.bfloat16
            plan.prefills.append(p)
        row += n
    if native_seqs:
        plan.native = native
        kept = [ctx.context_lens[s] - gaps[s][1] for s in native_seqs]
        nb = -(-max(kept) // bs)
        every = len(native_seqs) == ctx.num_seqs
        tables = ctx.block_tables if every else ctx.block_tables[native_seqs]
        qlens = [ctx.query_lens[s] for s in native_seqs]
        if every:
            plan.native_rows, qstarts = None, starts
        elif native_seqs == list(range(len(native_seqs))):  # decodes first, as the scheduler orders them
            plan.native_rows = slice(0, starts[native_seqs[-1]] + qlens[-1])
            qstarts = starts[: len(native_seqs)]
        else:
            rows = [
                r for s, n in zip(native_seqs, qlens, strict=True) for r in range(starts[s], starts[s] + n)
            ]
            plan.native_rows = torch.tensor(rows, device=device)
            qstarts = [0]
            for n in qlens[:-1]:
                qstarts.append(qstarts[-1] + n)
        plan.native_args = (
            tables[:, :nb].contiguous(),
            torch.tensor(qstarts, device=device),
            torch.tensor(qlens, device=device),
            torch.tensor(kept, device=device),
        )
        if ctx.kv_gaps is not None:
            plan.native_gaps = torch.tensor([gaps[s] for s in native_seqs], device=device)
    elif decode_seqs:
        sd = len(decode_seqs)
        # the scheduler puts decodes first: then their rows are a plain slice
        if decode_seqs == list(range(sd)):
            plan.decode_rows = slice(0, sd)
        else:
            plan.decode_rows = torch.tensor([starts[s] for s in decode_seqs], device=device)
        lens = [ctx.context_lens[s] - gaps[s][1] for s in decode_seqs]
        max_len = max(lens)
        nb = -(-max_len // bs)
        tables = ctx.block_tables if sd == ctx.block_tables.shape[0] else ctx.block_tables[decode_seqs]
        plan.decode_tables = tables[:, :nb].contiguous()
        plan.num_decode = sd
        plan.decode_lens = torch.tensor(lens, device=device)
        plan.decode_max_len = max_len
        if ctx.kv_gaps is not None:
            plan.decode_gaps = torch.tensor([gaps[s] for s in decode_seqs], device=device)
    ctx.attn_plan = plan
    return plan


def _prefill_mask(p: _Prefill, window: int | None, device: torch.device) -> torch.Tensor | None:
    if window not in p.masks:
        if p.blocks is None and (window is None or window >= p.length):
            mask = None  # plain causal over the chunk's own keys
        else:
            qpos = torch.arange(p.length - p.num_queries, p.length, device=device)
            kpos = torch.arange(p.kv_len, device=device)
            start, gap = p.gap
            if gap:
                kpos = kpos + (kpos >= start) * gap  # absolute positions of the kept keys
            mask = kpos[None, :] <= qpos[:, None]
            if window is not None:
                mask &= kpos[None, :] > (qpos[:, None] - window)
        p.masks[window] = mask
    return p.masks[window]


def _cache_args(k_cache: KVTensor, v_cache: KVTensor) -> tuple:
    """(keys, values, key scales, value scales) as the native kernels take a cache: an int8 cache's
    codes and float16 scales, a float cache as it is with no scales."""
    if isinstance(k_cache, QuantizedKV):
        return k_cache.data, v_cache.data, k_cache.scale, v_cache.scale
    return k_cache, v_cache, None, None


def _native_attention(
    plan: _AttentionPlan,
    q: torch.Tensor,
    k_cache: KVTensor,
    v_cache: KVTensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """The native sequences' query rows [T', H, D] attended in place over the paged cache by
    `tokenops::paged_prefill_attention` (a decode is a chunk of one query)."""
    tables, starts, qlens, lens = plan.native_args
    return plan.native.paged_prefill_attention(
        q, *_cache_args(k_cache, v_cache), tables, starts, qlens, lens, plan.native_gaps, window or 0, scale
    )


def _prologue_plan(ctx: ForwardContext, rope: object) -> _AttentionPlan | None:
    """The step's plan where a layer's rotary, KV store and attention can take the native one-call
    prologue (`rotary_store_kv_`): every row attends natively, with a native rope."""
    plan = _plan(ctx)
    if plan.native is None or plan.native_rows is not None or rope.native is None:
        return None
    return plan


def one_call_attention_args(ctx: ForwardContext, rope: object, layer: int) -> tuple | None:
    """(keys, values, key scales, value scales, slots, block tables, query starts, query lengths, kept
    lengths, gaps), in `tokenops::llama_layers_q4`'s order, where a layer's attention can run inside one
    native call with its projections: where `paged_attention_qkv` would take its one
    `rotary_store_kv_` path, else None."""
    plan = _prologue_plan(ctx, rope)
    if plan is None:
        return None
    return (*_cache_args(*ctx.kv_caches[layer]), ctx.slot_mapping, *plan.native_args, plan.native_gaps)


def paged_attention_qkv(
    qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim], the fused projection
    rope: object,  # models.layers.Rope: `rope(q, k)`, and `.native`, `.cos`, `.sin`
    ctx: ForwardContext,
    layer: int,
    scale: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`paged_attention` from the fused q|k|v projection: split, q and k rotated, k and v stored,
    attended. Where every row of the step attends natively, the first three are one
    `tokenops::rotary_store_kv_` call (bitwise the same cache and queries). -> [T, H, D]"""
    k_cache, v_cache = ctx.kv_caches[layer]
    plan = _prologue_plan(ctx, rope)
    if plan is not None and qkv.dim() == 2 and qkv.is_contiguous():
        k, v, k_scale, v_scale = _cache_args(k_cache, v_cache)
        plan.native.rotary_store_kv_(
            qkv, rope.cos, rope.sin, k, v, ctx.slot_mapping, num_heads, num_kv_heads, k_scale, v_scale
        )
        q = qkv.view(-1, num_heads + 2 * num_kv_heads, head_dim)[:, :num_heads]
        return _native_attention(plan, q, k_cache, v_cache, scale, sliding_window)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = rope(q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim))
    return paged_attention(q, k, v.view(-1, num_kv_heads, head_dim), ctx, layer, scale, sliding_window)


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    ctx: ForwardContext,
    layer: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of this step's queries over their sequences' cached + new keys. -> [T, H, D]"""
    k_cache, v_cache = ctx.kv_caches[layer]
    plan = _plan(ctx)
    if isinstance(k_cache, torch.Tensor) and k_cache.dtype != k.dtype:
        # the step's keys and values as stored (a bf16 cache), cast once: written, and read by first
        # chunks as later queries read them back, rather than cast again per chunk
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
    kv_shape = k_cache.shape[2:]
    dtype = q.dtype
    # the step's queries in each SDPA dtype its prefill chunks take, cast once for all of them
    cast_q: dict[torch.dtype, torch.Tensor] = {}
    if plan.native is not None:
        qn = q if plan.native_rows is None else q[plan.native_rows]
        o = _native_attention(plan, qn, k_cache, v_cache, scale, sliding_window)
        if plan.native_rows is None:
            return o
        out = torch.empty_like(q)
        out[plan.native_rows] = o
    else:
        # a batch of only decodes (or one prefill chunk) returns its attention output as is
        only_one_kind = not plan.prefills or (len(plan.prefills) == 1 and not plan.num_decode)
        out = None if only_one_kind else torch.empty_like(q)

    if plan.num_decode:
        s, L = plan.num_decode, plan.decode_max_len
        # whole blocks: [S * nb, bs, KV, D] -> [S, nb*bs, KV, D], trimmed to the longest sequence
        keys = gather_blocks(k_cache, plan.decode_blocks(), dtype).view(s, -1, *kv_shape)[:, :L]
        values = gather_blocks(v_cache, plan.decode_blocks(), dtype).view(s, -1, *kv_shape)[:, :L]
        qs = q[plan.decode_rows].unsqueeze(2)  # [S, H, 1, D]
        o = F.scaled_dot_product_attention(
            qs,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=plan.decode_mask(sliding_window),
            scale=scale,
            enable_gqa=True,
        ).squeeze(2)
        if out is None:
            return o
        out[plan.decode_rows] = o

    for p in plan.prefills:
        sdpa_dtype = p.dtype or dtype
        mask = _prefill_mask(p, sliding_window, q.device)
        if p.blocks is None:
            # nothing before this chunk: its own keys suffice (as stored, cast above)
            keys, values = k[p.rows].to(sdpa_dtype), v[p.rows].to(sdpa_dtype)
        else:
            keys = gather_blocks(k_cache, p.blocks, sdpa_dtype).view(-1, *kv_shape)[: p.kv_len]
            values = gather_blocks(v_cache, p.blocks, sdpa_dtype).view(-1, *kv_shape)[: p.kv_len]
        if len(plan.prefills) > 1:
            if sdpa_dtype not in cast_q:
                cast_q[sdpa_dtype] = q.to(sdpa_dtype)
            queries = cast_q[sdpa_dtype][p.rows]
        else:
            queries = q[p.rows].to(sdpa_dtype)
        o = F.scaled_dot_product_attention(
            queries.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )[0].transpose(0, 1)
        if out is None:
            return o.to(dtype)
        out[p.rows] = o
    return out
