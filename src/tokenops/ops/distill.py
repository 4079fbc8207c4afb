"""The distillation set: prompts and the strong model's answers, kept for tenants that opted in, and
read back as OpenAI chat fine-tuning JSONL (one `{"messages": [...]}` object a line).

What is worth keeping is decided where the outcome is known (`fusion.executor.RunRecord.distill`):
the answer a cascade escalated to, or the one an ensemble agreed on. This module only stores and
exports; whether a tenant opted in is the gateway's check against `distill.tenants`."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.engine import Connection

from tokenops.ops import models as m

D = m.distill_examples


def record_example(
    conn: Connection, tenant: str, model: str, route: str, reason: str, messages: list[dict[str, Any]]
) -> None:
    conn.execute(
        insert(D).values(
            created_at=datetime.now(UTC),
            tenant=tenant,
            model=model,
            route=route,
            reason=reason,
            messages=messages,
        )
    )


def examples(
    conn: Connection,
    *,
    tenant: str | None = None,
    model: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> Iterator[dict[str, Any]]:
    """The examples matching the filters, oldest first, each as a fine-tuning line's object."""
    q = select(D.c.messages).order_by(D.c.id)
    if tenant is not None:
        q = q.where(D.c.tenant == tenant)
    if model is not None:
        q = q.where(D.c.model == model)
    if since is not None:
        q = q.where(D.c.created_at >= since)
    if until is not None:
        q = q.where(D.c.created_at < until)
    for (messages,) in conn.execute(q):
        yield {"messages": messages}


__all__ = ["record_example", "examples"]
