"""What the weight formats share: one probe cache per (capability, device) and the gate to the native
small-row kernels (`tokenops.engine.kernels`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenops.engine import kernels
from tokenops.engine.quantize.auto import this_cpu_feature_set

# (capability, device) -> whether this process's torch build and CPU have it; probed once each
_KERNEL_CACHE: dict[str, bool] = {}


def probed(key: str, probe: Callable[[], bool]) -> bool:
    """`probe()` once per process for `key` (e.g. "int4:cpu"); its answer afterwards."""
    if key not in _KERNEL_CACHE:
        _KERNEL_CACHE[key] = probe()
    return _KERNEL_CACHE[key]


def native_ops(x: torch.Tensor, rows: int, max_rows: int) -> object | None:
    """The native kernels when they apply to this call: CPU float32 activations, few rows, no autograd."""
    if (
        not 0 < rows <= max_rows
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or torch.is_grad_enabled()
    ):
        return None
    return kernels.ops(x.device)


def has_native_bf16(device: torch.device | str) -> bool:
    """True on a CPU that computes bf16 natively, AVX512-BF16 or AMX, where oneDNN's bf16 path runs;
    probed once. (oneDNN's own check, `_is_mkldnn_bf16_supported`, also holds on AVX-512 CPUs without
    either, Skylake-SP or Cascade Lake, where it emulates bf16: there bf16 GEMMs are no gain.) The
    feature set is the one torch runs (`quantize.auto.this_cpu_feature_set`): an AMX CPU held to AVX2
    by `ATEN_CPU_CAPABILITY` / `ONEDNN_MAX_CPU_ISA` has no native bf16 here."""
    device = torch.device(device)

    def probe() -> bool:
        try:
            isa = this_cpu_feature_set() in ("amx", "avx512_bf16")
            return device.type == "cpu" and isa and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False

    return probed(f"bf16:{device}", probe)
