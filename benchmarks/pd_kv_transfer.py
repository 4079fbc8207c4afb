"""KV transfer between a prefill and a decode engine on loopback, per KV dtype: bytes per token, pull
time and bandwidth, and the decode leg's first token with the prompt's KV pulled against the same
engine prefilling that prompt itself. Prints JSON.

Two engine servers share one loaded model (the model holds no per-request state; each engine has its
own KV pool). Each round uses a fresh random prompt so neither side finds it cached.

    flock /tmp/bench.lock .venv/bin/python benchmarks/pd_kv_transfer.py --rounds 5 --prompt-len 1024
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import httpx

from tokenops.engine.config import EngineConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.loader import load_model
from tokenops.engine.server import ServerConfig, build_app, serve_in_thread


def _server(loaded, kv_dtype: str, role: str, threads: int):
    config = EngineConfig(
        kv_cache_dtype=kv_dtype,
        num_threads=threads,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=256 << 20,
    )
    engine = LLMEngine.from_loaded(loaded, config)
    app = build_app(
        engine, loaded.tokenizer, ServerConfig(served_model_names=["m"], max_model_len=2048, role=role)
    )
    return engine, serve_in_thread(app)


def _post(url: str, body: dict) -> tuple[dict, float]:
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json(), time.perf_counter() - start


def run(model: str, kv_dtypes: list[str], rounds: int, prompt_len: int, threads: int) -> dict:
    loaded = load_model(model)
    vocab = loaded.config.vocab_size
    rng = random.Random(0)
    out = {}
    for kv_dtype in kv_dtypes:
        p_engine, p_ctx = _server(loaded, kv_dtype, "prefill", threads)
        d_engine, d_ctx = _server(loaded, kv_dtype, "decode", threads)
        rows = []
        with p_ctx as p_url, d_ctx as d_url:
            for _ in range(rounds + 1):  # the first round warms both engines up and is dropped
                prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
                body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
                prefill, _ = _post(p_url, {**body, "kv_transfer_params": {"do_remote_decode": True}})
                decode, pulled_leg_s = _post(
                    d_url, {**body, "kv_transfer_params": prefill["kv_transfer_params"]}
                )
                local_prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
                _, local_leg_s = _post(d_url, {**body, "prompt": local_prompt})
                kv = decode["kv_transfer"]
                rows.append(
                    {
                        "bytes": kv["bytes"],
                        "seconds": kv["seconds"],
                        "blocks": kv["blocks"],
                        "tokens": kv["blocks"] * d_engine.pool.block_size,
                        "decode_leg_pulled_s": pulled_leg_s,
                        "decode_leg_local_prefill_s": local_leg_s,
                    }
                )
        rows = rows[1:]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out[kv_dtype] = {
            "kv_bytes_per_token": d_engine.kv_bytes_per_token,
            "transferred_tokens": med["tokens"],
            "transfer_bytes_median": med["bytes"],
            "transfer_s_median": round(med["seconds"], 6),
            "transfer_MB_per_s_median": round(med["bytes"] / med["seconds"] / 1e6, 1),
            "decode_leg_pulled_s_median": round(med["decode_leg_pulled_s"], 4),
            "decode_leg_local_prefill_s_median": round(med["decode_leg_local_prefill_s"], 4),
            "rounds": [{k: round(v, 6) if isinstance(v, float) else v for k, v in r.items()} for r in rows],
        }
    return {
        "benchmark": "pd_kv_transfer",
        "model": model,
        "prompt_len": prompt_len,
        "threads_per_engine": threads,
        "machine": platform.processor() or platform.machine(),
        "loadavg": os.getloadavg(),
        "results": out,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--kv-dtypes", default="float32,bfloat16,int8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1, help="threads per engine")
    args = ap.parse_args()
    print(
        json.dumps(
            run(args.model, args.kv_dtypes.split(","), args.rounds, args.prompt_len, args.threads), indent=2
        )
    )


if __name__ == "__main__":
    main()
