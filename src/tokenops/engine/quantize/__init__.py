"""Weight formats of a loaded model's linear layers (the `quantization` knob): `quantize_model(model,
mode)` swaps every `nn.Linear` (fused q|k|v and gate|up included) for "int8" (`Int8WeightOnlyLinear`,
per-channel int8), "int4" (`Int4WeightOnlyLinear`, group-wise asymmetric int4), "bf16" (`Bf16Linear`) or
"int8_dynamic" (`DynamicInt8Linear`, W8A8 on fbgemm, CPU only); `weight_bytes` counts what a model
holds. The token embedding and the output head stay in full precision (every mode on CPUs with native
bf16, and "bf16" everywhere, make the head's derived copies bf16; the other modes where the block
kernels run make a Q8_0 copy, the only one without native bf16 and the one for few rows beside it). One
module per format, the shared probes and kernel gate in `common`; this module walks the model. It
quantises nothing else (the KV cache is `kv_cache.py`'s) and chooses no mode (the engine config does).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenops.engine.models.layers import VocabProjection
from tokenops.engine.quantize.auto import auto_quantization_for, this_cpu_feature_set
from tokenops.engine.quantize.bf16 import NATIVE_MAX_ROWS, Bf16Linear, native_max_rows
from tokenops.engine.quantize.common import block_kernels, has_native_bf16
from tokenops.engine.quantize.int4 import (
    INT4_GROUP_SIZES,
    Int4WeightOnlyLinear,
    dequantize_int4,
    has_int4pack_kernel,
    quantize_int4,
)
from tokenops.engine.quantize.int8 import (
    INT8_NATIVE_MAX_ROWS,
    KERNEL_MAX_ROWS,
    Int8WeightOnlyLinear,
    has_int8pack_kernel,
    quantize_int8,
)
from tokenops.engine.quantize.int8_dynamic import DynamicInt8Linear, dynamic_int8_unavailable

__all__ = [
    "INT4_GROUP_SIZES",
    "INT8_NATIVE_MAX_ROWS",
    "KERNEL_MAX_ROWS",
    "MODES",
    "NATIVE_MAX_ROWS",
    "Bf16Linear",
    "DynamicInt8Linear",
    "Int4WeightOnlyLinear",
    "Int8WeightOnlyLinear",
    "auto_quantization",
    "dequantize_int4",
    "dynamic_int8_unavailable",
    "has_int4pack_kernel",
    "has_int8pack_kernel",
    "has_native_bf16",
    "quantize_int4",
    "quantize_int8",
    "quantize_model",
    "weight_bytes",
]

MODES = ("int8", "int4", "int8_dynamic", "bf16")


def auto_quantization(device: torch.device | str) -> str | None:
    """What `quantization="auto"` means on `device`: on a CPU, `quantize.auto.AUTO_TABLE`'s choice for
    this CPU's feature set (the mode nearest the fastest there at every batch size; docs/benchmarks.md
    has the figures and each mode's agreement with float32's greedy tokens); other devices keep their
    dtype. Where it picks "int4" on the block kernels or on a CPU with native bf16,
    `kv_cache_dtype="auto"` also stores the KV cache in bf16 (`kv_cache.resolve_kv_dtype`)."""
    if torch.device(device).type != "cpu":
        return None
    return auto_quantization_for(this_cpu_feature_set())


def quantize_model(
    model: nn.Module, mode: str | None, kernel_max_rows: int = KERNEL_MAX_ROWS, group_size: int = 32
) -> int:
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
    # an untied lm_head is read as `.weight` by the family's compute_logits, so it stays float
    targets = [
        (name, m)
        for name, m in model.named_modules()
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
                setattr(parent, leaf, Bf16Linear.from_linear(linear, native_max_rows(linear.weight.device)))
            else:
                setattr(parent, leaf, Int8WeightOnlyLinear.from_linear(linear, kernel_max_rows))
    if mode in ("bf16", "int4"):
        # a gated MLP's activation reads its gate|up projection's bf16 output as it is (its bf16
        # rounding is the activation's storage rounding), and the down projection takes it uncast;
        # int4 hands bf16 on only from its bf16 GEMM (long prefill chunks where bf16 runs on AMX)
        for m in model.modules():
            up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
            for kind in (Bf16Linear, Int4WeightOnlyLinear):
                if isinstance(up, kind) and isinstance(down, kind):
                    up.keeps_bf16 = True
        # a decoder layer whose norms widen a bf16 sublayer output as they add it to the stream
        # (`reads_bf16_sublayer_outputs`, Llama's wiring) takes its attention's and MLP's output
        # projections uncast from their bf16 GEMMs: the same bits, as widening is exact (a bias would
        # be added in bf16, so those keep their cast)
        for m in model.modules():
            if getattr(m, "reads_bf16_sublayer_outputs", False):
                for proj in (getattr(m.self_attn, "o_proj", None), getattr(m.mlp, "down_proj", None)):
                    if isinstance(proj, Bf16Linear | Int4WeightOnlyLinear) and proj.bias is None:
                        proj.keeps_bf16 = True
    # the output head's derived copies in bf16 too (the weight itself stays float32): always for
    # "bf16"; for the other modes where the CPU computes bf16 natively, where the float32 head is
    # the largest single GEMM of a batched int8 step and a large share of a single-row one
    # (docs/benchmarks.md, engine_quality_long.py and linear_small_rows.py)
    # the head as llama.cpp's Q8_0 in tiles of 8 rows for the other modes where the block kernels run:
    # at every row count without native bf16 (a quarter of float32's bytes, faster than its GEMM), and
    # for the few rows where it reads half the bf16 copy's bytes beside it (linear_small_rows.py --head);
    # on Zen 4 (avx512_bf16) alone, with no bf16 copy: its tiles, two at a time from 8 rows, beat
    # oneDNN's bf16 GEMM up to 32 rows and are level at 64 (the engine's default max_num_seqs)
    device = next(model.parameters()).device
    for m in model.modules():
        if isinstance(head := getattr(m, "vocab_projection", None), VocabProjection):
            head.q8 = mode != "bf16" and block_kernels(device)
            q8_alone = head.q8 and this_cpu_feature_set() == "avx512_bf16"
            head.bf16 = mode == "bf16" or (has_native_bf16(device) and not q8_alone)
    return len(targets)


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (the weight-only quantised weights live in
    buffers) and by fbgemm's prepacked weights (`DynamicInt8Linear`, outside torch's tensors)."""
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    packed = sum(m.packed_bytes for m in model.modules() if isinstance(m, DynamicInt8Linear))
    return sum(t.numel() * t.element_size() for t in tensors) + packed
