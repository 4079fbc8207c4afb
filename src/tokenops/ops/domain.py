"""The typed objects that cross the gateway/operations boundary: token usage by type, the principal
behind a key, an admission request, the admission granted, the outcome reported at settle, and the
ledger row written for it. Plain dataclasses, no behaviour beyond small conversions; the rules that
produce them live in `service.py` and the modules it calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenops.ops.pricing import Price


@dataclass
class TokenUsage:
    """Tokens of one request, one field per billed type.

    `uncached_input + cached_input` is the prompt; `output + reasoning` is the completion (OpenAI's
    `completion_tokens` includes reasoning tokens, so `output` here is the visible part only).
    `incremental_prefill` is a meter over the prompt (the tokens the engines computed for it where they
    report that, else new input since the session's previous turn), not an extra share of it; it is
    priced only when the model's price says so. The fields are
    `tokenops.token_types.TOKEN_TYPES`' names, in their order.
    """

    uncached_input: int = 0
    cached_input: int = 0
    incremental_prefill: int = 0
    output: int = 0
    reasoning: int = 0

    @property
    def prompt_tokens(self) -> int:
        return self.uncached_input + self.cached_input

    @property
    def completion_tokens(self) -> int:
        return self.output + self.reasoning

    @classmethod
    def from_openai(
        cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0
    ) -> TokenUsage:
        """Split an OpenAI `usage` object into billed types (clamped so no type goes negative)."""
        cached = max(0, min(cached_tokens, prompt_tokens))
        reasoning = max(0, min(reasoning_tokens, completion_tokens))
        return cls(
            uncached_input=max(0, prompt_tokens - cached),
            cached_input=cached,
            output=max(0, completion_tokens - reasoning),
            reasoning=reasoning,
        )


@dataclass
class Principal:
    """Who is asking: the key and every node above it (root first, the key's own node last)."""

    key_id: str
    node_path: tuple[str, ...]
    key_name: str = ""
    node_ids: tuple[int, ...] = ()
    priority: int = 1

    @property
    def tenant(self) -> str:
        return self.node_path[0] if self.node_path else ""


@dataclass
class AdmissionRequest:
    model: str
    prompt_tokens_upper: int
    max_tokens: int | None
    context_window: int
    session_id: str | None = None
    fingerprint: str = ""
    # the price to reserve at, when several models may answer (a fusion route's worst case over all
    # its steps); None: the price of `model`
    price: Price | None = None


@dataclass
class Admission:
    id: str
    principal: Principal
    model: str
    priority: int
    reserved_micros: int
    max_output_tokens: int
    budget_limited: bool
    session_id: str | None = None
    reserved_tokens: int = 0
    prompt_tokens_upper: int = 0
    max_reasoning_tokens: int | None = None  # the path's thinking-budget cap (tree.reasoning_cap)
    # the tightest budget on the key's path, before this request: fraction neither spent nor reserved
    # by other requests (0..1); None when no node has a budget. Feeds the cluster's `budget_below`.
    budget_left: float | None = None
    # internal: the (node id, period) budget rows holding the reservation, and the nodes whose
    # RPM/TPM/concurrency counters this admission took
    holds: list[tuple[int, str]] = field(default_factory=list)
    limit_nodes: list = field(default_factory=list)


@dataclass
class ModelCall:
    """An upstream call of one request whose answer was not the one returned (a rejected cascade
    step, an ensemble member that lost the vote, a verifier or judge): billed at its model's price."""

    model: str
    usage: TokenUsage


@dataclass
class Outcome:
    model_served: str
    usage: TokenUsage
    status: str  # "ok" | "client_disconnected" | "upstream_error" | "budget_exhausted" | "error" | "released"
    finish_reason: str | None = None
    ttft_ms: float | None = None
    latency_ms: float = 0.0
    http_status: int = 200
    error_code: str | None = None
    route: str | None = None  # the fusion decision, e.g. "route=auto; model=m; reason=..."
    degraded: str | None = None  # why the cluster served a lighter model or another group
    side_calls: list[ModelCall] = field(default_factory=list)  # billed on top of `usage`, in the same row
    # prompt tokens the engines computed for this request beyond what their caches and peers held
    # (`usage.prompt_token_sources.computed`, every PD leg's): the incremental-prefill meter where an
    # engine reports it; None: derived from the session's previous turn
    computed_prompt_tokens: int | None = None
    operation: str | None = None  # what the row meters beyond a plain completion (models.ledger)


@dataclass
class LedgerRow:
    """One metered request, as stored in the `ledger` table."""

    admission_id: str
    key_id: str
    node_path: str
    model_requested: str
    model_served: str
    session_id: str | None
    uncached_input: int
    cached_input: int
    incremental_prefill: int
    output: int
    reasoning: int
    cost_micros: int
    reserved_micros: int
    status: str
    finish_reason: str | None
    ttft_ms: float | None
    latency_ms: float
    http_status: int
    error_code: str | None
    route: str | None = None
    degraded: str | None = None
    created_at: datetime | None = None
    operation: str | None = None
