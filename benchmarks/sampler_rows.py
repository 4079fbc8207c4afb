"""The sampler on one decode step's logits: the native `sample_rows` kernel against the PyTorch path.

The logits are the bundled model's own (32 decode rows of SmolLM2-135M over a real prompt, as
engine_step_profile.py takes them: flat random logits would overstate the nucleus), sampled in each
mode with all rows alike, each path timed by wall clock over `--repeats` calls, medians in ms.
The two paths draw from the same distribution by the same inversion (docs/engine-core.md, "How a
step works"); the PyTorch path is what runs without the native kernels.

Run:  PYTHONPATH=src .venv/bin/python benchmarks/sampler_rows.py [--rows 32] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from pathlib import Path

import torch
from engine_step_profile import median_ms, real_logits  # benchmarks/ is on the path when run as a script

MODES = {
    "greedy": dict(temperature=0.0),
    "temperature_1": dict(temperature=1.0),
    "temperature_0.8": dict(temperature=0.8),
    "top_k_50": dict(temperature=0.8, top_k=50),
    "top_p_0.9": dict(temperature=0.8, top_p=0.9),
    "top_p_0.95_temperature_1.5": dict(temperature=1.5, top_p=0.95),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default="benchmarks/results/sampler_rows.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import tokenops.engine.sampler as sampler_module
    from tokenops.engine.config import EngineConfig
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.loader import load_model
    from tokenops.engine.sampling_params import SamplingParams

    load_at_start = os.getloadavg()
    loaded = load_model(args.model)
    engine = LLMEngine.from_loaded(loaded, EngineConfig(max_num_seqs=64, max_model_len=2048))
    logits = real_logits(engine, loaded.tokenizer, args.rows)
    sampler = sampler_module.Sampler()
    native = sampler_module._native
    if native(logits) is None:
        raise SystemExit("the native kernels are not available here: nothing to compare")
    modes: dict[str, dict[str, float]] = {}
    for name, kw in MODES.items():
        params = [SamplingParams(**kw)] * args.rows
        row: dict[str, float] = {}
        for path in ("native", "pytorch"):
            sampler_module._native = native if path == "native" else (lambda _logits: None)
            row[path] = median_ms(
                lambda p=params: sampler(logits, p, [None] * args.rows), args.repeats, time.perf_counter
            )
        sampler_module._native = native
        row["pytorch_over_native"] = round(row["pytorch"] / row["native"], 2)
        modes[name] = row
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cores": os.cpu_count(),
            "torch_threads": args.threads,
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),
        },
        "model": args.model,
        "rows": args.rows,
        "clock": "wall, median of --repeats calls",
        "ms": modes,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
