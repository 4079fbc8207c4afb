"""Dynamic int8 (W8A8): int8 weights prepacked for fbgemm and activations quantised to 8 bits per row at
run time, int32 accumulation. Integer arithmetic, so it also gains where decode is bound by compute
(batches of 8-32 rows), where the weight-only formats lose to float32. CPU only (x86 / fbgemm). This
module owns the layer and its availability check; which layers become one is `quantize_model`'s."""

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
        return (
            f"int8_dynamic needs the x86 / fbgemm quantized engine (torch.backends.quantized.engine is "
            f"{engine!r}; this build supports {supported}); use 'int8' or 'int4'"
        )
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
    ruinous: one token with huge activations (the first token of a sequence often has them) sets
    the step for every row. Dividing each row by its own max |x| first, and multiplying the output
    row back (the layer is linear), gives every row the full 8-bit range.

    Weights: `quantize_int8(w, qmax=63)`, symmetric, one scale per output channel, held in fbgemm's
    prepacked form. 7-bit weights and 8-bit activations (0..255, `reduce_range=False`) keep AVX2's
    vpmaddubsw, which sums pairs of u8 x s8 products in int16, from saturating (2 * 255 * 63 < 32767);
    torch's quantize_dynamic takes the other split (8-bit weights, 7-bit activations), which loses
    more accuracy (docs/benchmarks.md). Products accumulate in int32; the float32 result is cast to
    the input's dtype. The bias is added in float after the rescale.
    """

    WEIGHT_QMAX = 63

    def __init__(
        self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if int(weight_int8.to(torch.int16).abs().max()) > self.WEIGHT_QMAX:  # int8 abs(-128) stays -128
            raise ValueError(
                f"DynamicInt8Linear takes weights in -{self.WEIGHT_QMAX}..{self.WEIGHT_QMAX} (7 bits)"
            )
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
        native = None if torch.is_grad_enabled() else kernels.ops(x.device)
        if native is not None:
            # the whole call is one native op (`_fbgemm`'s passes, the reshape and the cast inside),
            # the same bits as the steps below
            return native.linear_dynamic_rows(x, self._packed, self.bias)
        shape = x.shape
        out = self._fbgemm(x.reshape(-1, self.in_features))
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _fbgemm(self, x2: torch.Tensor, ops: object | None = None) -> torch.Tensor:
        """Each row over its max |x| (clamped at 1e-30) into fbgemm, the output row times it, plus the
        bias. The native kernels (kernels/csrc/scale_rows.cpp) do each side in one pass, reading a
        bf16 / fp16 input without a float32 copy first; the torch ops below compute the same, bit for
        bit (a true division, then a multiply and an add each rounded)."""
        if ops is not None:
            scaled, row_max = ops.scale_rows(x2)
            return ops.mul_rows_add_(
                torch.ops.quantized.linear_dynamic(scaled, self._packed, False), row_max, self.bias
            )
        # the rescale and bias in place on fbgemm's fresh output, not into new tensors
        x2 = x2.float()
        row_max = x2.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)
        out = torch.ops.quantized.linear_dynamic(x2 / row_max, self._packed, False).mul_(row_max)
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, activations=8-bit per row"
