"""Dynamic int8 (W8A8): int8 weights (prepacked for fbgemm, plus a plain copy for `torch._int_mm` on
prefill-sized calls, off by default) and activations quantised to 8 bits per row at run time, int32 accumulation. Integer arithmetic, so it also gains where decode is bound by compute
(batches of 8-32 rows), where the weight-only formats lose to float32. CPU only (x86 / fbgemm)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tokenops.engine import kernels
from tokenops.engine.quantize.int8 import quantize_int8


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

    Weights: `quantize_int8(w, qmax=63)`, symmetric, one scale per output channel, held in fbgemm's
    prepacked form and, where INT_MM_MIN_ROWS is set (default None), as a plain int8 [out, in] buffer for
    `torch._int_mm` on calls of INT_MM_MIN_ROWS rows or more (see `_int_mm`; +1 byte a weight). 7-bit weights and 8-bit
    activations (0..255, `reduce_range=False`) keep AVX2's vpmaddubsw, which sums pairs of
    u8 x s8 products in int16, from saturating (2 * 255 * 63 < 32767); torch's quantize_dynamic
    takes the other split (8-bit weights, 7-bit activations: `reduce_range=True`), which simulated
    worse on SmolLM2 (top-1 0.80 against 0.88 on the benchmark text). Products accumulate in int32; the
    float32 result is cast to the input's dtype. The bias is added in float after the rescale.
    """

    WEIGHT_QMAX = 63
    # Calls of at least this many rows may run `torch._int_mm` on a plain int8 copy of the weights
    # instead of fbgemm (read when a layer is built; None: fbgemm always, no copy). Faster -- the
    # four projection shapes, 1 thread, Zen 4: 0.51 vs 0.56 ms at 16 rows, 0.80 vs 0.89 at 32, 9.9
    # vs 12.5 at 512, a tie at 1-8; 32 concurrent requests 245 -> 261 tok/s of CPU time -- but off by
    # default: on SmolLM2 its end metrics are worse than fbgemm's (perplexity +3.0% against +1.6% over
    # 9 chunks of 256 tokens, +5.5% against +1.0% on the benchmark text, top-1 0.85 against 0.90
    # there) although each layer's error against float is 15-25% lower; fed fbgemm's own quantisation
    # it scores +4.1% on that text too; over 10,200 tokens (benchmarks/engine_quality_long.py) it stays worse:
    # +3.4% against +2.2%, 2.5 standard errors apart, top-1 a tie (docs/benchmarks.md). Hence off.
    # 16 is where it wins with the native quantise / rescale kernels; with torch's ops from 128.
    INT_MM_MIN_ROWS: int | None = None
    INT_MM_MIN_ROWS_TORCH = 128

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
        # the plain copy `torch._int_mm` reads (weight_bytes counts it, a buffer): out_features * in_features
        # more bytes; not saved with the state dict, which never held the weights either
        self.int_mm_min_rows = self.INT_MM_MIN_ROWS
        int_mm = self.int_mm_min_rows is not None
        self.register_buffer("weight_int8", weight_int8.cpu().contiguous().clone() if int_mm else None,
                             persistent=False)
        self.register_buffer("weight_scales", scales.float().cpu().contiguous().clone() if int_mm else None,
                             persistent=False)
        # per output channel, sum_k q[c, k] * scale[c]: what a row's offset adds to each of its outputs
        self.register_buffer("weight_offsets", (weight_int8.cpu().sum(dim=1, dtype=torch.int32).float()
                                                * self.weight_scales) if int_mm else None, persistent=False)
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
        native = None if torch.is_grad_enabled() else kernels.ops(x.device)
        if native is not None and self.weight_int8 is None:
            # fbgemm at every row count: the whole call is one native op (`_fbgemm`'s passes, the
            # reshape and the cast inside), the same bits as the steps below
            return native.linear_dynamic_rows(x, self._packed, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if self.weight_int8 is not None and rows >= (self.int_mm_min_rows if native is not None
                                                     else max(self.int_mm_min_rows, self.INT_MM_MIN_ROWS_TORCH)):
            out = self._int_mm(x2, native)
        else:
            out = self._fbgemm(x2, native)
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _fbgemm(self, x2: torch.Tensor, ops: object | None = None) -> torch.Tensor:
        """Each row over its max |x| (clamped at 1e-30) into fbgemm, the output row times it, plus the
        bias. The native kernels (kernels/csrc/scale_rows.cpp) do each side in one pass, reading a
        bf16 / fp16 input without a float32 copy first; the torch ops below compute the same, bit for
        bit (a true division, then a multiply and an add each rounded)."""
        if ops is not None:
            scaled, row_max = ops.scale_rows(x2)
            return ops.mul_rows_add_(torch.ops.quantized.linear_dynamic(scaled, self._packed, False), row_max,
                                     self.bias)
        # the rescale and bias in place on fbgemm's fresh output, not into new tensors: 12.8 -> 12.2 ms
        # for the model's four projections at 512 rows (Zen 4, 1 thread); vector_norm(inf) instead
        # of abs().amax() was slower (16.9 ms)
        x2 = x2.float()
        row_max = x2.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)
        out = torch.ops.quantized.linear_dynamic(x2 / row_max, self._packed, False).mul_(row_max)
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def _int_mm(self, x2: torch.Tensor, ops: object | None) -> torch.Tensor:
        """Activations int8 per row, affine around the row's midpoint (x ~ q * scale + offset, 255
        levels over the row's min..max, like fbgemm's uint8 with a zero point: a symmetric scale
        wasted half of them on SmolLM2's rows, which lean one way: perplexity +4.2% against fbgemm's
        +1.0%, top-1 0.85 against 0.90), int8 x int8 -> int32 by `torch._int_mm`, then
        y = acc * row_scale * weight_scale + row_offset * sum(q_w * weight_scale) + bias.
        The native kernels (kernels/csrc/quantize_rows.cpp) do the quantise and the rescale in one
        pass each, the latter in place in the int32 result; the torch ops below compute the same, bit
        for bit."""
        if ops is not None:
            q, row_scale, row_offset = ops.quantize_rows_s8(x2)
            return ops.rescale_rows_(torch._int_mm(q, self.weight_int8.t()), row_scale, row_offset,
                                     self.weight_scales, self.weight_offsets, self.bias)
        xf = x2.float()
        lo, hi = xf.amin(dim=1, keepdim=True), xf.amax(dim=1, keepdim=True)
        mid = (hi + lo) * 0.5
        half = ((hi - lo) * 0.5).clamp_(min=1e-30)
        # 127 / half as one true division, as the kernel does (`127.0 / t` is reciprocal(t) * 127 in torch)
        q = ((xf - mid).mul_(torch.full_like(half, 127.0).div_(half))).round_().clamp_(-127, 127).to(torch.int8)
        out = torch._int_mm(q, self.weight_int8.t()).float().mul_(half / 127.0).mul_(self.weight_scales)
        out.add_(mid * self.weight_offsets)
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def extra_repr(self) -> str:
        int_mm = "" if self.weight_int8 is None else f", int8 x int8 from {self.int_mm_min_rows} rows"
        return f"in_features={self.in_features}, out_features={self.out_features}, activations=8-bit per row{int_mm}"
