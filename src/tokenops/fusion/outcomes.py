"""Cascade outcomes as router labels: every escalation says the cheap answer was not good enough,
every accepted cheap answer says it was.

This module owns `CascadeOutcome` (one cheap tier's verdict on one request), `OutcomeLearning`
(which tenants opted in to having their cascades kept, and which of them also allow the answer text,
for a distillation set) and `OutcomeStore` (one table, `fusion_cascade_outcomes`, on its own
SQLAlchemy MetaData in the platform's database, SQLite or PostgreSQL, created with `create_all` like
the profile tables). Only opted-in tenants are recorded; without the answer opt-in the row has the
question and the verdict but no answer. `examples()` turns the rows into the `LabelledExample`s every
router's `fit` takes. It does not train or evaluate (retrain.py) or decide anything on the request
path.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import sqlalchemy as sa

from tokenops.fusion.routers import LabelledExample
from tokenops.ops.db import engine_url

metadata = sa.MetaData()

outcomes_table = sa.Table(
    "fusion_cascade_outcomes",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("route", sa.String(128), nullable=False),
    sa.Column("model", sa.String(128), nullable=False),  # the cheap tier whose answer was judged
    sa.Column("prompt", sa.Text, nullable=False),  # what the router scores: the last user message
    sa.Column("cheap_ok", sa.Boolean, nullable=False),
    sa.Column("reason", sa.String(256), nullable=True),  # why it was rejected
    sa.Column("answer", sa.Text, nullable=True),  # only with the tenant's answer (distillation) opt-in
    sa.Index("ix_fusion_cascade_outcomes_route", "route", "id"),
)

MAX_PROMPT_CHARS = 8000
MAX_ANSWER_CHARS = 8000


@dataclass(frozen=True, slots=True)
class CascadeOutcome:
    tenant: str
    route: str
    model: str
    prompt: str
    cheap_ok: bool
    reason: str | None = None
    answer: str | None = None


@dataclass(frozen=True, slots=True)
class OutcomeLearning:
    """Who opted in: `tenants` have their cascade verdicts kept; `answer_tenants` (a subset) also
    their cheap answers' text."""

    tenants: frozenset[str] = frozenset()
    answer_tenants: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        stray = self.answer_tenants - self.tenants
        if stray:
            raise ValueError(f"answer opt-in without the outcome opt-in for tenant(s) {sorted(stray)}")

    def admits(self, tenant: str | None) -> bool:
        return tenant is not None and tenant in self.tenants

    def keeps_answer(self, tenant: str | None) -> bool:
        return tenant is not None and tenant in self.answer_tenants


@dataclass(slots=True)
class OutcomeStore:
    url: str
    engine: sa.Engine = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self.engine = sa.create_engine(engine_url(self.url), future=True)
        metadata.create_all(self.engine)

    def record(self, outcomes: Iterable[CascadeOutcome]) -> int:
        rows = [
            {
                "created_at": datetime.now(UTC),
                "tenant": o.tenant[:128],
                "route": o.route[:128],
                "model": o.model[:128],
                "prompt": o.prompt[:MAX_PROMPT_CHARS],
                "cheap_ok": o.cheap_ok,
                "reason": (o.reason or None) and o.reason[:256],  # type: ignore[index]
                "answer": o.answer[:MAX_ANSWER_CHARS] if o.answer is not None else None,
            }
            for o in outcomes
        ]
        if rows:
            with self._lock, self.engine.begin() as conn:
                conn.execute(outcomes_table.insert(), rows)
        return len(rows)

    def outcomes(
        self, route: str | None = None, *, tenant: str | None = None, limit: int | None = None
    ) -> list[CascadeOutcome]:
        """Stored outcomes, oldest first (the latest `limit` when given)."""
        t = outcomes_table
        q = sa.select(t).order_by(t.c.id.desc())
        if route is not None:
            q = q.where(t.c.route == route)
        if tenant is not None:
            q = q.where(t.c.tenant == tenant)
        if limit is not None:
            q = q.limit(limit)
        with self.engine.connect() as conn:
            rows = list(conn.execute(q))
        return [
            CascadeOutcome(r.tenant, r.route, r.model, r.prompt, bool(r.cheap_ok), r.reason, r.answer)
            for r in reversed(rows)
        ]

    def count(self, route: str) -> int:
        t = outcomes_table
        with self.engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).where(t.c.route == route)).scalar_one())

    def close(self) -> None:
        self.engine.dispose()


def examples(outcomes: Iterable[CascadeOutcome]) -> list[LabelledExample]:
    """The labels a router trains on: the question, and whether the cheap answer was kept."""
    return [LabelledExample(o.prompt, o.cheap_ok) for o in outcomes]


class OutcomeRecorder:
    """Writes outcomes from a thread of its own, so the request path only enqueues them."""

    def __init__(self, store: OutcomeStore, max_pending: int = 10_000) -> None:
        import queue

        self.store = store
        self._queue: queue.Queue[list[CascadeOutcome] | None] = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._run, name="fusion-outcomes", daemon=True)
        self._thread.start()
        self.dropped = 0  # outcomes lost to a full queue (the database is slower than the traffic)

    def submit(self, outcomes: list[CascadeOutcome]) -> None:
        import queue

        if not outcomes:
            return
        try:
            self._queue.put_nowait(outcomes)
        except queue.Full:
            self.dropped += len(outcomes)

    def _run(self) -> None:
        import logging

        while (batch := self._queue.get()) is not None:
            try:
                self.store.record(batch)
            except Exception:
                logging.getLogger("tokenops.fusion").exception("cascade outcomes not stored")
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
        self.store.close()


def cascade_outcomes(
    route: str, cheap: str, verdicts: Iterable[tuple[str, bool, str | None, str]], tenant: str | None,
    question: str, learning: OutcomeLearning,
) -> list[CascadeOutcome]:  # fmt: skip
    """The labels one cascade run gives, for an opted-in tenant: the verdict on the route's cheap
    model (a run that started at the strong model, or whose cheap call failed, gives none)."""
    if not learning.admits(tenant) or not question:
        return []
    assert tenant is not None
    keep = learning.keeps_answer(tenant)
    return [
        CascadeOutcome(tenant, route, model, question, ok, reason, answer if keep else None)
        for model, ok, reason, answer in verdicts
        if model == cheap
    ]
