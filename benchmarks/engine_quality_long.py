"""Perplexity and top-1 agreement of the weight modes over a longer text than engine_quantization.py's.

engine_quantization.py scores one ~150-token paragraph; at that length SmolLM2's perplexity moves by
several per cent from rounding noise alone, too little to rank two int8 variants. This scores chunks
of the project's own prose (../shared/*.md when present, README.md, docs/*.md: ~10k tokens by
default), each chunk a fresh prompt, and compares every mode with float32 on the same tokens:
perplexity of the pooled per-token loss, top-1 agreement with float32's argmax, and for the two
int8_dynamic prefill paths (fbgemm, `torch._int_mm` from 16 rows) the paired per-chunk difference
of mean loss with its standard error. `--kv-cache-dtypes float32,bfloat16[,int8]` scores every weight mode
over each KV cache dtype too (`<mode>+kv-bfloat16`), with the paired per-chunk loss difference
against the same weights over a float32 cache; `--modes` picks the weight modes. Every mode gets its
paired per-chunk loss difference against fp32 (mean and standard error). Prints JSON (and writes it
to --json).

Run:  flock /tmp/bench.lock .venv/bin/python benchmarks/engine_quality_long.py [--chunks 40] [--json out.json]
      [--modes fp32,bf16] [--kv-cache-dtypes float32,bfloat16]
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
from int_mm_linear import use_int_mm  # benchmarks/, the script's own folder
from rich.progress import track

from tokenops.engine.context import build_context
from tokenops.engine.kv_cache import allocate_kv_caches
from tokenops.engine.loader import load_model
from tokenops.engine.models.layers import VocabProjection
from tokenops.engine.quantize import quantize_model

ROOT = Path(__file__).resolve().parent.parent


def corpus() -> str:
    files = (
        sorted((ROOT.parent / "shared").glob("*.md"))
        + [ROOT / "README.md"]
        + sorted((ROOT / "docs").glob("*.md"))
    )
    return "\n\n".join(f.read_text() for f in files if f.is_file())


def scored(model, ids: list[int], kv_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and argmax of one chunk run as a single prompt. Every query reads its keys and
    values back from the cache (as stored in `kv_dtype`), as decoding them one at a time would."""
    c, n = model.config, len(ids)
    kv = allocate_kv_caches(c.num_layers, n // 16 + 2, 16, c.num_kv_heads, c.head_dim, kv_dtype)
    ctx = build_context([n], [n], [list(range(n // 16 + 1))], 16, kv)
    t = torch.tensor(ids)
    with torch.inference_mode():
        logits = model.compute_logits(model(t, ctx)).float()[:-1]
    return torch.nn.functional.cross_entropy(logits, t[1:], reduction="none"), logits.argmax(-1)


def int8_dynamic(fp, int_mm_rows: int | None):
    m = copy.deepcopy(fp)
    quantize_model(m, "int8_dynamic")
    if int_mm_rows is not None:
        use_int_mm(m, int_mm_rows)
    return m


def weight_only(fp, mode: str, bf16_head: bool | None):
    """`mode`'s weights; `bf16_head` False keeps the output head's float32 copies (what the quantised
    modes used before they took bf16 ones on native-bf16 CPUs and Q8_0 ones on AVX2), None leaves
    quantize_model's choice."""
    m = copy.deepcopy(fp)
    quantize_model(m, mode)
    if bf16_head is not None:
        for module in m.modules():
            if isinstance(head := getattr(module, "vocab_projection", None), VocabProjection):
                head.bf16 = bf16_head
                head.q8 = head.q8 and bf16_head
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--modes",
        default="fp32,bf16,int8_dynamic,int8_dynamic-int_mm",
        help="weight modes, comma-separated: fp32, bf16, int8_dynamic, int8_dynamic-int_mm, "
        "int8_dynamic-f32head, int8, int8-f32head, int4, int4-f32head (-f32head: the output head's "
        "float32 copies instead of the mode's bf16 or Q8_0 one)",
    )
    ap.add_argument(
        "--kv-cache-dtypes",
        default="float32",
        help="KV cache dtypes, comma-separated: float32, bfloat16, float16, int8 (each mode over each)",
    )
    args = ap.parse_args()
    kv_dtypes = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "int8": torch.int8,  # the quantised layout: int8 values, a float16 scale per (slot, kv head)
    }
    kvs = [k.strip() for k in args.kv_cache_dtypes.split(",")]
    wanted = [m.strip() for m in args.modes.split(",")]
    if unknown := [k for k in kvs if k not in kv_dtypes]:
        ap.error(f"unknown KV cache dtypes {unknown}; use {list(kv_dtypes)}")
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    ids = loaded.tokenizer.encode(corpus(), add_special_tokens=False)
    n = args.chunk_tokens
    chunks = [ids[i : i + n] for i in range(0, len(ids) - n, n)][: args.chunks]
    fp = loaded.model
    bf16 = copy.deepcopy(fp)
    quantize_model(bf16, "bf16")
    builders = {
        "fp32": lambda: fp,
        "bf16": lambda: bf16,
        "int8_dynamic": lambda: int8_dynamic(fp, None),
        "int8_dynamic-int_mm": lambda: int8_dynamic(fp, 16),
        "int8_dynamic-f32head": lambda: weight_only(fp, "int8_dynamic", bf16_head=False),
        "int8": lambda: weight_only(fp, "int8", bf16_head=None),
        "int8-f32head": lambda: weight_only(fp, "int8", bf16_head=False),
        "int4": lambda: weight_only(fp, "int4", bf16_head=None),
        "int4-f32head": lambda: weight_only(fp, "int4", bf16_head=False),
    }
    if unknown := [m for m in wanted if m not in builders]:
        ap.error(f"unknown modes {unknown}; use {list(builders)}")
    # name -> (weights, KV dtype); fp32 weights over a float32 cache is the reference, always run
    variants = {(m if kv == "float32" else f"{m}+kv-{kv}"): (m, kv) for m in wanted for kv in kvs}
    weights = {m: builders[m]() for m in {m for m, _ in variants.values()}}
    loss: dict[str, list[float]] = {k: [] for k in ["fp32", *variants]}
    agree: dict[str, list[float]] = {k: [] for k in loss}
    for chunk in track(chunks, description="scoring chunks"):
        ref_loss, ref_arg = scored(fp, chunk)
        loss["fp32"].append(float(ref_loss.mean()))
        agree["fp32"].append(1.0)
        for name, (m, kv) in variants.items():
            if name == "fp32":
                continue
            nll, arg = scored(weights[m], chunk, kv_dtypes[kv])
            loss[name].append(float(nll.mean()))
            agree[name].append(float((arg == ref_arg).float().mean()))

    def paired(a: str, b: str) -> dict:
        """Per-chunk mean loss of a minus b: mean, stdev, standard error of the mean."""
        d = [x - y for x, y in zip(loss[a], loss[b], strict=True)]
        sd = statistics.stdev(d) if len(d) > 1 else 0.0
        return {
            "mean": round(statistics.mean(d), 5),
            "stdev": round(sd, 5),
            "stderr": round(sd / math.sqrt(len(d)), 5),
            "a_better_chunks": sum(x < 0 for x in d),
        }

    base = math.exp(statistics.mean(loss["fp32"]))
    modes = {}
    for name in loss:
        ppl = math.exp(statistics.mean(loss[name]))
        modes[name] = {
            "perplexity": round(ppl, 3),
            "vs_fp32_pct": round((ppl / base - 1) * 100, 2),
            "top1_agreement": round(statistics.mean(agree[name]), 4),
        }
        if name != "fp32":
            modes[name]["loss_minus_fp32"] = paired(name, "fp32")
    out = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model": args.model,
        "chunks": len(chunks),
        "chunk_tokens": n,
        "predicted_tokens": len(chunks) * (n - 1),
        "modes": modes,
        # the same weights over a half-precision cache minus over a float32 one, per chunk
        "kv_minus_float32_kv_loss": {
            name: paired(name, m) for name, (m, kv) in variants.items() if kv != "float32" and m in loss
        },
    }
    if "int8_dynamic" in loss and "int8_dynamic-int_mm" in loss:
        diff = paired("int8_dynamic-int_mm", "int8_dynamic")
        diff["int_mm_better_chunks"] = diff.pop("a_better_chunks")
        out["int_mm_minus_fbgemm_loss"] = diff
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
