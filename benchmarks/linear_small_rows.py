"""Wall time of one decode step's linear layers per weight format and row count (SmolLM2-135M shapes).

30 layers of distinct random weights (q|k|v 576->960, o 576->576, gate|up 576->3072, down 1536->576),
so the weights stream from memory as in a real step, not from cache. Formats, interleaved per repeat:
- f32: `F.linear` on float32 weights (MKL);
- bf16_kernel: `tokenops::linear_bf16` (bf16 weights, float32 activations and sums);
- bf16_onednn: `F.linear` on bf16 activations and weights (oneDNN, AMX where the CPU has it);
- bf16_packed: oneDNN with a prepacked bf16 weight (`mkldnn._linear_pointwise`);
- int8_kernel: `tokenops::linear_int8` (int8 weights, per-channel scale, float32 activations);
- int8pack: `aten._weight_int8pack_mm` (bf16 activations), the int8 mode's previous small-row path.
Optionally the tied vocabulary head (576->49152) per format (`--head`).

    PYTHONPATH=src python benchmarks/linear_small_rows.py [--rows 1,2,4,8,16,32] [--repeats 5] [--threads 2]
Prints JSON: {format: {rows: median ms per step}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from tokenops.engine import kernels

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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = kernels.ops()
    torch.manual_seed(0)
    shapes = [(49152, 576)] if args.head else SHAPES * args.layers
    f32 = [torch.randn(o, i) * 0.05 for o, i in shapes]
    bf16 = [w.bfloat16() for w in f32]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in bf16]
    q8 = []
    for w in f32:
        s = w.abs().amax(1) / 127
        q8.append(((w / s[:, None]).round().to(torch.int8), s, s.bfloat16()))

    def step(fmt: str, xs: dict[int, torch.Tensor]) -> None:
        for j, (_, width) in enumerate(shapes):
            x = xs[width]
            if fmt == "f32":
                F.linear(x, f32[j])
            elif fmt == "bf16_kernel":
                ops.linear_bf16(x, bf16[j], None)
            elif fmt == "bf16_onednn":
                F.linear(x.bfloat16(), bf16[j]).float()
            elif fmt == "bf16_packed":
                torch.ops.mkldnn._linear_pointwise(x.bfloat16(), packed[j], None, "none", [], "").float()
            elif fmt == "int8_kernel":
                ops.linear_int8(x, q8[j][0], q8[j][1], None)
            else:
                torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q8[j][0], q8[j][2]).float()

    fmts = ["f32", "bf16_onednn", "bf16_packed", "int8pack"] + (["bf16_kernel", "int8_kernel"] if ops else [])
    rows = [int(r) for r in args.rows.split(",")]
    times: dict[str, dict[int, list[float]]] = {f: {n: [] for n in rows} for f in fmts}
    with torch.inference_mode():
        for _ in range(args.repeats):  # formats interleaved within each repeat
            for n in rows:
                xs = {width: torch.randn(n, width) for width in {w for _, w in shapes}}
                for fmt in fmts:
                    t0 = time.perf_counter()
                    step(fmt, xs)
                    times[fmt][n].append((time.perf_counter() - t0) * 1e3)
    print(
        json.dumps({f: {n: round(statistics.median(v), 2) for n, v in d.items()} for f, d in times.items()})
    )


if __name__ == "__main__":
    main()
