"""Weight-only int8: int8 weights with one symmetric float scale per output channel, a quarter of
float32's bytes (fewer bytes read: a gain where decode is bound by memory bandwidth, i.e. small
batches)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenops.engine.quantize.common import bf16_gemm_wins, native_ops, probed

# Rows at or below this use `_weight_int8pack_mm` (int8 weights, bf16 activations); larger prefill
# chunks dequantise to the activation dtype and use a plain GEMM, which wins once a call is large
# enough to be bound by compute (benchmarks/linear_small_rows.py).
KERNEL_MAX_ROWS = 256

# Rows at or below this run the native float32-activation kernel (kernels/csrc/gemv.cpp), which
# streams the weight once, faster than `_weight_int8pack_mm` there (benchmarks/linear_small_rows.py).
INT8_NATIVE_MAX_ROWS = 32


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


def has_int8pack_kernel(device: torch.device | str) -> bool:
    device = torch.device(device)
    return probed(f"int8:{device}", lambda: _has_int8pack_kernel(device))


class Int8WeightOnlyLinear(nn.Module):
    """y = x @ (q * scale).T + bias, with q int8 and one scale per output channel.

    Up to `INT8_NATIVE_MAX_ROWS` float32 rows on CPU run the native kernel (`tokenops::linear_int8`:
    float32 activations and sums, so also closer to float32 than the bf16-activation kernel). More
    rows where bf16 GEMMs beat float32's dequantise to bf16 for one oneDNN GEMM (bf16 activations); elsewhere
    small row counts go through the int8 x bf16 kernel when the device has it; larger ones, or a
    device without either, dequantise to the activation dtype. The output has the input's dtype
    either way. `kernel_max_rows=0` forces the dequantise path (exact with respect to the
    dequantised weights; tests use it as the reference).
    """

    def __init__(
        self,
        weight_int8: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
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
        native = native_ops(x, rows, min(INT8_NATIVE_MAX_ROWS, self.kernel_max_rows))
        if native is not None:
            bias = None if self.bias is None else self.bias.float()
            return native.linear_int8(x.contiguous(), self.weight_int8, self.scales, bias)
        if self.kernel_max_rows and rows > INT8_NATIVE_MAX_ROWS and bf16_gemm_wins(x.device):
            # prefill chunks where bf16 GEMMs beat float32's: oneDNN (AMX) on a bf16 copy made
            # for this call, faster than `_weight_int8pack_mm` from 64 rows (compute-bound there)
            out = F.linear(x.to(torch.bfloat16), self.dequantized_weight(torch.bfloat16)).to(x.dtype)
            return out if self.bias is None else out + self.bias.to(x.dtype)
        if self._kernel is None:
            self._kernel = has_int8pack_kernel(self.weight_int8.device)
        if self._kernel and 0 < rows <= self.kernel_max_rows:
            shape = x.shape
            out = (
                torch.ops.aten._weight_int8pack_mm(
                    x.reshape(rows, self.in_features).to(torch.bfloat16), self.weight_int8, self.scales_bf16
                )
                .to(x.dtype)
                .reshape(*shape[:-1], self.out_features)
            )
            return out if self.bias is None else out + self.bias.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"kernel_max_rows={self.kernel_max_rows}"
        )
