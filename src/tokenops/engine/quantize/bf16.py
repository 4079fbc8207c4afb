"""bf16 weights: held once as bf16, half of float32's bytes at near-float32 numerics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenops.engine.models.layers import _DerivedWeight, _prepack, bucket_rows, onednn_linear_available
from tokenops.engine.quantize.common import bf16_gemm_wins, native_ops

# Rows at or below this run the native bf16-weight x float32-activation kernel (kernels/csrc/gemv.cpp),
# which streams the weight once; more rows: oneDNN's bf16 GEMM (AMX on the Emerald Rapids machine) wins.
# Measured there, SmolLM2-135M shapes, 2 threads: benchmarks/linear_small_rows.py, docs/benchmarks.md.
NATIVE_MAX_ROWS = 8

# Where oneDNN's bf16 GEMM does not beat float32's, the native kernel (float32 activations, so no
# casts either) keeps up with it to here: a step's linears at 16 rows 36 against 44 ms, at 32 66
# against 69, at 64 127 against 117 (linear_small_rows.py on the Xeon AVX-512 kind, docs/benchmarks.md)
NATIVE_MAX_ROWS_SLOW_GEMM = 32

# Rows at or above this, on a CPU whose bf16 GEMM does not beat float32's (Intel without AMX, or no
# native bf16), widen the weight to float32 for the call and run a float32 GEMM: on the Xeon AVX-512
# kind 1.4-1.7x oneDNN's bf16 GEMM at 128-512 rows, level at 64 (docs/benchmarks.md, Xeon AVX-512)
WIDEN_MIN_ROWS = 128


def native_max_rows(device: torch.device | str) -> int:
    """Rows up to which a `Bf16Linear` on `device` takes the native kernel."""
    return NATIVE_MAX_ROWS if bf16_gemm_wins(device) else NATIVE_MAX_ROWS_SLOW_GEMM


class Bf16Linear(nn.Module):
    """y = x @ w.T + bias with w held once as bf16 (the bias stays float32).

    On CPU, float32 activations of up to `kernel_max_rows` rows (decode) run `tokenops::linear_bf16`:
    the weight widened to float32 in registers, float32 products and sums, so the only error is
    the weight's rounding to bf16 and the cost is half of float32's bytes. Other calls cast the
    activations to bf16 and run oneDNN's bf16 GEMM (AMX / AVX512-BF16 on CPUs that have them),
    output cast back to the layer's dtype, or kept in bf16 where `keeps_bf16` says the next op reads
    bf16 and oneDNN runs bf16, which plain AVX2 CPUs do not (a prefill chunk's [512, 3072] gate|up
    output cast to float32 and back cost as much as the GEMM that made it). `kernel_max_rows=0`
    forces that path. Where bf16 GEMMs trail float32's (`bf16_gemm_wins` false), calls of
    WIDEN_MIN_ROWS rows or more (prefill chunks) widen the weight to float32 for one float32 GEMM
    instead: the decode kernel's numerics (only the weight rounded), output in float32 whatever
    `keeps_bf16` says.

    Like `layers.Linear`, the oneDNN path reads a prepacked copy of the bf16 weight, derived on
    first use (`derived`; `use_derived_weights` switches it, `derived_bytes` is its size), which is
    faster than `F.linear` on the plain weight (docs/benchmarks.md).
    """

    derived = True  # False: F.linear on the plain bf16 weight, no second copy

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, kernel_max_rows: int = NATIVE_MAX_ROWS
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel_max_rows = kernel_max_rows
        self.out_dtype = weight.dtype  # the layer's own dtype: what the oneDNN path casts back to
        # set by `quantize` on a gated MLP's gate|up projection (the oneDNN path hands its bf16 output
        # on uncast, the activation reads and writes bf16 and the down projection needs no cast in) and
        # on a Llama layer's output projections (its norms widen their output as they add it)
        self.keeps_bf16 = False
        self.register_buffer("weight_bf16", weight.detach().to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._packed = _DerivedWeight(_prepack)

    def derived_bytes(self) -> int:
        """Bytes of the prepacked copy once built (0 where it is off or cannot apply)."""
        on = (
            self.derived and self.weight_bf16.device.type == "cpu" and onednn_linear_available(torch.bfloat16)
        )
        return self.weight_bf16.numel() * self.weight_bf16.element_size() if on else 0

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel_max_rows: int = NATIVE_MAX_ROWS) -> Bf16Linear:
        return cls(linear.weight, linear.bias, kernel_max_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = native_ops(x, x.numel() // self.in_features, self.kernel_max_rows)
        if native is not None:
            return native.linear_bf16(x.contiguous(), self.weight_bf16, self.bias)
        if (
            x.device.type == "cpu"
            and x.numel() // self.in_features >= WIDEN_MIN_ROWS
            and self.kernel_max_rows
            and not bf16_gemm_wins(x.device)
        ):
            return F.linear(x.float(), self.weight_bf16.float(), self.bias).to(self.out_dtype)
        xb = x.to(torch.bfloat16)
        if (
            self.derived
            and xb.dim() == 2
            and xb.device.type == "cpu"
            and onednn_linear_available(torch.bfloat16)
        ):
            out = torch.ops.mkldnn._linear_pointwise(
                bucket_rows(xb, torch.bfloat16), self._packed.get(self.weight_bf16), None, "none", [], ""
            )[: xb.shape[0]]
        else:
            out = F.linear(xb, self.weight_bf16)
        # bf16 is handed on uncast only where oneDNN runs bf16 (the next op's bf16 path is fast there);
        # plain AVX2 CPUs get the layer's dtype
        if not (self.keeps_bf16 and onednn_linear_available(torch.bfloat16)):
            out = out.to(self.out_dtype)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"kernel_max_rows={self.kernel_max_rows}"
        )
