"""An int4 MLP's gate|up projection and its SiLU: one pass (`tokenops::linear_q4_silu_mul`, what the
one-call Llama layer runs) against the two ops (`linear_q4`, then `silu_mul`) and the projection alone.

SmolLM2-135M's shape (576 -> 2 x 1536) with 30 layers of distinct random 4-bit tiles, so the weights
come from memory as in a step; at each row count the three variants run interleaved, `--repeats`
times, and the script prints one JSON document of median ms per 30 layers and the ratio of the one
pass to the two ops. Wall time at `--threads` > 1, the thread's CPU time at 1.

Run:  flock /tmp/bench.lock .venv/bin/python benchmarks/gate_up_silu.py [--rows 1,32,128,512] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time

import torch

from tokenops.engine import kernels
from tokenops.engine.quantize.int4 import native_blocks, native_params

HIDDEN, INTERMEDIATE, LAYERS, GROUP = 576, 1536, 30, 32


def _layer(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (2 * INTERMEDIATE, HIDDEN), dtype=torch.uint8, generator=g)
    d = torch.rand(2 * INTERMEDIATE, HIDDEN // GROUP, generator=g) * 0.02 + 1e-3
    m = -8 * d + torch.randn(2 * INTERMEDIATE, HIDDEN // GROUP, generator=g) * 0.01
    return native_blocks(codes), native_params(d).half(), native_params(m).half()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,32,128,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native = kernels.ops("cpu")
    if native is None:
        raise SystemExit(f"no native kernels: {kernels.build_error()}")
    layers = [_layer(i) for i in range(LAYERS)]
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    out = 2 * INTERMEDIATE
    results: dict[str, dict[str, float]] = {}
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, HIDDEN)

        def one_pass(x: torch.Tensor = x) -> None:
            for c, d, m in layers:
                native.linear_q4_silu_mul(x, c, d, m, out, GROUP)

        def two_ops(x: torch.Tensor = x) -> None:
            for c, d, m in layers:
                native.silu_mul(native.linear_q4(x, c, d, m, out, GROUP, None))

        def projection_alone(x: torch.Tensor = x) -> None:
            for c, d, m in layers:
                native.linear_q4(x, c, d, m, out, GROUP, None)

        variants = {"one_pass": one_pass, "two_ops": two_ops, "projection_alone": projection_alone}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for fn in variants.values():
            fn()
        for _ in range(args.repeats):
            for name, fn in variants.items():
                t = clock()
                fn()
                times[name].append(clock() - t)
        med = {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}
        med["one_pass_over_two_ops"] = round(med["one_pass"] / med["two_ops"], 3)
        results[str(rows)] = med
    print(
        json.dumps(
            {
                "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "kernel_isa": os.environ.get("TOKENOPS_KERNEL_ISA", "native"),
                "threads": args.threads,
                "clock": "thread CPU time" if args.threads == 1 else "wall",
                "ms_per_30_layers": results,
                "load_average": os.getloadavg(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
