"""Wall time of one decode step's linear layers per weight format and row count (SmolLM2-135M shapes).

30 layers of distinct random weights (q|k|v 576->960, o 576->576, gate|up 576->3072, down 1536->576),
so the weights stream from memory as in a real step, not from cache. Formats, interleaved per repeat:
- f32: `F.linear` on float32 weights (MKL);
- f32_packed: oneDNN with a prepacked float32 weight (`mkldnn._linear_pointwise`), the float32 output
  head's path past one row;
- bf16_kernel: `tokenops::linear_bf16` (bf16 weights, float32 activations and sums);
- bf16_onednn: `F.linear` on bf16 activations and weights (oneDNN, AMX where the CPU has it);
- bf16_packed: oneDNN with a prepacked bf16 weight (`mkldnn._linear_pointwise`);
- int8_kernel: `tokenops::linear_int8` (int8 weights, per-channel scale, float32 activations);
- int8pack: `aten._weight_int8pack_mm` (bf16 activations), the int8 mode's previous small-row path;
- q4_blocks: `tokenops::linear_q4` (4-bit codes in tiles of 8 rows, activations quantised to int8
  per block of 32), the int4 mode's layer on AVX2, with float32 d and m;
- q4_blocks_f16: the same with float16 d and m (a GGUF file's Q4_0 / Q4_1 parameters); where AMX-INT8
  runs, calls of `set_blocks_amx_min_rows` rows or more (16) take TDPBSUD on the same integer sums;
- q4_blocks_f16_no_amx: q4_blocks_f16 kept on the vpdpbusd tiles at every row count (AMX machines);
- q8_blocks: `tokenops::linear_q8` (Q8_0: int8 codes per block of 32, in tiles of 8 rows, activations
  quantised to int8 per block of 32), the output head's path where the block kernels run; where
  AMX-INT8 runs, calls of `set_blocks_amx_min_rows` rows or more take TDPBSSD on the same sums;
- q8_blocks_no_amx: q8_blocks kept on the vpdpbusd tiles at every row count (AMX machines);
- q4_dequant: the int4 layer's path past `int4.NATIVE_MAX_ROWS`: its weight dequantised to float32 per
  call, then `F.linear`;
- q4_bf16_gemm: the int4 layer's path from `int4.BF16_GEMM_MIN_ROWS` where bf16 GEMMs win: the tiles
  (float16 d and m) dequantised to bf16 per call (`tokenops::dequantize_q4_bf16`), then `F.linear` in
  bf16 (oneDNN, AMX where the CPU has it);
- w8a8_fbgemm: `DynamicInt8Linear` (fbgemm's dynamic int8 linear, per-row scales), int8_dynamic's layer.
`--clock thread` times the calling thread's CPU time instead of wall time (with `--threads 1` that is
all of the work, and it stays comparable on a loaded machine).
`--against REV`: q4_blocks_f16 (or q8_blocks, with `--formats q8_blocks`) from this tree against the
same calls of linear_blocks.cpp as of git revision REV (built on the side,
benchmarks/kernel_revision.py), alternating which goes first per repeat; adds per row count the
median of the per-repeat ratios REV / this tree and whether the two agree bitwise.
Optionally the tied vocabulary head (576->49152) per format (`--head`).

    PYTHONPATH=src python benchmarks/linear_small_rows.py [--rows 1,2,4,8,16,32] [--repeats 5] [--threads 2]
        [--formats q4_blocks,w8a8_fbgemm] [--clock thread] [--against REV]
Prints JSON: {format: {rows: median ms per step}} (and "against": {rows: {...}}).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from tokenops.engine import kernels
from tokenops.engine.quantize.common import q8_tiles, quantize_q8_blocks
from tokenops.engine.quantize.int4 import Int4WeightOnlyLinear, native_blocks, native_params
from tokenops.engine.quantize.int8_dynamic import DynamicInt8Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--head", action="store_true", help="time the 576->49152 vocabulary head instead of the layers"
    )
    ap.add_argument("--formats", default=None, help="comma-separated subset of the formats (default: all)")
    ap.add_argument("--clock", default="wall", choices=["wall", "thread"])
    ap.add_argument(
        "--against", metavar="REV", help="q4_blocks_f16 (or q8_blocks): this tree vs git revision REV"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = kernels.ops()
    torch.manual_seed(0)
    shapes = [(49152, 576)] if args.head else SHAPES * args.layers
    f32 = [torch.randn(o, i) * 0.05 for o, i in shapes]
    bf16 = [w.bfloat16() for w in f32]
    fmts = ["f32", "f32_packed", "bf16_onednn", "bf16_packed", "int8pack", "w8a8_fbgemm"]
    fmts += (
        [
            "bf16_kernel",
            "int8_kernel",
            "q4_blocks",
            "q4_blocks_f16",
            "q4_blocks_f16_no_amx",
            "q4_bf16_gemm",
            "q8_blocks",
            "q8_blocks_no_amx",
            "q4_dequant",
        ]
        if ops
        else []
    )
    if args.formats:
        fmts = [f for f in fmts if f in args.formats.split(",")]
    base = "q8_blocks" if args.formats == "q8_blocks" else "q4_blocks_f16"  # what --against compares
    rev_ops, rev_fmt = None, f"{base}@{args.against}"
    if args.against:
        from kernel_revision import build_revision  # same folder

        rev_ops = build_revision(args.against, "linear_blocks.cpp")
        fmts = [base, rev_fmt]
    # (oneDNN refuses to prepack bf16 where it is held to AVX2)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in bf16] if "bf16_packed" in fmts else []
    f32_packed = (
        [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in f32] if "f32_packed" in fmts else []
    )
    q8_0 = (
        [(*q8_tiles(*quantize_q8_blocks(w)), w.shape[0]) for w in f32]
        if {"q8_blocks", "q8_blocks_no_amx"} & set(fmts)
        else []
    )
    q8 = []
    for w in f32:
        s = w.abs().amax(1) / 127
        q8.append(((w / s[:, None]).round().to(torch.int8), s, s.bfloat16()))
    q4 = []  # codes 0..15 with w = code * d + m per block of 32, in the kernel's tiles
    for w in f32:
        g = w.view(w.shape[0], -1, 32)
        lo, hi = g.amin(-1), g.amax(-1)
        d = (hi - lo).clamp(min=1e-8) / 15
        codes = ((g - lo[..., None]) / d[..., None]).round().clamp(0, 15).to(torch.uint8).view(w.shape[0], -1)
        q4.append((native_blocks(codes), native_params(d), native_params(lo), w.shape[0]))
    q4_f16 = [(d.half(), m.half()) for _, d, m, _ in q4]
    int4_layers = [Int4WeightOnlyLinear.from_linear(_linear(w)) for w in f32]
    w8a8 = [DynamicInt8Linear.from_linear(_linear(w)) for w in f32]

    def step(fmt: str, xs: dict[int, torch.Tensor]) -> list[torch.Tensor] | None:
        if rev_ops is not None and fmt in (base, rev_fmt):  # --against: outputs kept for the bit check
            op = rev_ops if fmt == rev_fmt else ops
            if base == "q8_blocks":
                return [op.linear_q8(xs[w], *q8_0[j], None) for j, (_, w) in enumerate(shapes)]
            return [
                op.linear_q4(xs[w], q4[j][0], *q4_f16[j], q4[j][3], 32, None)
                for j, (_, w) in enumerate(shapes)
            ]
        for j, (_, width) in enumerate(shapes):
            x = xs[width]
            if fmt == "f32":
                F.linear(x, f32[j])
            elif fmt == "f32_packed":
                torch.ops.mkldnn._linear_pointwise(x, f32_packed[j], None, "none", [], "")
            elif fmt == "bf16_kernel":
                ops.linear_bf16(x, bf16[j], None)
            elif fmt == "bf16_onednn":
                F.linear(x.bfloat16(), bf16[j]).float()
            elif fmt == "bf16_packed":
                torch.ops.mkldnn._linear_pointwise(x.bfloat16(), packed[j], None, "none", [], "").float()
            elif fmt == "int8_kernel":
                ops.linear_int8(x, q8[j][0], q8[j][1], None)
            elif fmt == "q4_blocks":
                ops.linear_q4(x, *q4[j], 32, None)
            elif fmt in ("q4_blocks_f16", "q4_blocks_f16_no_amx"):
                ops.linear_q4(x, q4[j][0], *q4_f16[j], q4[j][3], 32, None)
            elif fmt == "q4_bf16_gemm":
                w = ops.dequantize_q4_bf16(q4[j][0], *q4_f16[j], q4[j][3], 32)
                F.linear(x.bfloat16(), w).float()
            elif fmt in ("q8_blocks", "q8_blocks_no_amx"):
                ops.linear_q8(x, *q8_0[j], None)
            elif fmt == "q4_dequant":
                F.linear(x, int4_layers[j]._dequantized(torch.float32)[:, :width])
            elif fmt == "w8a8_fbgemm":
                w8a8[j](x)
            else:
                torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q8[j][0], q8[j][2]).float()

    rows = [int(r) for r in args.rows.split(",")]
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    times: dict[str, dict[int, list[float]]] = {f: {n: [] for n in rows} for f in fmts}
    same: dict[int, bool] = {}
    with torch.inference_mode():
        for k in range(args.repeats):  # formats interleaved within each repeat
            for n in rows:
                xs = {width: torch.randn(n, width) for width in {w for _, w in shapes}}
                if rev_ops is not None and n not in same:
                    ours, theirs = step(base, xs), step(rev_fmt, xs)
                    same[n] = all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
                for fmt in fmts if k % 2 == 0 else fmts[::-1]:
                    no_amx = fmt in ("q4_blocks_f16_no_amx", "q8_blocks_no_amx")
                    amx_min_rows = ops.set_blocks_amx_min_rows(1 << 30) if no_amx else None
                    t0 = clock()
                    step(fmt, xs)
                    times[fmt][n].append((clock() - t0) * 1e3)
                    if amx_min_rows is not None:
                        ops.set_blocks_amx_min_rows(amx_min_rows)
    report: dict = {f: {n: round(statistics.median(v), 2) for n, v in d.items()} for f, d in times.items()}
    if rev_ops is not None:
        report["against"] = {
            n: {
                "rev_over_this_tree_paired": round(
                    statistics.median(a / b for a, b in zip(times[rev_fmt][n], times[base][n], strict=True)),
                    3,
                ),
                "bitwise_equal": same[n],
            }
            for n in rows
        }
    print(json.dumps(report))


def _linear(w: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w
    return lin


if __name__ == "__main__":
    main()
