"""One HTTP request's generation in the engine server: its choices (one per prompt x n), the mapping
of engine outputs onto them, and their OpenAI rendering.

`Generation.consume` applies one engine output to its choice: incremental detokenisation, stop strings
(also inside a multi-token speculative step, where the tokens after a stop are neither text nor billed),
the reasoning / content split for models with thinking markers, finish reasons and metrics. The rest
renders usage (with cached and reasoning tokens), logprobs, whole responses and SSE chunks. It does not
parse requests or speak HTTP (server.py does).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from tokenops.engine.config import RequestRejected
from tokenops.engine.detokenizer import OutputText
from tokenops.engine.reasoning import ReasoningParser
from tokenops.engine.tool_output import ToolOutput
from tokenops.protocol import APIError, SamplingFields, make_usage, new_id, now

if TYPE_CHECKING:
    from tokenops.engine.server import EngineServer


@dataclass
class Choice:
    index: int
    request_id: str
    prompt_ids: list[int]
    text: OutputText
    stop_ids: frozenset[int]
    counts_prompt: bool  # the first choice of its prompt carries the prompt in usage and metrics
    echo: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)  # TokenLogprob per generated token
    finish_reason: str | None = None
    num_cached: int = 0
    num_transferred: int = 0  # of the cached prompt tokens, those a peer engine sent (KV transfer)
    kv_hold: Any = None  # a prefill leg's held prompt blocks (kv_transfer.Hold)
    first_token_at: float | None = None
    reasoning: ReasoningParser | None = None  # counts reasoning tokens (the model has markers)
    reasoning_text: OutputText | None = None  # chat only: the reasoning_content split from the content
    reasoning_budget: int | None = None
    tools: ToolOutput | None = None  # chat with tools: the answer may hold tool calls

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Delta:
    choice: Choice
    text: str
    logprobs: list[Any]
    finished: bool
    reasoning: str = ""


class Generation:
    """The choices of one HTTP request and the mapping of engine outputs onto them."""

    def __init__(
        self,
        server: EngineServer,
        kind: str,
        req: SamplingFields,
        choices: list[Choice],
        logprobs_k: int | None,
    ) -> None:
        self.server = server
        self.kind = kind  # "chat" | "completion"
        self.req = req
        self.choices = choices
        self.by_request = {c.request_id: c for c in choices}
        self.logprobs_k = logprobs_k
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = now()
        self.arrival = time.perf_counter()
        self.sink: asyncio.Queue = asyncio.Queue()
        # top-level response fields of a PD leg: `kv_transfer_params` (prefill leg) and `kv_transfer`
        # (what was pulled: blocks, bytes, seconds, or why it fell back to local prefill)
        self.kv_fields: dict[str, Any] = {}

    @property
    def finished(self) -> bool:
        return all(c.done for c in self.choices)

    def abort_unfinished(self) -> None:
        at = time.perf_counter()
        for c in self.choices:
            if not c.done:
                c.finish_reason = "abort"
                self.server.engine.abort(c.request_id)
                self._record(c, at)

    def consume(self, item: Any) -> Delta | None:
        """Apply one engine output (or error) to its choice; return the text it releases."""
        if isinstance(item, RequestRejected):
            raise APIError(400, item.message, code=item.code, param=item.param)
        if isinstance(item, BaseException):
            raise APIError(500, str(item), type="server_error", code="engine_error")
        choice = self.by_request.get(item.request_id)
        if choice is None or choice.done:
            return None  # tokens that raced with a stop-string abort
        ids = list(item.new_token_ids)
        now_t = time.perf_counter()
        if ids and choice.first_token_at is None:
            choice.first_token_at = now_t
        choice.num_cached = max(choice.num_cached, item.num_cached_tokens or 0)
        choice.num_transferred = max(choice.num_transferred, getattr(item, "num_transferred_tokens", 0))
        if getattr(item, "kv_hold", None) is not None:
            choice.kv_hold = item.kv_hold
        if self.logprobs_k is not None and item.logprobs:
            new_logprobs = list(item.logprobs)
            choice.logprobs.extend(new_logprobs)
        else:
            new_logprobs = []
        text_ids = ids
        if item.finished and item.finish_reason == "stop" and ids and ids[-1] in choice.stop_ids:
            text_ids = ids[:-1]  # the stop token itself is not part of the text
        reasoning, text = "", ""
        # a speculative step emits several tokens: a stop string may end before the last one, and the
        # tokens after it are neither text nor billed output, as in plain decoding; so several tokens
        # go through the reasoning split and the stop check one at a time
        parts = [text_ids] if len(text_ids) <= 1 else [[token] for token in text_ids]
        for n, part in enumerate(parts):
            if choice.reasoning is not None:
                reasoning_ids, content_ids = choice.reasoning.split(part)
                if choice.reasoning_text is not None:
                    reasoning += choice.reasoning_text.add(reasoning_ids)
                    if choice.reasoning.closed:  # the section ended: its last characters are final
                        reasoning += choice.reasoning_text.finish()
                    part = content_ids
            text += choice.text.add(part)
            if choice.text.stopped:
                if len(parts) > 1:
                    ids = ids[: n + 1]
                break
        choice.token_ids.extend(ids)
        self.server.metrics.generation_tokens.inc(len(ids))
        if choice.text.stopped:
            choice.finish_reason = "stop"
            if not item.finished:
                self.server.engine.abort(choice.request_id)
        elif item.finished:
            if choice.reasoning is not None:  # tokens held as a possible marker belong to their part
                reasoning_ids, content_ids = choice.reasoning.flush()
                if choice.reasoning_text is not None:
                    reasoning += choice.reasoning_text.add(reasoning_ids) + choice.reasoning_text.finish()
                    text += choice.text.add(content_ids)
            text += choice.text.finish()
            choice.finish_reason = "length" if item.finish_reason == "length" else "stop"
        if (
            choice.finish_reason == "stop"
            and choice.tools is not None
            and choice.tools.result(choice.text.text)[1]
        ):
            choice.finish_reason = "tool_calls"
        if choice.done:
            self._record(choice, now_t)
        return Delta(choice, text, new_logprobs, choice.done, reasoning)

    def _record(self, choice: Choice, at: float) -> None:
        ttft = choice.first_token_at - self.arrival if choice.first_token_at is not None else None
        self.server.metrics.request_finished(
            choice.finish_reason or "abort",
            prompt_tokens=len(choice.prompt_ids) if choice.counts_prompt else 0,
            cached_tokens=choice.num_cached if choice.counts_prompt else 0,
            ttft=ttft,
            e2e=at - self.arrival,
            output_tokens=len(choice.token_ids),
        )
        if choice.reasoning is not None:
            self.server.metrics.reasoning_finished(
                choice.reasoning.reasoning_tokens,
                # the budget closed the section (a model that closes it itself stays under the budget)
                closed_by_budget=choice.reasoning.closed
                and choice.reasoning.reasoning_tokens == choice.reasoning_budget,
            )

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(c.prompt_ids) for c in self.choices if c.counts_prompt)
        cached = sum(c.num_cached for c in self.choices if c.counts_prompt)
        completion = sum(len(c.token_ids) for c in self.choices)
        reasoning = sum(c.reasoning.reasoning_tokens for c in self.choices if c.reasoning is not None)
        transferred = sum(c.num_transferred for c in self.choices if c.counts_prompt)
        usage = make_usage(prompt, completion, cached, reasoning).model_dump()
        # where the prompt's KV came from: this engine's prefix cache, a peer engine, or computed here
        usage["prompt_token_sources"] = {
            "local_cache": cached - transferred,
            "transferred": transferred,
            "computed": prompt - cached,
        }
        return usage

    # -- rendering ----------------------------------------------------------------------------

    def logprobs_json(
        self, choice: Choice, entries: list[Any], text_offset: int = 0
    ) -> dict[str, Any] | None:
        if self.logprobs_k is None:
            return None
        piece = self.server.token_text
        if self.kind == "chat":
            content = []
            for e in entries:
                tok = piece(e.token_id)
                content.append(
                    {
                        "token": tok,
                        "logprob": finite_logprob(e.logprob),
                        "bytes": list(tok.encode()),
                        "top_logprobs": [
                            {
                                "token": (t := piece(tid)),
                                "logprob": finite_logprob(lp),
                                "bytes": list(t.encode()),
                            }
                            for tid, lp in e.top[: self.logprobs_k]
                        ],
                    }
                )
            return {"content": content}
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = text_offset
        for e in entries:
            tok = piece(e.token_id)
            tokens.append(tok)
            token_logprobs.append(finite_logprob(e.logprob))
            top.append({piece(tid): finite_logprob(lp) for tid, lp in e.top[: self.logprobs_k]})
            offsets.append(offset)
            offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def response(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            text = c.echo + c.text.text
            lp = self.logprobs_json(c, c.logprobs, len(c.echo))
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if c.tools is not None:
                    content, calls = c.tools.result(text)
                    message["content"] = content
                    if calls:
                        message["tool_calls"] = [call.to_json() for call in calls]
                if c.reasoning_text is not None:
                    message["reasoning_content"] = c.reasoning_text.text or None
                choices.append(
                    {
                        "index": c.index,
                        "message": message,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                choices.append(
                    {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
                )
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
            "usage": self.usage(),
            **self.kv_fields,
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
        }
        if self.req.include_usage:
            body["usage"] = usage
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def delta_chunk(self, d: Delta, text_offsets: dict[int, int]) -> bytes | None:
        if not d.text and not d.reasoning and not d.logprobs and not d.finished:
            return None
        c = d.choice
        lp = None
        if d.logprobs:
            lp = self.logprobs_json(c, d.logprobs, text_offsets.get(c.index, 0))
        text_offsets[c.index] = text_offsets.get(c.index, 0) + len(d.text)
        reason = c.finish_reason if d.finished else None
        if self.kind == "chat":
            delta = {"reasoning_content": d.reasoning} if d.reasoning else {}
            if c.tools is not None:
                delta.update(c.tools.delta(d.text, d.finished))
            elif d.text:
                delta["content"] = d.text
            if not delta and not lp and not d.finished:
                return None
            choice = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            choice = {"index": c.index, "text": d.text, "logprobs": lp, "finish_reason": reason}
        return self.chunk([choice])


def finite_logprob(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number
    return x if x > -9999.0 else -9999.0
