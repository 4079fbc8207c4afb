"""CPU cost of hashing a request's prompt for prefix-aware balancing, per request, in the gateway process.

Two ways the gateway hashes a chat request (`InboundRequest.prompt_blocks`): text blocks of 64
characters (no tokenizer), and the engine's token blocks through `cluster.PromptTokenizer` (validate the
body, render the chat template, tokenise, hash 16-token blocks), with that path also timed stage by stage
(tokenising the whole text, and only the pieces not yet in `SegmentEncoder`'s cache, which is what the
gateway does). The chat is a system prompt and a few turns, about `--tokens` tokens for the bundled
SmolLM2 tokenizer; each call asks a different last question, so its last turn is always new text.
Each figure is the median over `--repeats` runs of the mean over `--n` calls, in microseconds of one
core. Prints JSON.

    PYTHONPATH=src .venv/bin/python benchmarks/cluster_prompt_hashing.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import orjson

from tokenops.cluster.prefix_index import block_hashes_from_tokens
from tokenops.cluster.prompt_tokenizer import PromptTokenizer
from tokenops.gateway.request import parse_request
from tokenops.modelfiles.tokenizer import template_messages
from tokenops.protocol import ChatCompletionRequest


def make_chat(tokenizer: PromptTokenizer, target: int) -> dict[str, Any]:
    """A system prompt grown until the whole chat is about `target` tokens."""
    sentence = (
        "Answer billing questions briefly, cite the relevant clause of the customer agreement, "
        "and stay polite. "
    )
    turns = [
        {"role": "user", "content": "My invoice for March shows two charges for the same seat. Why?"},
        {"role": "assistant", "content": "The second charge is a pro-rated upgrade made on March 14."},
        {"role": "user", "content": "Can I get a refund for the upgrade if I downgrade today?"},
    ]
    n = 1
    while True:
        body = {"model": "m", "messages": [{"role": "system", "content": sentence * n}, *turns]}
        if len(tokenizer.chat_ids(body) or ()) >= target:
            return body
        n += 1


def per_call_us(fn: Callable[[int], object], n: int, repeats: int) -> float:
    """Median over `repeats` of the mean time of fn(0..n-1), in microseconds."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for i in range(n):
            fn(i)
        runs.append((time.perf_counter_ns() - t0) / n / 1000)
    return round(statistics.median(runs), 1)


def main(args: argparse.Namespace) -> dict[str, Any]:
    load_start = os.getloadavg()
    tok = PromptTokenizer(args.model)
    t0 = time.perf_counter()
    if not tok.wait(600):
        raise SystemExit(f"tokenizer not loaded: {tok.error}")
    load_s = time.perf_counter() - t0
    body = make_chat(tok, args.tokens)
    n, r = args.n, args.repeats

    # every request is a new question after the same conversation: its last turn is always new text
    def variant(i: int) -> dict[str, Any]:
        last = body["messages"][-1]
        return {
            **body,
            "messages": [*body["messages"][:-1], {**last, "content": f"{last['content']} (case {i})"}],
        }

    bodies = [variant(i) for i in range(n)]
    inbounds = [parse_request("chat", orjson.dumps(b), None) for b in bodies]
    inner, segments = tok._tokenizer, tok._segments
    assert inner is not None and segments is not None
    reqs = [ChatCompletionRequest.model_validate(b) for b in bodies]
    texts = [
        inner.apply_chat_template(template_messages(q.messages), add_generation_prompt=True) for q in reqs
    ]
    ids = [segments.encode(t) for t in texts]
    assert all(x == inner.encode(t, add_special_tokens=False) for x, t in zip(ids, texts, strict=True))
    figures = {
        "text_blocks_us": per_call_us(lambda i: inbounds[i].prompt_blocks(None), n, r),
        "token_blocks_us": per_call_us(lambda i: inbounds[i].prompt_blocks(tok), n, r),
        "stages_us": {
            "validate": per_call_us(lambda i: ChatCompletionRequest.model_validate(bodies[i]), n, r),
            "render_template": per_call_us(
                lambda i: inner.apply_chat_template(
                    template_messages(reqs[i].messages), add_generation_prompt=True
                ),
                n,
                r,
            ),
            "tokenise_whole_text": per_call_us(
                lambda i: inner.encode(texts[i], add_special_tokens=False), n, r
            ),
            "tokenise_new_pieces_only": per_call_us(lambda i: segments.encode(texts[i]), n, r),
            "hash_blocks": per_call_us(lambda i: block_hashes_from_tokens(ids[i], 16), n, r),
        },
        "parse_request_us": per_call_us(lambda i: parse_request("chat", orjson.dumps(bodies[i]), None), n, r),
    }
    return {
        "benchmark": "cluster_prompt_hashing",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_at_start": load_start,
                    "loadavg_at_end": os.getloadavg()},
        "command": " ".join(sys.argv),
        "model": args.model,
        "prompt_tokens": len(ids[0]),
        "prompt_chars": len(texts[0]),
        "tokenizer_load_s": round(load_s, 2),
        **figures,
    }  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="smollm2-135m-instruct", help="a bundled name, HF folder or .gguf file"
    )
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    print(json.dumps(main(ap.parse_args()), indent=2))
