"""Output tokens per CPU-second of the engine_vs_peers.py workload: our engine against
transformers `generate`.

The same prompts as `engine_vs_peers.py` (`make_prompts`: 64 tokens each, 32 output tokens, greedy,
EOS ignored), all requests of a level at once, but timed by the CPU time of the computing thread
(`time.thread_time`, torch at 1 thread) instead of wall time. On a shared machine wall time at 2
threads moves 2-10x with other work (OpenMP threads wait on a descheduled peer); CPU time moves
~10%, so ratios are comparable across runs. Peers run interleaved within each repeat; figures are
medians over `--repeats`.

Run:  PYTHONPATH=src .venv/bin/python benchmarks/engine_throughput_cpu.py [--concurrency 32] [--repeats 3]
      [--quantization bf16,int8_dynamic] [--transformers-dtypes float32,bfloat16]
`--quantization int8_dynamic-int_mm` is int8_dynamic with `torch._int_mm` from 16 rows
(int_mm_linear.py's `use_int_mm`, an experiment the engine does not use): the A/B of that path in one process.
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from engine_vs_peers import make_prompts  # noqa: E402
from int_mm_linear import use_int_mm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default="bf16,int8_dynamic", help="our weight modes (none = float32)")
    ap.add_argument("--transformers-dtypes", default="float32,bfloat16")
    args = ap.parse_args()

    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    import transformers

    from tokenops.engine.config import EngineConfig, resolve_dtype
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.loader import load_model
    from tokenops.engine.sampling_params import SamplingParams

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    n_out = args.output_tokens
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    engines: dict[str, Any] = {}
    for q in args.quantization.split(","):
        loaded = load_model(args.model, dtype=torch.float32)  # fresh: quantisation works in place
        int_mm = q == "int8_dynamic-int_mm"
        engine = LLMEngine.from_loaded(
            loaded,
            EngineConfig(
                max_num_seqs=args.concurrency,
                max_model_len=2048,
                quantization="int8_dynamic" if int_mm else None if q == "none" else q,
            ),
        )
        if int_mm:
            use_int_mm(engine.model, 16)
        engines[f"ours-{q}"] = engine
    tok, gguf = loaded.tokenizer, loaded.path
    pad = tok.eos_token_ids[0]
    hf = {
        f"transformers-{d}": transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=resolve_dtype(d)
        ).eval()
        for d in args.transformers_dtypes.split(",")
    }

    def ours(engine: Any, prompts: list[list[int]]) -> float:
        for i, p in enumerate(prompts):
            engine.add_request(f"cpu-{time.perf_counter()}-{i}", p, params)
        t0 = time.thread_time()
        while engine.has_unfinished():
            engine.step()
        return time.thread_time() - t0

    def theirs(model: Any, prompts: list[list[int]]) -> float:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as in engine_vs_peers
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        t0 = time.thread_time()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n_out,
                min_new_tokens=n_out,
                do_sample=False,
                pad_token_id=pad,
            )
        return time.thread_time() - t0

    peers = {name: (ours, e) for name, e in engines.items()} | {name: (theirs, m) for name, m in hf.items()}
    warm = make_prompts(tok, "warm", 2, 16)
    for fn, target in peers.values():
        fn(target, warm)
    runs: dict[str, list[float]] = {name: [] for name in peers}
    loads = [os.getloadavg()[0]]
    for rep in range(args.repeats):
        prompts = make_prompts(tok, f"cpu{rep}", args.concurrency, args.prompt_tokens)
        for name, (fn, target) in peers.items():
            runs[name].append(args.concurrency * n_out / fn(target, prompts))
        loads.append(os.getloadavg()[0])
    med = {k: statistics.median(v) for k, v in runs.items()}
    base = med.get("transformers-float32")
    print(
        json.dumps(
            {
                "concurrency": args.concurrency,
                "output_tokens_per_cpu_s": {k: [round(x, 1) for x in v] for k, v in runs.items()},
                "median": {k: round(v, 1) for k, v in med.items()},
                "ratio_vs_transformers_float32": {k: round(v / base, 2) for k, v in med.items()}
                if base
                else None,
                "load_average": loads,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
