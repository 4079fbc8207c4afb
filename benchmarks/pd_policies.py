"""PD policies live on this machine: two engine servers as 1 prefill + 1 decode (static PD, Dynamo's
conditional rule, AMPD) or as 2 colocated engines, the same threads in all, driven by multi-round
agent sessions (a shared system prompt, tool outputs appended each round, tool waits) through
`PDDispatch`. Reports per-request latency against an end-to-end SLO, the share of prefills kept
local and KV bytes shipped. Non-streaming: TTFT and ITL are not separated here. Prints JSON.

    flock /tmp/bench.lock .venv/bin/python benchmarks/pd_policies.py --sessions 4 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

import aiohttp

from tokenops.cluster.pd import AMPD, Colocated, ConditionalPD, StaticPD
from tokenops.cluster.pd_dispatch import PDDispatch, PDWorker
from tokenops.cluster.perf_model import PerfModel
from tokenops.engine.config import EngineConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.loader import load_model
from tokenops.engine.server import ServerConfig, build_app, serve_in_thread

# coefficients of this model on this machine, from pd_kv_transfer.py's figures (1 thread per engine)
PERF = PerfModel(
    name="smollm2-135m-1t",
    base_s=0.03,
    per_token_s=2.6e-3,
    kv_bytes_per_token=46080,
    transfer_latency_s=0.02,
    transfer_bytes_per_s=6e8,
)


def _server(loaded, role: str):
    engine = LLMEngine.from_loaded(
        loaded, EngineConfig(num_threads=1, max_num_batched_tokens=512, kv_cache_memory_bytes=384 << 20)
    )
    return serve_in_thread(build_app(engine, loaded.tokenizer, ServerConfig(["m"], 4096, role=role)))


async def _session(dispatch, sid, system, rng, rounds, vocab, out_tokens, tool_len, wait_s, tok, rows):
    history = system + [rng.randrange(3, vocab) for _ in range(64)]
    held: dict[str, int] = {}
    for r in range(rounds):
        body = {
            "model": "m",
            "prompt": history,
            "max_tokens": out_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        start = time.perf_counter()
        res = await dispatch.complete(
            "/v1/completions", body, prompt_tokens=len(history), session_id=sid, round=r, cached_tokens=held
        )
        rows.append(
            {
                "latency_s": time.perf_counter() - start,
                "remote": res.decision.remote,
                "round": r,
                "kv_bytes": sum((leg.get("kv_transfer") or {}).get("bytes", 0) for leg in res.legs),
                "computed": res.incremental_prefill_tokens,
            }
        )
        history = history + tok.encode(res.body["choices"][0]["text"], add_special_tokens=False)
        held = {res.decision.decode: len(history)}
        history = history + [rng.randrange(3, vocab) for _ in range(tool_len)]
        await asyncio.sleep(wait_s)


async def _run_policy(policy, workers, args, loaded) -> dict:
    rng = random.Random(1)
    vocab = loaded.config.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(args.system_len)]
    rows: list[dict] = []
    async with aiohttp.ClientSession() as http:
        for w in workers:  # warm each engine up (first-step allocations, kernels) outside the measurement
            warm = {"model": "m", "prompt": [5] * 32, "max_tokens": 2}
            async with http.post(f"{w.url}/v1/completions", json=warm) as r:
                await r.read()
        dispatch = PDDispatch(policy, workers, http, ttft_slo_s=args.slo_s, itl_slo_s=args.itl_slo_s)
        await asyncio.gather(
            *(
                _session(
                    dispatch,
                    f"s{i}",
                    system,
                    random.Random(100 + i),
                    args.rounds,
                    vocab,
                    args.output_len,
                    args.tool_len,
                    args.tool_wait_s,
                    loaded.tokenizer,
                    rows,
                )
                for i in range(args.sessions)
            )
        )
    lat = sorted(r["latency_s"] for r in rows)
    incremental = [r for r in rows if r["round"] > 0]
    return {
        "requests": len(rows),
        "slo_attainment": sum(x <= args.slo_s for x in lat) / len(lat),
        "latency_p50_s": round(statistics.median(lat), 3),
        "latency_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
        "incremental_kept_local": (
            sum(not r["remote"] for r in incremental) / len(incremental) if incremental else None
        ),
        "kv_bytes_shipped": sum(r["kv_bytes"] for r in rows),
        "prompt_tokens_computed": sum(r["computed"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--tool-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--tool-wait-s", type=float, default=0.2)
    ap.add_argument("--slo-s", type=float, default=4.0, help="end-to-end latency SLO per request")
    ap.add_argument("--itl-slo-s", type=float, default=0.25, help="the ITL SLO AMPD plans with")
    ap.add_argument("--policies", default="colocated,static_pd,conditional_dynamo,ampd")
    args = ap.parse_args()
    loaded = load_model(args.model)
    make = {
        "colocated": Colocated,
        "static_pd": StaticPD,
        "conditional_dynamo": ConditionalPD.dynamo,
        "ampd": lambda: AMPD(PERF),
    }
    results = {}
    for name in args.policies.split(","):
        roles = ("both", "both") if name == "colocated" else ("prefill", "decode")
        with _server(loaded, roles[0]) as a, _server(loaded, roles[1]) as b:
            workers = [PDWorker("w0", a, roles[0]), PDWorker("w1", b, roles[1])]
            results[name] = asyncio.run(_run_policy(make[name](), workers, args, loaded))
    print(
        json.dumps(
            {"benchmark": "pd_policies", "args": vars(args), "loadavg": os.getloadavg(), "results": results},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
