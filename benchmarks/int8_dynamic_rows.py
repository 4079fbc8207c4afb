"""Time of one step's `DynamicInt8Linear` calls (int8_dynamic, fbgemm) with the native per-row passes
(kernels/csrc/scale_rows.cpp) against torch's ops, SmolLM2-135M's shapes. Paths:
- torch: the native kernels off (`kernels.enabled = False`): abs / amax / clamp / div, fbgemm, mul_ / add_;
- native_ops: `scale_rows`, fbgemm and `mul_rows_add_` as three calls from Python (the layer's
  forward before `linear_dynamic_rows`, emulated here);
- fused: the layer as it runs, one `linear_dynamic_rows` call.

30 layers x the four projections (q|k|v 576->960, o 576->576, gate|up 576->3072, down 1536->576) of
distinct random weights, so the weights stream from memory as in a real step: 120 layer calls per step.
The paths alternate per repeat (`kernels.enabled` flipped); each step is timed by wall clock and
by the process's CPU time. Outputs of all paths are checked equal first.

    PYTHONPATH=src python benchmarks/int8_dynamic_rows.py [--rows 1,32,512] [--repeats 9] [--threads 1]
Prints JSON: {path: {rows: {"wall_ms": median, "cpu_ms": median, "per_shape_ms": {...}}}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from tokenops.engine import kernels
from tokenops.engine.quantize import DynamicInt8Linear

SHAPES = {
    "qkv 576->960": (576, 960),
    "o 576->576": (576, 576),
    "gate_up 576->3072": (576, 3072),
    "down 1536->576": (1536, 576),
}


def _native_ops_forward(layer: DynamicInt8Linear, x: torch.Tensor) -> torch.Tensor:
    """The forward as it was with the separate native ops: reshape, three op calls, cast, reshape."""
    shape = x.shape
    x2 = x.reshape(-1, layer.in_features)
    native = None if torch.is_grad_enabled() else kernels.ops(x2.device)
    return layer._fbgemm(x2, native).to(x.dtype).reshape(*shape[:-1], layer.out_features)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,32,512")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if kernels.ops() is None:
        raise SystemExit(f"native kernels unavailable: {kernels.build_error()}")
    torch.manual_seed(0)
    layers = {
        name: [DynamicInt8Linear.from_linear(nn.Linear(i, o)) for _ in range(args.layers)]
        for name, (i, o) in SHAPES.items()
    }
    rows_list = [int(r) for r in args.rows.split(",")]
    xs = {(rows, name): torch.randn(rows, i) for rows in rows_list for name, (i, _) in SHAPES.items()}
    paths = {
        "fused": (True, DynamicInt8Linear.__call__),
        "native_ops": (True, _native_ops_forward),
        "torch": (False, DynamicInt8Linear.__call__),
    }
    result: dict[str, dict[int, dict[str, object]]] = {p: {} for p in paths}
    with torch.inference_mode():
        for rows in rows_list:  # same bits either way
            for name, ls in layers.items():
                outs = []
                for on, call in paths.values():
                    kernels.enabled = on
                    outs.append(call(ls[0], xs[rows, name]))
                assert all(o.equal(outs[0]) for o in outs), (rows, name)
        for rows in rows_list:
            wall: dict[str, list[float]] = {p: [] for p in paths}
            cpu: dict[str, list[float]] = {p: [] for p in paths}
            shape_ms: dict[str, dict[str, list[float]]] = {p: {n: [] for n in SHAPES} for p in paths}
            for rep in range(args.repeats + 1):  # the first round warms up
                for path, (on, call) in paths.items():
                    kernels.enabled = on
                    w0, c0 = time.perf_counter(), time.process_time()
                    for name, ls in layers.items():
                        s0 = time.perf_counter()
                        x = xs[rows, name]
                        for layer in ls:
                            call(layer, x)
                        if rep:
                            shape_ms[path][name].append((time.perf_counter() - s0) * 1e3)
                    if rep:
                        wall[path].append((time.perf_counter() - w0) * 1e3)
                        cpu[path].append((time.process_time() - c0) * 1e3)
            for path in paths:
                result[path][rows] = {
                    "wall_ms": round(statistics.median(wall[path]), 3),
                    "cpu_ms": round(statistics.median(cpu[path]), 3),
                    "per_shape_ms": {n: round(statistics.median(v), 3) for n, v in shape_ms[path].items()},
                }
    kernels.enabled = True
    print(json.dumps({"threads": args.threads, "layers_per_shape": args.layers, **result}, indent=1))


if __name__ == "__main__":
    main()
