"""GGUF-native int4 (`gguf_native`) against the float32 path and load-time int4: startup, decode,
memory, quality.

Variants, all from the same GGUF file:
- fp32: dequantised to float32 (through the on-disk dequantisation cache), the engine's default;
- int4: fp32 then `quantize_model(..., "int4")` at engine start (group 32), what `quantization=int4` does;
- gguf-native: `load_model(..., gguf_native=True)`: linear layers built from the file's Q4_0/Q4_1/Q4_K
  blocks as they are, other types quantised at load (what `quantization=int4, gguf_native=True` does).

Startup: each variant is loaded in a fresh Python process, first with an empty cache directory
(cold: `TOKENOPS_CACHE_DIR`-style `cache_dir` in a new temporary folder), then again with the same
folder (warm). Reported: seconds from `load_model` to a ready model (int4 includes the quantisation),
the import time apart, the process's peak resident memory, and the bytes left in the cache. The GGUF
file itself stays in the OS page cache after the first load, for every variant alike. Rounds
interleave the variants;
medians over `--startup-repeats`.

Decode / prefill tok/s at each batch level, perplexity, top-1 agreement and greedy-token agreement
with fp32: measured like benchmarks/engine_quantization.py (its `run_level` and `perplexity`),
variants interleaved within each repeat, medians over `--repeats`, ratios per repeat.

Run:  .venv/bin/python benchmarks/engine_gguf_native.py [--model smollm2-135m-instruct] [--levels 1,8,32]
      [--repeats 3] [--startup-repeats 3] [--startup-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from engine_quantization import TEXT, perplexity, speed_vs_fp32  # same folder: shared measurement code

from tokenops.engine.config import EngineConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.loader import load_model
from tokenops.engine.quantize import quantize_model, weight_bytes

VARIANTS = ("fp32", "int4", "gguf-native")

_STARTUP = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch
from tokenops.engine.loader import load_model
from tokenops.engine.quantize import quantize_model
t1 = time.perf_counter()
variant, model, cache, threads = sys.argv[1:5]
torch.set_num_threads(int(threads))
lm = load_model(model, cache_dir=cache, gguf_native=variant == "gguf-native")
if variant == "int4":
    quantize_model(lm.model, "int4", group_size=32)
t2 = time.perf_counter()
peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "peak_rss_mib": peak_mib, **lm.load_stats}))
"""


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def startup(model: str, threads: int, repeats: int) -> dict:
    """Cold then warm load of each variant in fresh processes, `repeats` rounds interleaved; medians."""
    raw: dict = {v: {"cold": [], "warm": []} for v in VARIANTS}
    cache_bytes: dict = {}
    for rep in range(repeats):
        for variant in VARIANTS:
            cache = Path(tempfile.mkdtemp(prefix="tokenops-startup-"))
            try:
                for label in ("cold", "warm"):
                    proc = subprocess.run(
                        [sys.executable, "-c", _STARTUP, variant, model, str(cache), str(threads)],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    stats = json.loads(proc.stdout.strip().splitlines()[-1])
                    stats.pop("sha256", None)
                    raw[variant][label].append(stats)
                    print(
                        f"rep {rep} startup {variant:<12} {label}: load {stats['load_s']:6.2f} s "
                        f"(import {stats['import_s']:.2f} s) {stats}",
                        flush=True,
                    )
                cache_bytes[variant] = _dir_bytes(cache / "gguf") if (cache / "gguf").exists() else 0
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    return {
        v: {
            **{
                label: {
                    k: statistics.median(r[k] for r in runs)
                    for k in ("load_s", "read_s", "build_s", "import_s", "peak_rss_mib")
                }
                for label, runs in raw[v].items()
            },
            "cache_bytes": cache_bytes[v],
            "runs": raw[v],
        }
        for v in VARIANTS
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="bundled name or .gguf file")
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--startup-repeats", type=int, default=3)
    ap.add_argument("--startup-only", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.levels.split(",")]
    result: dict = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.threads} thread(s)",
        "load_average_start": os.getloadavg(),
        "args": vars(args),
        "startup": startup(args.model, args.threads, args.startup_repeats),
    }
    if not args.startup_only:
        fp = load_model(args.model).model
        q4 = load_model(args.model).model
        quantize_model(q4, "int4", group_size=32)
        native = load_model(args.model, gguf_native=True)
        models = {"fp32": fp, "int4": q4, "gguf-native": native.model}
        ids = native.tokenizer.encode(TEXT, add_special_tokens=False)
        ppl_fp, top_fp = perplexity(fp, ids)
        variants: dict = {}
        for name, m in models.items():
            ppl, top = perplexity(m, ids)
            variants[name] = {
                "weight_mib": weight_bytes(m) / 2**20,
                "perplexity": ppl,
                "perplexity_delta_pct": (ppl / ppl_fp - 1) * 100,
                "top1_agreement": float((top == top_fp).float().mean()),
                "levels": {},
            }

        def prompts(n: int, rep: int) -> list[list[int]]:
            k = args.prompt_tokens
            return [(ids * 4)[(i * 7 + rep) % len(ids) :][:k] for i in range(n)]

        blocks = max(levels) * (args.prompt_tokens + args.max_tokens) // 16 + 64
        engines = {
            name: LLMEngine(
                m,
                EngineConfig(
                    num_kv_blocks=blocks,
                    max_num_seqs=64,
                    max_num_batched_tokens=2048,
                    enable_prefix_caching=False,
                    quantization=None if name == "fp32" else "int4",
                    gguf_native=name == "gguf-native",
                ),
            )
            for name, m in models.items()
        }
        for name, levels_out in speed_vs_fp32(
            engines, levels, args.repeats, prompts, args.max_tokens
        ).items():
            variants[name]["levels"] = levels_out
        result["variants"] = variants
    result["load_average_end"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
