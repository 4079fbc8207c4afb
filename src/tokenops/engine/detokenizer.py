"""Incremental detokenisation and stop strings for one generated sequence: token ids, a few at a time,
become text deltas that are safe to send, so that a streamed response's deltas concatenate exactly
to the text of the same request answered in one piece. It never emits half of a multi-byte UTF-8
character, and it applies stop strings, which may span token boundaries, are never emitted, and
hold back text that could still start one. The method is vLLM's offset scheme over
`Tokenizer.decode`: decode a short window that starts a few tokens before the unread ones and emit
what it adds beyond its already-read part once that no longer ends in U+FFFD. It does not choose
tokens or stop on token ids (the engine does) and knows nothing of HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Tokens of prompt context decoded in front of the first generated token: enough for decoders that
# strip or merge a leading space (SentencePiece's metaspace) to render the first token as it reads
# in the running text.
PROMPT_CONTEXT_TOKENS = 5

# A UTF-8 character has at most 4 bytes, so a window still incomplete after this many unread
# tokens will never complete (the model produced invalid bytes): emit it with its U+FFFD marks.
MAX_PENDING_TOKENS = 8

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """The part of `tokenops.modelfiles.tokenizer.Tokenizer` that detokenisation needs."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Token ids in, text deltas out, for one sequence; never splits a UTF-8 character."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # only the tail of the prompt matters, as decoding context for the first tokens
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = len(self._ids)  # tokens before this one have been emitted as text

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated tokens; return the text they complete (possibly empty)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._advance(force=False)

    def flush(self) -> str:
        """The sequence ended: return whatever text is still pending, incomplete characters included."""
        return self._advance(force=True)

    def _decode(self, end: int) -> str:
        return self._tokenizer.decode(
            self._ids[self._prefix_offset : end], skip_special_tokens=self._skip_special
        )

    def _advance(self, *, force: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._read_offset)

        def complete(text: str) -> bool:
            # something printable, and not ending inside a character whose bytes are still to come
            return len(text) > len(prefix_text) and not text.endswith(REPLACEMENT_CHAR)

        end = len(self._ids)
        new_text = self._decode(end)
        if not force and not complete(new_text):
            # A token may finish one character and start the next (several tokens per step, or a
            # BPE merge across a character boundary): emit up to the last complete boundary.
            for k in range(end - 1, self._read_offset, -1):
                text = self._decode(k)
                if complete(text):
                    end, new_text = k, text
                    break
            else:
                if end - self._read_offset <= MAX_PENDING_TOKENS:
                    return ""
                # bytes that never formed a character: emit them as U+FFFD rather than stall
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = end
        # keep the id list short: only the window is ever decoded again
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta


class StopStringMatcher:
    """Finds stop strings in a growing text and says how much of it is safe to emit."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._max_len = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, new_from: int) -> int:
        """Position of the earliest stop string in `text` that ends at or after `new_from`, or -1."""
        if not self.stops:
            return -1
        start = max(0, new_from - self._max_len + 1)
        hits = [p for p in (text.find(s, start) for s in self.stops) if p >= 0]
        return min(hits) if hits else -1

    def held_back(self, text: str) -> int:
        """Length of the longest tail of `text` that could still grow into a stop string."""
        for k in range(min(self._max_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


class OutputText:
    """The text of one generated sequence: incremental detokenisation plus stop strings.

    `add()` returns the delta to emit now; `finish()` the rest once the sequence has ended.
    After a stop string matched, `stopped` is true; once stopped or finished, further tokens add
    nothing (the engine may still produce a token or two before the abort reaches it).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int] = (),
        *,
        stop: Sequence[str] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens
        )
        self._stops = StopStringMatcher(stop or ())
        self._text = ""  # everything decoded so far, cut at a stop string once one matched
        self._emitted = 0  # characters of _text already returned
        self.stopped = False
        self.finished = False
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """The text emitted so far (what a client has seen)."""
        return self._text[: self._emitted]

    def add(self, token_ids: Sequence[int]) -> str:
        if self.finished:
            return ""
        return self._take(self._detok.push(token_ids), final=False)

    def finish(self) -> str:
        if self.finished:
            return ""
        return self._take(self._detok.flush(), final=True)

    def _take(self, new: str, *, final: bool) -> str:
        old_len = len(self._text)
        self._text += new
        if self._stops.stops and new:
            at = self._stops.find(self._text, old_len)
            if at >= 0:
                self.stop_string = next(s for s in self._stops.stops if self._text.startswith(s, at))
                self._text = self._text[:at]
                self.stopped = True
                final = True
        self.finished = final
        safe = len(self._text) if final else len(self._text) - self._stops.held_back(self._text)
        if safe <= self._emitted:
            return ""
        delta = self._text[self._emitted : safe]
        self._emitted = safe
        return delta
