"""A cached answer as the gateway serves it, and a streamed answer as the cache stores it.

This module owns `CachedResponse` (what `ResponseCache.lookup` returns on a hit: the stored completion,
rendered with a fresh id either as one JSON body or as the SSE chunks a `stream=true` client expects,
and the response headers that say it came from the cache), `completion_chunks` (a whole completion
as SSE chunks, also for the gateway's buffered cascade answers) and `assemble_stream`, which folds the
chunks the gateway relayed into the whole completion that `ResponseCache.store` keeps. It does not
look anything up or write any HTTP.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Literal

Layer = Literal["exact", "semantic"]

HEADER_STATUS = b"x-tokenops-cache"
HEADER_ID = b"x-tokenops-cache-id"
HEADER_SIMILARITY = b"x-tokenops-cache-similarity"
MISS_HEADERS: list[tuple[bytes, bytes]] = [(HEADER_STATUS, b"miss")]


@dataclass(frozen=True, slots=True)
class CachedResponse:
    """A hit: the stored completion and how it was found."""

    hit_id: str  # quote it to `ResponseCache.report_false_hit` if the answer was wrong
    layer: Layer
    similarity: float  # 1.0 for an exact hit
    body: dict[str, Any]  # the completion as it was first answered
    age_s: float
    matched_text: str | None  # the earlier prompt whose answer is served

    @property
    def usage(self) -> dict[str, Any] | None:
        """The usage of the original answer (a hit itself costs no engine tokens)."""
        return self.body.get("usage")

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [
            (HEADER_STATUS, f"hit-{self.layer}".encode()),
            (HEADER_ID, self.hit_id.encode()),
            (HEADER_SIMILARITY, f"{self.similarity:.4f}".encode()),
        ]

    def completion(self, response_id: str | None = None, created: int | None = None) -> dict[str, Any]:
        """The whole completion with a fresh id and creation time (JSON for a non-streamed client)."""
        body = copy.deepcopy(self.body)
        if response_id is not None:
            body["id"] = response_id
        body["created"] = int(time.time()) if created is None else created
        return body

    def chunks(self, include_usage: bool = False, response_id: str | None = None) -> list[dict[str, Any]]:
        """The completion as SSE chunk objects (each sent as `data: <json>`, then `data: [DONE]`)."""
        return completion_chunks(self.completion(response_id), include_usage)


def completion_chunks(body: dict[str, Any], include_usage: bool = False) -> list[dict[str, Any]]:
    """A whole completion as SSE chunk objects: per choice one chunk with all its content and one
    with its finish reason, then the usage chunk if asked (a buffered answer replayed to a
    streaming client: a cache hit, a cascade's accepted step)."""
    chat = body.get("object") == "chat.completion"
    base = {
        "id": body.get("id"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": body["created"],
        "model": body.get("model"),
    }
    if body.get("system_fingerprint") is not None:
        base["system_fingerprint"] = body["system_fingerprint"]
    out: list[dict[str, Any]] = []
    for choice in body.get("choices") or []:
        idx = choice.get("index", 0)
        if chat:
            msg = choice.get("message") or {}
            delta: dict[str, Any] = {"role": msg.get("role", "assistant")}
            for k in ("content", "reasoning_content", "refusal"):
                if msg.get(k) is not None:
                    delta[k] = msg[k]
            if msg.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(msg["tool_calls"])]
            first = {"index": idx, "delta": delta, "logprobs": choice.get("logprobs"), "finish_reason": None}
            last = {"index": idx, "delta": {}, "logprobs": None, "finish_reason": choice.get("finish_reason")}
        else:
            first = {
                "index": idx,
                "text": choice.get("text", ""),
                "logprobs": choice.get("logprobs"),
                "finish_reason": None,
            }
            last = {"index": idx, "text": "", "logprobs": None, "finish_reason": choice.get("finish_reason")}
        out.append({**base, "choices": [first]})
        out.append({**base, "choices": [last]})
    if include_usage and body.get("usage") is not None:
        out.append({**base, "choices": [], "usage": body["usage"]})
    return out


def assemble_stream(chunks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Fold streamed chunks (chat or text completion) into the whole completion; None if no choice came."""
    if not chunks:
        return None
    chat = any(c.get("object") == "chat.completion.chunk" for c in chunks)
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    head = chunks[0]
    for c in chunks:
        if c.get("usage"):
            usage = c["usage"]
        for ch in c.get("choices") or []:
            idx = ch.get("index", 0)
            acc = choices.setdefault(
                idx, {"index": idx, "parts": {}, "tools": {}, "finish_reason": None, "logprobs": None}
            )
            if ch.get("finish_reason"):
                acc["finish_reason"] = ch["finish_reason"]
            if ch.get("logprobs"):
                lp = ch["logprobs"]
                if acc["logprobs"] is None:
                    acc["logprobs"] = copy.deepcopy(lp)
                elif isinstance(lp, dict) and isinstance(acc["logprobs"], dict):
                    for key, val in lp.items():
                        if isinstance(val, list) and isinstance(acc["logprobs"].get(key), list):
                            acc["logprobs"][key].extend(val)
            if chat:
                delta = ch.get("delta") or {}
                if delta.get("role"):
                    acc["role"] = delta["role"]
                for k in ("content", "reasoning_content", "refusal"):
                    if delta.get(k):
                        acc["parts"][k] = acc["parts"].get(k, "") + delta[k]
                for tc in delta.get("tool_calls") or []:
                    t = acc["tools"].setdefault(
                        tc.get("index", 0),
                        {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                    )
                    if tc.get("id"):
                        t["id"] = tc["id"]
                    if tc.get("type"):
                        t["type"] = tc["type"]
                    fn = tc.get("function") or {}
                    t["function"]["name"] += fn.get("name") or ""
                    t["function"]["arguments"] += fn.get("arguments") or ""
            else:
                acc["parts"]["text"] = acc["parts"].get("text", "") + (ch.get("text") or "")
    if not choices:
        return None
    out_choices = []
    for idx in sorted(choices):
        acc = choices[idx]
        if chat:
            msg: dict[str, Any] = {
                "role": acc.get("role", "assistant"),
                "content": acc["parts"].get("content"),
            }
            for k in ("reasoning_content", "refusal"):
                if k in acc["parts"]:
                    msg[k] = acc["parts"][k]
            if acc["tools"]:
                msg["tool_calls"] = [acc["tools"][i] for i in sorted(acc["tools"])]
            out_choices.append(
                {
                    "index": idx,
                    "message": msg,
                    "logprobs": acc["logprobs"],
                    "finish_reason": acc["finish_reason"],
                }
            )
        else:
            out_choices.append(
                {
                    "index": idx,
                    "text": acc["parts"].get("text", ""),
                    "logprobs": acc["logprobs"],
                    "finish_reason": acc["finish_reason"],
                }
            )
    body: dict[str, Any] = {
        "id": head.get("id"),
        "object": "chat.completion" if chat else "text_completion",
        "created": head.get("created"),
        "model": head.get("model"),
        "choices": out_choices,
    }
    for key in ("system_fingerprint", "service_tier"):
        if head.get(key) is not None:
            body[key] = head[key]
    if usage is not None:
        body["usage"] = usage
    return body
