"""Int8 and int4 quantisation of a loaded model's linear layers (the `quantization` knob).

`quantize_model(model, mode)` walks the model after its weights are loaded and swaps every
`nn.Linear` (fused q|k|v and gate|up included) for a quantised module:
- "int8": `Int8WeightOnlyLinear`, int8 weights with one symmetric float scale per output channel,
  a quarter of float32's bytes (weight-only: fewer bytes read, a gain where decode is bound by
  memory bandwidth, i.e. small batches);
- "int4": `Int4WeightOnlyLinear`, group-wise asymmetric int4 (a bf16 scale and offset per group of
  32/64/128 input columns), two nibbles per byte, an eighth of float32's bytes plus the group params;
- "bf16": `Bf16Linear`, the weights held once as bf16 (half of float32's bytes, near-float32
  numerics): few rows (decode) run the native bf16-weight x float32-activation kernel, more rows
  cast the activations to bf16 for oneDNN (AMX / AVX512_BF16 where the CPU has them);
- "int8_dynamic": `DynamicInt8Linear` (W8A8), int8 per-channel weights prepacked for fbgemm and
  activations quantised to uint8 per row at run time, int32 accumulation: integer arithmetic, so
  it also gains where decode is bound by compute (batches of 8-32 rows), where the weight-only
  kernels lose to float32. CPU only (x86 / fbgemm).
The token embedding, the tied head that reads it and an untied `lm_head` stay in full precision: the
families' `compute_logits` read the head's `.weight`. `quantize_logits_head` is the opt-in, measured
alternative (an int8 copy of the head behind an instance-level `compute_logits`; not used by the
config knob); "bf16" also makes the head's derived copy a bf16 one (`VocabProjection.bf16`). This
module quantises nothing else (KV cache: kv_cache.py) and chooses no mode; the engine config does.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from tokenops.engine import kernels
from tokenops.engine.models.layers import VocabProjection

__all__ = [
    "MODES", "Bf16Linear", "DynamicInt8Linear", "Int4WeightOnlyLinear", "Int8WeightOnlyLinear", "dynamic_int8_unavailable",
    "quantize_int4", "quantize_int8", "quantize_model", "weight_bytes",
]

MODES = ("int8", "int4", "int8_dynamic", "bf16")
INT4_GROUP_SIZES = (32, 64, 128)

# Rows at or below this use `_weight_int8pack_mm` (int8 weights, bf16 activations); larger prefill
# chunks dequantise to the activation dtype and use a plain GEMM. Measured on 2 AVX2 cores, 576x1536
# weights, 1 thread: the kernel wins up to ~128 rows and loses 2x at 512 (bf16 compute is emulated).
KERNEL_MAX_ROWS = 256

# Rows at or below these run the native float32-activation kernels (kernels/csrc/gemv.cpp), which
# stream the weight once: bf16 weights up to 8 rows (more: oneDNN's bf16 GEMM, AMX here, wins), int8
# up to 32 (1.7x `_weight_int8pack_mm` at 32 rows, 1.7x at 1). Measured on the Emerald Rapids
# machine, SmolLM2-135M shapes, 2 threads: benchmarks/linear_small_rows.py, docs/benchmarks.md.
NATIVE_MAX_ROWS = 8
INT8_NATIVE_MAX_ROWS = 32


def _native_ops(x: torch.Tensor, rows: int, max_rows: int) -> object | None:
    """The native kernels when they apply to this call: CPU float32 activations, few rows, no autograd."""
    if not 0 < rows <= max_rows or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
        return None
    return kernels.ops(x.device)


def quantize_int8(weight: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (int8 [out, in] in -qmax..qmax, float32 scales [out]), symmetric per
    output row."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / qmax
    q = torch.round(w / scales[:, None]).clamp(-qmax, qmax).to(torch.int8)
    return q, scales


def _has_int8pack_kernel(device: torch.device) -> bool:
    """Probe once per device: the op exists on CPU builds and on recent CUDA builds only."""
    try:
        x = torch.zeros(1, 32, dtype=torch.bfloat16, device=device)
        w = torch.zeros(32, 32, dtype=torch.int8, device=device)
        s = torch.ones(32, dtype=torch.bfloat16, device=device)
        torch.ops.aten._weight_int8pack_mm(x, w, s)
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


_KERNEL_CACHE: dict[str, bool] = {}


def has_int8pack_kernel(device: torch.device | str) -> bool:
    key = str(torch.device(device))
    if key not in _KERNEL_CACHE:
        _KERNEL_CACHE[key] = _has_int8pack_kernel(torch.device(device))
    return _KERNEL_CACHE[key]


class Int8WeightOnlyLinear(nn.Module):
    """y = x @ (q * scale).T + bias, with q int8 and one scale per output channel.

    Up to `INT8_NATIVE_MAX_ROWS` float32 rows on CPU run the native kernel (`tokenops::linear_int8`:
    float32 activations and sums, so also closer to float32 than the bf16-activation kernel). More
    rows on a CPU with native bf16 dequantise to bf16 for one oneDNN GEMM (bf16 activations); elsewhere
    small row counts go through the int8 x bf16 kernel when the device has it; larger ones, or a
    device without either, dequantise to the activation dtype. The output has the input's dtype
    either way. `kernel_max_rows=0` forces the dequantise path (exact with respect to the
    dequantised weights; tests use it as the reference).
    """

    def __init__(
        self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
        kernel_max_rows: int = KERNEL_MAX_ROWS,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.kernel_max_rows = kernel_max_rows
        self.register_buffer("weight_int8", weight_int8.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        # the kernel takes its scales in the activation dtype (bf16); keep that copy ready
        self.register_buffer("scales_bf16", scales.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._kernel: bool | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel_max_rows: int = KERNEL_MAX_ROWS) -> Int8WeightOnlyLinear:
        q, scales = quantize_int8(linear.weight)
        return cls(q, scales, linear.bias, kernel_max_rows)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight_int8.to(dtype) * self.scales[:, None].to(dtype)).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        native = _native_ops(x, rows, min(INT8_NATIVE_MAX_ROWS, self.kernel_max_rows))
        if native is not None:
            bias = None if self.bias is None else self.bias.float()
            return native.linear_int8(x.contiguous(), self.weight_int8, self.scales, bias)
        if self.kernel_max_rows and rows > INT8_NATIVE_MAX_ROWS and has_native_bf16(x.device):
            # prefill chunks where the CPU computes bf16 natively: oneDNN (AMX) on a bf16 copy made
            # for this call, 2-5x `_weight_int8pack_mm` from 64 rows (compute-bound there)
            out = F.linear(x.to(torch.bfloat16), self.dequantized_weight(torch.bfloat16)).to(x.dtype)
            return out if self.bias is None else out + self.bias.to(x.dtype)
        if self._kernel is None:
            self._kernel = has_int8pack_kernel(self.weight_int8.device)
        if self._kernel and 0 < rows <= self.kernel_max_rows:
            shape = x.shape
            out = torch.ops.aten._weight_int8pack_mm(
                x.reshape(rows, self.in_features).to(torch.bfloat16), self.weight_int8, self.scales_bf16
            ).to(x.dtype).reshape(*shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel_max_rows={self.kernel_max_rows}"


# -- bf16 ---------------------------------------------------------------------------------------


class Bf16Linear(nn.Module):
    """y = x @ w.T + bias with w held once as bf16 (the bias stays float32).

    On CPU, float32 activations of up to `kernel_max_rows` rows (decode) run `tokenops::linear_bf16`:
    the weight widened to float32 in registers, float32 products and sums, so the only error is
    the weight's rounding to bf16 and the cost is half of float32's bytes. Other calls cast the
    activations to bf16 and run `F.linear` (oneDNN; AMX on CPUs that have it), output cast back
    to the input's dtype. `kernel_max_rows=0` forces that path.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel_max_rows: int = NATIVE_MAX_ROWS) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel_max_rows = kernel_max_rows
        self.register_buffer("weight_bf16", weight.detach().to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel_max_rows: int = NATIVE_MAX_ROWS) -> Bf16Linear:
        return cls(linear.weight, linear.bias, kernel_max_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = _native_ops(x, x.numel() // self.in_features, self.kernel_max_rows)
        if native is not None:
            return native.linear_bf16(x.contiguous(), self.weight_bf16, self.bias)
        out = F.linear(x.to(torch.bfloat16), self.weight_bf16).to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel_max_rows={self.kernel_max_rows}"


# -- int4 ---------------------------------------------------------------------------------------


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (codes uint8 [out, in'] in 0..15, scales, zeros [out, in' / group]).

    Asymmetric per group of `group_size` input columns, in the convention of torch's int4 kernels:
    w = (code - 8) * scale + zero. `in'` is `in` padded with zero columns to a multiple of the group.
    Scales and zeros are rounded to bf16 (what the kernel reads) before the codes are chosen, so the
    codes are the best ones for the stored parameters.
    """
    w = weight.detach().float()
    out_f, in_f = w.shape
    pad = -in_f % group_size
    if pad:
        w = F.pad(w, (0, pad))
    g = w.view(out_f, -1, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16).float()
    zeros = (lo + 8 * scales).to(torch.bfloat16).float()
    codes = torch.round((g - zeros[..., None]) / scales[..., None] + 8).clamp(0, 15).to(torch.uint8)
    return codes.view(out_f, -1), scales, zeros


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [out, in'] that `quantize_int4`'s output stands for."""
    out_f = codes.shape[0]
    g = codes.view(out_f, scales.shape[1], -1).to(dtype)
    return ((g - 8) * scales[..., None].to(dtype) + zeros[..., None].to(dtype)).view(out_f, -1)


def _has_int4pack_kernel(device: torch.device) -> bool:
    """CPU builds of torch >= 2.5 have `_weight_int4pack_mm_for_cpu` (bf16 activations)."""
    if device.type != "cpu":
        return False
    try:
        w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 32, dtype=torch.int32), 1)
        sz = torch.zeros(1, 16, 2, dtype=torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.zeros(1, 32, dtype=torch.bfloat16), w, 32, sz)
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def has_int4pack_kernel(device: torch.device | str) -> bool:
    key = "int4:" + str(torch.device(device))
    if key not in _KERNEL_CACHE:
        _KERNEL_CACHE[key] = _has_int4pack_kernel(torch.device(device))
    return _KERNEL_CACHE[key]


class Int4WeightOnlyLinear(nn.Module):
    """y = x @ dequant(codes).T + bias, int4 codes two per byte, asymmetric per group of inputs.

    On a CPU with torch's int4 kernel (and out_features a multiple of 16, its tile) the codes are
    kept in the kernel's tiled layout and every call is one `_weight_int4pack_mm_for_cpu` on bf16
    activations: nothing is dequantised in memory. Otherwise the codes are kept as plain nibbles
    (low nibble = even column) and dequantised to the activation dtype for an ordinary GEMM.
    Inputs whose width is not a multiple of the group are zero-padded (the padded weight columns
    are zero too).
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features = codes.shape[0]
        self.in_features = in_features
        self.padded_in = codes.shape[1]
        self.group_size = self.padded_in // scales.shape[1]
        self.kernel = has_int4pack_kernel(codes.device) and self.out_features % 16 == 0
        if self.kernel:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            # the kernel reads [groups, out, (scale, zero)]
            params = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        else:
            packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
            params = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16).contiguous()
        self.register_buffer("weight_packed", packed.contiguous())  # uint8 [out, in' / 2]
        self.register_buffer("scales_and_zeros", params)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 32) -> Int4WeightOnlyLinear:
        codes, scales, zeros = quantize_int4(linear.weight, group_size)
        return cls(codes, scales, zeros, linear.in_features, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.padded_in != self.in_features:
            x2 = F.pad(x2, (0, self.padded_in - self.in_features))
        if self.kernel:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16), self.weight_packed, self.group_size, self.scales_and_zeros
            ).to(x.dtype)
        else:
            out = F.linear(x2, self._dequantized(x.dtype))
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        p = self.weight_packed
        codes = torch.stack([p & 15, p >> 4], dim=-1).view(self.out_features, self.padded_in)
        sz = self.scales_and_zeros
        return dequantize_int4(codes, sz[..., 0], sz[..., 1], dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, kernel={self.kernel}")


# -- int8 dynamic (W8A8) ------------------------------------------------------------------------


def has_native_bf16(device: torch.device | str) -> bool:
    """True on a CPU that computes bf16 natively (AVX512-BF16 or AMX: oneDNN's bf16 path); probed once."""
    key = "bf16:" + str(torch.device(device))
    if key not in _KERNEL_CACHE:
        try:
            native = torch.device(device).type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            native = False
        _KERNEL_CACHE[key] = native
    return _KERNEL_CACHE[key]


def auto_quantization(device: torch.device | str) -> str | None:
    """What `quantization="auto"` means on `device`: "bf16" on a CPU that computes bf16 natively
    (AVX512-BF16 or AMX: oneDNN's bf16 path, which `Bf16Linear` uses beyond its small-row kernel),
    else None (float32). Measured on such a CPU: 1.3x float32's single-stream and 1.7x its 32-stream
    tokens/s at perplexity -0.3% (docs/benchmarks.md). On AVX2-only CPUs bf16 matmuls are emulated and
    slower than float32 for batches, so "auto" keeps float32 there; other devices keep their dtype."""
    return "bf16" if has_native_bf16(device) else None


def dynamic_int8_unavailable(device: torch.device | str) -> str | None:
    """Why "int8_dynamic" cannot run on `device`, or None where it can (fbgemm's ops are CPU only)."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"int8_dynamic runs on CPU only (fbgemm), not on {device.type}; use 'int8' or 'int4' there"
    engine = torch.backends.quantized.engine
    if engine not in ("x86", "fbgemm"):
        supported = torch.backends.quantized.supported_engines
        return (f"int8_dynamic needs the x86 / fbgemm quantized engine (torch.backends.quantized.engine is "
                f"{engine!r}; this build supports {supported}); use 'int8' or 'int4'")
    return None


@contextmanager
def _quantized_tensors_allowed() -> Iterator[None]:
    """fbgemm's prepack takes a per-channel qint8 tensor, whose constructors torch 2.13 marks as
    deprecated; silence that one warning here, where we build it, and nothing else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel")
        yield


class DynamicInt8Linear(nn.Module):
    """y = r * dequant(quant_u8(x / r) @ q.T) + bias, r = max|x| per row: fbgemm's dynamic int8
    linear (W8A8) with per-row activation scales.

    fbgemm's `linear_dynamic` quantises its whole input with one scale. Over a step's rows that is
    ruinous: one token with huge activations (the first token of a sequence has them in SmolLM2)
    sets the step for every row, and SmolLM2's perplexity went from 48 to 116 (top-1 agreement with
    float32 0.50). Dividing each row by its own max |x| first, and multiplying the output row back
    (the layer is linear), gives every row the full 8-bit range: perplexity +1.8%, top-1 0.90.

    Weights: `quantize_int8(w, qmax=63)`, symmetric, one scale per output channel, held only in
    fbgemm's prepacked form (no float or plain int8 copy is kept). 7-bit weights and 8-bit
    activations (0..255, `reduce_range=False`) keep AVX2's vpmaddubsw, which sums pairs of
    u8 x s8 products in int16, from saturating (2 * 255 * 63 < 32767); torch's quantize_dynamic
    takes the other split (8-bit weights, 7-bit activations: `reduce_range=True`), which simulated
    worse on SmolLM2 (top-1 0.80 against 0.88 on the benchmark text). Products accumulate in int32; the
    float32 result is cast to the input's dtype. The bias is added in float after the rescale.
    """

    WEIGHT_QMAX = 63

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if int(weight_int8.to(torch.int16).abs().max()) > self.WEIGHT_QMAX:  # int8 abs(-128) stays -128
            raise ValueError(f"DynamicInt8Linear takes weights in -{self.WEIGHT_QMAX}..{self.WEIGHT_QMAX} (7 bits)")
        self.out_features, self.in_features = weight_int8.shape
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with _quantized_tensors_allowed():
            qweight = torch._make_per_channel_quantized_tensor(
                weight_int8.cpu().contiguous(), scales.double().cpu(), zero_points, 0
            )
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        # what the prepacked weight holds: the int8 matrix and, per channel, a float scale, an int32
        # zero point and an int32 column offset (the bias is a buffer, counted with the others)
        self.packed_bytes = self.out_features * (self.in_features + 12)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> DynamicInt8Linear:
        q, scales = quantize_int8(linear.weight, qmax=cls.WEIGHT_QMAX)
        return cls(q, scales, linear.bias)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 weight [out, in], float32 scales [out]) as fbgemm holds them."""
        with _quantized_tensors_allowed():
            qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qweight.int_repr(), qweight.q_per_channel_scales().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        row_max = x2.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
        out = torch.ops.quantized.linear_dynamic(x2 / row_max, self._packed, False) * row_max
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, activations=uint8 per row"


def quantize_model(model: nn.Module, mode: str | None, kernel_max_rows: int = KERNEL_MAX_ROWS,
                   group_size: int = 32) -> int:
    """Replace every `nn.Linear` of `model` in place; return how many were replaced. None: no-op.

    `group_size` is int4's group of input columns (32, 64 or 128); the int8 modes ignore it."""
    if mode is None:
        return 0
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}; use one of {list(MODES)} or None")
    if mode == "int8_dynamic":
        device = next(model.parameters()).device
        reason = dynamic_int8_unavailable(device)
        if reason:
            raise ValueError(reason)
    if mode == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {list(INT4_GROUP_SIZES)}, not {group_size}")
    # an untied lm_head is read as `.weight` by the family's compute_logits: see quantize_logits_head
    targets = [
        (name, m) for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rpartition(".")[2] != "lm_head"
    ]
    for name, linear in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.no_grad():
            if mode == "int4":
                setattr(parent, leaf, Int4WeightOnlyLinear.from_linear(linear, group_size))
            elif mode == "int8_dynamic":
                setattr(parent, leaf, DynamicInt8Linear.from_linear(linear))
            elif mode == "bf16":
                setattr(parent, leaf, Bf16Linear.from_linear(linear))
            else:
                setattr(parent, leaf, Int8WeightOnlyLinear.from_linear(linear, kernel_max_rows))
    if mode == "bf16":  # the output head's derived copy in bf16 too (the weight itself stays float32)
        for m in model.modules():
            if isinstance(head := getattr(m, "vocab_projection", None), VocabProjection):
                head.bf16 = True
    return len(targets)


class _Int8LogitsHead:
    """compute_logits over an int8 copy of the output projection (weight-only, or W8A8 with
    `dynamic`), then the family's soft-capping.

    The families compute logits as F.linear(hidden, head weight) (tied: the embedding), then
    Gemma soft-caps them; this repeats that on the quantised weight. The embedding stays float
    for the input lookup, so a tied model holds both copies (+25% of the table's float32 bytes).
    """

    def __init__(self, model: nn.Module, kernel_max_rows: int, dynamic: bool = False) -> None:
        lm_head = getattr(model, "lm_head", None)
        weight = model.model.embed_tokens.weight if lm_head is None else lm_head.weight
        linear = _as_linear(weight)
        self.linear = (DynamicInt8Linear.from_linear(linear) if dynamic
                       else Int8WeightOnlyLinear.from_linear(linear, kernel_max_rows))
        self.cap = getattr(model.config, "final_logit_softcapping", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden).float()
        if self.cap:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits


def _as_linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return lin


def quantize_logits_head(model: nn.Module, kernel_max_rows: int = KERNEL_MAX_ROWS, dynamic: bool = False) -> None:
    """Make `model.compute_logits` read an int8 copy of the output projection (Llama, Gemma 3);
    `dynamic`: a `DynamicInt8Linear` (W8A8, CPU) instead of the weight-only one."""
    if model.compute_logits.__class__ is _Int8LogitsHead:
        return
    if dynamic and (reason := dynamic_int8_unavailable(next(model.parameters()).device)):
        raise ValueError(reason)
    head = _Int8LogitsHead(model, kernel_max_rows, dynamic)
    model.add_module("logits_head_int8", head.linear)  # so .to() and weight_bytes see it
    model.compute_logits = head  # instance attribute: shadows the family's method


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (the weight-only quantised weights live in
    buffers) and by fbgemm's prepacked weights (`DynamicInt8Linear`, outside torch's tensors)."""
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    packed = sum(m.packed_bytes for m in model.modules() if isinstance(m, DynamicInt8Linear))
    return sum(t.numel() * t.element_size() for t in tensors) + packed
