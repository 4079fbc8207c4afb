"""Building blocks shared by the model families: RMSNorm, rotary position embedding, linears. Nothing
here knows a family's layer order or weight names, and attention is `tokenops.engine.attention`'s.
The linears pick their matmul by the step's shape (docs/engine-core.md, "Where a decode step's time
goes"): MKL's GEMM behind `F.linear` for many rows, oneDNN with a prepacked weight for small
batches, and a transposed [in, out] copy for a single row through the large vocabulary projection.
Those derived copies are built from the loaded weight on first use (loading and quantisation still
see plain `nn.Linear` weights), rebuilt if the weight changes, and can be switched off to save their
memory (`use_derived_weights(model, False)`, the engine's `derived_weights`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenops.engine import kernels


def native_ops(x: torch.Tensor) -> object | None:
    """The native kernels for `x`'s device, or None: unavailable, or autograd must see torch ops."""
    return kernels.ops(x.device) if x.device.type == "cpu" and not torch.is_grad_enabled() else None


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32.

    `unit_offset=True` is Gemma's variant: the weight is stored as an offset from 1 and the scale is
    applied before casting back (HF Gemma3RMSNorm); Llama casts first, then scales (HF LlamaRMSNorm).
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`out_dtype`: the result's dtype where it differs from x's (bf16 for a bf16 GEMM's input,
        written as that GEMM reads it: the same bits as casting the norm's result afterwards)."""
        native = native_ops(x)
        if native is None:
            out = self._torch_forward(x)
            return out if out_dtype is None else out.to(out_dtype)
        x = x.contiguous()
        if out_dtype in (None, x.dtype):
            return native.rms_norm(x, None, self.weight, self.eps, self.unit_offset)
        if self._float32_stream(x):
            return native.rms_norm_to(x, None, self.weight, self.eps, self.unit_offset, out_dtype)
        return native.rms_norm(x, None, self.weight, self.eps, self.unit_offset).to(out_dtype)

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a sublayer's output joins the residual stream, which
        the next norm reads. The native kernel does both in one pass, writing the sum into `residual`
        in place (the PyTorch path leaves it alone): pass a residual this layer owns, use the returned
        sum. x may be bf16 on a float32 stream (a bf16 GEMM's output, widened as it is added);
        `out_dtype` as `forward`'s."""
        native = native_ops(residual)
        mixed = x.dtype != residual.dtype or out_dtype not in (None, residual.dtype)
        ok_mixed = self._float32_stream(residual) and x.dtype in (torch.float32, torch.bfloat16)
        if native is not None and (not mixed or ok_mixed):
            residual = residual.contiguous()
            x = x.contiguous()
            if mixed:
                out = native.rms_norm_to(
                    x, residual, self.weight, self.eps, self.unit_offset, out_dtype or residual.dtype
                )
            else:
                out = native.rms_norm(x, residual, self.weight, self.eps, self.unit_offset)
            return out, residual
        summed = x.to(residual.dtype) + residual
        out = self._torch_forward(summed)
        return (out if out_dtype is None else out.to(out_dtype)), summed

    def _float32_stream(self, stream: torch.Tensor) -> bool:
        """`rms_norm_to`'s case: a float32 stream and weight."""
        return stream.dtype == torch.float32 and self.weight.dtype == torch.float32

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


def input_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype:
    """The dtype `module` computes x in where it says (`input_dtype`: an int4 projection's bf16 GEMM),
    else x's: what the op producing x may write it in."""
    says = getattr(module, "input_dtype", None)
    return x.dtype if says is None else says(x)


def keep(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """x's rows `rows` (all of x where None): a step's last layer computes only the rows it samples."""
    return x if rows is None else x.index_select(0, rows)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    rope_type: str = "default",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, as HF's rope init functions compute them."""
    # explicit CPU: models are built under a meta-device context
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    )
    if rope_type in ("default", None):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_wavelen = original_max_position / low_freq_factor
        high_wavelen = original_max_position / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding:
    """The rotation of a batch of absolute positions (`Rope`), computed once per step for all layers.

    Not an nn.Module on purpose: `model.to(bfloat16)` must not round the inverse frequencies.
    """

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq.to(device="cpu", dtype=torch.float32)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        # float32 like HF, so positions in the thousands keep their precision
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        return Rope(freqs.cos(), freqs.sin(), dtype)


class Rope:
    """One step's rotary embedding, applied to each layer's queries and keys (`rope(q, k)`).

    Holds cos/sin of the angles, float32 [T, D/2] for the native kernel (which rotates q and k in
    place), or HF's [T, 1, D] table in the model's dtype for `apply_rotary`.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> None:
        self.native = native_ops(cos)
        if self.native is None:
            # HF's table repeats the angles for the two halves: cos(cat(f, f)) == cat(cos f, cos f)
            cos, sin = (torch.cat((t, t), dim=-1).to(dtype)[:, None, :] for t in (cos, sin))
        self.cos, self.sin = cos, sin

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, D], k: [T, kv_heads, D] -> both rotated (in place on the native path)."""
        if self.native is not None:
            self.native.rotary_(q, k, self.cos, self.sin)
            return q, k
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; the rotate-half convention of HF checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up over a fused gate|up projection [..., 2I] -> [..., I] (Llama's MLP)."""
    native = native_ops(gate_up)
    if native is not None:
        return native.silu_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU-tanh(gate) * up over a fused gate|up projection [..., 2I] -> [..., I] (Gemma's MLP)."""
    native = native_ops(gate_up)
    if native is not None:
        return native.gelu_tanh_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _probe_onednn_linear(dtype: torch.dtype) -> bool:
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), None)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), w, None, "none", [], "")
        return bool(torch.allclose(y.float(), torch.full((2, 8), 8.0)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


_ONEDNN: dict[torch.dtype, bool] = {}


def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """True where this PyTorch build runs oneDNN's prepacked CPU linear in `dtype` (probed once each).
    bf16 needs AVX512 BW/VL/DQ or AVX-NE-CONVERT (torch refuses it on plain AVX2 CPUs)."""
    if dtype not in _ONEDNN:
        _ONEDNN[dtype] = torch.backends.mkldnn.is_available() and _probe_onednn_linear(dtype)
    return _ONEDNN[dtype]


class _DerivedWeight:
    """A copy of a weight in another layout, rebuilt when the weight is replaced or written in place."""

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.make = make
        self.key: tuple[int, int] | None = None
        self.value: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        # inference tensors keep no version counter: for them only a replaced tensor is noticed
        key = (weight.data_ptr(), -1 if weight.is_inference() else weight._version)
        if key != self.key:
            with torch.no_grad():
                self.value = self.make(weight.detach())
            self.key = key
        return self.value

    # copies of a model start without the derived tensor (oneDNN's packed ones cannot be copied)
    def __deepcopy__(self, memo: dict) -> _DerivedWeight:
        return _DerivedWeight(self.make)

    def __getstate__(self) -> dict:
        return {"make": self.make, "key": None, "value": None}


def _prepack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _transpose(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous()


def _packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and x.shape[0] >= 2
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and onednn_linear_available()
    )


# oneDNN builds (JIT-compiles) a GEMM primitive per distinct row count, a few ms each for bf16 on AMX,
# so prefill chunks of arbitrary lengths would pay it on most steps; the bf16 GEMMs see row counts in
# buckets of this many instead (zero rows appended), which stay in oneDNN's primitive cache. Below
# GEMM_ROW_BUCKET_FROM rows the few distinct counts stay cached as they are, and padding would
# multiply a small call's work
GEMM_ROW_BUCKET = 16
GEMM_ROW_BUCKET_FROM = 64


def bucket_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2-D x in `dtype` with its rows padded with zeros to a multiple of GEMM_ROW_BUCKET from
    GEMM_ROW_BUCKET_FROM rows (x cast, otherwise): the caller keeps the product's first x.shape[0]
    rows."""
    rows = x.shape[0]
    pad = -rows % GEMM_ROW_BUCKET if rows >= GEMM_ROW_BUCKET_FROM else 0
    if not pad:
        return x.to(dtype)
    xp = x.new_empty((rows + pad, x.shape[1]), dtype=dtype)
    xp[:rows].copy_(x)
    xp[rows:].zero_()
    return xp


class Linear(nn.Linear):
    """`nn.Linear` whose CPU float32 batches of two or more rows run on a oneDNN-prepacked weight (row
    counts as they come: in float32 a new count's primitive costs too little to pay for padding).

    Still an `nn.Linear` (same parameters, same loading, swapped out whole by weight quantisation).
    """

    derived = True  # False: plain F.linear only, no second copy of the weight

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._packed = _DerivedWeight(_prepack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.derived or not _packable(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed.get(self.weight), bias, "none", [], "")


def _to_bf16(weight: torch.Tensor) -> torch.Tensor:
    return weight.to(torch.bfloat16).contiguous()


def _prepack_bf16(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16).contiguous(), None)


def _to_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from tokenops.engine.quantize.common import q8_tiles, quantize_q8_blocks  # quantize imports this module

    return q8_tiles(*quantize_q8_blocks(weight))


# Rows at or below this run the head's narrow copy through a native kernel (float32 activations):
# the Q8_0 tiles where the head keeps them, else the bf16 copy; more go to oneDNN in bf16. Where the
# Q8_0 tiles run on AMX-INT8 (`quantize.common.blocks_amx`) they beat oneDNN's bf16 GEMM up to
# HEAD_AMX_MAX_ROWS (behind it in a decode step of 64). Measured with benchmarks/linear_small_rows.py
# --head and engine_step_profile.py (docs/benchmarks.md).
HEAD_NATIVE_MAX_ROWS = 8
HEAD_AMX_MAX_ROWS = 48


class VocabProjection:
    """hidden [N, H] -> logits [N, V] against a (possibly tied) [V, H] weight, kernel chosen by N.

    Not an nn.Module: it holds no parameters, only derived copies of the weight it is given, so
    `model.to()` and `state_dict()` never see them. `bf16` (set by the "bf16" weight mode, and by
    every other quantised mode on a CPU with native bf16: quantize_model) makes
    the derived copies bf16 ones instead of the float32 transposed and prepacked copies: a plain
    one read by the native bf16 kernel for few rows, and a oneDNN-prepacked one for oneDNN's bf16
    GEMM for more, faster than `F.linear` on the plain copy or the float32 prepacked one
    (docs/benchmarks.md). `q8` (set by quantize_model for the quantised modes where
    `quantize.common.block_kernels` holds) makes a derived copy llama.cpp's Q8_0 (int8 per block of
    32 with a float32 scale) in tiles of 8 weight rows, read by the native `linear_q8` (8-bit
    activations): at every row count where `bf16` is not set (it measured faster than oneDNN's
    float32 GEMM at every row count tried on AVX2, so no float32 copy is made), and up to
    HEAD_NATIVE_MAX_ROWS rows where it is, HEAD_AMX_MAX_ROWS where its tiles run on AMX-INT8 (half the
    bf16 copy's bytes; past that oneDNN's bf16 GEMM on its prepacked copy wins, so no plain bf16 copy
    is made either).
    """

    derived = True  # False: plain F.linear only, no copies of the weight
    bf16 = False
    q8 = False

    def __init__(self) -> None:
        self._transposed = _DerivedWeight(_transpose)
        self._packed = _DerivedWeight(_prepack)
        self._bf16 = _DerivedWeight(_to_bf16)
        self._bf16_packed = _DerivedWeight(_prepack_bf16)
        self._q8 = _DerivedWeight(_to_q8)

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if (
            not self.derived
            or hidden.device.type != "cpu"
            or hidden.dtype != torch.float32
            or weight.dtype != torch.float32
        ):
            return F.linear(hidden, weight)
        if (
            self.q8
            and not torch.is_grad_enabled()
            and (native := kernels.ops(hidden.device)) is not None
            and (not self.bf16 or hidden.numel() // hidden.shape[-1] <= _q8_head_max_rows())
        ):
            return native.linear_q8(hidden.contiguous(), *self._q8.get(weight), weight.shape[0], None)
        if self.bf16:
            return self._bf16_logits(hidden, weight)
        if hidden.shape[0] == 1:
            return hidden @ self._transposed.get(weight)  # GEMV over [in, out]: faster than F.linear here
        if _packable(hidden, weight):
            return torch.ops.mkldnn._linear_pointwise(hidden, self._packed.get(weight), None, "none", [], "")
        return F.linear(hidden, weight)

    def _bf16_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        native = kernels.ops(hidden.device) if not torch.is_grad_enabled() else None
        if native is not None and hidden.numel() // hidden.shape[-1] <= HEAD_NATIVE_MAX_ROWS:
            return native.linear_bf16(hidden.contiguous(), self._bf16.get(weight), None)
        if hidden.dim() == 2 and onednn_linear_available(torch.bfloat16):
            packed = self._bf16_packed.get(weight)
            return torch.ops.mkldnn._linear_pointwise(
                hidden.to(torch.bfloat16), packed, None, "none", [], ""
            ).float()
        return F.linear(hidden.to(torch.bfloat16), self._bf16.get(weight)).float()


def _q8_head_max_rows() -> int:
    """The most rows the Q8_0 head takes where the head also keeps a bf16 copy."""
    from tokenops.engine.quantize.common import blocks_amx  # quantize imports this module

    return HEAD_AMX_MAX_ROWS if blocks_amx() else HEAD_NATIVE_MAX_ROWS


def derived_weight_bytes(model: nn.Module) -> int:
    """Bytes the derived copies of `model`'s weights take once built. They are built lazily, on the
    first step that uses them, so memory accounting must count them before they exist: one copy of
    each CPU float32 `Linear` weight (prepacked) and two of the output head (transposed for one
    row, prepacked for more), or two bf16 copies of it where its `bf16` is set (plain for the
    native kernel, prepacked for oneDNN; one where oneDNN's linear is unavailable) or one Q8_0 copy
    in tiles where its `q8` is set, plus what a
    quantised linear that keeps derived copies reports (`derived_bytes()`, quantize.Bf16Linear).
    0 where the copies are off or cannot apply, and none for a head that a quantised
    `compute_logits` set on the instance replaces (the copies are never built then)."""

    def size(w: torch.Tensor) -> int:
        return w.numel() * w.element_size() if w.device.type == "cpu" and w.dtype == torch.float32 else 0

    packs, packs_bf16 = onednn_linear_available(), onednn_linear_available(torch.bfloat16)
    total = sum(size(m.weight) for m in model.modules() if isinstance(m, Linear) and m.derived and packs)
    total += sum(
        m.derived_bytes() for m in model.modules() if _keeps_derived(m) and not isinstance(m, Linear)
    )
    for m in model.modules():
        head = getattr(m, "vocab_projection", None)
        if isinstance(head, VocabProjection) and head.derived and "compute_logits" not in vars(m):
            lm_head = getattr(m, "lm_head", None)
            weight = m.model.embed_tokens.weight if lm_head is None else lm_head.weight
            q8 = head.q8 and size(weight) > 0
            if q8:  # int8 codes and a float32 scale per 32, in tiles of 8 rows
                out_f, in_f = -(-weight.shape[0] // 8) * 8, -(-weight.shape[1] // 32) * 32
                total += out_f * in_f + out_f * in_f // 32 * 4
            if head.bf16:  # beside the Q8_0 tiles only the prepacked copy (more rows than they take)
                copies = (1 if q8 else 2) if packs_bf16 else 1
                total += size(weight) // 2 * copies
            elif not q8:
                total += size(weight) * (2 if packs else 1)
    return total


def _keeps_derived(module: nn.Module) -> bool:
    """A layers.Linear, or a quantised linear declaring derived copies (`derived` and `derived_bytes`)."""
    return isinstance(module, Linear) or (
        hasattr(module, "derived") and callable(getattr(module, "derived_bytes", None))
    )


def use_derived_weights(model: nn.Module, enabled: bool) -> None:
    """Switch the derived (prepacked / transposed) weight copies of every linear in `model`; off
    drops copies already built, giving their memory back."""
    heads = [
        m.vocab_projection
        for m in model.modules()
        if isinstance(getattr(m, "vocab_projection", None), VocabProjection)
    ]
    for layer in [m for m in model.modules() if _keeps_derived(m)] + heads:
        layer.derived = enabled
        if not enabled:
            for copy in vars(layer).values():
                if isinstance(copy, _DerivedWeight):
                    copy.key, copy.value = None, None


class MergedLinear(Linear):
    """One matmul for several projections that read the same input (q|k|v, gate|up).

    `shard_sizes` are the output widths of the parts in order; `load_shard` copies one HF weight
    into its rows.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = list(shard_sizes)

    def load_shard(self, index: int, weight: torch.Tensor, is_bias: bool = False) -> None:
        start = sum(self.shard_sizes[:index])
        size = self.shard_sizes[index]
        target = self.bias if is_bias else self.weight
        if weight.shape[0] != size:
            raise ValueError(f"shard {index} has {weight.shape[0]} rows, expected {size}")
        with torch.no_grad():
            target[start : start + size].copy_(weight)


def load_into(
    module: nn.Module,
    params: dict[str, nn.Parameter],
    name: str,
    tensor: torch.Tensor,
    stacked: dict[str, tuple[str, int]],
) -> str | None:
    """Copy one HF-named tensor into `module`, routing parts of merged linears via `stacked`.

    `params` is `dict(module.named_parameters())`; `stacked` maps an HF sub-name (".q_proj.") to
    (our sub-name (".qkv_proj."), shard index). Returns the name of the parameter written (shards
    report "<param>#<shard>"), or None when the name has no home in the module.
    """
    for hf_part, (our_part, shard) in stacked.items():
        if hf_part in name:
            target_name = name.replace(hf_part, our_part)
            owner_name, _, leaf = target_name.rpartition(".")
            try:
                owner = module.get_submodule(owner_name)
            except AttributeError:
                return None
            if not isinstance(owner, MergedLinear):
                return None
            owner.load_shard(shard, tensor, is_bias=(leaf == "bias"))
            return f"{target_name}#{shard}"
    param = params.get(name)
    if param is None:
        return None
    if param.shape != tensor.shape:
        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
    return name


def expected_loads(module: nn.Module, stacked: dict[str, tuple[str, int]]) -> set[str]:
    """Every name `load_into` must report for a complete load (merged linears count once per shard)."""
    out: set[str] = set()
    for pname, _ in module.named_parameters():
        owner_name, _, leaf = pname.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if isinstance(owner, MergedLinear):
            out.update(f"{pname}#{i}" for i in range(len(owner.shard_sizes)))
        else:
            out.add(pname)
    return out
