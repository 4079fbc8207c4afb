"""Where a prefill's time goes: a cold long prompt and many short prompts arriving together.

The in-process `LLMEngine` (prefix cache on, fresh prompts each time so nothing is cached) runs each
case to its first token once warm, under torch.profiler; operators are summed into groups (linears,
prefill attention, dtype conversions, the elementwise kernels, KV write). With `--ab` the same case
also runs with long prefill chunks on the native attention kernel (`BF16_SDPA_MIN_QUERIES` and
`BF16_SDPA_MIN_QUERIES_CACHED` lifted), and with `--ab-rows` with the last layer finishing every row
rather than the sampling rows alone (the whole forward, then the rows picked), and with
`--ab-prefill-step` with `max_prefill_step_tokens` held to the step budget (a lone long prompt in
chunks of the budget rather than one chunk of up to `max_prefill_step_tokens`), and with
`--ab-mlp-cast` with a gated MLP's gate|up output cast to float32 and back rather than handed to the
activation in bf16 (`keeps_bf16` off), and with `--ab-norm-cast` with the norms writing float32 and
every int4 projection casting its input to bf16 and its output back (`input_dtype` and the o and down
projections' `keeps_bf16` off) rather than the norms writing and widening bf16, and with
`--ab-row-bucket` with the bf16 GEMMs' rows left
unpadded (`layers.GEMM_ROW_BUCKET` 1: oneDNN builds a primitive per row count), and with
`--ab-gemm-min-rows N` with int4's bf16 GEMM taking calls from N rows (`int4.bf16_gemm_min_rows`),
and with `--ab-sdpa-min-queries N` with first chunks going to bf16 SDPA from N queries, and with
`--ab-dot-amx` with the attention kernel's bf16 dot path off AMX's tiles (long chunks then go to bf16
SDPA, as before the tiles), interleaved, so the modes are compared in one process. Where the kernel
has the tiles every chunk is native, so `--ab` and `--ab-sdpa-min-queries` equal the shipped mode
there. Each mode also lists the largest operators of the "other" group (`other_top_ms`: the GEMMs
and dequantisation where int4 takes oneDNN's bf16 GEMM). `--length-spread N` gives each long prompt
the next of N lengths from `--long-tokens` up, so no length repeats within N calls (as arbitrary
prompt lengths do). Times are the process's CPU time (`cpu_ms`: at one thread, the default, a shared
machine's load slows them less than wall time would) and wall time (`wall_ms`, what a client waits).

Run:  .venv/bin/python benchmarks/engine_prefill_profile.py [--quantization bf16] [--threads 1]
      [--ab] [--ab-rows] [--ab-prefill-step] [--ab-mlp-cast] [--ab-norm-cast] [--ab-row-bucket]
      [--ab-gemm-min-rows N] [--ab-sdpa-min-queries N] [--ab-dot-amx] [--length-spread N]
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import itertools
import json
import os
import statistics
import time

import torch

GROUPS = (  # first match wins
    ("linears", ("linear",)),
    ("attention", ("scaled_dot_product", "paged_prefill_attention", "paged_decode_attention")),
    ("dtype_copies", ("aten::copy_",)),
    ("kv_write", ("aten::index_copy_", "quantize_kv_into")),
    ("rms_norm", ("rms_norm",)),
    ("gated_activation", ("silu_mul", "gelu_tanh_mul")),
    ("rotary", ("rotary",)),
)


def group_of(name: str) -> str:
    return next((g for g, keys in GROUPS if any(k in name for k in keys)), "other")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="bf16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--short", default="32x64", help="COUNTxTOKENS short prompts arriving together")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ab", action="store_true", help="also time with long chunks on the native kernel")
    ap.add_argument(
        "--ab-rows", action="store_true", help="also time with the last layer finishing every row"
    )
    ap.add_argument(
        "--ab-prefill-step",
        action="store_true",
        help="also time with max_prefill_step_tokens held to the step budget",
    )
    ap.add_argument(
        "--ab-mlp-cast",
        action="store_true",
        help="also time with the gate|up projections' bf16 output cast to float32 (keeps_bf16 off)",
    )
    ap.add_argument(
        "--ab-norm-cast",
        action="store_true",
        help="also time with the norms in float32 and the int4 projections casting around them",
    )
    ap.add_argument(
        "--ab-row-bucket",
        action="store_true",
        help="also time with the oneDNN GEMMs' rows unpadded (layers.GEMM_ROW_BUCKET = 1)",
    )
    ap.add_argument(
        "--ab-gemm-min-rows", type=int, default=None, help="also time with int4's bf16 GEMM from N rows"
    )
    ap.add_argument(
        "--ab-sdpa-min-queries", type=int, default=None, help="also time with bf16 SDPA from N queries"
    )
    ap.add_argument(
        "--ab-dot-amx",
        action="store_true",
        help="also time with the kernel's bf16 dot path off AMX's tiles (long chunks then go to bf16 SDPA)",
    )
    ap.add_argument(
        "--length-spread", type=int, default=1, help="each long prompt the next of this many lengths"
    )
    ap.add_argument("--max-prefill-step-tokens", type=int, default=None, help="default: the engine's")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from torch.profiler import ProfilerActivity, profile

    from tokenops.engine import attention, kernels
    from tokenops.engine.config import EngineConfig, resolve_dtype
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.loader import load_model
    from tokenops.engine.models import layers
    from tokenops.engine.quantize import int4
    from tokenops.engine.sampling_params import SamplingParams

    loaded = load_model(args.model, dtype=resolve_dtype("float32"))
    engine = LLMEngine.from_loaded(
        loaded,
        EngineConfig(
            max_num_seqs=64,
            max_num_batched_tokens=args.max_num_batched_tokens,
            **(
                {}
                if args.max_prefill_step_tokens is None
                else {"max_prefill_step_tokens": args.max_prefill_step_tokens}
            ),
            max_model_len=2048,
            quantization=None if args.quantization == "none" else args.quantization,
        ),
    )
    tok = loaded.tokenizer
    text = tok.encode(
        "The history of the lighthouse begins with fires lit on hills. " * 200, add_special_tokens=False
    )
    count, short_len = map(int, args.short.split("x"))
    fresh = iter(range(1 << 30))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prompts(n: int, length: int) -> list[list[int]]:
        k = next(fresh)  # a distinct head per prompt: no prefix cache hits
        head = [tok.encode(f"Doc {k}.{i}:", add_special_tokens=False) for i in range(n)]
        return [(h + text[i * 3 :])[:length] for i, h in enumerate(head)]

    spread = itertools.cycle(range(max(1, args.length_spread)))
    cases = {
        "long": lambda: prompts(1, args.long_tokens + next(spread)),
        "short": lambda: prompts(count, short_len),
    }

    def cpu_s(batch: list[list[int]]) -> float:
        """The process's CPU time for the batch's first tokens; its wall time goes to `walls`."""
        t, w = time.process_time(), time.perf_counter()
        engine.generate(batch, one)
        walls.append(time.perf_counter() - w)
        return time.process_time() - t

    walls: list[float] = []

    # (first chunks, chunks over a cached prefix): the fewest queries that go to bf16 SDPA
    shipped_min = attention.BF16_SDPA_MIN_QUERIES, attention.BF16_SDPA_MIN_QUERIES_CACHED
    model_type = type(engine.runner.model)
    kept_rows_forward = model_type.forward

    def all_rows_forward(self, ids, ctx, num_layers=None, rows=None):
        hidden = kept_rows_forward(self, ids, ctx, num_layers)
        return hidden if rows is None else hidden[rows]

    config = engine.scheduler.config  # read by every schedule() call
    prefill_step = config.max_prefill_step_tokens
    # the projections that hand their bf16 output on (a gated MLP's gate|up)
    named = list(engine.runner.model.named_modules())
    handing = [m for n, m in named if n.endswith("gate_up_proj") and getattr(m, "keeps_bf16", False)]
    # the o and down projections, whose bf16 output the next norm widens
    widened = [m for n, m in named if n.endswith(("o_proj", "down_proj")) and getattr(m, "keeps_bf16", False)]
    int4_input_dtype = int4.Int4WeightOnlyLinear.input_dtype
    bucket, gemm_rows = layers.GEMM_ROW_BUCKET, int4.bf16_gemm_min_rows
    # mode -> (bf16 SDPA thresholds, the model's forward, max_prefill_step_tokens, keeps_bf16,
    # the GEMMs' row bucket, int4's bf16_gemm_min_rows, the norms' bf16 hand-off, the attention
    # kernel's bf16 dot path on AMX's tiles where built)
    native_ops = kernels.ops()
    dot_amx = native_ops is not None and native_ops.prefill_bf16_amx()
    shipped = (shipped_min, kept_rows_forward, prefill_step, True, bucket, gemm_rows, True, dot_amx)
    modes = {"shipped": shipped}
    if args.ab:
        modes["native_attention"] = ((1 << 30, 1 << 30), *shipped[1:])
    if args.ab_rows:
        modes["last_layer_all_rows"] = (shipped_min, all_rows_forward, *shipped[2:])
    if args.ab_prefill_step:
        modes["prefill_step_at_budget"] = (*shipped[:2], args.max_num_batched_tokens, *shipped[3:])
    if args.ab_mlp_cast:
        modes["mlp_cast"] = (*shipped[:3], False, *shipped[4:])
    if args.ab_row_bucket:
        modes["rows_unpadded"] = (*shipped[:4], 1, *shipped[5:])
    if args.ab_sdpa_min_queries:
        lifted = (args.ab_sdpa_min_queries, shipped_min[1])
        modes[f"sdpa_from_{args.ab_sdpa_min_queries}_queries"] = (lifted, *shipped[1:])
    if args.ab_gemm_min_rows:
        modes[f"gemm_from_{args.ab_gemm_min_rows}_rows"] = (
            *shipped[:5],
            lambda: args.ab_gemm_min_rows,
            True,
            dot_amx,
        )
    if args.ab_norm_cast:
        modes["norm_cast"] = (*shipped[:6], False, dot_amx)
    if args.ab_dot_amx:
        modes["dot_without_tiles"] = (*shipped[:7], False)

    def use(mode: str) -> None:
        (
            min_queries,
            forward,
            config.max_prefill_step_tokens,
            keeps,
            bucket_rows,
            gemm_from,
            norm_bf16,
            amx,
        ) = modes[mode]
        if native_ops is not None:
            native_ops.set_prefill_bf16_amx(amx)
        layers.GEMM_ROW_BUCKET, int4.bf16_gemm_min_rows = bucket_rows, gemm_from
        attention.BF16_SDPA_MIN_QUERIES, attention.BF16_SDPA_MIN_QUERIES_CACHED = min_queries
        model_type.forward = forward
        for m in handing:
            m.keeps_bf16 = keeps
        for m in widened:
            m.keeps_bf16 = norm_bf16
        int4.Int4WeightOnlyLinear.input_dtype = int4_input_dtype if norm_bf16 else (lambda self, x: x.dtype)

    out: dict = {
        "model": args.model,
        "quantization": args.quantization,
        "kv_cache_dtype": engine.load().kv_cache_dtype,
        "threads": args.threads,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_prefill_step_tokens": prefill_step,
        "bf16_handing_projections": len(handing),
        "bf16_widened_projections": len(widened),
        "gemm_row_bucket": bucket,
        "bf16_gemm_min_rows": gemm_rows(),
        "attention_dot_amx": dot_amx,
        "long_tokens": args.long_tokens,
        "length_spread": args.length_spread,
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load_average_start": os.getloadavg(),
        "cases": {},
    }
    for case, make in cases.items():
        res: dict = {}
        for mode in modes:
            use(mode)
            cpu_s(make())  # warm: this batch shape's oneDNN primitives
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                cpu_s(make())
            groups: collections.Counter[str] = collections.Counter()
            others: collections.Counter[str] = collections.Counter()  # what "other" holds, by op
            for e in prof.key_averages():
                group = group_of(e.key)
                groups[group] += e.self_cpu_time_total / 1e3
                if group == "other":
                    others[e.key] += e.self_cpu_time_total / 1e3
            total = sum(groups.values())
            res[mode] = {
                "profiled_ms": round(total, 1),
                "groups_ms": {g: round(v, 1) for g, v in groups.most_common()},
                "groups_pct": {g: round(100 * v / total, 1) for g, v in groups.most_common()},
                "other_top_ms": {k: round(v, 1) for k, v in others.most_common(8)},
                "cpu_ms": [],
                "wall_ms": [],
            }
        for _ in range(args.repeats):  # interleaved, unprofiled
            for mode in modes:
                use(mode)
                res[mode]["cpu_ms"].append(round(cpu_s(make()) * 1e3, 1))
                res[mode]["wall_ms"].append(round(walls[-1] * 1e3, 1))
        for r in res.values():
            r["cpu_ms_median"] = statistics.median(r["cpu_ms"])
            r["wall_ms_median"] = statistics.median(r["wall_ms"])
            # the shipped mode's repeat i over this mode's: a machine drifting between repeats cancels
            pairs = [a / b for a, b in zip(res["shipped"]["cpu_ms"], r["cpu_ms"], strict=True)]
            r["shipped_over_paired"] = {
                "median": round(statistics.median(pairs), 3),
                "min": round(min(pairs), 3),
                "max": round(max(pairs), 3),
            }
        out["cases"][case] = res
    use("shipped")
    out["load_average_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
