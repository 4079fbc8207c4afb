"""How near the block kernels' AVX2 tiles run to what the core's vector pipes allow, and what that
leaves for the int4 mode against float32 GEMMs on the same core.

Builds `tile_kernel_bound.cpp` (g++ -O2 -march=native) and runs its register-only probes: the clock
(a chain of dependent adds), the throughput of `vpmaddubsw` and `vfmadd231ps` on 256-bit registers,
and the instruction mix the shipped Q4 and Q8_0 tile loops issue per activation row and tile block
(8 weight rows x 32 inputs), without loads or dependencies between blocks: the fastest that loop
could run on this core; and the Q4 mix again with its loads from L1 (the 8 broadcast activation
quads, the row's two scalars, a quarter of the code loads), which take vector pipe slots too. Then
times, at one thread (CPU time of the thread), on weights that stay in the caches, the int4 layer
(`Int4WeightOnlyLinear`, which runs `tokenops::linear_q4` on these CPUs) and `tokenops::linear_q8` on
the gate|up (576->3072) and down (1536->576) shapes of SmolLM2-135M, and `F.linear` in float32 (MKL)
beside them, and reports each as cycles per row-block and multiply-adds per cycle.

    PYTHONPATH=src python benchmarks/tile_kernel_bound.py [--rows 256] [--repeats 7]
Prints JSON. x86 with AVX2 and FMA only; needs g++.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenops import cpu_info
from tokenops.engine import kernels
from tokenops.engine.quantize.common import q8_tiles, quantize_q8_blocks
from tokenops.engine.quantize.int4 import Int4WeightOnlyLinear

SHAPES = {"gate_up": (3072, 576), "down": (576, 1536)}
PROBE = Path(__file__).with_name("tile_kernel_bound.cpp")


def probe() -> dict:
    compiler = shutil.which("g++")
    if compiler is None:
        raise SystemExit("tile_kernel_bound.py needs g++")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "probe"
        subprocess.run([compiler, "-O2", "-march=native", "-o", str(exe), str(PROBE)], check=True)
        out = json.loads(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)
    out.pop("sink")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256, help="activation rows per call (many: the loop's rate)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    flags = cpu_info.cpu_flags()
    if not {"avx2", "fma"} <= flags:
        raise SystemExit("tile_kernel_bound.py measures the AVX2 tiles: this CPU has no AVX2 and FMA")
    ops = kernels.ops()
    if ops is None:
        raise SystemExit(f"native kernels unavailable: {kernels.build_error()}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    bounds = probe()
    cycles = bounds["cycles"]

    timed: dict[str, dict[str, list[float]]] = {}
    with torch.inference_mode():
        layers = {}
        for name, (out_f, in_f) in SHAPES.items():
            w = torch.randn(out_f, in_f) * 0.05
            linear = torch.nn.Linear(in_f, out_f, bias=False)
            linear.weight.data = w
            q4 = Int4WeightOnlyLinear.from_linear(linear)
            if not q4.native:
                raise SystemExit("int4 layers do not run the block kernels' tiles on this CPU")
            q8 = (*q8_tiles(*quantize_q8_blocks(w)), out_f)
            layers[name] = (w, q4, q8, torch.randn(args.rows, in_f))
        calls = {
            "linear_q4": lambda w, q4, q8, x: q4(x),
            "linear_q8": lambda w, q4, q8, x: ops.linear_q8(x, *q8, None),
            "f32_linear": lambda w, q4, q8, x: F.linear(x, w),
        }
        for _ in range(args.repeats):  # kernels and shapes interleaved within each repeat
            for name, layer in layers.items():
                for kernel, call in calls.items():
                    call(*layer)  # warm: the weights in cache, the activations' buffers sized
                    t = time.thread_time()
                    call(*layer)
                    timed.setdefault(kernel, {}).setdefault(name, []).append(time.thread_time() - t)

    # the clock again after the kernels: this VM's clock moves; the kernels' cycles use the mean
    ghz_after = probe()["ghz"]
    ghz = (bounds["ghz"] + ghz_after) / 2
    kernels_out: dict[str, dict] = {}
    for kernel, per_shape in timed.items():
        for name, samples in per_shape.items():
            out_f, in_f = SHAPES[name]
            seconds = statistics.median(samples)
            macs = args.rows * out_f * in_f
            # a row-block: one activation row against 8 weight rows x 32 inputs
            row_blocks = args.rows * (out_f // 8) * (in_f // 32)
            entry = {
                "ms": round(seconds * 1e3, 3),
                "macs_per_cycle": round(macs / (seconds * ghz * 1e9), 2),
            }
            if kernel != "f32_linear":
                entry["cycles_per_row_block"] = round(seconds * ghz * 1e9 / row_blocks, 2)
                mix = cycles["q4_row_block_mix" if kernel == "linear_q4" else "q8_row_block_mix"]
                entry["mix_bound_over_measured"] = round(mix / entry["cycles_per_row_block"], 3)
                if kernel == "linear_q4":
                    with_loads = cycles["q4_row_block_mix_with_loads"] / entry["cycles_per_row_block"]
                    entry["mix_with_loads_bound_over_measured"] = round(with_loads, 3)
            kernels_out.setdefault(kernel, {})[name] = entry

    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu": {
            "model": cpu_info.cpuinfo_field("model name"),
            "family": cpu_info.cpuinfo_field("cpu family"),
            "model_number": cpu_info.cpuinfo_field("model"),
            "vendor": cpu_info.cpu_vendor(),
        },
        "load_average": os.getloadavg(),
        "rows": args.rows,
        "threads": 1,
        "clock": "thread CPU time, medians; cycles at the mean of the probe's clock before and after",
        "probe": bounds,
        "ghz_after_kernels": ghz_after,
        # 32 int8 multiply-adds per vpmaddubsw, 8 float32 ones per vfmadd231ps
        "peak_macs_per_cycle": {
            "vpmaddubsw": round(32 / cycles["vpmaddubsw_ymm"], 2),
            "vfmadd231ps": round(8 / cycles["vfmadd231ps_ymm"], 2),
            "q4_loop_mix": round(256 / cycles["q4_row_block_mix"], 2),
            "q4_loop_mix_with_loads": round(256 / cycles["q4_row_block_mix_with_loads"], 2),
            "q8_loop_mix": round(256 / cycles["q8_row_block_mix"], 2),
        },
        "kernels": kernels_out,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
