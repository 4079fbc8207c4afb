"""`SpeculativeConfig`: which drafter, how many draft tokens, and how the draft length adapts.

Built from the engine config (`speculative: {method: ngram, num_tokens: 4}`), from the
`--speculative` command-line flag (a method name or a JSON object), or directly. Validated once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft")


@dataclass
class SpeculativeConfig:
    method: str  # "ngram": prompt lookup; "draft": a draft model ("self:N")
    num_tokens: int = 4  # most draft tokens per sequence per step (k)
    # prompt lookup: match the last n tokens, longest n first
    ngram_max: int = 3
    ngram_min: int = 1
    # draft model: "self:N" = the target's own first N layers + its final norm and lm head, or a
    # smaller model with the same tokenizer (a bundled name, an HF folder or a .gguf file)
    draft_model: str | None = None
    # adapt each sequence's draft length to its recent acceptance rate (EWMA); below
    # `min_acceptance` the sequence decodes plainly for `cooldown_steps` steps, then probes again
    adaptive: bool = True
    ewma_weight: float = 0.3
    min_acceptance: float = 0.2
    cooldown_steps: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; use one of {list(METHODS)}")
        if self.num_tokens < 1:
            raise ValueError("speculative num_tokens must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("speculative ngram sizes need 1 <= ngram_min <= ngram_max")
        if self.method == "draft":
            if not self.draft_model:
                raise ValueError(
                    "speculative method 'draft' needs draft_model, e.g. 'self:8' or a model path"
                )
            _ = self.draft_layers  # raises on a malformed self:N
        if not 0.0 < self.ewma_weight <= 1.0:
            raise ValueError("speculative ewma_weight must be in (0, 1]")
        if not 0.0 <= self.min_acceptance < 1.0:
            raise ValueError("speculative min_acceptance must be in [0, 1)")
        if self.cooldown_steps < 0:
            raise ValueError("speculative cooldown_steps must be >= 0")

    @property
    def draft_layers(self) -> int | None:
        """N of a 'self:N' draft model; None for a separate draft model."""
        prefix, _, n = (self.draft_model or "").partition(":")
        if prefix != "self":
            return None
        if not n.isdigit() or int(n) < 1:
            raise ValueError(
                f"draft_model {self.draft_model!r}: write 'self:N' with N >= 1 (the target's first N layers)"
            )
        return int(n)

    @staticmethod
    def settings_from_text(text: str) -> dict[str, Any]:
        """'ngram' -> {"method": "ngram"}; a JSON object -> its dict (validated by `from_value`)."""
        text = text.strip()
        value = json.loads(text) if text.startswith("{") else {"method": text}
        if not isinstance(value, dict):
            raise ValueError(f"speculative must be a method name or a JSON object, got {text!r}")
        return value

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a config object, a dict, a JSON object string or a bare method name."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = cls.settings_from_text(value)
        if not isinstance(value, dict):
            raise ValueError(f"speculative must be a method name or a mapping, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative settings {unknown}; known: {sorted(known)}")
        return cls(**value)
