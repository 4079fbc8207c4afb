"""Capability profiles: run task suites against models and keep, per model, category x level ->
accuracy, mean tokens, cost and latency.

This module owns the model endpoint description (`ModelEndpoint`: an OpenAI-compatible base URL, the
gateway or an engine, spoken to through the official `openai` SDK, as chat or as text completion),
the per-item outcomes of a run (`ItemResult`), their aggregation (`Profile`), and their storage in
the database (`ProfileStore`: two tables of its own on its own SQLAlchemy MetaData, created with
`create_all`; no Alembic migration needed). It does not generate or check items (suites.py) and does
not route (routers.py), but the per-item outcomes it stores are what the learned router trains on.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from tokenops.fusion.suites import Mode, TaskItem

# ---------------------------------------------------------------------------------------------
# Endpoints and calls


@dataclass(frozen=True, slots=True)
class ModelEndpoint:
    """A model reachable through an OpenAI-compatible API, and what its tokens cost."""

    name: str  # the name profiles and plans use
    base_url: str  # ending in /v1
    mode: Mode = "chat"  # "completion" for base models (no chat template)
    served_name: str | None = None  # the `model` field sent (default: name)
    api_key: str = "none"
    input_price: float = 0.0  # currency units per million input tokens
    output_price: float = 0.0  # currency units per million output tokens

    @property
    def model_field(self) -> str:
        return self.served_name or self.name

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.input_price + completion_tokens * self.output_price) / 1e6

    @classmethod
    def parse(cls, spec: str) -> ModelEndpoint:
        """`name=URL[,mode=completion][,served=NAME][,in=PRICE][,out=PRICE][,key=KEY]` (the CLI's --model)."""
        head, _, rest = spec.partition(",")
        name, eq, url = head.partition("=")
        if not eq or not url.startswith(("http://", "https://")):
            raise ValueError(f"model spec {spec!r}: expected NAME=http://host:port/v1[,mode=completion,...]")
        opts = dict(p.split("=", 1) for p in rest.split(",") if "=" in p)
        mode = opts.get("mode", "chat")
        if mode not in ("chat", "completion"):
            raise ValueError(f"model spec {spec!r}: mode must be chat or completion")
        return cls(
            name=name,
            base_url=url.rstrip("/"),
            mode=mode,  # type: ignore[arg-type]
            served_name=opts.get("served"),
            api_key=opts.get("key", "none"),
            input_price=float(opts.get("in", 0.0)),
            output_price=float(opts.get("out", 0.0)),
        )

    def client(self, timeout_s: float = 600.0) -> Any:
        from openai import AsyncOpenAI

        # no retries: a retried generation doubles the load on a busy server, and a failed call is
        # recorded (as a wrong answer, with its error) rather than hidden
        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=timeout_s, max_retries=0)


@dataclass(slots=True)
class Completion:
    """One answer from one model, with what it cost to produce."""

    model: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    cost: float
    token_logprobs: list[float] = field(default_factory=list)


async def complete(
    client: Any,
    endpoint: ModelEndpoint,
    prompt: str,
    *,
    max_tokens: int,
    stop: Iterable[str] | None = None,
    temperature: float = 0.0,
    logprobs: bool = False,
    seed: int | None = None,
) -> Completion:
    """Ask one model once (chat: one user message; completion: the raw prompt)."""
    started = time.perf_counter()
    extra: dict[str, Any] = {} if seed is None else {"seed": seed}
    # optional fields are left out rather than sent as null: strict servers refuse a null boolean
    if endpoint.mode == "chat":
        if logprobs:
            extra["logprobs"] = True
        resp = await client.chat.completions.create(
            model=endpoint.model_field,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=temperature,
            **extra,
        )
        choice = resp.choices[0]
        text = choice.message.content or ""
        lps = [t.logprob for t in (choice.logprobs.content or [])] if logprobs and choice.logprobs else []
    else:
        if logprobs:
            extra["logprobs"] = 1
        if stop:
            extra["stop"] = list(stop)[:4]
        resp = await client.completions.create(
            model=endpoint.model_field,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            **extra,
        )
        choice = resp.choices[0]
        text = choice.text or ""
        lps = (
            [x for x in (choice.logprobs.token_logprobs or []) if x is not None]
            if logprobs and choice.logprobs
            else []
        )
    usage = resp.usage
    pt = usage.prompt_tokens if usage else 0
    ct = usage.completion_tokens if usage else 0
    return Completion(
        model=endpoint.name,
        text=text,
        prompt_tokens=pt,
        completion_tokens=ct,
        latency_s=time.perf_counter() - started,
        cost=endpoint.cost(pt, ct),
        token_logprobs=lps,
    )


# ---------------------------------------------------------------------------------------------
# Running a suite


@dataclass(slots=True)
class ItemResult:
    """One model's outcome on one item."""

    model: str
    item_id: str
    category: str
    level: int
    prompt: str  # the prompt text as a chat model sees it (what routers embed)
    correct: bool
    output: str
    prompt_tokens: int
    completion_tokens: int
    cost: float
    latency_s: float
    error: str | None = None


async def run_items(
    endpoint: ModelEndpoint,
    items: list[TaskItem],
    *,
    concurrency: int = 4,
    on_done: Callable[[ItemResult], None] | None = None,
    timeout_s: float = 600.0,
) -> list[ItemResult]:
    """Ask `endpoint` every item (greedy decoding) and check each answer; results in item order."""
    client = endpoint.client(timeout_s)
    sem = asyncio.Semaphore(concurrency)

    async def one(item: TaskItem) -> ItemResult:
        async with sem:
            try:
                c = await complete(
                    client,
                    endpoint,
                    item.prompt(endpoint.mode),
                    max_tokens=item.max_tokens,
                    stop=item.stop if endpoint.mode == "completion" else None,
                )
            except Exception as exc:  # a failed call is a wrong answer, recorded with its reason
                r = ItemResult(
                    endpoint.name,
                    item.id,
                    item.category,
                    item.level,
                    item.instruction,
                    False,
                    "",
                    0,
                    0,
                    0.0,
                    0.0,
                    error=f"{type(exc).__name__}: {exc}"[:500],
                )
            else:
                correct = await asyncio.to_thread(item.is_correct, c.text, endpoint.mode)
                r = ItemResult(
                    endpoint.name,
                    item.id,
                    item.category,
                    item.level,
                    item.instruction,
                    correct,
                    c.text,
                    c.prompt_tokens,
                    c.completion_tokens,
                    c.cost,
                    c.latency_s,
                )
        if on_done is not None:
            on_done(r)
        return r

    try:
        return list(await asyncio.gather(*(one(i) for i in items)))
    finally:
        await client.close()


# ---------------------------------------------------------------------------------------------
# Aggregation


@dataclass(frozen=True, slots=True)
class Cell:
    """One category x level of a profile."""

    n: int
    accuracy: float
    mean_prompt_tokens: float
    mean_completion_tokens: float
    mean_cost: float
    mean_latency_s: float


@dataclass(slots=True)
class Profile:
    model: str
    run_id: str
    cells: dict[tuple[str, int], Cell]

    @property
    def accuracy(self) -> float:
        n = sum(c.n for c in self.cells.values())
        return sum(c.accuracy * c.n for c in self.cells.values()) / n if n else 0.0


def aggregate(model: str, run_id: str, results: list[ItemResult]) -> Profile:
    groups: dict[tuple[str, int], list[ItemResult]] = {}
    for r in results:
        groups.setdefault((r.category, r.level), []).append(r)
    cells = {
        key: Cell(
            n=len(rs),
            accuracy=sum(r.correct for r in rs) / len(rs),
            mean_prompt_tokens=statistics.fmean(r.prompt_tokens for r in rs),
            mean_completion_tokens=statistics.fmean(r.completion_tokens for r in rs),
            mean_cost=statistics.fmean(r.cost for r in rs),
            mean_latency_s=statistics.fmean(r.latency_s for r in rs),
        )
        for key, rs in sorted(groups.items())
    }
    return Profile(model=model, run_id=run_id, cells=cells)


# ---------------------------------------------------------------------------------------------
# Storage

metadata = sa.MetaData()

runs_table = sa.Table(
    "fusion_profile_runs",
    metadata,
    sa.Column("run_id", sa.String(40), primary_key=True),
    sa.Column("model", sa.String(200), nullable=False, index=True),
    sa.Column("mode", sa.String(16), nullable=False),
    sa.Column("seed", sa.Integer, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)

results_table = sa.Table(
    "fusion_item_results",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column(
        "run_id", sa.String(40), sa.ForeignKey("fusion_profile_runs.run_id"), nullable=False, index=True
    ),
    sa.Column("model", sa.String(200), nullable=False),
    sa.Column("item_id", sa.String(100), nullable=False),
    sa.Column("category", sa.String(32), nullable=False),
    sa.Column("level", sa.Integer, nullable=False),
    sa.Column("prompt", sa.Text, nullable=False),
    sa.Column("correct", sa.Boolean, nullable=False),
    sa.Column("output", sa.Text, nullable=False),
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("completion_tokens", sa.Integer, nullable=False),
    sa.Column("cost", sa.Float, nullable=False),
    sa.Column("latency_s", sa.Float, nullable=False),
    sa.Column("error", sa.Text, nullable=True),
)


class ProfileStore:
    """Profile runs and their per-item results in the platform's database (SQLite or PostgreSQL)."""

    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url, future=True)
        metadata.create_all(self.engine)

    def save(self, model: str, mode: str, seed: int, results: list[ItemResult]) -> str:
        run_id = uuid.uuid4().hex
        with self.engine.begin() as conn:
            conn.execute(
                runs_table.insert().values(
                    run_id=run_id, model=model, mode=mode, seed=seed, created_at=datetime.now(UTC)
                )
            )
            if results:
                conn.execute(
                    results_table.insert(),
                    [
                        {
                            "run_id": run_id,
                            "model": r.model,
                            "item_id": r.item_id,
                            "category": r.category,
                            "level": r.level,
                            "prompt": r.prompt,
                            "correct": r.correct,
                            "output": r.output[:4000],
                            "prompt_tokens": r.prompt_tokens,
                            "completion_tokens": r.completion_tokens,
                            "cost": r.cost,
                            "latency_s": r.latency_s,
                            "error": r.error,
                        }
                        for r in results
                    ],
                )
        return run_id

    def models(self) -> list[str]:
        with self.engine.connect() as conn:
            return sorted({row[0] for row in conn.execute(sa.select(runs_table.c.model))})

    def latest_run(self, model: str) -> str | None:
        q = (
            sa.select(runs_table.c.run_id)
            .where(runs_table.c.model == model)
            .order_by(runs_table.c.created_at.desc())
            .limit(1)
        )
        with self.engine.connect() as conn:
            return conn.execute(q).scalar()

    def results(self, model: str, run_id: str | None = None) -> list[ItemResult]:
        run_id = run_id or self.latest_run(model)
        if run_id is None:
            return []
        cols = [c for c in results_table.c if c.name not in ("id", "run_id")]
        q = sa.select(*cols).where(results_table.c.run_id == run_id).order_by(results_table.c.id)
        with self.engine.connect() as conn:
            return [ItemResult(**row._mapping) for row in conn.execute(q)]

    def profile(self, model: str, run_id: str | None = None) -> Profile | None:
        run_id = run_id or self.latest_run(model)
        if run_id is None:
            return None
        return aggregate(model, run_id, self.results(model, run_id))

    def close(self) -> None:
        self.engine.dispose()
