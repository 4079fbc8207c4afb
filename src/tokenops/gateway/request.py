"""The first stage of the request path: from raw HTTP body bytes to a validated `InboundRequest`.

This module owns body parsing and validation (OpenAI wire types from `tokenops.protocol`), the
UPPER BOUND on prompt tokens computed without a tokenizer, the request fingerprint for the repeat
breaker, the prompt's block hashes for prefix-aware balancing (token blocks through the model's
`cluster.prompt_tokenizer` when it has one, text blocks otherwise), and the body the gateway
forwards upstream (the client's own JSON with the model name, `max_tokens` and `stream_options`
rewritten). It does not authenticate, admit or send anything.

Why bytes bound tokens: a byte-level BPE tokenizer never yields more tokens than the UTF-8 bytes
it encodes, so the text's byte count plus a per-message allowance for role markers, plus the chat
template's fixed overhead (a default system prompt, the generation prompt), can never be short.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import ValidationError

from tokenops.cluster.prefix_index import block_hashes_from_text, block_hashes_from_tokens
from tokenops.cluster.prompt_tokenizer import PromptTokenizer
from tokenops.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    context_length_exceeded,
    from_validation_error,
    invalid_request,
)
from tokenops.structured_output import output_spec

Kind = Literal["chat", "completion"]

# role marker, separators and end-of-turn tokens a chat template wraps around each message
PER_MESSAGE_TOKENS = 8
# typical English BPE: about four bytes per token; used only to estimate a prompt the backend never reported
BYTES_PER_TOKEN_ESTIMATE = 4
# no tokenizer's tokens average more than this many bytes over a prompt of text (long runs of one
# repeated character aside): the LOWER bound on prompt tokens that refuses a prompt over the window
MAX_BYTES_PER_TOKEN = 8
# prefix hashing for the cluster's prefix index: 64 characters stand for about 16 tokens
PREFIX_BLOCK_CHARS = 64
PREFIX_BLOCK_TOKENS = 16


@dataclass(slots=True)
class InboundRequest:
    """A validated client request, ready to authenticate and admit."""

    kind: Kind
    body: dict[str, Any]  # the client's JSON, forwarded upstream after `upstream_body` rewrites it
    model: str
    stream: bool
    client_wants_usage: bool  # stream_options.include_usage as the client sent it
    max_tokens: int | None  # requested completion tokens per choice (None: up to the context window)
    choices: int  # completions produced per request (n x number of prompts)
    prompt_bytes: int  # UTF-8 bytes of all prompt text (or token ids for token prompts)
    prompt_messages: int
    session_id: str | None
    fingerprint: str
    max_reasoning_tokens: int | None = None  # the client's thinking budget, if it gave one
    # the longest single prompt's token count, a LOWER bound (exact for token ids): refuses what cannot fit
    prompt_tokens_lower: int = 0
    prompt_is_ids: bool = False  # a text completion's prompt given as token ids
    # the validated body: prompt hashing renders its messages without validating them a second time
    parsed: ChatCompletionRequest | CompletionRequest | None = None

    def prompt_tokens_upper(self, template_overhead: int) -> int:
        """A bound the real prompt token count never exceeds."""
        return self.prompt_bytes + PER_MESSAGE_TOKENS * self.prompt_messages + template_overhead

    def prompt_tokens_estimate(self) -> int:
        """A realistic guess, for billing a prompt when the backend never reported its usage."""
        return -(-self.prompt_bytes // BYTES_PER_TOKEN_ESTIMATE) + PER_MESSAGE_TOKENS * self.prompt_messages

    def check_context(self, window: int) -> None:
        """Refuse, as the engine does, a request whose prompt plus max_tokens cannot fit the model's
        context window; with only a lower bound on the prompt, a request that may fit goes on (the
        backend decides it with the real count)."""
        prompt = self.prompt_tokens_lower
        if prompt + (self.max_tokens or 1) > window:
            param = (
                "max_tokens"
                if self.max_tokens is not None and self.max_tokens >= window
                else ("messages" if self.kind == "chat" else "prompt")
            )
            raise context_length_exceeded(
                prompt, self.max_tokens, window, at_least=not self.prompt_is_ids, param=param
            )

    def prompt_blocks(self, tokenizer: PromptTokenizer | None = None) -> tuple[tuple[int, ...], int]:
        """Chained hashes of the prompt's leading blocks, and the prompt tokens one block stands for,
        for prefix-aware balancing.

        With the model's tokenizer (loaded), the prompt is rendered and tokenised as the engine does
        and hashed in the engine's KV blocks, the hashes its KV events name (exact mode). Otherwise the
        rendered text is hashed in blocks of characters (a prompt given as token ids, by tokens):
        requests that share a system prompt still share their leading hashes."""
        if tokenizer is not None:
            if self.kind == "chat":
                ids = tokenizer.chat_ids(
                    self.parsed if isinstance(self.parsed, ChatCompletionRequest) else self.body
                )
            else:
                ids = tokenizer.prompt_ids(self.body.get("prompt"))
            if ids is not None:
                return tuple(block_hashes_from_tokens(ids, tokenizer.block_size)), tokenizer.block_size
        if self.kind == "chat":
            parts = []
            for m in self.body.get("messages") or ():
                content = m.get("content") if isinstance(m, dict) else None
                if not isinstance(content, str):
                    content = orjson.dumps(content).decode() if content is not None else ""
                parts.append(f"<{m.get('role') if isinstance(m, dict) else ''}>{content}\n")
            text = "".join(parts)
        else:
            prompt = self.body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return tuple(block_hashes_from_tokens(prompt, PREFIX_BLOCK_TOKENS)), PREFIX_BLOCK_TOKENS
            text = prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()
        return tuple(block_hashes_from_text(text, PREFIX_BLOCK_CHARS)), PREFIX_BLOCK_TOKENS

    def cap_reasoning(self, cap: int | None, field: str | None) -> int | None:
        """Put the thinking budget the backend gets into the forwarded body: the client's
        max_reasoning_tokens, lowered to the tenant tree's cap, or the cap when the client gave none;
        under the backend's own field name. Done before the cache lookup, so the budget is part of the
        cache key. Returns the budget sent (None: none, or a backend that takes no budget)."""
        if field is None:
            return None
        budget = self.max_reasoning_tokens
        if cap is not None:
            budget = cap if budget is None else min(budget, cap)
        if budget is None:
            return None
        self.body.pop("max_reasoning_tokens", None)
        self.body[field] = budget
        return budget

    def upstream_body(self, served_name: str, max_tokens: int | None, *, stream: bool = False) -> bytes:
        """The JSON sent to the backend: its model name, the capped max_tokens, usage always asked.
        `stream`: streamed from the backend even though the client wants a whole answer (the gateway
        assembles it, and so knows what was produced should the client leave before the end)."""
        body = dict(self.body)
        body["model"] = served_name
        body.pop("priority", None)  # the key's priority class decides, sent as x-priority (upstream.py)
        if max_tokens is not None:
            # keep the client's spelling: some providers accept only max_completion_tokens
            key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
            body.pop("max_tokens", None)
            body[key] = max_tokens
        if self.stream or stream:
            body["stream"] = True
            opts = dict(body.get("stream_options") or {})
            opts["include_usage"] = True
            body["stream_options"] = opts
        return orjson.dumps(body)


def _text_bytes(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    # structured parts (images, tool calls, tool schemas): their JSON is a generous bound of their text
    return len(orjson.dumps(value))


def _chat_prompt_bytes(req: ChatCompletionRequest) -> tuple[int, int]:
    total = 0
    for m in req.messages:
        total += _text_bytes(m.content) + _text_bytes(m.name) + _text_bytes(m.tool_calls)
        total += _text_bytes(m.tool_call_id)
    total += _text_bytes(req.tools) + _text_bytes(req.response_format)
    return total, len(req.messages)


def _completion_prompt_bytes(req: CompletionRequest) -> tuple[int, int, int]:
    """(bytes or token ids, number of prompt segments, number of prompts)."""
    p = req.prompt
    if isinstance(p, str):
        return _text_bytes(p) + _text_bytes(req.suffix), 1, 1
    if all(isinstance(x, int) for x in p):
        return len(p), 1, 1
    if all(isinstance(x, str) for x in p):
        return sum(_text_bytes(x) for x in p), len(p), len(p)
    return sum(len(x) for x in p), len(p), len(p)  # list of token-id lists


def _prompt_is_ids(req: CompletionRequest) -> bool:
    return isinstance(req.prompt, list) and not isinstance(req.prompt[0], str)


def _completion_prompt_lower(req: CompletionRequest) -> int:
    """The longest prompt's token count: exact for token ids, a lower bound for text."""
    p = req.prompt
    if isinstance(p, str):
        return max(1, (_text_bytes(p) + _text_bytes(req.suffix)) // MAX_BYTES_PER_TOKEN)
    if all(isinstance(x, int) for x in p):
        return len(p)
    if all(isinstance(x, str) for x in p):
        return max(1, max(_text_bytes(x) for x in p) // MAX_BYTES_PER_TOKEN)
    return max(len(x) for x in p)


def parse_request(kind: Kind, raw: bytes, session_header: str | None) -> InboundRequest:
    """Parse and validate a request body; every failure is a 400 OpenAI error naming the field."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid_request(
            f"The request body is not valid JSON ({exc.msg} at position {exc.pos}). Send a JSON object.",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_json")
    try:
        if kind == "chat":
            req: ChatCompletionRequest | CompletionRequest = ChatCompletionRequest.model_validate(body)
        else:
            req = CompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except (TypeError, ValueError) as exc:  # a validator raising outside pydantic's wrapping
        raise invalid_request(str(exc)) from None

    if isinstance(req, ChatCompletionRequest):
        # a tool_choice or schema no backend can serve is refused here, before any backend is asked
        output_spec(req.tools, req.tool_choice, req.response_format, req.parallel_tool_calls)
        prompt_bytes, segments = _chat_prompt_bytes(req)
        prompts = 1
        lower = max(1, prompt_bytes // MAX_BYTES_PER_TOKEN)  # a prompt is at least one token
    else:
        prompt_bytes, segments, prompts = _completion_prompt_bytes(req)
        lower = _completion_prompt_lower(req)
    session = session_header or req.user
    return InboundRequest(
        kind=kind,
        body=body,
        model=req.model,
        stream=req.stream,
        client_wants_usage=req.include_usage,
        max_tokens=req.max_tokens,
        choices=req.n * prompts,
        prompt_bytes=prompt_bytes,
        prompt_messages=segments,
        session_id=session[:256] if session else None,
        fingerprint=hashlib.blake2b(raw, digest_size=16).hexdigest(),
        max_reasoning_tokens=req.max_reasoning_tokens,
        prompt_tokens_lower=lower,
        prompt_is_ids=isinstance(req, CompletionRequest) and _prompt_is_ids(req),
        parsed=req,
    )


def body_too_large(size: int, limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is {size} bytes or more; this gateway accepts at most {limit} bytes. "
        "Shorten the prompt or split the request.",
        code="request_too_large",
    )
