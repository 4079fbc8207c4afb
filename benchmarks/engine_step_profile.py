"""Where one decode step's time goes, at several batch sizes, and what each kernel choice buys.

Three measurements, printed as one JSON document (and written to `--json`):
- `steps`: for each batch size, decode steps of the in-process `LLMEngine` on SmolLM2-135M split into
  phases (schedule, context build, model forward, vocabulary projection, sampling, scheduler update)
  and the forward's operator groups (linears, KV write + block gather, SDPA, the rest) from
  torch.profiler, with the dozen ops of most self time by name;
- `kernels`: each projection shape of the model at 1 / 8 / 32 rows, `F.linear` (what the models
  used before) against the kernel `layers.Linear` / `layers.VocabProjection` pick now, interleaved;
- `sampler`: one sampler call over 32 decode rows of the model's own logits, per sampling mode.
Times are CPU time of the measuring thread (`time.thread_time`, torch at 1 thread by default), so a
machine loaded by other work slows the figures less than wall time would; ratios within one run
are what to compare.

Run:  .venv/bin/python benchmarks/engine_step_profile.py [--threads 1] [--prompt-len 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

PROMPT = "The history of the lighthouse begins with fires lit on hills to guide ships home. " * 80
OP_GROUPS = {
    "linears": (
        "aten::mm",
        "aten::addmm",
        "mkldnn::_linear_pointwise",
        "tokenops::linear_int8",
        "tokenops::linear_bf16",
        "tokenops::linear_q4",
        "tokenops::linear_q8",
        "tokenops::linear_dynamic_rows",
        "quantized::linear_dynamic",
        "aten::_weight_int8pack_mm",
        "aten::_weight_int4pack_mm_for_cpu",
    ),
    "kv_write_and_gather": ("aten::index_copy_", "aten::index_select", "tokenops::quantize_kv_into"),
    "sdpa": (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "tokenops::paged_decode_attention",
        "tokenops::paged_prefill_attention",
    ),
    "norm_rotary_activation": ("tokenops::rms_norm", "tokenops::rotary_", "tokenops::silu_mul"),
}


def median_ms(fn: Any, n: int, clock: Any = time.thread_time) -> float:
    """Median ms of `n` calls after one warm call, by `clock` (this thread's CPU time by default)."""
    fn()
    times = []
    for _ in range(n):
        t = clock()
        fn()
        times.append(clock() - t)
    return round(statistics.median(times) * 1e3, 3)


def timed(phases: dict[str, list[float]], name: str, fn: Any) -> Any:
    """`fn`, adding its CPU time to phases[name] on each call."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.thread_time()
        result = fn(*args, **kwargs)
        phases[name].append(time.thread_time() - t)
        return result

    return wrapper


def profile_steps(
    engine: Any, tokenizer: Any, batches: list[int], steps: int, prompt_len: int
) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from tokenops.engine.sampling_params import SamplingParams

    body = tokenizer.encode(PROMPT)
    out: dict[str, Any] = {}
    for batch in batches:
        params = SamplingParams(max_tokens=10**4, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"b{batch}-{i}", body[i : i + prompt_len], params)
        while any(s.num_output_tokens == 0 for s in engine._requests.values()):
            engine.step()  # prefill; only decode steps are measured
        phases: dict[str, list[float]] = collections.defaultdict(list)
        runner, model, scheduler = engine.runner, engine.model, engine.scheduler
        originals = {
            "schedule": (scheduler, "schedule"),
            "context_build": (runner, "prepare"),
            "model_forward": (model, "forward"),
            "vocab_projection": (model, "compute_logits"),
            "sampler": (engine, "sampler"),
            "scheduler_update": (scheduler, "update"),
        }
        saved = {name: getattr(obj, attr) for name, (obj, attr) in originals.items()}

        for name, (obj, attr) in originals.items():
            setattr(obj, attr, timed(phases, name, saved[name]))
        for _ in range(steps):
            t = time.thread_time()
            engine.step()
            phases["step_total"].append(time.thread_time() - t)
        for name, (obj, attr) in originals.items():
            if obj is model:
                delattr(obj, attr)  # back to the class's method
            else:
                setattr(obj, attr, saved[name])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                engine.step()
        groups: collections.Counter[str] = collections.Counter()
        total = 0.0
        for e in prof.key_averages():
            total += e.self_cpu_time_total
            for group, names in OP_GROUPS.items():
                if e.key in names:
                    groups[group] += e.self_cpu_time_total
        share = {g: round(100 * groups[g] / total, 1) for g in OP_GROUPS}
        share["other_ops"] = round(100 - sum(share.values()), 1)
        # the ops with the most self time, ms per step: what "other_ops" holds, by name
        top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
        top_ops = {e.key: round(e.self_cpu_time_total / 3 / 1e3, 2) for e in top}
        ms = {k: round(statistics.median(v) * 1e3, 2) for k, v in phases.items()}
        ms["python_rest"] = round(ms["step_total"] - sum(v for k, v in ms.items() if k != "step_total"), 2)
        out[str(batch)] = {"phases_ms": ms, "op_share_pct": share, "top_ops_ms_per_step": top_ops}
        for rid in list(engine._requests):
            engine.abort(rid)
        engine.step()
    return out


def kernels(config: Any, rows: list[int], n: int) -> dict[str, Any]:
    from tokenops.engine.models.layers import Linear, VocabProjection

    h, i = config.hidden_size, config.intermediate_size
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    shapes = {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * i), "down": (i, h)}
    out: dict[str, Any] = {}
    weight = torch.randn(config.vocab_size, h)
    with torch.inference_mode():
        for m in rows:
            for name, (fan_in, fan_out) in shapes.items():
                lin = Linear(fan_in, fan_out, bias=False)
                x = torch.randn(m, fan_in)
                old = median_ms(lambda: F.linear(x, lin.weight), n)  # noqa: B023
                new = median_ms(lambda: lin(x), n)  # noqa: B023
                out[f"{name}@{m}"] = {"f_linear_ms": old, "ours_ms": new, "speedup": round(old / new, 2)}
            head = VocabProjection()
            x = torch.randn(m, h)
            old = median_ms(lambda: F.linear(x, weight), max(3, n // 4))  # noqa: B023
            new = median_ms(lambda: head(x, weight), max(3, n // 4))  # noqa: B023
            out[f"vocab@{m}"] = {"f_linear_ms": old, "ours_ms": new, "speedup": round(old / new, 2)}
    return out


def real_logits(engine: Any, tokenizer: Any, rows: int) -> torch.Tensor:
    """Logits of `rows` decode rows of the model itself (flat random logits would overstate top-p)."""
    from tokenops.engine.sampling_params import SamplingParams

    body = tokenizer.encode(PROMPT)
    captured: list[torch.Tensor] = []
    project = engine.model.compute_logits
    engine.model.compute_logits = lambda hidden: captured.append(project(hidden)) or captured[-1]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"logits-{i}", body[i : i + 32], params)
    while engine.has_unfinished():
        engine.step()
    del engine.model.compute_logits
    return next(t for t in reversed(captured) if t.shape[0] == rows)


def sampler_costs(logits: torch.Tensor, n: int) -> dict[str, float]:
    from tokenops.engine.sampler import Sampler
    from tokenops.engine.sampling_params import SamplingParams

    modes = {
        "greedy": SamplingParams(temperature=0.0),
        "temperature": SamplingParams(temperature=0.8),
        "top_k_50": SamplingParams(temperature=0.8, top_k=50),
        "top_p_0.9": SamplingParams(temperature=0.8, top_p=0.9),
        "top_p_0.95_temperature_1.5": SamplingParams(temperature=1.5, top_p=0.95),
    }
    sampler = Sampler()
    rows = logits.shape[0]
    return {
        name: median_ms(lambda p=p: sampler(logits, [p] * rows, [None] * rows), n)
        for name, p in modes.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument(
        "--prompt-len", type=int, default=64, help="prompt tokens per request (the decode steps' context)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantization", default=None, help="the engine's weight format (default float32)")
    ap.add_argument("--json", default="benchmarks/results/engine_step_profile.json")
    ap.add_argument("--parts", default="steps,kernels,sampler", help="which measurements, comma-separated")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    torch.set_num_threads(args.threads)
    from tokenops.engine.config import EngineConfig
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.loader import load_model

    load_at_start = os.getloadavg()
    loaded = load_model(args.model)
    engine = LLMEngine.from_loaded(
        loaded, EngineConfig(max_num_seqs=64, max_model_len=2048, quantization=args.quantization)
    )
    batches = [int(b) for b in args.batches.split(",")]
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": args.threads,
            "load_average_at_start": load_at_start,
        },
        "model": args.model,
        "prompt_len": args.prompt_len,
        "quantization": engine.config.quantization,
        "kernel_isa": os.environ.get("TOKENOPS_KERNEL_ISA", "native"),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "clock": "thread CPU time (time.thread_time), medians",
    }
    if "steps" in parts:
        result["steps"] = profile_steps(engine, loaded.tokenizer, batches, args.steps, args.prompt_len)
    if "kernels" in parts:
        result["kernels"] = kernels(loaded.config, batches, 15)
    if "sampler" in parts:
        result["sampler_32_rows_ms"] = sampler_costs(real_logits(engine, loaded.tokenizer, 32), 7)
    result["machine"]["load_average_at_end"] = os.getloadavg()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
