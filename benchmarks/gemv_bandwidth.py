"""How fast the native small-row kernels stream their weights (`tokenops::linear_bf16` / `linear_int8`).

Cycles through more distinct weights than the caches hold (3072x576, 212 MB per format; the f32
references 106 MB), so every call reads its weight from memory, as in a decode step; reports the
weight bytes read per second (best of `--repeats` passes) for 1..8 activation rows (int8 also 16 and
32: its native path runs up to 32), next to float32 `F.linear` (MKL over [out, in]) and `x @ W.T`
(MKL over a contiguous [in, out] copy, the fastest float32 stream on AVX-512 CPUs). At 1 thread the
clock is the thread's CPU time (other work on the machine does not count), at more the wall time.

    PYTHONPATH=src python benchmarks/gemv_bandwidth.py [--threads 1] [--rows 1,2,4,8] [--repeats 3]
Prints JSON: {"threads": n, "gbps": {format: {rows: GB/s}}}.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from tokenops.engine import kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--int8-rows", default="16,32", help="extra row counts for int8 (native up to 32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--head", action="store_true", help="also the 49152x576 bf16 vocabulary head")
    args = ap.parse_args()
    ops = kernels.ops()
    if ops is None:
        raise SystemExit(f"native kernels unavailable: {kernels.build_error()}")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    torch.manual_seed(0)
    n = 60
    wf = [torch.randn(3072, 576) * 0.02 for _ in range(n // 4)]
    wt = [w.t().contiguous() for w in wf]
    wb = [torch.randn(3072, 576).bfloat16() for _ in range(n)]
    wi = [torch.randint(-127, 128, (3072, 576), dtype=torch.int8) for _ in range(n * 2)]
    sc = torch.rand(3072)
    head = [torch.randn(49152, 576).bfloat16()] if args.head else []

    def gbps(fn, ws) -> float:
        best = float("inf")
        for _ in range(args.repeats):
            t = clock()
            for w in ws:
                fn(w)
            best = min(best, clock() - t)
        return round(sum(w.numel() * w.element_size() for w in ws) / best / 1e9, 2)

    rows = [int(r) for r in args.rows.split(",")]
    out: dict[str, dict[int, float]] = {f: {} for f in ("f32_linear", "f32_xWt", "bf16", "int8")}
    if head:
        out["bf16_head"] = {}
    with torch.inference_mode():
        for r in rows + [int(r) for r in args.int8_rows.split(",") if r]:
            x = torch.randn(r, 576)
            if r in rows:
                out["f32_linear"][r] = gbps(lambda w, x=x: F.linear(x, w), wf)
                out["f32_xWt"][r] = gbps(lambda w, x=x: x @ w, wt)
                out["bf16"][r] = gbps(lambda w, x=x: ops.linear_bf16(x, w, None), wb)
                if head:
                    out["bf16_head"][r] = gbps(lambda w, x=x: ops.linear_bf16(x, w, None), head)
            out["int8"][r] = gbps(lambda w, x=x: ops.linear_int8(x, w, sc, None), wi)
    print(json.dumps({"threads": args.threads, "gbps": out}))


if __name__ == "__main__":
    main()
