"""One admitted request, from `ops.admit` to `ops.settle`: what the backend reported and what the
gateway saw, turned into exactly one `Outcome`.

This module owns metering from the source (the backend's `usage`: uncached = prompt - cached,
reasoning from completion_tokens_details), the fallback when no usage ever arrived (count the
content chunks relayed, estimate the prompt), the request's status, and the guarantee that settle
runs once and survives cancellation. It does not speak HTTP to the client or to the backend.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenops.gateway.request import InboundRequest
from tokenops.gateway.timing import PathTimer
from tokenops.ops.domain import Admission, LedgerRow, ModelCall, Outcome, TokenUsage

log = logging.getLogger("tokenops.gateway")


class Settler(Protocol):
    """What settling needs of the ops layer (`tokenops.ops.service.Operations` is one)."""

    async def settle(self, admission: Admission, outcome: Outcome) -> LedgerRow | None: ...


def usage_from_openai(u: dict[str, Any]) -> TokenUsage:
    """An OpenAI `usage` object as billed token types."""
    return TokenUsage.from_openai(
        int(u.get("prompt_tokens") or 0),
        int(u.get("completion_tokens") or 0),
        int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        int((u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0),
    )


@dataclass(slots=True, eq=False)
class Exchange:
    """The gateway's running account of one admitted request."""

    admission: Admission
    inbound: InboundRequest
    timer: PathTimer  # its stamps from arrival on (perf_counter_ns)
    model_served: str
    # the real model it is sent to (a route's plan; for a cascade or ensemble, the answering step):
    # the metrics' label. None: the model the client named
    model: str | None = None
    max_tokens_sent: int | None = None
    budget_cut: bool = False  # max_tokens_sent was lowered by the budget, not by the client
    usage: dict[str, Any] | None = None  # the backend's usage object, once it arrives
    content_chunks: int = 0  # chunks that carried generated text (or tool calls), relayed or not
    first_token_at: float | None = None
    sent_upstream: bool = False  # a backend received the request (it prefilled the prompt, at least)
    finish_reason: str | None = None
    status: str = "ok"
    http_status: int = 200
    error_code: str | None = None
    route: str | None = None  # the fusion plan's header value, for the ledger
    degraded: str | None = None  # the cluster's degradation reason, for the ledger
    side_calls: list[ModelCall] = field(default_factory=list)  # other calls of a cascade or ensemble
    prefill_computed: int = 0  # prompt tokens a PD prefill leg computed (the answer's usage lacks them)
    operation: str | None = None  # the ledger's operation column: "responses", "compaction", ...
    ledger: LedgerRow | None = None
    settled_outcome: Outcome | None = None
    settle_ns: int = 0  # how long the settle took, its commit included
    _settle_task: asyncio.Task[LedgerRow | None] | None = field(default=None, repr=False)

    # -- observing -------------------------------------------------------------------------------

    def observe(self, obj: dict[str, Any]) -> None:
        """Account one response object: a streamed chunk or a whole completion."""
        usage = obj.get("usage")
        if usage:
            self.usage = usage
        model = obj.get("model")
        if model:
            self.model_served = model
        for choice in obj.get("choices") or ():
            delta = choice.get("delta")
            if delta is not None:
                if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                    self.count_token()
            elif choice.get("text") or (choice.get("message") or {}).get("content"):
                self.count_token()
            reason = choice.get("finish_reason")
            if reason:
                self.finish_reason = reason

    def count_token(self) -> None:
        """One chunk carried generated text (the relay's fast path counts without parsing it)."""
        self.content_chunks += 1
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    @property
    def produced(self) -> bool:
        return self.content_chunks > 0 or bool(self.usage and self.usage.get("completion_tokens"))

    @property
    def stopped_by_budget(self) -> bool:
        """The backend stopped at the length the budget allowed, short of what the client asked."""
        return self.budget_cut and self.finish_reason == "length"

    def fail(self, status: str, http_status: int, code: str | None) -> None:
        self.status, self.http_status, self.error_code = status, http_status, code

    # -- settling --------------------------------------------------------------------------------

    def token_usage(self) -> TokenUsage:
        if self.usage:
            return usage_from_openai(self.usage)
        if self.content_chunks == 0:
            if self.status == "client_disconnected" and self.sent_upstream:
                # the client left while the backend worked on it: its prompt was read, at least
                return TokenUsage(uncached_input=self.inbound.prompt_tokens_estimate())
            return TokenUsage()  # nothing produced (a failure before the first token): not billed
        # the backend's final usage never arrived (client gone, backend cut): bill what was seen
        return TokenUsage(uncached_input=self.inbound.prompt_tokens_estimate(), output=self.content_chunks)

    def outcome(self) -> Outcome:
        end = time.perf_counter()
        started = self.timer.received / 1e9  # perf_counter and perf_counter_ns read the same clock
        ttft = (self.first_token_at - started) * 1000 if self.first_token_at is not None else None
        return Outcome(
            model_served=self.model_served,
            usage=self.token_usage(),
            status=self.status,
            finish_reason=self.finish_reason,
            ttft_ms=ttft,
            latency_ms=(end - started) * 1000,
            http_status=self.http_status,
            error_code=self.error_code,
            route=self.route,
            degraded=self.degraded,
            side_calls=list(self.side_calls),
            computed_prompt_tokens=self.computed_prompt_tokens(),
            operation=self.operation,
        )

    def computed_prompt_tokens(self) -> int | None:
        """What the engines computed of the prompt, where the answering engine reports its sources."""
        sources = (self.usage or {}).get("prompt_token_sources")
        if not isinstance(sources, dict):
            return None
        return int(sources.get("computed") or 0) + self.prefill_computed

    async def settle(self, ops: Settler) -> LedgerRow | None:
        """Settle once; a cancelled caller does not cancel the settle (the ledger row is never lost)."""
        if self._settle_task is None:
            self.settled_outcome = self.outcome()
            self._settle_task = asyncio.ensure_future(self._settle(ops, self.settled_outcome))
        return await asyncio.shield(self._settle_task)

    async def _settle(self, ops: Settler, outcome: Outcome) -> LedgerRow | None:
        started = time.perf_counter_ns()
        try:
            self.ledger = await ops.settle(self.admission, outcome)
        except Exception:
            log.exception("settle failed for admission %s", self.admission.id)
            return None
        finally:
            self.settle_ns = time.perf_counter_ns() - started
        return self.ledger
