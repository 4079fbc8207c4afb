"""Weight formats of a loaded model's linear layers (the `quantization` knob).

`quantize_model(model, mode)` walks the model after its weights are loaded and swaps every
`nn.Linear` (fused q|k|v and gate|up included) for a quantised module:
- "int8": `Int8WeightOnlyLinear`, int8 weights with one symmetric float scale per output channel,
  a quarter of float32's bytes (weight-only: fewer bytes read, a gain where decode is bound by
  memory bandwidth, i.e. small batches);
- "int4": `Int4WeightOnlyLinear`, group-wise asymmetric int4 (a bf16 scale and offset per group of
  32/64/128 input columns), two nibbles per byte, an eighth of float32's bytes plus the group params;
- "bf16": `Bf16Linear`, the weights held once as bf16 (half of float32's bytes, near-float32
  numerics): few rows (decode) run the native bf16-weight x float32-activation kernel, more rows
  cast the activations to bf16 for oneDNN (AMX / AVX512_BF16 where the CPU has them);
- "int8_dynamic": `DynamicInt8Linear` (W8A8), int8 per-channel weights prepacked for fbgemm and
  activations quantised to uint8 per row at run time, int32 accumulation: integer arithmetic, so
  it also gains where decode is bound by compute (batches of 8-32 rows), where the weight-only
  kernels lose to float32. CPU only (x86 / fbgemm).
The token embedding, the tied head that reads it and an untied `lm_head` stay in full precision: the
families' `compute_logits` read the head's `.weight`. `quantize_logits_head` is the opt-in, measured
alternative (an int8 copy of the head behind an instance-level `compute_logits`; not used by the
config knob); "bf16", and "int8_dynamic" on CPUs with native bf16, also make the head's derived
copies bf16 ones (`VocabProjection.bf16`). This
package quantises nothing else (KV cache: kv_cache.py) and chooses no mode; the engine config does.

One module per weight format (`int8`, `bf16`, `int4`, `int8_dynamic`), the shared probes and kernel
gate in `common`, the opt-in int8 output head in `logits_head`; this module walks the model.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenops.engine.models.layers import VocabProjection
from tokenops.engine.quantize.bf16 import NATIVE_MAX_ROWS, Bf16Linear
from tokenops.engine.quantize.common import has_native_bf16
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
from tokenops.engine.quantize.logits_head import quantize_logits_head

__all__ = [
    "INT4_GROUP_SIZES", "INT8_NATIVE_MAX_ROWS", "KERNEL_MAX_ROWS", "MODES", "NATIVE_MAX_ROWS", "Bf16Linear",
    "DynamicInt8Linear", "Int4WeightOnlyLinear", "Int8WeightOnlyLinear", "auto_quantization", "dequantize_int4",
    "dynamic_int8_unavailable", "has_int4pack_kernel", "has_int8pack_kernel", "has_native_bf16", "quantize_int4",
    "quantize_int8", "quantize_logits_head", "quantize_model", "weight_bytes",
]

MODES = ("int8", "int4", "int8_dynamic", "bf16")


def auto_quantization(device: torch.device | str) -> str | None:
    """What `quantization="auto"` means on `device`: "bf16" on a CPU that computes bf16 natively
    (AVX512-BF16 or AMX: oneDNN's bf16 path, which `Bf16Linear` uses beyond its small-row kernel),
    else None (float32). Measured on such a CPU: 1.3x float32's single-stream and 1.7x its 32-stream
    tokens/s at perplexity -0.3% (docs/benchmarks.md). On AVX2-only CPUs bf16 matmuls are emulated and
    slower than float32 for batches, so "auto" keeps float32 there; other devices keep their dtype.
    On AMD Zen 4 (AVX512-BF16 + VNNI, no AMX) "int8_dynamic" decodes 1.3-2.2x faster than "bf16" at
    1-32 requests but agrees with float32's top-1 on 0.91 of tokens against bf16's 0.99, so "auto"
    does not pick it (docs/benchmarks.md, "Throughput at 32 concurrent requests on AMD Zen 4").
    With "bf16" here, `kv_cache_dtype="auto"` also stores the KV cache in bf16
    (`kv_cache.resolve_kv_dtype`)."""
    return "bf16" if has_native_bf16(device) else None


def quantize_model(model: nn.Module, mode: str | None, kernel_max_rows: int = KERNEL_MAX_ROWS,
                   group_size: int = 32) -> int:
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
    # an untied lm_head is read as `.weight` by the family's compute_logits: see quantize_logits_head
    targets = [
        (name, m) for name, m in model.named_modules()
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
                setattr(parent, leaf, Bf16Linear.from_linear(linear))
            else:
                setattr(parent, leaf, Int8WeightOnlyLinear.from_linear(linear, kernel_max_rows))
    # the output head's derived copies in bf16 too (the weight itself stays float32): always for
    # "bf16"; for the other modes where the CPU computes bf16 natively. There the float32 head was
    # the largest single GEMM of a 32-row int8_dynamic step (Zen 4, 1 thread: 21.1 -> 11.6 ms per
    # step), and at one row it was a third of an int8 step (113 MB read; the bf16 copy through the
    # native small-row kernel reads 56 MB at ~2x the bandwidth: docs/benchmarks.md, "The int8 modes'
    # output head in bf16")
    device = next(model.parameters()).device
    if mode == "bf16" or has_native_bf16(device):
        for m in model.modules():
            if isinstance(head := getattr(m, "vocab_projection", None), VocabProjection):
                head.bf16 = True
    return len(targets)


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (the weight-only quantised weights live in
    buffers) and by fbgemm's prepacked weights (`DynamicInt8Linear`, outside torch's tensors)."""
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    packed = sum(m.packed_bytes for m in model.modules() if isinstance(m, DynamicInt8Linear))
    return sum(t.numel() * t.element_size() for t in tensors) + packed
