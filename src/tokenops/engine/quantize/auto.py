"""What `quantization="auto"` means: a table keyed by the CPU's feature set (docs/engine-core.md, "What
`quantization="auto"` picks").

The feature set is the widest one that torch's kernels and ours actually run, not only what the CPU
advertises: `ATEN_CPU_CAPABILITY=avx2` or `TOKENOPS_KERNEL_ISA=avx2` make an AVX-512 machine count
as "avx2", which is how the AVX2 rows were measured here. Every function below but
`this_cpu_feature_set` is a pure function of its arguments (the tests call them with made-up CPUs).
"""

from __future__ import annotations

import functools
import os

FEATURE_SETS = ("amx", "avx512_bf16", "avx512_bf16_intel", "avx512", "avx2", "portable")

# The weight format nearest the fastest at every batch size on each feature set (the engine_vs_peers.py
# runs in docs/benchmarks.md); None = float32 weights. An engine converts its weights once at start and
# serves every concurrency with them, so a row is the mode that loses least anywhere, not the best at one
# batch size. int4 on the block kernels' tiles (W4A8) wherever they run fast: on AMX, with vpdpbusd, far
# ahead of bf16 at a few streams and level at 32 (bf16 leads only past that, by less than int4 leads at
# one stream); on Zen 4 the tiles, two at a time in 512-bit registers, beat bf16 at 1 to 32 streams and
# fbgemm's W8A8 at 1-8, level with it at 32 (where W8A8 changes greedy output); on Intel cores with
# AVX512-BF16 but no AMX ahead of bf16 at few streams and of float32 at many; on AVX2 ahead of W8A8 and
# float32 at every level, and far nearer float32's greedy output (engine_quality_long.py); float32
# elsewhere.
AUTO_TABLE: dict[str, str | None] = {
    "amx": "int4",
    "avx512_bf16": "int4",
    "avx512_bf16_intel": "int4",
    "avx512": None,
    "avx2": "int4",
    "portable": None,
}


def cpu_feature_set(
    flags: frozenset[str] | set[str], aten_capability: str, kernel_isa: str = "native", vendor: str = ""
) -> str:
    """The feature set (one of FEATURE_SETS) of a CPU with /proc/cpuinfo `flags` and `vendor_id`,
    given ATen's CPU capability ("AVX512", "AVX2", "DEFAULT": `torch.backends.cpu.get_cpu_capability()`,
    which `ATEN_CPU_CAPABILITY` caps) and the native kernels' build target (`kernels.kernel_isa()`).

    AVX512-BF16 splits by vendor: Zen 4 runs a 512-bit float32 FMA as two halves, so a bf16 dot product
    (two multiply-adds per lane) doubles its rate; Intel's server cores have two full-width FMA ports
    and run the bf16 dot product on one, so there it only matches float32."""
    if kernel_isa == "portable":  # the kernels' scalar paths: int4/bf16 would not pay off there
        return "portable"
    has_avx2 = {"avx2", "fma"} <= flags
    capped = aten_capability.upper() != "AVX512" or kernel_isa in ("avx2", "avx2_vnni")
    if capped or not {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx2" if has_avx2 and aten_capability.upper() in ("AVX2", "AVX512") else "portable"
    if {"amx_tile", "amx_bf16"} <= flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16_intel" if vendor == "GenuineIntel" else "avx512_bf16"
    return "avx512"


def auto_quantization_for(feature_set: str) -> str | None:
    """The weight format "auto" resolves to on `feature_set`."""
    if feature_set not in AUTO_TABLE:
        raise ValueError(f"unknown CPU feature set {feature_set!r}; use one of {', '.join(FEATURE_SETS)}")
    return AUTO_TABLE[feature_set]


@functools.cache
def this_cpu_feature_set() -> str:
    """`cpu_feature_set` of this process's CPU, ATen capability and kernel build target; once."""
    import torch

    from tokenops import cpu_info
    from tokenops.engine import kernels

    try:
        isa = kernels.kernel_isa()
    except ValueError:
        isa = "native"
    capability = torch.backends.cpu.get_cpu_capability()
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper().startswith("AVX2"):
        capability = "AVX2"  # oneDNN held to AVX2 as well: its bf16 and int8 paths are AVX2's
    return cpu_feature_set(cpu_info.cpu_flags(), capability, isa, cpu_info.cpu_vendor())
