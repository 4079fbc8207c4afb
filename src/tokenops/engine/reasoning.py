"""Reasoning sections (`<think>` ... `</think>` in Qwen3, QwQ, DeepSeek-R1): `ReasoningMarkers` (the
two markers as token ids, configured or detected from the tokenizer and its chat template),
`prompt_phase` (whether generation starts before, inside or after a thinking section),
`ReasoningParser` (classifies output tokens as reasoning or content one at a time, holding back
tokens that may still start a marker; markers belong to neither), `ReasoningBudget` (the engine's
forced-token hook: once the section holds `max_reasoning_tokens` tokens the end marker replaces the
sampled tokens) and `resolve_budget` (a request's budget from `max_reasoning_tokens` and
`reasoning_effort`). The engine and the server run the same parser over the same tokens, so the
`reasoning_tokens` the server reports is the count the budget enforced. This module knows nothing
of HTTP or sampling.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tokenops.engine.config import RequestRejected
from tokenops.engine.sequence import TokenLogprob

# marker pairs recognised without configuration (Qwen3, QwQ, DeepSeek-R1 and their distillations)
KNOWN_MARKERS: tuple[tuple[str, str], ...] = (("<think>", "</think>"),)

# OpenAI's reasoning_effort values mapped to thinking budgets (Gemini's OpenAI-compatible mapping
# for low / medium / high); None = no budget. `tokenops engine --reasoning-effort-budget` overrides.
DEFAULT_EFFORT_BUDGETS: dict[str, int | None] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 8192,
    "high": 24576,
}


class MarkerTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class ReasoningMarkers:
    start: tuple[int, ...]
    end: tuple[int, ...]
    start_text: str
    end_text: str

    @classmethod
    def from_strings(cls, tokenizer: MarkerTokenizer, start: str, end: str) -> ReasoningMarkers:
        """The pair as `tokenizer` spells it: one vocabulary token each where it has one."""
        ids = []
        for text in (start, end):
            one = _token_id(tokenizer, text)
            tokens = (one,) if one is not None else tuple(tokenizer.encode(text, add_special_tokens=False))
            if not text or not tokens:
                raise ValueError(f"reasoning marker {text!r} encodes to no tokens")
            ids.append(tokens)
        if ids[0] == ids[1]:
            raise ValueError("the start and end reasoning markers must differ")
        return cls(ids[0], ids[1], start, end)

    @classmethod
    def parse(cls, tokenizer: Any, spec: str | None) -> ReasoningMarkers | None:
        """From a command-line value: "auto" (detect), "none", or "START,END" (e.g. "<think>,</think>")."""
        if spec is None or spec == "auto":
            return detect_markers(tokenizer)
        if spec == "none":
            return None
        start, sep, end = spec.partition(",")
        if not sep or not start.strip() or not end.strip():
            raise ValueError(f"reasoning markers must be 'auto', 'none' or 'START,END', got {spec!r}")
        return cls.from_strings(tokenizer, start.strip(), end.strip())


def _token_id(tokenizer: Any, text: str) -> int | None:
    lookup = getattr(tokenizer, "token_to_id", None)
    return lookup(text) if lookup is not None else None


def detect_markers(tokenizer: Any) -> ReasoningMarkers | None:
    """A known pair whose markers are single vocabulary tokens and whose end marker the chat template
    names (Qwen3 and DeepSeek-R1 templates cut the thinking out of earlier turns at it). A vocabulary
    that merely holds the tokens (Qwen2.5 does not; some base models do) is not taken for a thinker."""
    template = getattr(tokenizer, "chat_template", None) or ""
    for start, end in KNOWN_MARKERS:
        if (
            end in template
            and _token_id(tokenizer, start) is not None
            and _token_id(tokenizer, end) is not None
        ):
            return ReasoningMarkers.from_strings(tokenizer, start, end)
    return None


class Phase(enum.Enum):
    BEFORE = "before"  # no section yet: the first output tokens may open one
    THINKING = "thinking"
    ANSWER = "answer"  # the section is closed (or the model answered without one)


def prompt_phase(text: str, markers: ReasoningMarkers) -> Phase:
    """Where generation starts, from the end of the prompt: the last marker in `text` decides."""
    s, e = text.rfind(markers.start_text), text.rfind(markers.end_text)
    if s < 0 and e < 0:
        return Phase.BEFORE
    if s > e and not (e >= 0 and s < e + len(markers.end_text)):  # a start marker inside the end marker
        return Phase.THINKING
    return Phase.ANSWER


def generation_suffix(with_prompt: str, without_prompt: str) -> str:
    """What a chat template's generation prompt added (the rendered prompt past the messages)."""
    n = 0
    for a, b in zip(with_prompt, without_prompt, strict=False):
        if a != b:
            break
        n += 1
    return with_prompt[n:]


class ReasoningParser:
    """Output tokens of one sequence in, (token, is_reasoning) pairs out once their part is known."""

    __slots__ = ("markers", "phase", "reasoning_tokens", "_held", "closed")

    def __init__(self, markers: ReasoningMarkers, phase: Phase) -> None:
        self.markers = markers
        self.phase = phase
        self.reasoning_tokens = 0  # released as reasoning
        self.closed = False  # a thinking section ended in the output (an end marker was emitted)
        self._held: list[int] = []  # tokens that may be the start of the marker being watched for

    @property
    def section_tokens(self) -> int:
        """Tokens of the open thinking section so far (what the budget counts)."""
        return self.reasoning_tokens + len(self._held) if self.phase is Phase.THINKING else 0

    def feed(self, token: int) -> tuple[list[int], list[int]]:
        """Add one token; return the (reasoning, content) tokens it releases."""
        buf = self._held
        buf.append(token)
        if self.phase is Phase.ANSWER:
            self._held = []
            return [], buf
        if self.phase is Phase.BEFORE:
            start = self.markers.start
            if tuple(buf) == start:
                self.phase, self._held = Phase.THINKING, []
                return [], []
            if start[: len(buf)] == tuple(buf):
                return [], []
            self.phase, self._held = Phase.ANSWER, []  # the model answered without thinking
            return [], buf
        end = self.markers.end
        if tuple(buf) == end:
            self.phase, self._held, self.closed = Phase.ANSWER, [], True
            return [], []
        cut = 0  # drop from the front until the rest could still grow into the end marker
        while end[: len(buf) - cut] != tuple(buf[cut:]):
            cut += 1
        released, self._held = buf[:cut], buf[cut:]
        self.reasoning_tokens += cut
        return released, []

    def split(self, tokens: Iterable[int]) -> tuple[list[int], list[int]]:
        reasoning: list[int] = []
        content: list[int] = []
        for t in tokens:
            r, c = self.feed(t)
            reasoning += r
            content += c
        return reasoning, content

    def flush(self) -> tuple[list[int], list[int]]:
        """The sequence ended: release held tokens into the part they were in."""
        held, self._held = self._held, []
        if self.phase is Phase.THINKING:
            self.reasoning_tokens += len(held)
            return held, []
        return [], held


@dataclass(frozen=True)
class ReasoningSpec:
    """What the engine needs to enforce one request's budget."""

    markers: ReasoningMarkers
    phase: Phase
    max_tokens: int

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise RequestRejected("max_reasoning_tokens must be >= 0.", param="max_reasoning_tokens")


class ReasoningBudget:
    """The forced-token hook of one sequence: closes its thinking section when the budget is spent."""

    __slots__ = ("parser", "max_tokens", "_forced", "forced_tokens")

    def __init__(self, spec: ReasoningSpec) -> None:
        self.parser = ReasoningParser(spec.markers, spec.phase)
        self.max_tokens = spec.max_tokens
        self._forced: deque[int] = deque()
        self.forced_tokens = 0
        self._check()

    def next_token(self, sampled: int, logprob: TokenLogprob | None) -> tuple[int, TokenLogprob | None]:
        """The token to append instead of `sampled` (the same one unless the end marker is due).

        A forced token is reported with logprob 0 (it was certain), with the model's alternatives."""
        if self._forced:
            token = self._forced.popleft()
            self.forced_tokens += 1
            if logprob is not None:
                logprob = TokenLogprob(token, 0.0, logprob.top)
        else:
            token = sampled
        self.parser.feed(token)
        if not self._forced:
            self._check()
        return token, logprob

    def apply(
        self, sampled: int | list[int], logprob: TokenLogprob | None
    ) -> tuple[int | list[int], TokenLogprob | None]:
        """`next_token` over a step's token or accepted speculative run. A run is cut at the first
        token the hook replaces: the drafts after it were conditioned on another token."""
        if isinstance(sampled, int):
            return self.next_token(sampled, logprob)
        out: list[int] = []
        for token in sampled:
            kept, _ = self.next_token(token, None)
            out.append(kept)
            if kept != token:
                break
        return out, logprob

    def _check(self) -> None:
        p = self.parser
        if p.phase is Phase.THINKING and p.section_tokens >= self.max_tokens:
            self._forced.extend(p.markers.end)


def resolve_budget(
    max_reasoning_tokens: int | None, reasoning_effort: str | None, effort_budgets: Mapping[str, int | None]
) -> int | None:
    """The request's thinking budget: the smaller of `max_reasoning_tokens` and the effort's budget."""
    budgets = []
    if max_reasoning_tokens is not None:
        if (
            isinstance(max_reasoning_tokens, bool)
            or not isinstance(max_reasoning_tokens, int)
            or max_reasoning_tokens < 0
        ):
            raise RequestRejected(
                f"max_reasoning_tokens must be an integer >= 0, got {max_reasoning_tokens!r}.",
                param="max_reasoning_tokens",
            )
        budgets.append(max_reasoning_tokens)
    if reasoning_effort is not None:
        if reasoning_effort not in effort_budgets:
            raise RequestRejected(
                f"reasoning_effort must be one of {', '.join(effort_budgets)}; got {reasoning_effort!r}.",
                param="reasoning_effort",
            )
        effort = effort_budgets[reasoning_effort]
        if effort is not None:
            budgets.append(effort)
    return min(budgets) if budgets else None


def parse_effort_budgets(items: Iterable[str]) -> dict[str, int | None]:
    """`["low=512", "high=none"]` over the defaults (command-line values)."""
    out = dict(DEFAULT_EFFORT_BUDGETS)
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip().lower()
        if not sep or not name:
            raise ValueError(f"a reasoning effort budget is EFFORT=TOKENS (or EFFORT=none), got {item!r}")
        if value == "none":
            out[name] = None
            continue
        try:
            n = int(value)
        except ValueError:
            raise ValueError(
                f"the budget of reasoning effort {name!r} must be an integer or 'none', got {value!r}"
            ) from None
        if n < 0:
            raise ValueError(f"the budget of reasoning effort {name!r} must be >= 0")
        out[name] = n
    return out
