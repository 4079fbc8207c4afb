"""Decode step time of `LLMEngine` per weight mode (float32, int8, int4, int8_dynamic, bf16)
at several batch sizes.

One mode per process (quantisation rewrites the model in place): decode steps after a 64-token
prefill per sequence, greedy, median CPU time of the stepping thread (`time.thread_time`) over
`--steps` steps; `--clock wall` takes wall time instead (with 2+ threads the stepping thread's CPU
time misses the other threads' work). Prints one JSON line. To compare two trees, run it alternately
with each on PYTHONPATH.

`--native on,off` compares the native CPU kernels (`tokenops.engine.kernels`) with the PyTorch paths
in the same process: `kernels.enabled` is switched between interleaved blocks of `--steps`
steps (read at every step), `--repeats` rounds, median wall-clock ms per step of each (wall clock:
the kernels run on torch's thread pool, which the stepping thread's CPU time would not count).

Run:  flock /tmp/bench.lock .venv/bin/python benchmarks/engine_decode_modes.py [--quantization int4]
      flock /tmp/bench.lock .venv/bin/python benchmarks/engine_decode_modes.py --native on,off --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from tokenops.engine import kernels

PROMPT = "The history of the lighthouse begins with fires lit on hills to guide ships home. " * 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default=None, choices=[None, "int8", "int4", "int8_dynamic", "bf16"])
    ap.add_argument("--clock", default="thread", choices=["thread", "wall"])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--native", default=None, help="comma-separated on/off: interleaved A/B of the native kernels"
    )
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds per batch with --native")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tokenops.engine.config import EngineConfig
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.loader import load_model
    from tokenops.engine.sampling_params import SamplingParams

    loaded = load_model(args.model)
    engine = LLMEngine.from_loaded(
        loaded, EngineConfig(max_num_seqs=64, max_model_len=2048, quantization=args.quantization)
    )
    body = loaded.tokenizer.encode(PROMPT)
    step_ms: dict[str, object] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        params = SamplingParams(max_tokens=10**4, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"b{batch}-{i}", body[i : i + 64], params)
        while any(s.num_output_tokens == 0 for s in engine._requests.values()):
            engine.step()  # prefill; only decode steps are timed
        if args.native:
            step_ms[str(batch)] = native_ab(engine, args.native.split(","), args.steps, args.repeats)
        else:
            clock = time.thread_time if args.clock == "thread" else time.perf_counter
            times = []
            for _ in range(args.steps):
                t = clock()
                engine.step()
                times.append(clock() - t)
            step_ms[str(batch)] = round(statistics.median(times) * 1e3, 2)
        for rid in list(engine._requests):
            engine.abort(rid)
        engine.step()
    if args.native:
        tok_s = {b: {m: round(int(b) * 1e3 / ms, 1) for m, ms in per.items()} for b, per in step_ms.items()}
    else:
        tok_s = {b: round(int(b) * 1e3 / ms, 1) for b, ms in step_ms.items()}
    print(
        json.dumps(
            {
                "quantization": args.quantization or "float32",
                "step_ms": step_ms,
                "tok_s": tok_s,
                "memory_mib": {k: round(v / 2**20, 1) for k, v in engine.memory_bytes.items()},
                "torch_threads": args.threads,
                "clock": args.clock,
                "load_average": os.getloadavg(),
            }
        )
    )


def native_ab(engine, modes: list[str], steps: int, repeats: int) -> dict[str, float]:
    """Median wall-clock ms per decode step with the native kernels on / off, in interleaved blocks."""
    times: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for _ in range(repeats):
            for mode in modes:
                kernels.enabled = mode == "on"
                engine.step()  # one untimed step after the switch
                t = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[mode].append((time.perf_counter() - t) / steps)
    finally:
        kernels.enabled = True
    return {m: round(statistics.median(v) * 1e3, 2) for m, v in times.items()}


if __name__ == "__main__":
    main()
