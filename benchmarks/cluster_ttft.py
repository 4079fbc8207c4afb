"""Balancing policies end to end: local engine replicas behind the gateway, a multi-turn workload with
several long shared system prompts, the same seeded workload for each policy.

For each policy in turn (in `--rounds` alternating orders) the script starts `tokenops serve` in its
own process with a config naming the policy: the gateway starts `--replicas` fresh `tokenops engine`
processes of the bundled SmolLM2-135M (so every policy begins with empty prefix caches), each
limited to `--threads` torch threads so that they share the CPU without fighting. It warms each
engine with an unrelated prompt, creates a key through the admin API, and drives the workload through
the gateway (real HTTP, streaming, `x-session-id` per conversation) with `tokenops.bench`'s load
driver: `--sessions` conversations of `--turns` rounds, session i opening with system prompt
i % `--groups` (`--system-tokens` long), each round a new user message of `--user-tokens` and an
answer of at most `--output-tokens`, `--concurrency` conversations at a time.

Reported per policy: prefix-cache hit rate (the engines' `cached_tokens` over prompt tokens, from the
usage each response carries), p50/p99 time to first token, output tokens/s, and the gateway's
placement counters (picks by reason) from its `/metrics`. Prints JSON and writes it to `--out`.

    PYTHONPATH=src .venv/bin/python benchmarks/cluster_ttft.py --out benchmarks/results/cluster_ttft.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from tokenops.bench.driver import LoadConfig, LoadDriver
from tokenops.bench.metrics import RequestRecord
from tokenops.bench.ports import free_ports
from tokenops.bench.workloads import make_workload

TOKENOPS = [sys.executable, "-c", "from tokenops.cli import app; app()"]
ADMIN_KEY = "bench-admin"
MODEL = "smollm2"
BLOCK_WORDS = 64  # words per workload text block: system prompts are whole blocks


def policy_config(spec: str) -> dict[str, Any]:
    """A policy name, or a variant: `prefix_aware:exact` (index fed by the engines' KV events,
    `learn: false`, the default for local engines) and `prefix_aware:approx` (index learnt from its
    own decisions, `learn: true`)."""
    name, _, variant = spec.partition(":")
    if variant not in ("", "exact", "approx"):
        raise SystemExit(f"unknown policy variant {spec!r} (use :exact or :approx)")
    if not variant:
        return {"policy": name}
    return {"policy": name, "policy_options": {"learn": variant == "approx"}}


class Serve:
    """`tokenops serve` with local engines and one balancing policy, in its own process group."""

    def __init__(self, policy: str, args: argparse.Namespace, work: Path, run: int) -> None:
        self.port, *self.engine_ports = free_ports(args.replicas + 1)
        engine_args = {"kv_cache_memory": args.kv_cache_memory, "log_level": "warning"}
        cfg = {
            "data_dir": str(work / f"data-{policy.replace(':', '-')}-{run}"),  # a fresh ledger per run
            "admin_key": ADMIN_KEY,
            "log_level": "warning",
            "models": {
                MODEL: {
                    "engine": {
                        "model": args.model,
                        "port": self.engine_ports[0],
                        "replicas": args.replicas,
                        "args": engine_args,
                    },
                    "served_name": args.model,
                    "max_inflight": args.max_inflight,
                    "context_window": 8192,
                }
            },
            "cluster": {"models": {MODEL: policy_config(policy)}},
        }
        path = work / f"{policy.replace(':', '-')}-{run}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        # torch reads these at import: one intra-op thread per engine, so N engines share N cores
        threads = str(args.threads)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENOPS_")}
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads)
        self.log = (work / f"serve-{policy.replace(':', '-')}-{run}.log").open("wb")
        self.proc = subprocess.Popen(
            [*TOKENOPS, "serve", "--config", str(path), "--port", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tokenops serve exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"tokenops serve not ready within {timeout} s")

    def warm_engines(self, model: str) -> None:
        """One short unrelated request per engine: the first forward pass pays one-off costs."""
        for port in self.engine_ports:
            body = {"model": model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2}
            httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120
            ).raise_for_status()

    def warm_gateway(self, key: str, timeout: float = 120) -> dict[str, Any] | None:
        """One unrelated chat through the gateway (it starts loading the prompt tokenizer), then wait
        until the tokenizer is loaded, so every policy's first turns are hashed the same way."""
        body = {"model": MODEL, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1}
        httpx.post(
            self.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
            timeout=120,
        ).raise_for_status()
        deadline = time.monotonic() + timeout
        while True:
            status = httpx.get(
                self.url + "/admin/cluster", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
            ).json()
            tok = status["models"][MODEL].get("prompt_tokenizer")
            if tok is None or tok["state"] in ("ready", "failed") or time.monotonic() > deadline:
                return tok
            time.sleep(0.5)

    def new_key(self) -> str:
        h = {"authorization": f"Bearer {ADMIN_KEY}"}
        httpx.post(self.url + "/admin/tenants", json={"parent": None, "name": "bench"}, headers=h, timeout=10)
        r = httpx.post(
            self.url + "/admin/keys", json={"node": "bench", "name": "k", "limits": {}}, headers=h, timeout=10
        )
        r.raise_for_status()
        return r.json()["key"]

    def picks(self) -> dict[str, float]:
        """The gateway's placement counters (`tokenops_cluster_picks_total` by reason)."""
        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("tokenops_cluster_picks_total{"):
                labels, value = line[len("tokenops_cluster_picks_total{") :].rsplit("} ", 1)
                fields = dict(part.split("=", 1) for part in labels.split(","))
                key = f"{fields['replica'].strip(chr(34))} {fields['reason'].strip(chr(34))}"
                out[key] = out.get(key, 0) + float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarise(records: list[RequestRecord], duration: float, opening: int) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    # the `opening` first requests start together with cold system prompts, placed alike by every
    # policy (equal loads): the slowest request after them shows what the policy itself adds to the tail
    later = [r.ttft for r in sorted(ok, key=lambda r: r.start)[opening:] if r.ttft is not None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    output = sum(r.output_tokens or 0 for r in ok)
    t0 = min((r.start for r in records), default=0.0)
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "prefix_cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_p90_s": round(pct(ttfts, 0.90), 3) if ttfts else None,
        # with fewer than 100 requests this is the slowest request
        "ttft_p99_s": round(pct(ttfts, 0.99), 3) if ttfts else None,
        "ttft_mean_s": round(statistics.fmean(ttfts), 3) if ttfts else None,
        "ttft_max_after_opening_s": round(max(later), 3) if later else None,
        "output_tokens_per_s": round(output / duration, 2) if duration else 0.0,
        "duration_s": round(duration, 1),
        # each request in start order, to see what the tail is made of (cold prefixes? queueing?)
        "per_request": [
            {
                "session": r.session_id,
                "turn": r.round,
                "start_s": round(r.start - t0, 2),
                "ttft_s": round(r.ttft, 3) if r.ttft is not None else None,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
            }
            for r in sorted(records, key=lambda r: r.start)
        ],
    }


def run_policy(policy: str, args: argparse.Namespace, work: Path, run: int) -> dict[str, Any]:
    serve = Serve(policy, args, work, run)
    try:
        serve.wait_ready(args.startup_timeout)
        serve.warm_engines(args.model)
        key = serve.new_key()
        tokenizer = serve.warm_gateway(key)
        workload = make_workload(
            "multi-turn",
            seed=args.seed,
            block_size=BLOCK_WORDS,
            turns=str(args.turns),
            input_len=str(args.user_tokens),
            output_len=str(args.output_tokens),
            prefix_len=args.system_tokens,
            groups=args.groups,
        )
        cfg = LoadConfig(
            base_url=serve.url,
            model=MODEL,
            concurrency=args.concurrency,
            num_requests=args.sessions * args.turns,
            seed=args.seed,
            api_key=key,
            extra_body={"temperature": 0},
            block_size=BLOCK_WORDS,
            timeout_s=900,
        )
        result = asyncio.run(LoadDriver(cfg).run(workload))
        out = summarise(result.records, result.duration_s, opening=args.concurrency)
        out["picks"] = serve.picks()
        out["prompt_tokenizer"] = tokenizer
        return out
    finally:
        serve.stop()


def main(args: argparse.Namespace) -> dict[str, Any]:
    began = time.time()
    load_at_start = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in args.policies}
    with tempfile.TemporaryDirectory(prefix="cluster-ttft-") as tmp:
        for rnd in range(args.rounds):
            order = args.policies if rnd % 2 == 0 else list(reversed(args.policies))
            for policy in order:
                res = run_policy(policy, args, Path(tmp), rnd)
                runs[policy].append(res)
                print(
                    f"round {rnd} {policy}: "
                    f"{json.dumps({k: v for k, v in res.items() if k not in ('picks', 'per_request')})}",
                    file=sys.stderr,
                )

    def med(policy: str, key: str) -> float | None:
        vals = [r[key] for r in runs[policy] if r.get(key) is not None]
        return round(statistics.median(vals), 4) if vals else None

    keys = (
        "prefix_cache_hit_rate",
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "ttft_mean_s",
        "ttft_max_after_opening_s",
        "output_tokens_per_s",
    )
    summary = {p: {k: med(p, k) for k in keys} for p in args.policies}
    ratios: dict[str, Any] = {}
    rr, lo = summary.get("round_robin"), summary.get("least_outstanding")
    for name in (p for p in args.policies if p.startswith("prefix_aware")):
        pa = summary[name]
        if pa and rr and pa["ttft_p50_s"]:
            ratios[f"p50_ttft_round_robin_over_{name}"] = round(rr["ttft_p50_s"] / pa["ttft_p50_s"], 2)
        if pa and lo and pa["ttft_p50_s"]:
            ratios[f"p50_ttft_least_outstanding_over_{name}"] = round(lo["ttft_p50_s"] / pa["ttft_p50_s"], 2)
            ratios[f"p99_ttft_{name}_over_least_outstanding"] = round(pa["ttft_p99_s"] / lo["ttft_p99_s"], 2)
            if pa["ttft_max_after_opening_s"] and lo["ttft_max_after_opening_s"]:
                ratios[f"max_ttft_after_opening_{name}_over_least_outstanding"] = round(
                    pa["ttft_max_after_opening_s"] / lo["ttft_max_after_opening_s"], 2
                )
    return {
        "benchmark": "cluster_ttft",
        "date": datetime.fromtimestamp(began, UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_at_start": load_at_start,
            "loadavg_at_end": os.getloadavg(),
        },
        "command": " ".join(sys.argv),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "summary": summary,
        "ratios": ratios,
        "runs": runs,
        "wall_s": round(time.time() - began, 1),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--policies",
        nargs="+",
        default=["round_robin", "least_outstanding", "prefix_aware:approx", "prefix_aware:exact"],
        help="policy names; prefix_aware:exact / :approx choose how its prefix index is fed",
    )
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--kv-cache-memory", default="72MiB", help="per engine: room for half the system prompts, not all"
    )
    ap.add_argument("--max-inflight", type=int, default=8, help="ceiling of each replica's concurrency limit")
    ap.add_argument("--groups", type=int, default=4, help="distinct system prompts")
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="passes over the policies, alternating the order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args(argv)


if __name__ == "__main__":
    ns = parse()
    doc = main(ns)
    text = json.dumps(doc, indent=2)
    print(text)
    if ns.out is not None:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(text + "\n")
