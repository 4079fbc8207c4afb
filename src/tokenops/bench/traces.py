"""Request traces as JSONL in the Mooncake format, and prompts rebuilt from their block hashes.

One line per request: ``timestamp`` (ms from the trace start), ``input_length``, ``output_length``,
``hash_ids`` (one id per block of ``block_size`` prompt tokens, 512 in Mooncake's traces), extended
as AIPerf does with ``session_id`` and ``delay`` (ms to wait after the previous round of the session
finished), plus our ``round`` (0-based position in the session). Unknown fields are kept in
``extra`` and written back, so traces from guidellm or AIPerf pass through unchanged.

Prompts are reconstructed deterministically: each hash id maps to a fixed block of common words
(seeded by the id alone), so two requests that share hash ids share a real textual prefix and a
server's prefix cache sees it. This module owns the file format and that mapping; what a session
sends at each round (previous answers included) is the driver's business.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

MOONCAKE_BLOCK_SIZE = 512
_KNOWN = ("timestamp", "input_length", "output_length", "hash_ids", "session_id", "round", "delay")

# Common words that are single tokens in the usual BPE vocabularies (with a leading space), so a
# block of N words is close to N tokens for real tokenizers and exactly N for the stub.
VOCAB = (
    "the of and to in is it that for on was with as at by be this are from or have an they which one "
    "you were all we her she there would their will when who him been has more if no out do so can "
    "what up said about other into than them these may its time only could new some way my then first "
    "any like now over such our man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too little state "
    "good very make world still own see men work long get here between both life being under never day "
    "same another know while last might us great old year off come since against go came right used take"
).split()


@dataclass(slots=True)
class TraceRecord:
    timestamp: float = 0.0
    input_length: int = 0
    output_length: int = 0
    hash_ids: list[int] = field(default_factory=list)
    session_id: str | None = None
    round: int = 0
    delay: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "timestamp": int(self.timestamp) if float(self.timestamp).is_integer() else self.timestamp,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }
        if self.session_id is not None:
            d["session_id"] = self.session_id
            d["round"] = self.round
        if self.delay:
            d["delay"] = self.delay
        d.update(self.extra)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TraceRecord:
        if "input_length" not in d or "output_length" not in d:
            raise ValueError("a trace line needs input_length and output_length")
        sid = d.get("session_id")
        return cls(
            timestamp=float(d.get("timestamp") or 0.0),
            input_length=int(d["input_length"]),
            output_length=int(d["output_length"]),
            hash_ids=[int(h) for h in d.get("hash_ids") or []],
            session_id=None if sid is None else str(sid),
            round=int(d.get("round") or 0),
            delay=float(d.get("delay") or 0.0),
            extra={k: v for k, v in d.items() if k not in _KNOWN},
        )


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> int:
    n = 0
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r.to_json(), separators=(", ", ": ")) + "\n")
            n += 1
    return n


def read_trace(path: str | Path) -> list[TraceRecord]:
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(TraceRecord.from_json(json.loads(line)))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
    return out


_CORPUS_WORDS = 1 << 16


@lru_cache(maxsize=1)
def prompt_corpus() -> tuple[str, ...]:
    # one fixed seeded corpus; a block is a slice of it, so building a prompt costs no RNG work
    # on the driver's event loop (a block per fresh hash id would otherwise seed a generator)
    return tuple(random.Random(20250101).choices(VOCAB, k=_CORPUS_WORDS))


def block_words(hash_id: int, block_size: int = MOONCAKE_BLOCK_SIZE) -> list[str]:
    """The fixed block of words that hash id `hash_id` stands for."""
    corpus = prompt_corpus()
    n = block_size - 1
    # splitmix-style scramble of the id picks the slice; the marker word makes distinct ids differ
    # from their first token even if two slices overlap
    x = (hash_id * 0x9E3779B97F4A7C15 + block_size) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    off = x % (_CORPUS_WORDS - n) if n < _CORPUS_WORDS else 0
    words = [f"b{hash_id}"]
    while len(words) < block_size:
        take = corpus[off : off + block_size - len(words)]
        words.extend(take)
        off = 0
    return words


def prompt_from_hash_ids(hash_ids: list[int], length: int, block_size: int = MOONCAKE_BLOCK_SIZE) -> str:
    """A prompt of exactly `length` words: the blocks of `hash_ids` in order, cut at `length`.

    If the ids cover fewer than `length` words, the rest is filled with words seeded by the last id
    and the length, so the text is still deterministic.
    """
    words: list[str] = []
    for h in hash_ids:
        if len(words) >= length:
            break
        words.extend(block_words(h, block_size))
    if len(words) < length:
        rng = random.Random((hash_ids[-1] if hash_ids else 0) * 7_919 + length)
        words.extend(rng.choices(VOCAB, k=length - len(words)))
    return " ".join(words[:length])


def group_sessions(records: Iterable[TraceRecord]) -> list[list[TraceRecord]]:
    """Split a trace into sessions: records sharing a session id, ordered by round; a record without
    a session id is a session of its own. Sessions are ordered by their first timestamp."""
    sessions: dict[str, list[TraceRecord]] = {}
    singles: list[list[TraceRecord]] = []
    for r in records:
        if r.session_id is None:
            singles.append([r])
        else:
            sessions.setdefault(r.session_id, []).append(r)
    out = singles + [sorted(s, key=lambda r: r.round) for s in sessions.values()]
    out.sort(key=lambda s: s[0].timestamp)
    return out
