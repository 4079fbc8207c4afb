"""What `quantization="auto"` means: a table keyed by the CPU's feature set and by how many rows a
decode step runs (docs/engine-core.md, "What `quantization="auto"` picks").

The feature set is the widest one that torch's kernels and ours actually run, not only what the CPU
advertises: `ATEN_CPU_CAPABILITY=avx2` or `TOKENOPS_KERNEL_ISA=avx2` make an AVX-512 machine count
as "avx2", which is how the AVX2 rows were measured here. Every function below but
`this_cpu_feature_set` is a pure function of its arguments (the tests call them with made-up CPUs).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

FEATURE_SETS = ("amx", "avx512_bf16", "avx512_bf16_intel", "avx512", "avx2", "portable")

# rows per step at or below which a table row's `low` mode applies (the engine's max_num_seqs bounds
# the rows of every decode step)
LOW_CONCURRENCY_ROWS = 8


@dataclass(frozen=True)
class AutoChoice:
    """The weight formats that decode fastest on one feature set: at few rows per step (`low`, bound
    by the weights' bytes) and at many (`high`, bound by arithmetic). None = float32 weights."""

    low: str | None
    high: str | None


# int4 on the block kernels' tiles (W4A8) wherever they run fast, bf16 for many rows on AMX (the
# engine_vs_peers.py runs in docs/benchmarks.md): on AMX int4's tiles with vpdpbusd decode one stream
# faster and 4-8 streams level or better, bf16 on AMX's tiles wins past 8; on Zen 4 (AVX512-BF16
# without AMX) int4's tiles, two at a time in 512-bit registers from 8 rows, beat bf16 at 1 to 32
# streams, prefill included, and fbgemm's W8A8 at 1-8 in an engine of 8, level with it at 32 (where
# W8A8 changes greedy output); on Intel cores with AVX512-BF16 but no AMX int4
# at every level: faster than bf16 at 1-8 streams and than float32 at 16-32, whose GEMMs beat
# oneDNN's bf16 ones there (the Xeon AMX kind with oneDNN held off AMX); on AVX2 int4 on the 8-row
# tiles: faster than fbgemm's W8A8 and float32 at every level on both EPYC AVX2 kinds, and far nearer
# float32's greedy output (engine_quality_long.py); float32 elsewhere.
AUTO_TABLE: dict[str, AutoChoice] = {
    "amx": AutoChoice(low="int4", high="bf16"),
    "avx512_bf16": AutoChoice(low="int4", high="int4"),
    "avx512_bf16_intel": AutoChoice(low="int4", high="int4"),
    "avx512": AutoChoice(low=None, high=None),
    "avx2": AutoChoice(low="int4", high="int4"),
    "portable": AutoChoice(low=None, high=None),
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


def auto_quantization_for(feature_set: str, max_rows: int) -> str | None:
    """The weight format "auto" resolves to on `feature_set` for an engine whose decode steps run at
    most `max_rows` rows (its max_num_seqs): the table's `low` mode up to LOW_CONCURRENCY_ROWS,
    else its `high` one (one format per engine: its weights are converted once at start)."""
    if feature_set not in AUTO_TABLE:
        raise ValueError(f"unknown CPU feature set {feature_set!r}; use one of {', '.join(FEATURE_SETS)}")
    choice = AUTO_TABLE[feature_set]
    return choice.low if max_rows <= LOW_CONCURRENCY_ROWS else choice.high


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
