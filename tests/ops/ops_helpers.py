"""Small shared helpers for the operations tests."""

from __future__ import annotations

from tokenops.ops.domain import AdmissionRequest, Outcome, TokenUsage
from tokenops.ops.pricing import Price
from tokenops.ops.service import Operations, OpsSettings

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/0"
PRICING = {"m1": Price(input=1.0, output=2.0), "free": Price()}


async def open_ops(db_target, **kw) -> Operations:
    url, schema = db_target
    return await Operations.open(OpsSettings(database_url=url, database_schema=schema, **kw), PRICING)


def request(
    prompt=10, max_tokens=10, model="m1", session=None, fingerprint="fp", window=4096
) -> AdmissionRequest:
    return AdmissionRequest(
        model=model,
        prompt_tokens_upper=prompt,
        max_tokens=max_tokens,
        context_window=window,
        session_id=session,
        fingerprint=fingerprint,
    )


def outcome(prompt=10, output=10, cached=0, reasoning=0, model="m1", status="ok") -> Outcome:
    return Outcome(
        model_served=model,
        usage=TokenUsage.from_openai(prompt, output, cached, reasoning),
        status=status,
        finish_reason="stop",
        ttft_ms=5.0,
        latency_ms=20.0,
        http_status=200,
    )
