"""Perplexity and top-1 agreement of the weight modes over a longer text than engine_quantization.py's.

engine_quantization.py scores one ~150-token paragraph; at that length SmolLM2's perplexity moves by
several per cent from rounding noise alone, too little to rank two int8 variants. This scores chunks
of the project's own prose (../shared/*.md when present, README.md, docs/*.md: ~10k tokens by
default), each chunk a fresh prompt, and compares every mode with float32 on the same tokens:
perplexity of the pooled per-token loss, top-1 agreement with float32's argmax, and for the two
int8_dynamic prefill paths (fbgemm, `torch._int_mm` from 16 rows) the paired per-chunk difference
of mean loss with its standard error. Prints JSON (and writes it to --json).

Run:  flock /tmp/bench.lock .venv/bin/python benchmarks/engine_quality_long.py [--chunks 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import math
import statistics
from pathlib import Path

import torch
from rich.progress import track

from tokenops.engine.context import allocate_kv_caches, build_context
from tokenops.engine.loader import load_model
from tokenops.engine.quantize import quantize_model
from tokenops.engine.quantize.int8_dynamic import DynamicInt8Linear

ROOT = Path(__file__).resolve().parent.parent


def corpus() -> str:
    files = sorted((ROOT.parent / "shared").glob("*.md")) + [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    return "\n\n".join(f.read_text() for f in files if f.is_file())


def scored(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and argmax of one chunk run as a single prompt."""
    c, n = model.config, len(ids)
    kv = allocate_kv_caches(c.num_layers, n // 16 + 2, 16, c.num_kv_heads, c.head_dim, torch.float32)
    ctx = build_context([n], [n], [list(range(n // 16 + 1))], 16, kv)
    t = torch.tensor(ids)
    with torch.inference_mode():
        logits = model.compute_logits(model(t, ctx)).float()[:-1]
    return torch.nn.functional.cross_entropy(logits, t[1:], reduction="none"), logits.argmax(-1)


def int8_dynamic(fp, int_mm_rows: int | None):
    saved, DynamicInt8Linear.INT_MM_MIN_ROWS = DynamicInt8Linear.INT_MM_MIN_ROWS, int_mm_rows
    try:  # read by the layers built now
        m = copy.deepcopy(fp)
        quantize_model(m, "int8_dynamic")
    finally:
        DynamicInt8Linear.INT_MM_MIN_ROWS = saved
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    ids = loaded.tokenizer.encode(corpus(), add_special_tokens=False)
    n = args.chunk_tokens
    chunks = [ids[i : i + n] for i in range(0, len(ids) - n, n)][: args.chunks]
    fp = loaded.model
    bf16 = copy.deepcopy(fp)
    quantize_model(bf16, "bf16")
    models = {"fp32": fp, "bf16": bf16, "int8_dynamic": int8_dynamic(fp, None), "int8_dynamic-int_mm": int8_dynamic(fp, 16)}
    loss: dict[str, list[float]] = {k: [] for k in models}
    agree: dict[str, list[float]] = {k: [] for k in models}
    for chunk in track(chunks, description="scoring chunks"):
        ref_loss, ref_arg = scored(fp, chunk)
        for name, model in models.items():
            nll, arg = (ref_loss, ref_arg) if model is fp else scored(model, chunk)
            loss[name].append(float(nll.mean()))
            agree[name].append(float((arg == ref_arg).float().mean()))
    base = math.exp(statistics.mean(loss["fp32"]))
    modes = {}
    for name in models:
        ppl = math.exp(statistics.mean(loss[name]))
        modes[name] = {"perplexity": round(ppl, 3), "vs_fp32_pct": round((ppl / base - 1) * 100, 2),
                       "top1_agreement": round(statistics.mean(agree[name]), 4)}
    diff = [a - b for a, b in zip(loss["int8_dynamic-int_mm"], loss["int8_dynamic"], strict=True)]
    out = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model": args.model, "chunks": len(chunks), "chunk_tokens": n, "predicted_tokens": len(chunks) * (n - 1),
        "modes": modes,
        "int_mm_minus_fbgemm_loss": {
            "mean": round(statistics.mean(diff), 5), "stdev": round(statistics.stdev(diff), 5),
            "stderr": round(statistics.stdev(diff) / math.sqrt(len(diff)), 5),
            "int_mm_better_chunks": sum(d < 0 for d in diff),
        },
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
