"""The cluster seen from one admitted request: every call it makes to a backend, written once.

This module owns building each call's `DispatchRequest` (the placement facts, the priority class's
wait and line, the budget left, the request id and priority headers), opening it on the cluster
with a non-200 answer turned into the client's error, reading a whole answer with the faults of a
broken replica caught, and `ClusterPort`, the fusion executor's port over all of this. It does not
write to the client (reply.py) or decide which model answers (tokenops.fusion).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from tokenops.cluster import Cluster, DispatchRequest, RequestInfo, Upstream, UpstreamBroken
from tokenops.cluster.prompt_tokenizer import PromptTokenizer
from tokenops.config import PriorityClass
from tokenops.fusion.executor import Answer, Step
from tokenops.fusion.strategies import HELPER_PROMPT_TOKENS, VERDICT_TOKENS
from tokenops.gateway.request import PREFIX_BLOCK_TOKENS, InboundRequest, Kind
from tokenops.protocol import APIError

UPSTREAM_PATH: dict[Kind, str] = {"chat": "/chat/completions", "completion": "/completions"}
# what a replica that broke while its answer was being read raises
UPSTREAM_FAULTS = (UpstreamBroken, aiohttp.ClientError, OSError, TimeoutError)
# the body of one call: built for the replica's served name, or a JSON object whose model is set
Body = Callable[[str], bytes] | dict[str, Any]


def upstream_error(status: int, body: bytes, model: str) -> APIError:
    """A backend's non-200 answer as the client's error: 4xx passed on, 5xx and auth failures as 502."""
    try:
        err = orjson.loads(body).get("error") or {}
        message = str(err.get("message") or "")
        code = err.get("code")
        param = err.get("param")
        etype = err.get("type") or "invalid_request_error"
    except (orjson.JSONDecodeError, AttributeError):
        message, code, param, etype = "", None, None, "api_error"
    if 400 <= status < 500 and status not in (401, 403, 407):
        headers = {"retry-after": "1"} if status == 429 else None
        return APIError(
            status,
            message or f"The backend refused the request (HTTP {status}).",
            type=etype,
            code=code,
            param=param,
            headers=headers,
        )
    return APIError(
        502,
        f"The backend for model '{model}' failed (HTTP {status}). Retry shortly.",
        type="api_error",
        code="upstream_error",
    )


def upstream_broken(model: str, exc: BaseException) -> APIError:
    return APIError(
        502,
        f"The backend for model '{model}' broke off its answer ({type(exc).__name__}). Retry the request.",
        type="api_error",
        code="upstream_error",
    )


@dataclass(frozen=True, slots=True)
class Calls:
    """What every call of one admitted request shares, and how each one is opened."""

    cluster: Cluster
    inbound: InboundRequest
    request_id: str
    priority: int
    line: PriorityClass  # the priority class: how long and behind how many a call may wait for a slot
    budget_left: float | None
    max_tokens: int | None  # per choice, after the budget's cap
    # models whose balancing policy reads the prompt's prefix, with the tokenizer that hashes it
    prefix_models: dict[str, PromptTokenizer | None]

    @property
    def path(self) -> str:
        return UPSTREAM_PATH[self.inbound.kind]

    def request(self, model: str, body: Body, prompt_tokens: int | None = None) -> DispatchRequest:
        """One call on `model`; `prompt_tokens` set: a helper's own prompt, not the client's (not hashed)."""
        inbound = self.inbound
        hashed = prompt_tokens is None and model in self.prefix_models
        hashes, block_tokens = (
            inbound.prompt_blocks(self.prefix_models[model]) if hashed else ((), PREFIX_BLOCK_TOKENS)
        )
        info = RequestInfo(
            model=model,
            session_id=inbound.session_id,
            block_hashes=hashes,
            block_tokens=block_tokens,
            prompt_tokens=inbound.prompt_tokens_estimate() if prompt_tokens is None else prompt_tokens,
            max_tokens=self.max_tokens or 0,
            priority=self.priority,
        )
        return DispatchRequest(
            info,
            self.path,
            body,
            {"x-request-id": self.request_id, "x-priority": str(self.priority)},
            budget_left=self.budget_left,
            max_wait=self.line.max_wait_s,
            max_queued=self.line.max_queued,
        )

    def client_body(self, step: Step | None = None, *, stream: bool = False) -> Callable[[str], bytes]:
        """The client's request for one call, changed by `step`: not streamed unless the step is, with
        log-probs when a check reads them; sample k is a fresh draw: one choice at the step's
        temperature, a client's seed moved by k + 1; n samples are one call's n choices. `stream` (no
        step): streamed from the backend whatever the client asked (reply.py assembles a whole answer)."""
        inbound, max_tokens = self.inbound, self.max_tokens
        if step is None:
            return lambda served: inbound.upstream_body(served, max_tokens, stream=stream)
        body = dict(inbound.body)
        if step.sample is not None:
            body["temperature"] = step.temperature
            body.pop("n", None)
            if isinstance(body.get("seed"), int):
                body["seed"] += step.sample + 1
        if step.n is not None:  # best-of-n: the samples of one call share its prefill
            body["n"], body["temperature"] = step.n, step.temperature
        if not step.stream:
            body.pop("stream", None)
            body.pop("stream_options", None)
        if step.logprobs:
            if inbound.kind == "chat":
                body["logprobs"] = True
            elif body.get("logprobs") is None:
                body["logprobs"] = 0  # the chosen tokens' log-probs, no alternatives
        req = dataclasses.replace(inbound, body=body, stream=step.stream)
        return lambda served: req.upstream_body(served, max_tokens)

    @asynccontextmanager
    async def open(self, request: DispatchRequest) -> AsyncIterator[Upstream]:
        """The call opened on a replica; a non-200 answer raises as the client's error."""
        async with self.cluster.open(request) as up:
            if up.status != 200:
                raise upstream_error(up.status, await up.read(), request.info.model)
            yield up

    async def whole(self, model: str, body: Body, prompt_tokens: int | None = None) -> Answer:
        """One non-streamed call; a failure comes back as `Answer.error` (the caller decides)."""
        try:
            async with self.open(self.request(model, body, prompt_tokens)) as up:
                obj = orjson.loads(await up.read())
                if not isinstance(obj, dict):
                    return Answer(up.model, error=upstream_error(502, b"", model))
                return Answer(up.model, obj, degraded=up.degraded)
        except APIError as err:
            return Answer(model, error=err)
        except orjson.JSONDecodeError:
            return Answer(model, error=upstream_error(502, b"", model))
        except UPSTREAM_FAULTS as exc:
            return Answer(model, error=upstream_broken(model, exc))


@dataclass(frozen=True, slots=True)
class ClusterPort:
    """The fusion executor's port in the gateway: each step is its own call on the cluster, so
    balancing, retries, breakers and failover apply to every one."""

    calls: Calls

    @property
    def streaming(self) -> bool:
        return self.calls.inbound.stream

    @property
    def question(self) -> str:
        from tokenops.fusion.routers import features_from_body

        inbound = self.calls.inbound
        return features_from_body(inbound.kind, inbound.body).text

    async def call(self, model: str, step: Step) -> Answer:
        return await self.calls.whole(model, self.calls.client_body(step))

    async def ask(self, model: str, question: str) -> Answer:
        if self.calls.inbound.kind == "chat":
            body: dict[str, Any] = {"messages": [{"role": "user", "content": question}]}
        else:
            body = {"prompt": question, "stop": ["\n"]}
        body.update(model=model, max_tokens=VERDICT_TOKENS, temperature=0)
        return await self.calls.whole(model, body, prompt_tokens=len(question) // 4 + HELPER_PROMPT_TOKENS)
