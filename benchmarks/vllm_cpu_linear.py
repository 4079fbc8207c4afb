"""vLLM's CPU linear layer by dtype: which GEMM path its CPU build takes and how long one call lasts.

Runs in vLLM's venv (`make vllm-env`), not the project's: vLLM's own `create_onednn_mm` / `onednn_mm`
on a SmolLM2-135M MLP weight (576 -> 1536) at 1 and 32 rows, falling back to
`torch.nn.functional.linear` where oneDNN refuses the dtype, as vLLM's `dispatch_cpu_unquantized_gemm`
does. On CPUs without AVX512-BF16 or AMX, oneDNN refuses bfloat16 and torch emulates it.

Run:  flock /tmp/bench.lock env -u PYTHONPATH .venv-vllm/bin/python benchmarks/vllm_cpu_linear.py
"""

from __future__ import annotations

import json
import time

import torch

from vllm import _custom_ops as ops

K, N = 576, 1536  # SmolLM2-135M: hidden size, MLP width
CALLS, WARMUP = 300, 20


def main() -> None:
    torch.set_num_threads(2)
    out: dict[str, object] = {
        "onednn": ops._supports_onednn,
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "us_per_call": {},
    }
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(N, K).to(dtype)
        try:
            handle = ops.create_onednn_mm(w.t(), 32)
            path = "onednn_mm"

            def f(x: torch.Tensor, handle=handle) -> torch.Tensor:
                return ops.onednn_mm(handle, x, None)
        except RuntimeError as exc:
            path = f"torch linear (oneDNN refused: {str(exc)[:80]})"

            def f(x: torch.Tensor, w=w) -> torch.Tensor:
                return torch.nn.functional.linear(x, w)

        for rows in (1, 32):
            x = torch.randn(rows, K).to(dtype)
            for _ in range(WARMUP):
                f(x)
            t = time.perf_counter()
            for _ in range(CALLS):
                f(x)
            us = (time.perf_counter() - t) / CALLS * 1e6
            out["us_per_call"][f"{str(dtype).removeprefix('torch.')}_rows{rows}"] = {"us": us, "path": path}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
