"""Running a `Plan`: the one executor of single models, cascades and ensembles.

This module owns the order of a plan's calls and the decisions between them: a cascade asks its
cheapest model for a whole answer, checks it (rules and log-probs, agreement of a few extra samples,
a verifier) and escalates on a rejection, the last model answering unconditionally; an ensemble asks
every member at once and votes or lets a judge pick, samples in rounds until the answers agree
(self-consistency), or asks one model for n samples in one call and keeps the one a scorer picks
(best-of-n). It sends nothing itself: every call goes through a `ModelPort` (the gateway's,
over the cluster, or `sdk_port.SdkPort` over the openai SDK), and what a run did (its trace, the
calls whose answer was not returned) is kept in a `RunRecord` the caller holds, so a failed or
cancelled run is still traced and billed. It does not plan (plan.py), price (strategies.py) or
speak HTTP to a client.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from tokenops.fusion.strategies import (
    CascadePolicy,
    EnsemblePolicy,
    Tally,
    agreement,
    judge_prompt,
    judged_index,
    mean_logprob,
    verdict_is_yes,
    verifier_prompt,
    vote,
)
from tokenops.protocol import APIError

if TYPE_CHECKING:
    from tokenops.fusion.plan import Plan


@dataclass(frozen=True, slots=True)
class Step:
    """How one call departs from the client's request: streamed or not, with the chosen tokens'
    log-probs (a check reads them), as sample `sample` (a fresh draw at `temperature`), or as `n`
    samples of one call at `temperature` (best-of-n)."""

    stream: bool = False
    logprobs: bool = False
    sample: int | None = None
    temperature: float | None = None
    n: int | None = None


@dataclass(slots=True)
class Answer:
    """One whole (non-streamed) answer in the OpenAI wire shape, or why there is none."""

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

    @property
    def usage(self) -> dict[str, Any] | None:
        """The backend's `usage` object, if it reported one."""
        return (self.obj or {}).get("usage") or None


@dataclass(frozen=True, slots=True)
class Relay:
    """The last step of a plan whose client reads a stream: the port relays `model`'s answer live."""

    model: str


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


class ModelPort(Protocol):
    """What the executor needs from whoever sends the calls of one request."""

    @property
    def streaming(self) -> bool:
        """The client reads a stream: a cascade's last model is relayed live (`Relay`)."""
        ...

    @property
    def question(self) -> str:
        """The text a verifier or judge is asked about: the last user message, or the prompt."""
        ...

    async def call(self, model: str, step: Step) -> Answer:
        """The client's request, changed by `step`, answered whole by `model`; a failure comes back
        as `Answer.error`, never raised."""
        ...

    async def ask(self, model: str, question: str) -> Answer:
        """A verifier's or judge's short greedy answer to `question`, in the client's request kind."""
        ...


@dataclass(slots=True)
class RunRecord:
    """What one run did: the trace of its steps (`x-tokenops-route`, the ledger's `route`), each
    call's outcome (for the step metric) and the answers that were not returned (billed as side
    calls). The caller keeps it, so it survives a failure or a cancellation."""

    plan: Plan
    trace: list[str] = field(default_factory=list)
    outcomes: list[tuple[str, str]] = field(default_factory=list)  # (model, outcome) per call
    side: list[Answer] = field(default_factory=list)
    # a cascade's checked tiers: (model, answer kept, why not, the answer) -- the router's labels
    verdicts: list[tuple[str, bool, str | None, str]] = field(default_factory=list)
    # an answer worth distilling and why: the one a cascade escalated to ("escalated"), or the one
    # an ensemble's members agreed on ("agreed")
    distill: tuple[Answer, str] | None = None

    def step(self, model: str, outcome: str, detail: str | None = None) -> None:
        """One step of the trace, counted in the step metric too."""
        text = outcome.replace("_", " ")
        if detail:
            # why a step failed or was rejected; how an answer was chosen
            text += f": {detail}" if outcome in ("failed", "rejected") else f", {detail}"
        self.trace.append(f"{model}({text})")
        self.outcomes.append((model, outcome))

    def failed(self, model: str, error: APIError) -> None:
        self.step(model, "failed", str(error.code or error.status))

    def route(self) -> str:
        """The plan and what was tried: one line for the response header and the ledger row."""
        if self.plan.strategy == "single":
            return self.plan.header()
        return f"{self.plan.header()}; tried={' -> '.join(self.trace)}"


async def execute(
    plan: Plan, policy: CascadePolicy | EnsemblePolicy | None, port: ModelPort, record: RunRecord
) -> Answer | Relay:
    """Run `plan` under its route's `policy` (None for a single model) through `port`: the answer
    to return, or the model to relay live. Raises `APIError` when no step could answer (the record
    says what was tried)."""
    if plan.strategy == "cascade":
        assert isinstance(policy, CascadePolicy)
        return await _cascade(plan, policy, port, record)
    if plan.strategy == "ensemble":
        assert isinstance(policy, EnsemblePolicy)
        if policy.aggregate == "self_consistency":
            return await _self_consistency(policy, port, record)
        if policy.aggregate == "best_of_n":
            return await _best_of_n(policy, port, record)
        return await _ensemble(plan, policy, port, record)
    return await _last(plan.model, port, record)


async def _last(model: str, port: ModelPort, record: RunRecord) -> Answer | Relay:
    """The last model tried answers unconditionally: whole, or relayed live to a streaming client."""
    if port.streaming:
        return Relay(model)
    ans = await port.call(model, Step())
    if ans.error is not None:
        record.failed(model, ans.error)
        raise ans.error
    if record.plan.strategy != "single":
        record.step(ans.model, "answered")
    return ans


async def _cascade(plan: Plan, policy: CascadePolicy, port: ModelPort, record: RunRecord) -> Answer | Relay:
    check = policy.check
    tiers = plan.models
    for model in tiers[:-1]:
        ans = await port.call(model, Step(logprobs=check.wants_logprobs))
        if ans.error is not None:
            # a failed step is an escalation, not the client's failure: the next model answers
            record.failed(model, ans.error)
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
            reasons = await _agreement(model, policy, ans, port, record)
        if not reasons and policy.verifier is not None:
            reasons = await _verify(policy.verifier, ans, port, record)
        record.verdicts.append((model, not reasons, reasons[0] if reasons else None, ans.text))
        if not reasons:
            record.step(ans.model, "accepted")
            return ans
        record.side.append(ans)
        record.step(ans.model, "rejected", reasons[0])
    last = await _last(tiers[-1], port, record)
    if isinstance(last, Answer) and record.side:
        record.distill = (last, "escalated")
    return last


async def _agreement(
    model: str, policy: CascadePolicy, ans: Answer, port: ModelPort, record: RunRecord
) -> list[str]:
    """Draw `policy.samples` more answers from `model` at once; [] when enough match the first."""
    extra = await asyncio.gather(
        *(port.call(model, Step(sample=k, temperature=policy.temperature)) for k in range(policy.samples))
    )
    record.side.extend(extra)
    share = agreement(ans.text, [a.text if a.ok else None for a in extra])
    return [] if share >= policy.min_agreement else [f"agreement {share:.2f} < {policy.min_agreement:g}"]


async def _verify(verifier: str, ans: Answer, port: ModelPort, record: RunRecord) -> list[str]:
    """Ask the verifier about the first choice's answer; [] when it says yes."""
    verdict = await port.ask(verifier, verifier_prompt(port.question, ans.text))
    record.side.append(verdict)
    if verdict.error is not None:
        return [f"verifier {verifier} failed"]
    return [] if verdict_is_yes(verdict.text) else [f"verifier {verdict.model} said no"]


async def _ensemble(plan: Plan, policy: EnsemblePolicy, port: ModelPort, record: RunRecord) -> Answer:
    answers = list(await asyncio.gather(*(port.call(m, Step()) for m in plan.models)))
    ok = [a.ok for a in answers]
    if not any(ok):
        for a in answers:
            record.step(a.model, "failed", a.error.code if a.error else "empty")
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
        verdict = await port.ask(
            policy.judge, judge_prompt(port.question, [answers[i].text for i in candidates])
        )
        k = judged_index(verdict.text, len(candidates)) if verdict.error is None else None
        record.side.append(verdict)
        if k is not None:
            picked, how = candidates[k], f"picked by judge {verdict.model}"
        else:
            record.step(policy.judge, "judge_unclear", "no valid pick: vote")
    if picked is None:
        picked, votes = vote([a.text if good else None for a, good in zip(answers, ok, strict=True)])
        how = f"{votes} of {sum(ok)} votes"
        if votes > 1:
            record.distill = (answers[picked], "agreed")
    for i, (a, good) in enumerate(zip(answers, ok, strict=True)):
        if i == picked:
            record.step(a.model, "answered", how)
            continue
        record.side.append(a)
        if good:
            record.step(a.model, "not_picked")
        else:
            record.step(a.model, "failed", a.error.code if a.error else "empty")
    return answers[picked]


async def _self_consistency(policy: EnsemblePolicy, port: ModelPort, record: RunRecord) -> Answer:
    """Sample in rounds until `Tally` is settled; the leading answer's first sample is returned,
    every other sample is a side call. A round in which every sample failed ends the run."""
    models = policy.sample_models()
    tally = Tally(policy.samples, policy.agree)
    answers: list[Answer] = []
    while batch := tally.next_round(policy.round_size):
        new = await asyncio.gather(
            *(
                port.call(models[k], Step(sample=k, temperature=policy.temperature))
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
        first = answers[0]
        record.step(first.model, "failed", first.error.code if first.error else "empty")
        raise first.error or APIError(
            502,
            "No sample of the ensemble answered. Retry the request.",
            type="api_error",
            code="upstream_error",
        )
    picked, votes = tally.leader()
    how = f"{votes} of {len(answers)} votes"
    if votes > 1:
        record.distill = (answers[picked], "agreed")
    if len(answers) < policy.samples:
        how += f", stopped early (max {policy.samples})"
    if failed:
        how += f", {failed} failed"
    for i, a in enumerate(answers):
        if i != picked:  # one step in the trace, but every sample in the step metric
            record.side.append(a)
            record.outcomes.append((a.model, "not_picked" if a.ok else "failed"))
    record.step(answers[picked].model, "answered", how)
    return answers[picked]


async def _best_of_n(policy: EnsemblePolicy, port: ModelPort, record: RunRecord) -> Answer:
    """One call for `samples` choices; the scorer's pick is returned as the only choice, under the
    call's usage (every sample's tokens), so the one ledger row meters them all. Scorer calls are
    side calls."""
    model = policy.models[0]
    ans = await port.call(
        model, Step(logprobs=policy.scorer == "logprob", n=policy.samples, temperature=policy.temperature)
    )
    if ans.error is not None:
        record.failed(model, ans.error)
        raise ans.error
    choices = ans.choices()
    if not choices:
        record.step(ans.model, "failed", "empty")
        raise APIError(502, "The model returned no sample. Retry the request.", type="api_error",
                       code="upstream_error")  # fmt: skip
    texts = [choice_text(c) for c in choices]
    confidence = [mean_logprob(choice_logprobs(c)) for c in choices]
    picked, how = max(range(len(choices)), key=lambda i: (confidence[i], -i)), "highest mean log-prob"
    if policy.scorer == "verifier" and policy.verifier is not None:
        verdicts = await asyncio.gather(
            *(port.ask(policy.verifier, verifier_prompt(port.question, t)) for t in texts)
        )
        record.side.extend(verdicts)
        yes = [i for i, v in enumerate(verdicts) if v.error is None and verdict_is_yes(v.text)]
        picked, how = (yes[0], f"verifier said yes to {len(yes)}") if yes else (0, "verifier said no to all")
    elif policy.scorer == "judge" and policy.judge is not None:
        verdict = await port.ask(policy.judge, judge_prompt(port.question, texts))
        record.side.append(verdict)
        k = judged_index(verdict.text, len(texts)) if verdict.error is None else None
        if k is not None:
            picked, how = k, f"picked by judge {verdict.model}"
        else:
            record.step(policy.judge, "judge_unclear", "no valid pick: first sample")
            picked, how = 0, "first sample"
    record.outcomes.extend((ans.model, "not_picked") for i in range(len(choices)) if i != picked)
    record.step(ans.model, "answered", f"sample {picked + 1} of {len(choices)}, {how}")
    obj = dict(ans.obj or {})
    obj["choices"] = [{**choices[picked], "index": 0}]
    return Answer(ans.model, obj, degraded=ans.degraded)
