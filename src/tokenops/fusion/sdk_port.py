"""The fusion executor's port over the official `openai` SDK, for offline evaluation.

This module owns `SdkPort`, which answers the executor's calls for one prompt by asking
`ModelEndpoint`s (any OpenAI-compatible URL, chat or completion) directly, and `run_plan`, which runs
a plan under a cascade's or ensemble's policy that way and prices every call at its endpoint's
prices. The decisions are the gateway's own (executor.py, strategies.py); only the transport
differs. It does not meter into a ledger: a cost is returned, not settled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenops.fusion.executor import Answer, Relay, RunRecord, Step, execute
from tokenops.fusion.plan import Plan
from tokenops.fusion.profiles import ModelEndpoint
from tokenops.fusion.strategies import VERDICT_TOKENS, CascadePolicy, EnsemblePolicy
from tokenops.protocol import APIError


@dataclass(slots=True)
class SdkPort:
    """One prompt put to `endpoints` by name: greedy unless a step samples (then seeded by the
    sample's number, so a run is repeatable)."""

    endpoints: Mapping[str, ModelEndpoint]
    prompt: str
    max_tokens: int = 64
    stop: list[str] | None = None
    _clients: dict[str, Any] = field(default_factory=dict)

    @property
    def streaming(self) -> bool:
        return False

    @property
    def question(self) -> str:
        return self.prompt

    async def call(self, model: str, step: Step) -> Answer:
        extra: dict[str, Any] = {}
        if step.sample is not None:
            extra.update(temperature=step.temperature, seed=step.sample + 1)
        if step.n is not None:
            extra.update(n=step.n, temperature=step.temperature, seed=1)
        return await self._complete(model, self.prompt, self.max_tokens, self.stop, step.logprobs, extra)

    async def ask(self, model: str, question: str) -> Answer:
        return await self._complete(model, question, VERDICT_TOKENS, ["\n"], False, {})

    def cost(self, answer: Answer) -> float:
        """What `answer` cost at its endpoint's prices (nothing when no usage came back)."""
        u = answer.usage or {}
        endpoint = self.endpoints[answer.model]
        return endpoint.cost(int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0))

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    async def _complete(
        self,
        model: str,
        prompt: str,
        max_tokens: int,
        stop: list[str] | None,
        logprobs: bool,
        extra: dict[str, Any],
    ) -> Answer:
        from openai import OpenAIError

        endpoint = self.endpoints[model]
        client = self._clients.get(model)
        if client is None:
            client = self._clients[model] = endpoint.client()
        # optional fields are left out rather than sent as null: strict servers refuse a null boolean
        args: dict[str, Any] = {"model": endpoint.model_field, "max_tokens": max_tokens, "temperature": 0.0}
        args.update(extra)
        try:
            if endpoint.mode == "chat":
                if logprobs:
                    args["logprobs"] = True
                resp = await client.chat.completions.create(
                    messages=[{"role": "user", "content": prompt}], **args
                )
            else:
                if logprobs:
                    args["logprobs"] = 1
                if stop:
                    args["stop"] = list(stop)[:4]
                resp = await client.completions.create(prompt=prompt, **args)
        except OpenAIError as exc:
            error = APIError(
                502, f"The model '{model}' failed: {exc}", type="api_error", code="upstream_error"
            )
            return Answer(model, error=error)
        return Answer(model, resp.model_dump())


@dataclass(slots=True)
class PlanRun:
    """One offline run: the answer returned, what was tried, and what every call cost."""

    answer: Answer
    record: RunRecord
    cost: float

    @property
    def text(self) -> str:
        return self.answer.text

    @property
    def calls(self) -> int:
        return len(self.record.side) + 1


async def run_plan(
    plan: Plan,
    policy: CascadePolicy | EnsemblePolicy | None,
    endpoints: Mapping[str, ModelEndpoint],
    prompt: str,
    *,
    max_tokens: int = 64,
    stop: list[str] | None = None,
) -> PlanRun:
    """Run `plan` for `prompt` through the SDK, the way the gateway would run it for a client."""
    port = SdkPort(endpoints, prompt, max_tokens, stop)
    record = RunRecord(plan)
    try:
        answer = await execute(plan, policy, port, record)
    finally:
        await port.aclose()
    assert not isinstance(answer, Relay)  # the SDK port never streams
    cost = port.cost(answer) + sum(port.cost(a) for a in record.side if a.error is None)
    return PlanRun(answer, record, cost)
