"""What the weight formats share: one probe cache per (capability, device), the gate to the native
small-row kernels (`tokenops.engine.kernels`) and to the block-quantised ones."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenops.engine import kernels
from tokenops.engine.quantize.auto import this_cpu_feature_set

# CPU feature sets where int4 layers and the output head run the block-quantised kernels
# (kernels/csrc/linear_blocks.cpp: 8-bit activations, integer products) instead of torch's int4 kernel
# and a float32 head: measured faster there (EPYC AVX2 in docs/benchmarks.md). Elsewhere they run where
# the kernels were built with vpdpbusd (`compiled_int8_dot() == "vnni"`), which makes their integer
# products faster than AVX2's and the tiles faster than torch's int4 kernel at every row count
# (Xeon AMX in docs/benchmarks.md)
BLOCK_KERNEL_FEATURE_SETS = ("avx2",)

# weight rows interleaved in `linear_q8`'s tiles
Q8_TILE = 8

# (capability, device) -> whether this process's torch build and CPU have it; probed once each
_KERNEL_CACHE: dict[str, bool] = {}


def probed(key: str, probe: Callable[[], bool]) -> bool:
    """`probe()` once per process for `key` (e.g. "int4:cpu"); its answer afterwards."""
    if key not in _KERNEL_CACHE:
        _KERNEL_CACHE[key] = probe()
    return _KERNEL_CACHE[key]


def native_ops(
    x: torch.Tensor, rows: int, max_rows: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,)
) -> object | None:
    """The native kernels when they apply to this call: CPU activations of `dtypes` (float32), few
    rows, no autograd."""
    if not 0 < rows <= max_rows or x.dtype not in dtypes or x.device.type != "cpu" or torch.is_grad_enabled():
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
            isa = this_cpu_feature_set() in ("amx", "avx512_bf16", "avx512_bf16_intel")
            return device.type == "cpu" and isa and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False

    return probed(f"bf16:{device}", probe)


def bf16_gemm_wins(device: torch.device | str) -> bool:
    """True where oneDNN's bf16 GEMM beats its float32 one at many rows (AMX, and AVX512-BF16 on
    Zen 4), so int8 prefill chunks and bf16 weights past a few rows go to it; on Intel cores with
    AVX512-BF16 alone it is slower than float32 from 64 rows (docs/benchmarks.md, Xeon AVX-512)."""
    return has_native_bf16(device) and this_cpu_feature_set() in ("amx", "avx512_bf16")


def has_bf16_tiles(device: torch.device | str) -> bool:
    """True where bf16 runs on AMX tiles: there int4's prefill chunks take oneDNN's bf16 GEMM, and
    long prefill chunks over a bf16 cache attend in bf16 on tiles (the attention kernel's own, else
    oneDNN's SDPA); with AVX512-BF16 alone the native kernels are the faster (docs/benchmarks.md,
    paged_prefill_attention.py)."""
    return has_native_bf16(device) and this_cpu_feature_set() == "amx"


def blocks_amx() -> bool:
    """Whether the block kernels (int4's tiles, the Q8_0 head) run calls of many rows on AMX-INT8's
    tiles here (a build for an AMX CPU, granted the tile state); probed once."""

    def probe() -> bool:
        ops = kernels.ops("cpu")
        return ops is not None and bool(ops.blocks_amx())

    return probed("blocks_amx:cpu", probe)


def block_kernels(device: torch.device | str) -> bool:
    """Whether int4 layers and the output head on `device` take the block-quantised kernels."""
    if torch.device(device).type != "cpu" or (ops := kernels.ops("cpu")) is None:
        return False
    feature_set = this_cpu_feature_set()
    return feature_set in BLOCK_KERNEL_FEATURE_SETS or (
        feature_set != "portable" and ops.compiled_int8_dot() == "vnni"
    )


def quantize_q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (int8 codes [out, in'] in -127..127, float32 d [out, in' / 32]):
    llama.cpp's Q8_0, d = max|w| / 127 per block of 32 inputs, `in'` padded with zeros to 32."""
    w = weight.detach().float()
    w = torch.nn.functional.pad(w, (0, -w.shape[1] % 32)).view(w.shape[0], -1, 32)
    d = w.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = (w * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
    return codes.view(w.shape[0], -1).contiguous(), d.contiguous()


def q8_tiles(codes: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_q8_blocks`' (codes [out, in'], d [out, in' / 32]) -> the `linear_q8` tiles: codes int8
    [ceil(out / 8), in' / 32 * 256], per tile of 8 weight rows and block of 32 inputs 8 chunks of 32
    bytes whose byte 4r + u holds row r's input 4c + u (chunk c); d float32 [ceil(out / 8), in' / 32 * 8],
    element 8b + r row r's scale in block b. Rows past `out` are zero."""
    out_f, padded = codes.shape
    tiles = -(-out_f // Q8_TILE)
    pad = (0, 0, 0, tiles * Q8_TILE - out_f)
    # [tile, row, block, chunk, u] -> [tile, block, chunk, row, u]
    c = torch.nn.functional.pad(codes, pad).view(tiles, Q8_TILE, padded // 32, 8, 4)
    s = torch.nn.functional.pad(d.float(), pad).view(tiles, Q8_TILE, -1)
    return (
        c.permute(0, 2, 3, 1, 4).reshape(tiles, -1).contiguous(),
        s.transpose(1, 2).reshape(tiles, -1).contiguous(),
    )
