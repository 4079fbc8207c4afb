"""Warm start of a bundled GGUF model, end to end and by phase (its caches already filled).

Each run is a fresh Python process (`--child`) that times, in order: the imports, the file's sha256,
the cached config / tokenizer / weights read (`read_gguf`, its tokenizer share measured on its own),
building the model and streaming the weights in, the native kernels' load, `LLMEngine`
construction, the first chat-template render, and the first engine step (a 16-token prompt, one
greedy token). The parent runs `--runs` of those per model, interleaved, and prints medians.

    flock /tmp/bench.lock .venv/bin/python benchmarks/engine_warm_start.py --runs 3

`--gateway` times the gateway's prompt tokeniser instead (`load_tokenizer`, import included).

A first (cold) load per model fills the caches before the timed runs and is not counted. `--srcs
before=/path/to/old/src,after=src` runs two source trees interleaved (same models, same caches).
`read_s` includes `tokenizer_s` (older loaders do not report it: it is then timed on its own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

T0 = time.perf_counter()


def child(model: str, native: bool) -> dict:
    import json as _json
    from pathlib import Path

    import torch

    from tokenops.engine import gguf_reader
    from tokenops.modelfiles.bundled import resolve_bundled
    from tokenops.modelfiles.tokenizer import Tokenizer

    out: dict[str, float | str | bool] = {"import_s": time.perf_counter() - T0}
    extra = 0.0
    cache_dir = gguf_reader.default_cache_dir()
    path = resolve_bundled(model, cache_dir)
    t = time.perf_counter()
    gguf_reader.file_sha256(path)  # remembered for the process: the load below does not hash again
    out["hash_s"] = time.perf_counter() - t

    from tokenops.engine.loader import load_model

    t = time.perf_counter()
    loaded = load_model(model, dtype=torch.float32, cache_dir=cache_dir, gguf_native=native)
    out["load_model_s"] = time.perf_counter() - t
    stats = loaded.load_stats
    out["from_cache"] = bool(stats.get("from_cache"))
    if "tokenizer_s" in stats:  # the loader says how long its tokenizer took
        out["tokenizer_s"] = float(stats["tokenizer_s"])
    else:  # older loaders: time the same read once more, on its own (not counted in total_s)
        entry = cache_dir / "gguf" / f"{stats['sha256']}-v{gguf_reader.CACHE_FORMAT}"
        if native:
            entry = entry.with_name(entry.name + "-int4")
        t = time.perf_counter()
        Tokenizer.from_dict(_json.loads((Path(entry) / "tokenizer.json").read_text(encoding="utf-8")))
        out["tokenizer_s"] = time.perf_counter() - t
        extra = out["tokenizer_s"]
    out["read_s"] = float(stats["read_s"])
    out["weights_s"] = float(stats["build_s"])

    from tokenops.engine import kernels

    t = time.perf_counter()
    kernels.ops("cpu")
    out["kernels_s"] = time.perf_counter() - t

    from tokenops.engine.config import EngineConfig
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.sampling_params import SamplingParams

    t = time.perf_counter()
    engine = LLMEngine.from_loaded(
        loaded, EngineConfig(num_kv_blocks=64, gguf_native=native, quantization="int4" if native else None)
    )
    out["engine_s"] = time.perf_counter() - t

    tok = loaded.tokenizer
    t = time.perf_counter()
    if tok.has_chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}])
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode("Name three rivers in Europe. The first is")
    out["chat_template_s"] = time.perf_counter() - t

    t = time.perf_counter()
    engine.add_request("r0", ids[:16], SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    out["first_step_s"] = time.perf_counter() - t
    out["total_s"] = time.perf_counter() - T0 - extra
    return out


def gateway_child(model: str) -> dict:
    """The gateway's side: `prompt_tokenizer.load_tokenizer` in a fresh process (no torch)."""
    from tokenops.cluster.prompt_tokenizer import load_tokenizer

    out: dict[str, float | bool] = {"import_s": time.perf_counter() - T0}
    t = time.perf_counter()
    tok = load_tokenizer(model)
    tok.encode("Name three rivers in Europe.")
    out["load_s"] = time.perf_counter() - t
    out["torch_free"] = "torch" not in sys.modules
    out["total_s"] = time.perf_counter() - T0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--native", action="store_true", help="gguf_native loading (int4 entry)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument(
        "--gateway",
        action="store_true",
        help="time the gateway's prompt tokeniser instead: import + load_tokenizer + one encode, per process",
    )
    ap.add_argument("--out", help="write the per-run figures and medians here (JSON)")
    ap.add_argument(
        "--srcs", help="A/B: LABEL=SRC_DIR,... source trees run interleaved (PYTHONPATH of each child)"
    )
    args = ap.parse_args()
    if args.child:
        print(json.dumps(gateway_child(args.child) if args.gateway else child(args.child, args.native)))
        return

    models = args.models.split(",")
    cmd = [sys.executable, os.path.abspath(__file__)] + (["--native"] if args.native else [])
    cmd += ["--gateway"] if args.gateway else []
    srcs = dict(item.split("=", 1) for item in args.srcs.split(",")) if args.srcs else {"this": None}

    def run(model: str, src: str | None) -> dict:
        env = dict(os.environ, PYTHONPATH=src) if src else None
        proc = subprocess.run(cmd + ["--child", model], capture_output=True, text=True, check=True, env=env)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    arms = [(model, label) for model in models for label in srcs]
    for model, label in arms:  # fill the caches (a cold start), not counted
        run(model, srcs[label])
    runs: dict[tuple[str, str], list[dict]] = {arm: [] for arm in arms}
    for _ in range(args.runs):
        for model, label in arms:  # interleaved
            runs[model, label].append(run(model, srcs[label]))
    keys = [
        "import_s",
        "hash_s",
        "read_s",
        "tokenizer_s",
        "weights_s",
        "kernels_s",
        "engine_s",
        "chat_template_s",
        "first_step_s",
        "total_s",
    ]
    if args.gateway:
        keys = ["import_s", "load_s", "total_s"]
    medians = {}
    print(f"loadavg {open('/proc/loadavg').read().strip()}")
    for model, label in arms:
        rs = runs[model, label]
        med = medians[f"{model} {label}"] = {k: round(statistics.median(r[k] for r in rs), 3) for k in keys}
        flags = [f"{k} {all(r[k] for r in rs)}" for k in ("from_cache", "torch_free") if k in rs[0]]
        print(model, label, "(native)" if args.native else "", *flags)
        for k in keys:
            print(f"  {k:16s} {med[k]:7.3f}   runs: {', '.join(f'{r[k]:.3f}' for r in rs)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "medians": medians,
                    "runs": {f"{m} {lab}": r for (m, lab), r in runs.items()},
                    "loadavg": open("/proc/loadavg").read().strip(),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
