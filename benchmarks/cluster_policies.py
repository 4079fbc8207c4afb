"""Compare balancing policies on real engine replicas: a multi-turn workload with shared system
prompts, run once per policy through the cluster's dispatch API, reporting prefix-cache hit rate
(cached prompt tokens / prompt tokens, as the engines report them), p50/p99 time to first token and
output tokens/s.

A measuring script, not a test and not a library module: `.venv/bin/python benchmarks/cluster_policies.py
--replicas 2` starts local `tokenops engine` processes (or `--url` points at running ones). Each
policy gets its own random salt in the system prompts, so no policy profits from the cache another
one warmed. It measures the cluster layer alone (no gateway, no metering).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass

from tokenops.bench.ports import free_port
from tokenops.cluster.dispatch import Cluster, DispatchRequest, RetryConfig
from tokenops.cluster.policies import make_policy
from tokenops.cluster.pool import ReplicaPool, ReplicaSpec
from tokenops.cluster.prefix_index import block_hashes_from_text
from tokenops.cluster.snapshot import RequestInfo
from tokenops.cluster.supervisor import Supervisor, engine_specs

WORDS = "policy account refund invoice shipping warranty customer order billing support escalate".split()


@dataclass
class Sample:
    ttft: float
    total: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


def system_prompt(rng: random.Random, salt: str, words: int) -> str:
    return f"[{salt}] You are the assistant of team {rng.randrange(10**6)}. " + " ".join(
        rng.choice(WORDS) for _ in range(words)
    )


async def run_policy(
    urls: list[str], model: str, policy: str, args: argparse.Namespace, seed: int
) -> tuple[list[Sample], float]:
    rng = random.Random(seed)
    salt = f"{policy}-{seed}"
    systems = [system_prompt(rng, salt, args.system_words) for _ in range(args.systems)]
    specs = [ReplicaSpec(url=u, id=f"r{i}", kind="tokenops") for i, u in enumerate(urls)]
    pool = ReplicaPool(model, specs, make_policy(policy))
    cluster = Cluster({model: pool}, retry=RetryConfig(first_byte_timeout=600))
    await cluster.start()
    samples: list[Sample] = []
    sem = asyncio.Semaphore(args.concurrency)

    async def conversation(c: int) -> None:
        messages = [{"role": "system", "content": systems[c % len(systems)]}]
        for turn in range(args.turns):
            messages.append(
                {"role": "user", "content": f"Question {turn} of customer {c}: {rng.choice(WORDS)}?"}
            )
            text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
            info = RequestInfo(
                model=model,
                session_id=f"conv-{c}",
                block_hashes=tuple(block_hashes_from_text(text)),
                prompt_tokens=len(text) // 4,
                max_tokens=args.max_tokens,
            )
            body = {
                "messages": messages,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with sem:
                start = time.perf_counter()
                ttft = None
                usage: dict = {}
                reply = []
                async with cluster.open(DispatchRequest(info, "/v1/chat/completions", body)) as up:
                    buf = b""
                    async for chunk in up.aiter_bytes():
                        buf += chunk
                        while b"\n\n" in buf:
                            event, buf = buf.split(b"\n\n", 1)
                            if not event.startswith(b"data: {"):
                                continue
                            data = json.loads(event[6:])
                            if data.get("usage"):
                                usage = data["usage"]
                            for choice in data.get("choices", []):
                                content = choice.get("delta", {}).get("content")
                                if content:
                                    ttft = ttft or time.perf_counter() - start
                                    reply.append(content)
                total = time.perf_counter() - start
            details = usage.get("prompt_tokens_details") or {}
            samples.append(
                Sample(
                    ttft or total,
                    total,
                    usage.get("prompt_tokens", 0),
                    details.get("cached_tokens", 0),
                    usage.get("completion_tokens", 0),
                )
            )
            messages.append({"role": "assistant", "content": "".join(reply)})

    began = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
    wall = time.perf_counter() - began
    await cluster.aclose()
    return samples, wall


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def main(args: argparse.Namespace) -> None:
    sup = None
    urls = list(args.url)
    if not urls:
        ports = [free_port() for _ in range(args.replicas)]
        engine_args = [
            "--model",
            args.model,
            "--kv-cache-memory",
            args.kv_cache_memory,
            "--log-level",
            "warning",
        ]
        sup = Supervisor(engine_specs(ports, engine_args))
        await sup.start()
        await sup.wait_ready("/v1/load", timeout=600)
        urls = [s.url for s in sup.specs.values()]
    try:
        print(
            f"{len(urls)} replicas, {args.conversations} conversations x {args.turns} turns, "
            f"{args.systems} system prompts of ~{args.system_words} words, concurrency {args.concurrency}, "
            f"max_tokens {args.max_tokens}"
        )
        print(f"{'policy':<20}{'hit rate':>10}{'p50 TTFT':>11}{'p99 TTFT':>11}{'out tok/s':>11}{'wall s':>9}")
        for i, policy in enumerate(args.policies):
            samples, wall = await run_policy(
                urls, args.served_model or args.model, policy, args, args.seed + i
            )
            prompt = sum(s.prompt_tokens for s in samples)
            hit = sum(s.cached_tokens for s in samples) / prompt if prompt else 0.0
            ttfts = [s.ttft for s in samples]
            out = sum(s.output_tokens for s in samples) / wall
            print(
                f"{policy:<20}{hit:>10.1%}{statistics.median(ttfts):>10.2f}s{pct(ttfts, 0.99):>10.2f}s"
                f"{out:>11.1f}{wall:>9.1f}"
            )
    finally:
        if sup is not None:
            await sup.stop()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", action="append", default=[], help="a running engine's base URL (repeatable)")
    ap.add_argument("--replicas", type=int, default=2, help="local engines to start when no --url is given")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--served-model", default=None, help="the name the engines serve (default: --model)")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--policies", nargs="+", default=["round_robin", "least_outstanding", "prefix_aware"])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
