"""When and how an agent session's history is compacted: a plain policy over a snapshot of the session.

The policy decides; the Responses endpoint carries it out (the summary is one metered call on the
compaction model). Recent turns stay byte-identical, so after a compaction the prompt's head
(instructions, the summary, the kept turns) is the same from one round to the next and the prefix
cache serves it; only turns older than the kept tail are summarised, and a tool call is never split
from its outputs. Token counts come from the previous turn's measured usage (exact for the stored
history) spread over its messages by their bytes, plus an estimate for the new input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

SUMMARY_PREFIX = "Summary of the earlier conversation:\n"
# role marker and separators around each message, as request.PER_MESSAGE_TOKENS
PER_MESSAGE_TOKENS = 8
# what one message may show of itself in the transcript the compaction model reads
TRANSCRIPT_MESSAGE_CHARS = 1200
SUMMARY_INSTRUCTIONS = (
    "You compact an assistant's conversation history. Summarise the conversation below in a few short "
    "sentences: the user's goal, facts and results established so far (tool results included), and "
    "open questions. Write only the summary."
)


def content_bytes(m: dict[str, Any]) -> int:
    content = m.get("content")
    size = len(content.encode()) if isinstance(content, str) else len(orjson.dumps(content)) if content else 0
    if m.get("tool_calls"):
        size += len(orjson.dumps(m["tool_calls"]))
    return size


def message_bytes(m: dict[str, Any]) -> int:
    """A message's weight in the history: its content and a typical template's markers around it."""
    return content_bytes(m) + PER_MESSAGE_TOKENS * 4


@dataclass(frozen=True, slots=True)
class SessionSnapshot:
    """A session as the next round would send it."""

    history: tuple[dict[str, Any], ...]  # stored messages (instructions excluded)
    history_tokens: int  # the previous turn's prompt + output tokens, as the backend counted them
    new_tokens: int  # an estimate of this round's new input (and instructions)
    window: int  # the model's context window
    max_output: int  # output tokens this round may produce
    tenant_budget: int | None = None  # the tenant tree's history budget (smallest on the key's path)


@dataclass(frozen=True, slots=True)
class Compaction:
    """Summarise `history[:split]`, keep `history[split:]` as it is."""

    split: int
    prompt_budget: int
    tokens_per_byte: float  # the session's measured ratio: sizes the transcript the summariser reads


@dataclass(frozen=True, slots=True)
class CompactionPolicy:
    compact_at: float = 0.75  # of the context window
    max_history_tokens: int | None = None  # the gateway's budget, tighter than the window's share
    keep_recent: float = 0.4  # of the prompt budget, kept byte-identical
    summary_tokens: int = 160

    def prompt_budget(self, window: int, max_output: int, tenant_budget: int | None = None) -> int:
        """The tightest of the window's share, the gateway's budget and the tenant's."""
        budget = min(int(window * self.compact_at), window - max_output - self.summary_tokens)
        for cap in (self.max_history_tokens, tenant_budget):
            if cap is not None:
                budget = min(budget, cap)
        return max(budget, 1)

    def decide(self, s: SessionSnapshot) -> Compaction | None:
        """None while the next prompt fits the budget; otherwise where to cut the history."""
        budget = self.prompt_budget(s.window, s.max_output, s.tenant_budget)
        if s.history_tokens + s.new_tokens <= budget or not s.history:
            return None
        sizes = [message_bytes(m) for m in s.history]
        per_byte = s.history_tokens / max(sum(sizes), 1)  # the measured count spread by bytes
        keep = max(int(budget * self.keep_recent) - s.new_tokens, 0)
        split = len(s.history)
        kept = 0.0
        while split > 0 and kept + sizes[split - 1] * per_byte <= keep:
            split -= 1
            kept += sizes[split] * per_byte
        # the kept tail starts at a user turn: never a tool output without the call it answers; when
        # no user turn follows, the last one is kept with all after it (a tool loop in progress)
        start = split
        while split < len(s.history) and s.history[split].get("role") != "user":
            split += 1
        if split == len(s.history):
            split = min(start, len(s.history) - 1)
            while split > 0 and s.history[split].get("role") != "user":
                split -= 1
        if split == 0:
            return None
        # tokens per byte of text alone (markers are counted against it): never short for the transcript
        text_bytes = sum(content_bytes(m) for m in s.history)
        return Compaction(split, budget, s.history_tokens / max(text_bytes, 1))


def transcript(messages: list[dict[str, Any]], max_chars: int) -> str:
    """The messages as plain text for the compaction model, each cut to a share, the whole to
    `max_chars` (its latest part kept: recent facts matter most)."""
    lines = []
    for m in messages:
        content = m.get("content")
        text = content if isinstance(content, str) else orjson.dumps(content).decode() if content else ""
        if m.get("tool_calls"):
            text += " [calls: " + orjson.dumps(m["tool_calls"]).decode() + "]"
        if len(text) > TRANSCRIPT_MESSAGE_CHARS:
            text = text[: TRANSCRIPT_MESSAGE_CHARS // 2] + " ... " + text[-TRANSCRIPT_MESSAGE_CHARS // 2 :]
        lines.append(f"{m.get('role')}: {text}")
    joined = "\n".join(lines)
    return joined if len(joined) <= max_chars else joined[-max_chars:]


def summary_message(summary: str) -> dict[str, Any]:
    return {"role": "user", "content": SUMMARY_PREFIX + summary.strip()}


def truncated_message(dropped: int) -> dict[str, Any]:
    """What stands for the dropped turns when no summary could be made."""
    return {"role": "user", "content": f"{SUMMARY_PREFIX}({dropped} earlier messages were dropped.)"}
