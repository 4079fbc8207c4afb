"""PD policies live on this machine, streamed through the cluster's dispatch: two engine servers as
1 prefill + 1 decode (static PD, Dynamo's conditional rule, AMPD) or as 2 colocated engines, the same
threads in all, driven by multi-round agent sessions (a shared system prompt, tool outputs appended
each round, tool waits). Reports TTFT and ITL apart (p50/p99), SLO attainment (a request meets its SLO
when its TTFT and its mean ITL are both within theirs), goodput (requests meeting the SLO per
second), the share of incremental prefills kept on the decode worker and the KV bytes shipped, as
medians over `--repeats` runs with fresh engines, the policies interleaved. Prints JSON.

AMPD's cost model is fitted at start from two prefills timed on this machine's engine.

    flock /tmp/bench.lock .venv/bin/python benchmarks/pd_policies.py --sessions 4 --rounds 3 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import time

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from tokenops.cluster import Cluster, ClusterConfig, DispatchRequest, RequestInfo, build_cluster
from tokenops.cluster.pd import AMPD, Colocated, ConditionalPD, StaticPD
from tokenops.cluster.perf_model import PerfModel
from tokenops.cluster.prefix_index import block_hashes_from_tokens
from tokenops.config import load_settings
from tokenops.engine.config import EngineConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.loader import load_model
from tokenops.engine.server import ServerConfig, build_app, serve_in_thread

BLOCK = 16  # the engines' KV block size, which the gateway hashes prompts in


def _server(loaded, role: str):
    engine = LLMEngine.from_loaded(
        loaded,
        EngineConfig(
            num_threads=1, block_size=BLOCK, max_num_batched_tokens=512, kv_cache_memory_bytes=384 << 20
        ),
    )
    return serve_in_thread(build_app(engine, loaded.tokenizer, ServerConfig(["m"], 4096, role=role)))


def _fit_perf(url: str, vocab: int) -> PerfModel:
    """Prefill time against prompt length on this engine (two lengths, median of three each)."""
    rng = random.Random(7)
    times = {}
    for n in (64, 512):
        runs = []
        for _ in range(3):
            prompt = [rng.randrange(3, vocab) for _ in range(n)]
            start = time.perf_counter()
            httpx.post(
                f"{url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1}, timeout=120
            )
            runs.append(time.perf_counter() - start)
        times[n] = statistics.median(runs)
    per_token = max(1e-5, (times[512] - times[64]) / 448)
    return PerfModel(
        name="fitted",
        base_s=max(0.005, times[64] - 64 * per_token),
        per_token_s=per_token,
        kv_bytes_per_token=46080,
        transfer_latency_s=0.02,
        transfer_bytes_per_s=6e8,
    )


def _kv_received(urls: list[str]) -> int:
    total = 0.0
    for url in urls:
        for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for s in fam.samples:
                if s.name == "tokenops_engine_kv_transfer_bytes_received_total":
                    total += s.value
    return int(total)


async def _request(cluster: Cluster, sid: str, prompt: list[int], out_tokens: int) -> dict:
    info = RequestInfo(
        "m",
        session_id=sid,
        block_hashes=tuple(block_hashes_from_tokens(prompt, BLOCK)),
        block_tokens=BLOCK,
        prompt_tokens=len(prompt),
        max_tokens=out_tokens,
    )
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": out_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    stamps: list[float] = []
    buf = b""
    async with cluster.open(DispatchRequest(info, "/completions", body)) as up:
        async for chunk in up.aiter_bytes():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ").strip()
                if not data or data == b"[DONE]":
                    continue
                choices = orjson.loads(data).get("choices") or []
                if choices and choices[0].get("text"):
                    stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {
        "ttft_s": stamps[0] - start if stamps else float("inf"),
        "itl_s": gaps,
        "remote": bool(up.pd and up.pd.decision and up.pd.decision.remote),
    }


async def _session(cluster, sid, system, rng, args, vocab, rows):
    history = system + [rng.randrange(3, vocab) for _ in range(64)]
    for r in range(args.rounds):
        row = await _request(cluster, sid, history, args.output_len)
        row["round"] = r
        rows.append(row)
        # the agent's own output (the same greedy tokens whichever policy) and the tool's, then its wait
        history = history + [rng.randrange(3, vocab) for _ in range(args.output_len)]
        history = history + [rng.randrange(3, vocab) for _ in range(args.tool_len)]
        await asyncio.sleep(args.tool_wait_s)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _run(name: str, urls: list[str], roles: tuple[str, str], args, perf, vocab) -> dict:
    prefill = [u + "/v1" for u, r in zip(urls, roles, strict=True) if r == "prefill"]
    decode = [u + "/v1" for u, r in zip(urls, roles, strict=True) if r != "prefill"]
    pd = {"policy": "colocated" if name == "colocated" else "static", "prefill": prefill, "decode": decode}
    settings = load_settings(None, environ={}, overrides={"models": {"m": {"pd": pd}}})
    cluster = build_cluster(settings.models, ClusterConfig())
    route = cluster.pd["m"]
    route.policy = {
        "colocated": Colocated,
        "static_pd": StaticPD,
        "conditional_dynamo": ConditionalPD.dynamo,
        "ampd": lambda: AMPD(perf),
    }[name]()
    route.ttft_slo_s, route.itl_slo_s = args.ttft_slo_s, args.itl_slo_s
    async with httpx.AsyncClient() as client:
        await cluster.poller.poll_once(client)
    cluster.poller.start()
    rng = random.Random(1)
    system = [rng.randrange(3, vocab) for _ in range(args.system_len)]
    rows: list[dict] = []
    kv_before = _kv_received(urls)
    start = time.perf_counter()
    await asyncio.gather(
        *(
            _session(cluster, f"s{i}", system, random.Random(100 + i), args, vocab, rows)
            for i in range(args.sessions)
        )
    )
    wall = time.perf_counter() - start
    await cluster.aclose()
    met = [
        r
        for r in rows
        if r["ttft_s"] <= args.ttft_slo_s
        and (not r["itl_s"] or statistics.fmean(r["itl_s"]) <= args.itl_slo_s)
    ]
    ttft = [r["ttft_s"] for r in rows]
    itl = [g for r in rows for g in r["itl_s"]]
    incremental = [r for r in rows if r["round"] > 0]
    return {
        "requests": len(rows),
        "slo_attainment": len(met) / len(rows),
        "goodput_rps": len(met) / wall,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "itl_p50_s": _pct(itl, 0.5),
        "itl_p99_s": _pct(itl, 0.99),
        "incremental_kept_local": sum(not r["remote"] for r in incremental) / len(incremental)
        if incremental
        else None,
        "kv_bytes_shipped": _kv_received(urls) - kv_before,
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--tool-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--tool-wait-s", type=float, default=0.2)
    ap.add_argument("--ttft-slo-s", type=float, default=2.0)
    ap.add_argument("--itl-slo-s", type=float, default=0.25)
    ap.add_argument("--policies", default="colocated,static_pd,conditional_dynamo,ampd")
    args = ap.parse_args()
    loaded = load_model(args.model)
    vocab = loaded.config.vocab_size
    with _server(loaded, "both") as url:
        perf = _fit_perf(url, vocab)
    load_start = os.getloadavg()
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for name in args.policies.split(","):
            roles = ("both", "both") if name == "colocated" else ("prefill", "decode")
            with _server(loaded, roles[0]) as a, _server(loaded, roles[1]) as b:
                runs.setdefault(name, []).append(asyncio.run(_run(name, [a, b], roles, args, perf, vocab)))
    medians = {
        name: {k: statistics.median(r[k] for r in rs) if rs[0][k] is not None else None for k in rs[0]}
        for name, rs in runs.items()
    }
    ratios = {}
    if "ampd" in medians:
        for peer in ("static_pd", "colocated", "conditional_dynamo"):
            if peer in medians and medians[peer]["slo_attainment"]:
                ratios[f"ampd_vs_{peer}_slo_attainment"] = (
                    medians["ampd"]["slo_attainment"] / medians[peer]["slo_attainment"]
                )
    print(
        json.dumps(
            {
                "benchmark": "pd_policies",
                "args": vars(args),
                "perf_model": dataclasses.asdict(perf),
                "loadavg_start": load_start,
                "loadavg_end": os.getloadavg(),
                "medians": medians,
                "ratios": ratios,
                "runs": runs,
            },
            indent=2,
            default=str,
        )
    )


if __name__ == "__main__":
    main()
