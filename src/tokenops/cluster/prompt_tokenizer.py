"""The gateway's prompt tokeniser: a request's prompt as the token ids our engine will compute, so that
prefix-aware balancing hashes the same token blocks the engine caches (and reports in its KV events).

It owns where a model's tokenizer comes from (the model spec of the local `tokenops engine` replicas,
or the model's `tokenizer:` key: a bundled name, a HF folder or a .gguf file), loading it once per
model in a background thread (a GGUF tokenizer is read from the shared tokenizer cache, about a second
for Gemma's 262k tokens, or rebuilt from the file's metadata and cached the first time; either way only
the file's header is read, never its tensor data), and turning a chat or text
completion body into prompt token ids exactly as the engine server does: the same message dicts
(`modelfiles.tokenizer.template_messages`), the same chat-template renderer (`Tokenizer.apply_chat_template`,
with the generation prompt, tools and `chat_template_kwargs`), no added special tokens for a rendered
chat prompt (the template writes BOS if the model wants it) and the tokenizer's own for a text prompt.
The spec is resolved by `modelfiles.files.resolve_model`, as the engine's loader does, so the gateway
reads the file the engine serves. It never imports torch or reads weights. Until the tokenizer is loaded,
or when a prompt cannot be rendered, it answers None and the caller hashes text blocks instead
(`prefix_index.block_hashes_from_text`).
It does not route and does not hash: `prefix_index` does.

Not reproduced: an engine started with reasoning markers renders a request whose thinking budget is 0
with `enable_thinking=False`; the gateway renders without it (only the generation prompt, the
prompt's last block, can differ).
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal

from tokenops.modelfiles.tokenizer import Tokenizer, template_messages
from tokenops.modelfiles.tool_prompt import prompt_messages
from tokenops.protocol import ChatCompletionRequest

log = logging.getLogger(__name__)

State = Literal["idle", "loading", "ready", "failed"]


def load_tokenizer(source: str, cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer of a bundled model name, a HF folder (tokenizer.json) or a .gguf file; of a GGUF
    file only the header is read (the bundled file's sha256 is the engine's to check)."""
    from tokenops.modelfiles.files import ModelNotFoundError, gguf_tokenizer, resolve_model

    try:
        model = resolve_model(source, cache_dir, verify=False)
    except ModelNotFoundError as exc:
        raise FileNotFoundError(f"tokenizer {source!r}: {exc}") from None
    if model.kind == "gguf":
        return gguf_tokenizer(model.path, cache_dir)
    return Tokenizer.from_hf_folder(model.path)


class SegmentEncoder:
    """`encode(text, add_special_tokens=False)` with the pieces between added tokens cached.

    A tokenizer extracts its added tokens (`<|im_start|>`, ...) before normalising and pre-tokenising,
    and encodes each piece between them on its own, so the ids of a rendered chat are the ids of its
    pieces joined. Conversations resend the same system prompt and earlier turns, so after the first
    request most pieces come from the cache and only the new turn is tokenised (tokenising ~600 tokens
    costs about a millisecond of the event loop). Used only when every added token matches literally (no
    lstrip / rstrip / single_word / normalised matching) and pieces encode alone as they do in context
    (checked on probes at start); otherwise every call encodes the whole text.
    """

    def __init__(self, tokenizer: Tokenizer, max_tokens: int = 1_000_000) -> None:
        self.backend = tokenizer.backend
        # memory bound: token ids held (a cached id costs ~40 bytes with its share of the text)
        self.max_tokens = max_tokens
        self.tokens = 0
        added = self.backend.get_added_tokens_decoder()
        literal = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values())
        self._added = {t.content: i for i, t in added.items()}
        # longest first: at one position the longest added token wins, as in the tokenizer's own matcher
        alternatives = "|".join(re.escape(c) for c in sorted(self._added, key=len, reverse=True))
        self._split = re.compile(f"({alternatives})") if literal and alternatives else None
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        if self._split is not None and not self._pieces_agree():
            self._split = None

    def _pieces_agree(self) -> bool:
        """Whether joined piece encodings equal whole-text encodings on probes. They do not for a
        Metaspace pre-tokenizer with `prepend_scheme="first"` (Llama 2, Mistral, TinyLlama): a piece
        encoded alone starts a text and gets a leading "▁" that the same piece after an added token
        does not."""
        token = next(iter(self._added))
        probes = (f"{token}user\nhi there{token}\n x", f"a {token} b{token}{token}c", f"{token}")
        for text in probes:
            whole = self.backend.encode(text, add_special_tokens=False).ids
            joined: list[int] = []
            for i, piece in enumerate(self._split.split(text)):
                if i % 2:
                    joined.append(self._added[piece])
                elif piece:
                    joined.extend(self.backend.encode(piece, add_special_tokens=False).ids)
            if joined != whole:
                return False
        return True

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self.backend.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # an added token (the split keeps them at odd positions)
                ids.append(self._added[piece])
            elif piece:
                ids.extend(self._piece(piece))
        return ids

    def _piece(self, piece: str) -> list[int]:
        cached = self._cache.get(piece)
        if cached is not None:
            self._cache.move_to_end(piece)
            return cached
        ids = self.backend.encode(piece, add_special_tokens=False).ids
        if len(ids) <= self.max_tokens // 8:  # a huge one-off piece would flush everything else
            self._cache[piece] = ids
            self.tokens += len(ids)
            while self.tokens > self.max_tokens:
                self.tokens -= len(self._cache.popitem(last=False)[1])
        return ids


class PromptTokenizer:
    """One model's prompt tokeniser: loaded once, in the background, on first use.

    `chat_ids(body)` / `prompt_ids(prompt)` return the engine's prompt token ids, or None while the
    tokenizer is loading, when it failed to load, or when this prompt cannot be rendered (the
    engine will then refuse or render it its own way; the caller falls back to text hashing).
    `block_size` is the engine's KV block size, the unit of the hashes the gateway computes.
    """

    def __init__(self, source: str, block_size: int = 16, cache_dir: Path | None = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.source = source
        self.block_size = block_size
        self.cache_dir = cache_dir
        self.state: State = "idle"
        self.error: str | None = None
        self._tokenizer: Tokenizer | None = None
        self._segments: SegmentEncoder | None = None
        self._lock = threading.Lock()
        self._loaded = threading.Event()

    def start_loading(self) -> None:
        """Begin loading in a daemon thread (once); requests meanwhile hash text."""
        with self._lock:
            if self.state != "idle":
                return
            self.state = "loading"
        threading.Thread(target=self._load, name=f"tokenizer {self.source}", daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        """Load if needed and wait until it has finished (tests, benchmarks); True when ready."""
        self.start_loading()
        self._loaded.wait(timeout)
        return self.state == "ready"

    def _load(self) -> None:
        try:
            tok = load_tokenizer(self.source, self.cache_dir)
        except Exception as exc:  # noqa: BLE001 - any failure means: hash text, and say why once
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = "failed"
            log.warning(
                "prompt tokenizer %s not loaded (%s); prefix hashing falls back to text",
                self.source,
                self.error,
            )
        else:
            self._segments = SegmentEncoder(tok)
            self._tokenizer = tok
            self.state = "ready"
        finally:
            self._loaded.set()

    def _ready(self) -> Tokenizer | None:
        tok = self._tokenizer  # read first: the request that starts the load never waits for it
        if tok is None and self.state == "idle":
            self.start_loading()
        return tok

    def chat_ids(self, body: ChatCompletionRequest | dict[str, Any]) -> list[int] | None:
        """The prompt ids our engine computes for this chat completion (validated, or its JSON body)."""
        tok = self._ready()
        if tok is None or not tok.has_chat_template:
            return None
        try:
            req = (
                body
                if isinstance(body, ChatCompletionRequest)
                else ChatCompletionRequest.model_validate(body)
            )
            variables = dict(req.chat_template_kwargs or {})
            for reserved in ("messages", "add_generation_prompt", "tools"):  # the engine refuses these
                if reserved in variables:
                    return None
            messages = prompt_messages(tok.chat_template, template_messages(req.messages), req.tools)
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=req.tools, **variables)
        except Exception:  # noqa: BLE001 - invalid messages, a template's raise_exception...: the engine will say
            return None
        assert self._segments is not None  # set before the tokenizer
        return self._segments.encode(text)

    def prompt_ids(self, prompt: Any) -> list[int] | None:
        """The prompt ids for a text completion's `prompt` (its first prompt when it holds several)."""
        if isinstance(prompt, list) and prompt:
            if isinstance(prompt[0], int):
                return prompt
            prompt = prompt[0]
            if isinstance(prompt, list):
                return prompt if all(isinstance(t, int) for t in prompt) else None
        if not isinstance(prompt, str):
            return None
        tok = self._ready()
        return tok.encode(prompt, add_special_tokens=True) if tok is not None else None
