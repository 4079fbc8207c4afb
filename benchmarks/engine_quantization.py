"""Weight and KV-cache quantisation against float32 on SmolLM2-135M, in one run: speed, memory, quality.

Variants (same loaded float32 weights, each weight mode quantised once on a deep copy):
- fp32: the engine as loaded;
- int8: `EngineConfig(quantization="int8")`, every linear layer int8, embedding / tied head float32;
- int8+head: int8 plus an int8 copy of the tied output projection (logits_head.py's
  `quantize_logits_head`, an experiment);
- int4: `quantization="int4"`, group-wise asymmetric int4 (group `--group-size`), packed two per byte;
- int8_dynamic: `quantization="int8_dynamic"` (W8A8: int8 weights, activations quantised per row
  at run time, fbgemm), embedding / tied head float32;
- int8_dynamic-int_mm: the same with `torch._int_mm` from 16 rows (int_mm_linear.py, an experiment
  the engine does not use), the A/B of that path;
- int8_dynamic+head: int8_dynamic plus a W8A8 copy of the output projection
  (`quantize_logits_head(dynamic=True)`);
- bf16: `quantization="bf16"`, every linear layer's weight held as bf16 (native float32-activation
  kernel for decode rows, oneDNN bf16 beyond) and a bf16 copy of the tied head;
- kv-int8: float32 weights, `kv_cache_dtype="int8"` (int8 keys/values, a float16 scale per token-head);
- int8+kv-int8, int4+kv-int8: both.

Speed: decode output tokens/s through `LLMEngine` at each batch level (same prompt token ids,
greedy, EOS ignored, fixed output length), measured after every prompt is prefilled, so it is
decode alone; prefill tokens/s of the same prompts is reported too. Variants interleave within
each repeat so a change in the machine's load hits all of them; figures are medians over
`--repeats`, ratios are taken per repeat, then the median. Memory: bytes of parameters and buffers,
and KV bytes per token (all layers, keys and values). Quality: perplexity of a fixed text
(teacher-forced, through the variant's KV cache), top-1 agreement with fp32 on it, and greedy
tokens equal to fp32's at each batch level.

Run:  .venv/bin/python benchmarks/engine_quantization.py [--levels 1,8] [--repeats 3] [--json out.json]
      [--variants fp32,int8,int4,int8_dynamic,int8_dynamic+head,bf16]   (fp32 always runs: the baseline)
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import statistics
import time

import torch
from int_mm_linear import use_int_mm  # benchmarks/, the script's own folder
from logits_head import quantize_logits_head

from tokenops.engine.config import EngineConfig
from tokenops.engine.context import build_context
from tokenops.engine.kv_cache import allocate_kv_caches, kv_bytes_per_token
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.loader import load_model
from tokenops.engine.quantize import quantize_model, weight_bytes
from tokenops.engine.sampling_params import SamplingParams

TEXT = (
    "The history of the lighthouse begins with fires lit on hills to guide ships home. Later, towers "
    "of stone carried lanterns, then mirrors, then the great Fresnel lenses that bent light into beams "
    "visible for miles. Keepers trimmed wicks, polished brass and logged the weather every hour. "
    "Storms tested them; some towers fell, others stood for centuries. Today most lights are automatic, "
    "yet people still visit them to climb the stairs and look out over the water. The river rises in "
    "the hills to the north of the town and flows south through farmland before it reaches the sea. "
    "In the spring the water is high and fast, and the old stone bridge near the market has been "
    "closed more than once. Farmers along its banks grow wheat, barley and potatoes."
)


def perplexity(model, ids: list[int], kv_dtype: torch.dtype = torch.float32) -> tuple[float, torch.Tensor]:
    c = model.config
    n = len(ids)
    kv = allocate_kv_caches(c.num_layers, n // 16 + 2, 16, c.num_kv_heads, c.head_dim, kv_dtype)
    ctx = build_context([n], [n], [list(range(n // 16 + 1))], 16, kv)
    t = torch.tensor(ids)
    with torch.inference_mode():
        logits = model.compute_logits(model(t, ctx))
    return float(torch.exp(torch.nn.functional.cross_entropy(logits[:-1], t[1:]))), logits.argmax(-1)


def run_level(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Prefill all prompts, then decode to the end; time the two phases apart."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        engine.add_request(rid, p, params)
    out: dict[str, list[int]] = {r: [] for r in rids}
    t0 = time.perf_counter()
    t_first = None
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        if t_first is None and all(out[r] for r in rids):
            t_first = time.perf_counter()  # every prompt prefilled and its first token out
    t1 = time.perf_counter()
    decoded = sum(len(v) - 1 for v in out.values())
    return {
        "prefill_tok_s": sum(map(len, prompts)) / (t_first - t0),
        "decode_tok_s": decoded / (t1 - t_first),
        "tokens": [out[r] for r in rids],
    }


def speed_vs_fp32(engines: dict, levels: list[int], repeats: int, prompts, max_tokens: int) -> dict:
    """Decode / prefill tok/s per engine and batch level, engines interleaved within each level and
    repeat (so machine noise hits them alike), with medians and ratios against the "fp32" engine and
    the share of greedy tokens equal to fp32's. `prompts(n, rep)` gives n fresh prompts."""
    for e in engines.values():  # warm-up
        run_level(e, prompts(2, 99), 4)
    raw: dict = {n: {lvl: [] for lvl in levels} for n in engines}
    for rep in range(repeats):
        for lvl in levels:
            for name, e in engines.items():
                r = run_level(e, prompts(lvl, rep), max_tokens)
                raw[name][lvl].append(r)
                print(
                    f"rep {rep} batch {lvl:>2} {name:<12} decode {r['decode_tok_s']:7.1f} tok/s  "
                    f"prefill {r['prefill_tok_s']:7.1f} tok/s",
                    flush=True,
                )
    out: dict = {}
    for name in engines:
        out[name] = {}
        for lvl in levels:
            runs, base = raw[name][lvl], raw["fp32"][lvl]
            pairs = list(zip(runs, base, strict=True))
            same = [
                sum(
                    a == b
                    for x, y in zip(r["tokens"], b_["tokens"], strict=True)
                    for a, b in zip(x, y, strict=True)
                )
                / sum(map(len, b_["tokens"]))
                for r, b_ in pairs
            ]
            out[name][str(lvl)] = {
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
                "decode_speedup_vs_fp32": statistics.median(
                    r["decode_tok_s"] / b_["decode_tok_s"] for r, b_ in pairs
                ),
                "prefill_speedup_vs_fp32": statistics.median(
                    r["prefill_tok_s"] / b_["prefill_tok_s"] for r, b_ in pairs
                ),
                "greedy_tokens_equal_fp32": statistics.median(same),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variants (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.levels.split(",")]

    loaded = load_model(args.model)
    ids = loaded.tokenizer.encode(TEXT, add_special_tokens=False)
    fp = loaded.model
    weights = {"fp32": fp}
    q = copy.deepcopy(fp)
    quantize_model(q, "int8")
    weights["int8"] = q
    qh = copy.deepcopy(q)
    quantize_logits_head(qh)
    weights["int8+head"] = qh
    q4 = copy.deepcopy(fp)
    quantize_model(q4, "int4", group_size=args.group_size)
    weights["int4"] = q4
    qd = copy.deepcopy(fp)
    quantize_model(qd, "int8_dynamic")
    weights["int8_dynamic"] = qd
    qdh = copy.deepcopy(qd)
    quantize_logits_head(qdh, dynamic=True)
    weights["int8_dynamic+head"] = qdh
    qdi = copy.deepcopy(fp)
    quantize_model(qdi, "int8_dynamic")
    use_int_mm(qdi, 16)
    weights["int8_dynamic-int_mm"] = qdi
    qb = copy.deepcopy(fp)
    quantize_model(qb, "bf16")
    weights["bf16"] = qb
    # variant -> (weights, kv_cache_dtype)
    variants = {name: (name, "auto") for name in weights}
    variants |= {
        "kv-int8": ("fp32", "int8"),
        "int8+kv-int8": ("int8", "int8"),
        "int4+kv-int8": ("int4", "int8"),
    }
    if args.variants:
        wanted = {"fp32", *args.variants.split(",")}
        if unknown := wanted - set(variants):
            raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {list(variants)}")
        variants = {n: v for n, v in variants.items() if n in wanted}
    c = fp.config

    result: dict = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.threads} thread(s)",
        "load_average_start": os.getloadavg(),
        "args": vars(args),
        "variants": {},
    }
    ppl_fp, top_fp = perplexity(fp, ids)
    for name, (w, kv) in variants.items():
        kv_dtype = torch.int8 if kv == "int8" else torch.float32
        ppl, top = perplexity(weights[w], ids, kv_dtype)
        result["variants"][name] = {
            "weight_mib": weight_bytes(weights[w]) / 2**20,
            "kv_bytes_per_token": kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype),
            "perplexity": ppl,
            "perplexity_delta_pct": (ppl / ppl_fp - 1) * 100,
            "top1_agreement": float((top == top_fp).float().mean()),
            "levels": {},
        }

    # prompts: windows of the text, distinct per request so prefix caching does not help
    def prompts(n: int, rep: int) -> list[list[int]]:
        k = args.prompt_tokens
        return [(ids * 4)[(i * 7 + rep) % len(ids) :][:k] for i in range(n)]

    engines = {
        name: LLMEngine(
            weights[w],
            EngineConfig(
                num_kv_blocks=max(levels) * (args.prompt_tokens + args.max_tokens) // 16 + 64,
                max_num_seqs=64,
                max_num_batched_tokens=2048,
                enable_prefix_caching=False,
                kv_cache_dtype=kv,
            ),
        )
        for name, (w, kv) in variants.items()
    }
    for name, levels_out in speed_vs_fp32(engines, levels, args.repeats, prompts, args.max_tokens).items():
        result["variants"][name]["levels"] = levels_out
    result["load_average_end"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
