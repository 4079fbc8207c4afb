"""An experiment on int8_dynamic's prefill: `torch._int_mm` on a plain int8 copy of the weights in place
of fbgemm, for calls of `min_rows` rows or more (`use_int_mm(model, min_rows)`).

Activations are quantised to int8 per row, affine around the row's midpoint (255 levels over the
row's min..max, like fbgemm's uint8 with a zero point; a symmetric scale wastes half of them on rows
that lean one way), multiplied int8 x int8 -> int32 by `torch._int_mm`, then
y = acc * row_scale * weight_scale + row_offset * sum(q_w * weight_scale) + bias. The native kernels
(`quantize_rows_s8`, `rescale_rows_` in kernels/csrc/quantize_rows.cpp) do the quantise and the
rescale in one pass each; the torch ops here compute the same, bit for bit. Without the native
kernels the path starts at `MIN_ROWS_TORCH` rows. engine_quantization.py, engine_throughput_cpu.py and
engine_quality_long.py measure it against fbgemm (docs/benchmarks.md); the engine never uses it.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenops.engine import kernels
from tokenops.engine.quantize import DynamicInt8Linear

MIN_ROWS_TORCH = 128  # with torch's ops the quantise / rescale passes cost more below this


class IntMMDynamicInt8Linear(DynamicInt8Linear):
    """A `DynamicInt8Linear` that also keeps a plain int8 copy of its weights (+1 byte a weight) and
    runs `torch._int_mm` on calls of `int_mm_min_rows` rows or more; fbgemm below."""

    def add_int_mm_copy(self, min_rows: int) -> None:
        weight_int8, scales = self.unpacked()
        self.int_mm_min_rows = min_rows
        # buffers, so weight_bytes counts them; not saved with the state dict
        self.register_buffer("weight_int8", weight_int8.contiguous().clone(), persistent=False)
        self.register_buffer("weight_scales", scales.contiguous().clone(), persistent=False)
        # per output channel, sum_k q[c, k] * scale[c]: what a row's offset adds to each of its outputs
        self.register_buffer(
            "weight_offsets", weight_int8.sum(dim=1, dtype=torch.int32).float() * scales, persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = None if torch.is_grad_enabled() else kernels.ops(x.device)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        threshold = self.int_mm_min_rows if native is not None else max(self.int_mm_min_rows, MIN_ROWS_TORCH)
        out = self.int_mm(x2, native) if x2.shape[0] >= threshold else self._fbgemm(x2, native)
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def int_mm(self, x2: torch.Tensor, ops: object | None) -> torch.Tensor:
        """x2 [rows, in] through `torch._int_mm`: the native passes when `ops`, else torch's ops."""
        if ops is not None:
            q, row_scale, row_offset = ops.quantize_rows_s8(x2)
            return ops.rescale_rows_(
                torch._int_mm(q, self.weight_int8.t()),
                row_scale,
                row_offset,
                self.weight_scales,
                self.weight_offsets,
                self.bias,
            )
        xf = x2.float()
        lo, hi = xf.amin(dim=1, keepdim=True), xf.amax(dim=1, keepdim=True)
        mid = (hi + lo) * 0.5
        half = ((hi - lo) * 0.5).clamp_(min=1e-30)
        # 127 / half as one true division, as the kernel does (`127.0 / t` is reciprocal(t) * 127 in torch)
        inv = torch.full_like(half, 127.0).div_(half)
        q = (xf - mid).mul_(inv).round_().clamp_(-127, 127).to(torch.int8)
        out = torch._int_mm(q, self.weight_int8.t()).float().mul_(half / 127.0).mul_(self.weight_scales)
        out.add_(mid * self.weight_offsets)
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int8 x int8 from {self.int_mm_min_rows} rows"


def use_int_mm(model: nn.Module, min_rows: int = 16) -> int:
    """Turn every `DynamicInt8Linear` of `model` into an `IntMMDynamicInt8Linear`; return how many."""
    layers = [m for m in model.modules() if type(m) is DynamicInt8Linear]
    for m in layers:
        m.__class__ = IntMMDynamicInt8Linear
        m.add_int_mm_copy(min_rows)
    return len(layers)
