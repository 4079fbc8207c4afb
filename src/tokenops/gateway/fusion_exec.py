"""Multi-model plans on the request path: cascades and ensembles of a fusion route.

This module owns executing a `Plan` whose strategy is `cascade` (ask the cheapest model for a whole
answer, check it (rules, log-probs, agreement of a few extra samples, a verifier), escalate on a
rejection; the last model tried answers unconditionally) or `ensemble` (ask every member at once,
then vote or let a judge pick; or self-consistency: sample in rounds until the answers agree), and
the reservation such a route needs: the worst case over all its steps, priced per model. Every
upstream call goes through `Cluster.open`, so balancing, retries, breakers and failover apply to
each step. Calls whose answer is not returned are recorded on the `Exchange` as side calls (billed
at their own model's price in the request's one ledger row); what was tried is appended to the route
trace (`x-tokenops-route` header and ledger `route` column). A streaming client gets a buffered
answer replayed as SSE, or, when a cascade reaches its last model, that model's stream relayed live.

It does not plan (`tokenops.fusion`), admit or settle (routes.py, which calls `FusedRun.serve` and
settles in its `finally`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from tokenops.cache import MISS_HEADERS, assemble_stream
from tokenops.cache.response import completion_chunks
from tokenops.cluster import DEGRADE_HEADER, RequestInfo, UpstreamBroken
from tokenops.fusion.strategies import (
    VERDICT_TOKENS,
    Tally,
    agreement,
    judge_prompt,
    judged_index,
    verdict_is_yes,
    verifier_prompt,
    vote,
)
from tokenops.gateway.exchange import Exchange, usage_from_openai
from tokenops.gateway.http import SSE_CT, Receive, Send, base_headers, send_bytes
from tokenops.gateway.request import PREFIX_BLOCK_TOKENS, InboundRequest
from tokenops.gateway.sse import encode_chunks, relay_to_client
from tokenops.ops.domain import ModelCall, TokenUsage
from tokenops.ops.pricing import Price
from tokenops.protocol import APIError

if TYPE_CHECKING:
    from tokenops.fusion.plan import Plan, RouteConfig
    from tokenops.fusion.strategies import CascadePolicy, EnsemblePolicy
    from tokenops.gateway.app import Gateway
    from tokenops.gateway.routes import CompletionsEndpoint

# a verifier's or judge's own words around the question and answers, plus its verdict: added to the
# prompt bound of a route that calls one, so the reservation stays an upper bound
HELPER_PROMPT_TOKENS = 96
DEGRADED = DEGRADE_HEADER.lower().encode("latin-1")


@dataclass(frozen=True, slots=True)
class Reservation:
    """What a multi-model route is admitted at: a price whose rates are the sums of its steps'
    rates (a verifier or judge also reads the answers, so its input rate is added to the output
    rate), and the extra prompt tokens of its helper calls."""

    price: Price | None = None
    extra_prompt_tokens: int = 0


NO_RESERVATION = Reservation()


def reservation(gw: Gateway, model: str) -> Reservation:
    """The reservation for a request that names `model`: the worst case over every step of a
    cascade or ensemble route; nothing special for a real model or a single-model route."""
    fusion = gw.fusion
    route: RouteConfig | None = fusion.routes.get(model) if fusion is not None else None
    if route is None or route.strategy == "single":
        return NO_RESERVATION
    price = gw.ops.price_of
    if route.strategy == "cascade":
        assert route.cascade is not None
        c = route.cascade
        # the router may start at the strong model: reserve for the dearer of the two tier lists
        sums = []
        for tiers in (c.tiers(), c.tiers(route.strong)):
            inp = sum(price(m).max_input_rate for m in tiers)
            out = sum(price(m).max_output_rate for m in tiers)
            for m in tiers[:-1]:  # agreement samples: the answer's prompt and max_tokens again
                inp += c.samples * price(m).max_input_rate
                out += c.samples * price(m).max_output_rate
            if c.verifier is not None:  # asked about every answer but the last
                v = price(c.verifier)
                checked = len(tiers) - 1
                inp += checked * max(v.max_input_rate, v.max_output_rate)
                out += checked * v.max_input_rate
            sums.append((inp, out))
        inp, out = max(s[0] for s in sums), max(s[1] for s in sums)
        return Reservation(Price(input=inp, output=out), HELPER_PROMPT_TOKENS if c.verifier else 0)
    assert route.ensemble is not None
    e = route.ensemble
    members = e.sample_models() if e.aggregate == "self_consistency" else e.models
    inp = sum(price(m).max_input_rate for m in members)
    out = sum(price(m).max_output_rate for m in members)
    if e.aggregate == "judge" and e.judge is not None:
        j = price(e.judge)
        inp += max(j.max_input_rate, j.max_output_rate)
        out += len(e.models) * j.max_input_rate  # every member's answer is in the judge's prompt
        return Reservation(Price(input=inp, output=out), HELPER_PROMPT_TOKENS)
    return Reservation(Price(input=inp, output=out))


@dataclass(slots=True)
class Answer:
    """One whole (non-streamed) upstream answer, or why there is none."""

    model: str  # the model that served it (the cluster may have failed over)
    obj: dict[str, Any] | None = None
    error: APIError | None = None
    degraded: str | None = None

    def choices(self) -> list[dict[str, Any]]:
        return list((self.obj or {}).get("choices") or [])

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.choices())

    @property
    def text(self) -> str:
        choices = self.choices()
        return choice_text(choices[0]) if choices else ""

    def usage(self, fallback_prompt: int) -> TokenUsage:
        u = (self.obj or {}).get("usage")
        if u:
            return usage_from_openai(u)
        if self.obj is None:
            return TokenUsage()  # nothing came back: nothing to bill
        # the backend reported no usage: bill an estimate of the prompt and a word per token
        return TokenUsage(uncached_input=fallback_prompt, output=len(self.text.split()))


def choice_text(choice: dict[str, Any]) -> str:
    """What a check reads and a vote compares: the text, or the tool calls of a chat answer."""
    message = choice.get("message") or {}
    if message.get("tool_calls") and not message.get("content"):
        return orjson.dumps(message["tool_calls"]).decode()
    return str(message.get("content") or choice.get("text") or "")


def choice_logprobs(choice: dict[str, Any]) -> list[float]:
    lp = choice.get("logprobs") or {}
    if lp.get("content") is not None:  # chat
        return [float(t["logprob"]) for t in lp["content"] if t.get("logprob") is not None]
    return [float(x) for x in lp.get("token_logprobs") or () if x is not None]  # text completion


def question_of(inbound: InboundRequest) -> str:
    """The text a verifier or judge is asked about: the last user message, or the prompt."""
    from tokenops.fusion.routers import features_from_body

    return features_from_body(inbound.kind, inbound.body).text


class FusedRun:
    """One request answered by a cascade or an ensemble."""

    def __init__(
        self,
        endpoint: CompletionsEndpoint,
        receive: Receive,
        send: Send,
        exchange: Exchange,
        plan: Plan,
        max_tokens: int | None,
        request_id: str,
        *,
        collect: bool,
        cache_miss: bool,
    ) -> None:
        self.ep = endpoint
        self.gw = endpoint.gw
        self.receive = receive
        self.send = send
        self.exchange = exchange
        self.inbound = exchange.inbound
        self.plan = plan
        assert plan.route is not None
        self.route = self.gw.fusion.routes[plan.route]
        self.max_tokens = max_tokens
        self.request_id = request_id
        self.collect = collect  # keep the answer for the cache
        self.cache_miss = cache_miss
        self.started = False  # the response's first byte has gone to the client
        self.trace: list[str] = []
        priority = exchange.admission.priority
        self.line = endpoint.classes[min(max(priority, 0), len(endpoint.classes) - 1)]
        self.headers = {"x-request-id": request_id, "x-priority": str(priority)}

    async def serve(self) -> dict[str, Any] | bytes | None:
        """Answer the client; returns the answer to store in the cache (None: nothing to store).
        Raises `APIError` only before the response has started."""
        if self.plan.strategy == "cascade":
            return await self._cascade()
        return await self._ensemble()

    # -- strategies ------------------------------------------------------------------------------

    async def _cascade(self) -> dict[str, Any] | bytes | None:
        policy = self.route.cascade
        assert policy is not None
        check = policy.check
        tiers = self.plan.models
        for i, model in enumerate(tiers):
            if i == len(tiers) - 1:
                return await self._answer_last(model)
            ans = await self._whole(model, self._step_body(stream=False, logprobs=check.wants_logprobs))
            if ans.error is not None:
                # a failed step is an escalation, not the client's failure: the next model answers
                self._step(model, "failed", str(ans.error.code or ans.error.status))
                continue
            reasons = (
                [
                    r
                    for c in ans.choices()
                    for r in check.reasons(choice_text(c), choice_logprobs(c), c.get("finish_reason"))
                ]
                if ans.choices()
                else ["no answer"]
            )
            if not reasons and policy.samples:
                reasons = await self._agreement(model, policy, ans)
            if not reasons and policy.verifier is not None:
                reasons = await self._verify(policy.verifier, ans)
            if not reasons:
                self._step(ans.model, "accepted")
                return await self._respond_whole(ans)
            self._side(ans)
            self._step(ans.model, "rejected", reasons[0])
        raise AssertionError("a cascade plan has at least one model")  # pragma: no cover

    async def _ensemble(self) -> dict[str, Any] | bytes | None:
        policy = self.route.ensemble
        assert policy is not None
        if policy.aggregate == "self_consistency":
            return await self._self_consistency(policy)
        members = self.plan.models
        body = self._step_body(stream=False, logprobs=False)
        answers = list(await asyncio.gather(*(self._whole(m, body) for m in members)))
        ok = [a.error is None and bool(a.choices()) for a in answers]
        if not any(ok):
            for a in answers:
                self._step(a.model, "failed", a.error.code if a.error else "empty")
            self._set_route()
            first = next((a.error for a in answers if a.error is not None), None)
            raise first or APIError(
                502,
                "No member of the ensemble answered. Retry the request.",
                type="api_error",
                code="upstream_error",
            )
        picked: int | None = None
        how = ""
        if policy.aggregate == "judge" and policy.judge is not None:
            candidates = [i for i, good in enumerate(ok) if good]
            verdict = await self._ask(
                policy.judge, judge_prompt(question_of(self.inbound), [answers[i].text for i in candidates])
            )
            k = judged_index(verdict.text, len(candidates)) if verdict.error is None else None
            self._side(verdict)
            if k is not None:
                picked, how = candidates[k], f"picked by judge {verdict.model}"
            else:
                self._step(policy.judge, "judge_unclear", "no valid pick: vote")
        if picked is None:
            picked, votes = vote([a.text if good else None for a, good in zip(answers, ok, strict=True)])
            how = f"{votes} of {sum(ok)} votes"
        for i, (a, good) in enumerate(zip(answers, ok, strict=True)):
            if i == picked:
                self._step(a.model, "answered", how)
            elif good:
                self._side(a)
                self._step(a.model, "not_picked")
            else:
                self._side(a)
                self._step(a.model, "failed", a.error.code if a.error else "empty")
        return await self._respond_whole(answers[picked])

    async def _agreement(self, model: str, policy: CascadePolicy, ans: Answer) -> list[str]:
        """Draw `policy.samples` more answers from `model` at once; [] when enough match the first."""
        extra = await asyncio.gather(
            *(
                self._whole(
                    model,
                    self._step_body(stream=False, logprobs=False, sample=k, temperature=policy.temperature),
                )
                for k in range(policy.samples)
            )
        )
        for a in extra:
            self._side(a)
        share = agreement(ans.text, [a.text if a.ok else None for a in extra])
        return [] if share >= policy.min_agreement else [f"agreement {share:.2f} < {policy.min_agreement:g}"]

    async def _self_consistency(self, policy: EnsemblePolicy) -> dict[str, Any] | bytes | None:
        """Sample in rounds until `Tally` is settled; the leading answer's first sample is returned,
        every other sample is a side call. A round in which every sample failed ends the run."""
        models = policy.sample_models()
        tally = Tally(policy.samples, policy.agree)
        answers: list[Answer] = []
        while batch := tally.next_round(policy.round_size):
            new = await asyncio.gather(
                *(
                    self._whole(
                        models[k],
                        self._step_body(
                            stream=False, logprobs=False, sample=k, temperature=policy.temperature
                        ),
                    )
                    for k in range(len(answers), len(answers) + batch)
                )
            )
            answers.extend(new)
            for a in new:
                tally.add(a.text if a.ok else None)
            if not any(a.ok for a in new):
                break
        failed = sum(not a.ok for a in answers)
        if failed == len(answers):
            self._step(answers[0].model, "failed", answers[0].error.code if answers[0].error else "empty")
            self._set_route()
            raise answers[0].error or APIError(
                502,
                "No sample of the ensemble answered. Retry the request.",
                type="api_error",
                code="upstream_error",
            )
        picked, votes = tally.leader()
        how = f"{votes} of {len(answers)} votes"
        if len(answers) < policy.samples:
            how += f", stopped early (max {policy.samples})"
        if failed:
            how += f", {failed} failed"
        for i, a in enumerate(answers):
            if i != picked:  # one step in the trace, but every sample in the step metric
                self._side(a)
                self.gw.metrics.fusion_step(self.route.name, a.model, "not_picked" if a.ok else "failed")
        self._step(answers[picked].model, "answered", how)
        return await self._respond_whole(answers[picked])

    async def _verify(self, verifier: str, ans: Answer) -> list[str]:
        """Ask the verifier about the first choice's answer; [] when it says yes."""
        verdict = await self._ask(verifier, verifier_prompt(question_of(self.inbound), ans.text))
        self._side(verdict)
        if verdict.error is not None:
            return [f"verifier {verifier} failed"]
        return [] if verdict_is_yes(verdict.text) else [f"verifier {verdict.model} said no"]

    # -- calls -----------------------------------------------------------------------------------

    def _info(self, model: str, prompt_tokens: int, prefix: bool) -> RequestInfo:
        inbound = self.inbound
        hashed = prefix and model in self.ep.prefix_models
        hashes, block_tokens = inbound.prompt_blocks(self.ep.prefix_models[model]) if hashed else ((), PREFIX_BLOCK_TOKENS)
        return RequestInfo(
            model=model,
            session_id=inbound.session_id,
            block_hashes=hashes,
            block_tokens=block_tokens,
            prompt_tokens=prompt_tokens,
            max_tokens=self.max_tokens or 0,
            priority=self.exchange.admission.priority,
        )

    def _step_body(
        self, *, stream: bool, logprobs: bool, sample: int | None = None, temperature: float | None = None
    ) -> Callable[[str], bytes]:
        """The client's request for one step: streamed or not, with log-probs when the check reads
        them; sample k is a fresh draw: one choice at `temperature`, a client's seed moved by k + 1."""
        body = dict(self.inbound.body)
        if sample is not None:
            body["temperature"] = temperature
            body.pop("n", None)
            if isinstance(body.get("seed"), int):
                body["seed"] += sample + 1
        if not stream:
            body.pop("stream", None)
            body.pop("stream_options", None)
        if logprobs:
            if self.inbound.kind == "chat":
                body["logprobs"] = True
            elif body.get("logprobs") is None:
                body["logprobs"] = 0  # the chosen tokens' log-probs, no alternatives
        req = dataclasses.replace(self.inbound, body=body, stream=stream)
        max_tokens = self.max_tokens
        return lambda served: req.upstream_body(served, max_tokens)

    async def _whole(
        self, model: str, body: Callable[[str], bytes] | dict[str, Any], prompt_tokens: int | None = None
    ) -> Answer:
        """One non-streamed call; failures come back as `Answer.error` (the caller decides)."""
        from tokenops.gateway.routes import _upstream_error, upstream_broken

        prompt = self.inbound.prompt_tokens_estimate() if prompt_tokens is None else prompt_tokens
        try:
            async with self.gw.cluster.open(
                self._info(model, prompt, prompt_tokens is None),
                self.ep.path,
                body,
                self.headers,
                max_wait=self.line.max_wait_s,
                max_queued=self.line.max_queued,
                budget_left=self.exchange.admission.budget_left,
            ) as up:
                data = await up.read()
                if up.status != 200:
                    return Answer(up.model, error=_upstream_error(up.status, data, model))
                obj = orjson.loads(data)
                if not isinstance(obj, dict):
                    return Answer(up.model, error=_upstream_error(502, b"", model))
                return Answer(up.model, obj, degraded=up.degraded)
        except APIError as err:
            return Answer(model, error=err)
        except orjson.JSONDecodeError:
            return Answer(model, error=_upstream_error(502, b"", model))
        except (UpstreamBroken, aiohttp.ClientError, OSError, TimeoutError) as exc:
            return Answer(model, error=upstream_broken(model, exc))

    async def _ask(self, model: str, question: str) -> Answer:
        """A verifier's or judge's short greedy answer, in the client's request kind."""
        if self.inbound.kind == "chat":
            body: dict[str, Any] = {"messages": [{"role": "user", "content": question}]}
        else:
            body = {"prompt": question, "stop": ["\n"]}
        body.update(model=model, max_tokens=VERDICT_TOKENS, temperature=0)
        return await self._whole(model, body, prompt_tokens=len(question) // 4 + HELPER_PROMPT_TOKENS)

    def _side(self, ans: Answer) -> None:
        usage = ans.usage(self.inbound.prompt_tokens_estimate())
        if usage.prompt_tokens or usage.completion_tokens:
            self.exchange.side_calls.append(ModelCall(ans.model, usage))

    def _step(self, model: str, outcome: str, detail: str | None = None) -> None:
        """Record one step for the route trace (`x-tokenops-route`, ledger) and the step metric."""
        text = outcome.replace("_", " ")
        if detail:
            # why a step failed or was rejected; how an answer was chosen
            text += f": {detail}" if outcome in ("failed", "rejected") else f", {detail}"
        self.trace.append(f"{model}({text})")
        self.gw.metrics.fusion_step(self.route.name, model, outcome)

    # -- answering -------------------------------------------------------------------------------

    def _set_route(self) -> bytes:
        self.exchange.route = f"{self.plan.header()}; tried={' -> '.join(self.trace)}"
        return self.exchange.route.encode("latin-1", "replace")

    def _response_headers(self, model: str, degraded: str | None) -> list[tuple[bytes, bytes]]:
        headers = base_headers(self.request_id, [(b"x-tokenops-model", model.encode("latin-1", "replace"))])
        if degraded:
            headers.append((DEGRADED, degraded.encode("latin-1", "replace")))
        headers.append((b"x-tokenops-route", self._set_route()))
        if self.cache_miss:
            headers.extend(MISS_HEADERS)
        return headers

    async def _respond_whole(self, ans: Answer) -> dict[str, Any]:
        """Return a buffered answer: JSON, or replayed as SSE to a streaming client."""
        obj = ans.obj
        assert obj is not None
        ex = self.exchange
        ex.degraded = ans.degraded
        ex.observe(obj)
        ex.model_served = self.inbound.model = ans.model  # metrics at settle count the answering model
        if not self._client_wants_logprobs():
            for c in obj.get("choices") or ():
                c["logprobs"] = None  # asked for the check, not by the client
        headers = self._response_headers(ans.model, ans.degraded)
        if ex.stopped_by_budget:
            ex.fail("budget_exhausted", 200, "budget_exhausted")
            headers.append((b"x-tokenops-budget-exhausted", b"true"))
        self.started = True
        if self.inbound.stream:
            body = encode_chunks(completion_chunks(obj, include_usage=self.inbound.client_wants_usage))
            await send_bytes(self.send, 200, body, [(b"cache-control", b"no-cache"), *headers], SSE_CT)
        else:
            await send_bytes(self.send, 200, orjson.dumps(obj), headers)
        return obj

    def _client_wants_logprobs(self) -> bool:
        lp = self.inbound.body.get("logprobs")
        return bool(lp) if self.inbound.kind == "chat" else lp is not None

    async def _answer_last(self, model: str) -> dict[str, Any] | bytes | None:
        """The last model tried answers unconditionally: whole, or relayed live to a streaming client."""
        from tokenops.gateway.routes import _upstream_error

        if not self.inbound.stream:
            ans = await self._whole(model, self._step_body(stream=False, logprobs=False))
            if ans.error is not None:
                self._step(model, "failed", str(ans.error.code or ans.error.status))
                self._set_route()
                raise ans.error
            self._step(ans.model, "answered")
            return await self._respond_whole(ans)
        ex = self.exchange
        try:
            async with self.gw.cluster.open(
                self._info(model, self.inbound.prompt_tokens_estimate(), True),
                self.ep.path,
                self._step_body(stream=True, logprobs=False),
                self.headers,
                max_wait=self.line.max_wait_s,
                max_queued=self.line.max_queued,
                budget_left=self.exchange.admission.budget_left,
            ) as up:
                ex.model_served, ex.degraded = up.model, up.degraded
                if up.status != 200:
                    raise _upstream_error(up.status, await up.read(), model)
                self._step(up.model, "answered", "streamed")
                headers = self._response_headers(up.model, up.degraded)
                await self.send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [SSE_CT, (b"cache-control", b"no-cache"), *headers],
                    }
                )
                self.started = True
                return await self._relay(up)
        except APIError as err:
            if not self.started:
                self._step(model, "failed", str(err.code or err.status))
                self._set_route()
            raise

    async def _relay(self, up: Any) -> dict[str, Any] | None:
        """Relay the last step's stream to the client."""
        ex = self.exchange
        collected: list[dict[str, Any]] | None = [] if self.collect else None
        await relay_to_client(up.aiter_bytes(), self.send, self.receive, ex, collected)
        # billed under the configured name (not the backend's served name); metrics count it too
        ex.model_served = self.inbound.model = up.model
        return assemble_stream(collected) if collected else None
