"""`Operations`, the façade the gateway calls: authenticate a key, admit a request (allowed models,
breaker, RPM/TPM/concurrency on every node of the path, budget reservation, priority class), settle
it (one ledger row, reservation moved to spent, limits corrected, alerts), plus the admin operations
the HTTP admin API and the CLI share. It wires the modules of this package together and holds no
rule of its own beyond the order of the steps.

Round trips: authenticate hits the database only on a key-cache miss (entries live
`key_cache_ttl_s`, default 2 s, renewed ahead of expiry by one background lookup while the key is in
use; concurrent misses of one key share one lookup; revocation through this instance takes effect
at once); admit costs
no database round trip when no node on the path has a budget, else one transaction; settle is one
transaction. Limits cost nothing (in process) or one Redis call each way."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from tokenops.ops import budgets, console_sessions, keys, ledger, tree
from tokenops.ops.alerts import AlertSink, BudgetAlert, SpendRateRule, SpendRates
from tokenops.ops.breaker import (
    BreakerStore,
    InProcessBreaker,
    RedisBreaker,
    SessionBreakerSettings,
    breaker_open,
)
from tokenops.ops.budget_memory import MemoryBudgets
from tokenops.ops.budget_redis import RedisBudgets
from tokenops.ops.budget_redis import encode as budget_redis_encode
from tokenops.ops.db import Database
from tokenops.ops.domain import Admission, AdmissionRequest, LedgerRow, Outcome, Principal, TokenUsage
from tokenops.ops.limits import InProcessLimits, LimitNode, LimitRefusal, LimitStore, RedisLimits
from tokenops.ops.pricing import FREE, Price, cost_micros, output_tokens_affordable, worst_case_micros
from tokenops.ops.responses_store import purge_expired
from tokenops.ops.tree import Node, NodeSettings
from tokenops.ops.usage import usage_report
from tokenops.protocol import APIError

__all__ = [
    "Operations",
    "OpsSettings",
    "TokenUsage",
    "Principal",
    "AdmissionRequest",
    "Admission",
    "Outcome",
    "LedgerRow",
    "Price",
    "SessionBreakerSettings",
]

log = logging.getLogger("tokenops.ops")

CLOSE_SETTLE_WAIT_S = 30.0  # how long close() waits for settles still running
SETTLE_COMMIT_WAIT_S = 2.0  # how long a settle waits for a written-behind row's commit


@dataclass
class OpsSettings:
    database_url: str = "sqlite:///tokenops.db"
    database_schema: str | None = None  # PostgreSQL only: keep the tables in this schema
    redis_url: str | None = None  # set: limits and breaker shared through Redis
    redis_prefix: str = "tokenops:ops:"
    alert_webhook: str | None = None
    alert_webhooks: list[str] = field(default_factory=list)  # every alert goes to each of these too
    spend_rate: SpendRateRule | None = None  # the spend-rate alert's rule (None: off)
    breaker: SessionBreakerSettings = field(default_factory=SessionBreakerSettings)
    default_priority: int = 1
    key_cache_ttl_s: float = 2.0
    concurrency_lease_s: float = 30.0
    reservation_ttl_s: float = 3600.0  # an unsettled reservation is released after this long
    # this gateway's name, stable across its restarts and unique among live gateways: a restart
    # releases the reservations and leases its previous run left (None: nothing is released early)
    instance_id: str | None = None
    sweep_interval_s: float = 60.0
    # where budget counters and reservations live: "auto" (Redis when redis_url is set, else the
    # database), "redis", "memory" (this process: one gateway alone on its database), or "database"
    # (one guarded aggregate row per node and period)
    budget_store: str = "auto"
    db_pool_size: int = 8

    @classmethod
    def coerce(cls, obj: Any) -> OpsSettings:
        """Accept an OpsSettings, a mapping, or any object with some of these attributes (the
        gateway's config section)."""
        if isinstance(obj, cls):
            return obj
        get = obj.get if isinstance(obj, dict) else (lambda k, d=None: getattr(obj, k, d))
        values = {f.name: get(f.name) for f in dataclasses.fields(cls) if get(f.name) is not None}
        sr = values.get("spend_rate")
        if isinstance(sr, dict):
            values["spend_rate"] = SpendRateRule(**sr)
        br = values.get("breaker")
        if isinstance(br, dict):
            values["breaker"] = SessionBreakerSettings(**br)
        elif br is not None and not isinstance(br, SessionBreakerSettings):
            values["breaker"] = SessionBreakerSettings(
                **{
                    f.name: getattr(br, f.name)
                    for f in dataclasses.fields(SessionBreakerSettings)
                    if hasattr(br, f.name)
                }
            )
        return cls(**values)


def _paths(node_path: tuple[str, ...]) -> list[str]:
    """Each node's path on a key's path, root first: ("a", "b") -> ["a", "a/b"]."""
    return ["/".join(node_path[: i + 1]) for i in range(len(node_path))]


def invalid_api_key(message: str) -> APIError:
    return APIError(401, message, type="invalid_request_error", code="invalid_api_key")


def rate_limited(r: LimitRefusal) -> APIError:
    what = {
        "rpm": "requests per minute",
        "tpm": "tokens per minute",
        "max_concurrent": "concurrent requests",
    }[r.limit]
    when = f"Retry after {r.retry_after_header} s"
    if r.frees_by_s is not None:
        # a slot frees as soon as one of the requests ends; the lease bounds it if its gateway died
        when = (
            f"A slot frees when one of them ends, at the latest in {max(1, math.ceil(r.frees_by_s))} s "
            f"(the oldest one's lease); retry after {r.retry_after_header} s"
        )
    return APIError(
        429,
        f"Rate limit reached for '{r.node_path}': {r.limit} = {r.value} {what}. "
        f"{when} or ask for a higher limit.",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": r.retry_after_header},
    )


@dataclass
class _Resolved:
    principal: Principal
    nodes: list[Node]  # root first, the key's own node last
    expires: float
    refresh_at: float = float("inf")  # past this, a use starts one background lookup (refresh ahead)


class Operations:
    def __init__(self, settings: OpsSettings, pricing: dict[str, Price], db: Database) -> None:
        self.settings = settings
        self.pricing = dict(pricing)
        self.db = db
        self.alerts = AlertSink(
            [*([settings.alert_webhook] if settings.alert_webhook else []), *settings.alert_webhooks]
        )
        self.spend_rates = SpendRates(settings.spend_rate) if settings.spend_rate is not None else None
        self.limits: LimitStore
        self.breaker: BreakerStore
        if settings.redis_url:
            self.limits = RedisLimits(settings.redis_url, settings.redis_prefix, settings.concurrency_lease_s)
            self.breaker = RedisBreaker(settings.breaker, settings.redis_url, settings.redis_prefix)
        else:
            self.limits = InProcessLimits(settings.concurrency_lease_s)
            self.breaker = InProcessBreaker(settings.breaker)
        if settings.budget_store not in ("auto", "redis", "memory", "database"):
            raise ValueError(
                f"budget_store must be auto, redis, memory or database, not '{settings.budget_store}'"
            )
        if settings.budget_store == "redis" and not settings.redis_url:
            raise ValueError("budget_store 'redis' needs redis_url")
        self.hot_budgets: RedisBudgets | MemoryBudgets | None = None
        if settings.budget_store == "memory":
            self.hot_budgets = MemoryBudgets(db)
        elif settings.redis_url and settings.budget_store != "database":
            self.hot_budgets = RedisBudgets(
                settings.redis_url, settings.redis_prefix, db, settings.instance_id
            )
        self._alerted: set[tuple[int, str, float]] = set()  # (node, period, level) alerts known recorded
        self._tasks: set[asyncio.Task] = set()
        # admission ids: the instance's prefix, 64 random bits drawn per process (a restarted instance
        # never repeats an id) and a counter: no uuid object and no random syscall per admission
        self._admission_stem = self.admission_prefix + os.urandom(8).hex()
        self._admission_count = itertools.count(1)
        self._sweeper: asyncio.Task | None = None
        self._by_hash: dict[str, _Resolved] = {}
        self._by_key: dict[str, _Resolved] = {}
        # one database lookup per key digest at a time (single flight): when an entry expires under
        # load, the requests that arrive meanwhile wait for that one lookup instead of each queueing
        # its own; `_key_generation` changes on every revocation or tree change, so a lookup that
        # started before one never writes its (possibly stale) answer into the cache
        self._lookups: dict[str, asyncio.Future[_Resolved | None]] = {}
        self._key_generation = 0
        # settles running now: close() lets them finish before the stores they write to close (a
        # gateway answers before it settles, so its last requests settle while it is stopping)
        self._settling = 0

    @classmethod
    async def open(cls, settings: Any = None, pricing: dict[str, Price] | None = None) -> Operations:
        """Connect, run migrations, set up limits (in process or Redis)."""
        s = OpsSettings.coerce(settings if settings is not None else OpsSettings())
        db = Database(s.database_url, schema=s.database_schema, pool_size=s.db_pool_size)
        await db.migrate()
        ops = cls(s, pricing or {}, db)
        await ops.release_previous_run()
        if ops.hot_budgets is not None:
            await ops.hot_budgets.start()
        await ops.sweep()
        ops._sweeper = asyncio.get_running_loop().create_task(ops._sweep_forever())
        return ops

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        deadline = time.monotonic() + CLOSE_SETTLE_WAIT_S
        while self._settling and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._settling:
            log.warning("closing with %d settle(s) still running", self._settling)
        if self._tasks:  # background work, key lookups included
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self.hot_budgets is not None:  # its flusher writes the last settled rows first
            await self.hot_budgets.close()
        await self.alerts.drain()
        await self.limits.close()
        await self.breaker.close()
        self.db.dispose()

    # ------------------------------------------------------------------ hot path

    async def authenticate(self, api_key: str | None) -> Principal:
        if not api_key:
            raise invalid_api_key("Missing API key: send it as 'Authorization: Bearer <key>'.")
        digest = keys.hash_key(api_key)
        cached = self._by_hash.get(digest)
        now = time.monotonic()
        if cached is not None and cached.expires > now:
            if cached.refresh_at <= now and digest not in self._lookups:
                # refresh ahead: this request uses the still valid entry, one background lookup
                # renews it before it expires, so a busy key never waits for the database (a
                # revocation elsewhere still shows within key_cache_ttl_s)
                self._start_lookup(digest, api_key)
            return cached.principal
        pending = self._lookups.get(digest) or self._start_lookup(digest, api_key)
        resolved = await asyncio.shield(pending)  # a cancelled caller leaves the shared lookup running
        if resolved is None:
            raise invalid_api_key(
                "Incorrect or revoked API key. Check the key, or ask an admin for a new one."
            )
        return resolved.principal

    def _start_lookup(self, digest: str, api_key: str) -> asyncio.Future[_Resolved | None]:
        fut = asyncio.ensure_future(self._lookup(digest, api_key, self._key_generation))
        self._lookups[digest] = fut
        self._tasks.add(fut)  # close() waits for it, also after a revocation forgot it here
        fut.add_done_callback(self._tasks.discard)

        def done(f: asyncio.Future) -> None:
            if self._lookups.get(digest) is f:
                del self._lookups[digest]
            if not f.cancelled() and f.exception() is not None:  # retrieved: a refresh has no waiter
                log.warning("key lookup failed: %r", f.exception())

        fut.add_done_callback(done)
        return fut

    async def _lookup(self, digest: str, api_key: str, generation: int) -> _Resolved | None:
        found = await self.db.run(keys.lookup_key, api_key)
        current = generation == self._key_generation
        if found is None:
            if current:
                self._by_hash.pop(digest, None)
            return None
        info, nodes = found
        now = time.monotonic()
        ttl = self.settings.key_cache_ttl_s
        resolved = _Resolved(self._principal(info.id, info.name, nodes), nodes, now + ttl, now + ttl / 2)
        if current:
            if len(self._by_hash) > 50_000:
                self._by_hash.clear()
                self._by_key.clear()
            self._by_hash[digest] = resolved
            self._by_key[info.id] = resolved
        return resolved

    def _principal(self, key_id: str, key_name: str, nodes: list[Node]) -> Principal:
        priority = self.settings.default_priority
        for n in reversed(nodes):  # the nearest node that sets a class wins
            if n.settings.priority is not None:
                priority = n.settings.priority
                break
        return Principal(
            key_id=key_id,
            node_path=tuple(n.name for n in nodes),
            key_name=key_name,
            node_ids=tuple(n.id for n in nodes),
            priority=priority,
        )

    async def _nodes_of(self, principal: Principal, stale_ok: bool = False) -> list[Node]:
        cached = self._by_key.get(principal.key_id)
        now = time.monotonic()
        if cached is not None and (stale_ok or cached.expires > now):
            return cached.nodes
        path = "/".join(principal.node_path)
        nodes = await self.db.run(tree.load_path, path)
        if not nodes or nodes[-1].path != path:
            raise invalid_api_key("This API key no longer exists.")
        self._by_key[principal.key_id] = _Resolved(principal, nodes, now + self.settings.key_cache_ttl_s)
        return nodes

    async def history_budget(self, principal: Principal) -> int | None:
        """The compaction budget the tenant tree sets for this key's agent sessions (None: none)."""
        return tree.history_budget(await self._nodes_of(principal))

    def price_of(self, model: str) -> Price:
        return self.pricing.get(model, FREE)

    async def admit(self, principal: Principal, req: AdmissionRequest) -> Admission:
        nodes = await self._nodes_of(principal)
        for n in nodes:
            allowed = n.settings.allowed_models
            if allowed is not None and req.model not in allowed:
                raise APIError(
                    403,
                    f"The model '{req.model}' is not allowed for '{n.path}'. "
                    f"Allowed: {', '.join(allowed) or 'none'}.",
                    type="invalid_request_error",
                    code="model_not_allowed",
                    param="model",
                )
        session = f"{principal.key_id}:{req.session_id}" if req.session_id else None
        if session is not None:
            tripped = await self.breaker.check(session, req.fingerprint or "")
            if tripped is not None:
                raise breaker_open(req.session_id or "", tripped[0], tripped[1])

        prompt = max(0, int(req.prompt_tokens_upper))
        max_out = req.max_tokens if req.max_tokens else max(1, int(req.context_window) - prompt)
        for n in nodes:  # a request never asks for more tokens than a node's whole TPM
            if n.settings.tpm is not None:
                if n.settings.tpm < prompt + 1:
                    raise APIError(
                        429,
                        f"This request ({prompt} prompt tokens) is larger than the tpm limit of '{n.path}' "
                        f"({n.settings.tpm} tokens per minute). "
                        "Shorten the prompt or ask for a higher limit.",
                        type="rate_limit_error",
                        code="rate_limit_exceeded",
                    )
                max_out = min(max_out, n.settings.tpm - prompt)

        admission_id = f"{self._admission_stem}{next(self._admission_count):016x}"
        limit_nodes = [
            LimitNode(n.id, n.path, n.settings.rpm, n.settings.tpm, n.settings.max_concurrent)
            for n in nodes
            if n.settings.rpm or n.settings.tpm or n.settings.max_concurrent
        ]
        tokens = prompt + max_out
        if limit_nodes:
            refusal = await self.limits.acquire(admission_id, limit_nodes, tokens)
            if refusal is not None:
                raise rate_limited(refusal)

        price = req.price if req.price is not None else self.price_of(req.model)
        now = datetime.now(UTC)
        holds = [
            budgets.BudgetHold(
                n.id,
                n.path,
                budgets.period_key(n.settings.budget_period or "month", now),
                n.settings.budget_micros,
            )
            for n in nodes
            if n.settings.budget_micros is not None
        ]
        wanted = worst_case_micros(price, prompt, max_out)
        reserved = wanted
        budget_limited = False
        budget_left: float | None = None
        if holds:
            minimal = worst_case_micros(price, prompt, 1)

            def shrink(headroom: int) -> int:
                return worst_case_micros(
                    price, prompt, min(max_out, output_tokens_affordable(price, prompt, headroom))
                )

            if self.hot_budgets is not None:

                def write_ahead(amount: int) -> str:
                    return self._write_ahead(principal, req, admission_id, amount, holds)

                fut = asyncio.ensure_future(
                    self.hot_budgets.reserve(
                        holds,
                        wanted,
                        shrink,
                        minimal,
                        admission_id,
                        self.settings.reservation_ttl_s,
                        write_ahead,
                    )
                )
            else:
                expires = now + timedelta(seconds=self.settings.reservation_ttl_s)
                fut = asyncio.ensure_future(
                    self.db.run(budgets.reserve, holds, wanted, shrink, minimal, admission_id, expires)
                )
            try:
                # shielded: a caller cancelled mid-transaction must not leave a reservation nobody settles
                reservation = await asyncio.shield(fut)
            except asyncio.CancelledError:
                self._spawn(
                    self._release_orphan(
                        fut, admission_id, [(h.node_id, h.period) for h in holds], limit_nodes, tokens
                    )
                )
                raise
            except BaseException:
                if limit_nodes:
                    await self.limits.settle(admission_id, limit_nodes, tokens, 0)
                raise
            reserved, budget_left = reservation.amount, reservation.left
            if reserved < wanted:
                max_out = max(1, min(max_out, output_tokens_affordable(price, prompt, reserved)))
                budget_limited = True
        return Admission(
            id=admission_id,
            principal=principal,
            model=req.model,
            priority=principal.priority,
            reserved_micros=reserved,
            max_output_tokens=max_out,
            budget_limited=budget_limited,
            budget_left=budget_left,
            session_id=req.session_id,
            reserved_tokens=tokens,
            prompt_tokens_upper=prompt,
            max_reasoning_tokens=tree.reasoning_cap(nodes),
            holds=[(h.node_id, h.period) for h in holds],
            limit_nodes=limit_nodes,
        )

    def _write_ahead(
        self,
        principal: Principal,
        req: AdmissionRequest,
        admission_id: str,
        amount: int,
        holds: list[budgets.BudgetHold],
    ) -> str:
        """The ledger row this admission is settled as should its gateway die before settling it:
        no tokens known, nothing billed, its reservation noted (an operator can reconcile it)."""
        admission = Admission(
            id=admission_id,
            principal=principal,
            model=req.model,
            priority=principal.priority,
            reserved_micros=amount,
            max_output_tokens=0,
            budget_limited=False,
            session_id=req.session_id,
        )
        lost = Outcome(
            model_served=req.model,
            usage=TokenUsage(),
            status="gateway_lost",
            http_status=0,
            error_code="gateway_lost",
        )
        _, values, _ = ledger.make_row(admission, lost, FREE, 0, None)
        return budget_redis_encode(values, [(h.node_id, h.period) for h in holds])

    async def _release_orphan(
        self,
        fut: asyncio.Future,
        admission_id: str,
        holds: list[tuple[int, str]],
        limit_nodes: list,
        tokens: int,
    ) -> None:
        try:
            await fut
        except BaseException:
            pass  # the reservation failed: nothing is held in the database
        else:
            if self.hot_budgets is not None:
                await self.hot_budgets.release(admission_id)
            else:
                await self.db.run(budgets.commit, admission_id, holds, 0)
        finally:
            if limit_nodes:
                await self.limits.settle(admission_id, limit_nodes, tokens, 0)

    def _spawn(self, coro) -> None:  # noqa: ANN001
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def admission_prefix(self) -> str:
        """What every admission id of this instance starts with (a short digest of instance_id)."""
        if self.settings.instance_id is None:
            return "adm-"
        return "adm-" + hashlib.blake2b(self.settings.instance_id.encode(), digest_size=5).hexdigest() + "-"

    async def release_previous_run(self) -> tuple[int, int]:
        """At start-up: release the budget reservations and concurrency leases this instance's
        previous run left unsettled (it was killed); returns (reservations, leases) released."""
        if self.settings.instance_id is None:
            return 0, 0
        prefix = self.admission_prefix
        held = await self.db.run(budgets.release_instance, prefix)
        leases = await self.limits.release_instance(prefix)
        if held or leases:
            log.warning(
                "released %d budget reservation(s) and %d concurrency lease(s) left by this instance's "
                "previous run",
                held,
                leases,
            )
        return held, leases

    async def sweep(self) -> int:
        """Release reservations whose admission was never settled within `reservation_ttl_s` (a
        gateway that died mid-request); returns how many node reservations were released (with
        Redis budgets: how many open admissions, those of gateways gone settled from their
        write-ahead rows)."""
        n = await self.db.run(budgets.sweep_expired, datetime.now(UTC))
        if self.hot_budgets is not None:
            n += await self.hot_budgets.sweep()
        if n:
            log.warning("released %d expired budget reservation(s) of unsettled admissions", n)
        await self.db.run(purge_expired)  # stored responses past their expiry (refused already)
        return n

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                await self.sweep()
            except Exception:  # a failed sweep is retried next interval
                log.exception("reservation sweep failed")

    async def settle(self, admission: Admission, outcome: Outcome) -> LedgerRow:
        """Commit the actual cost, release the rest, write one ledger row (idempotent per
        admission id: a repeat returns the first row and moves nothing)."""
        self._settling += 1
        try:
            return await self._settle(admission, outcome)
        finally:
            self._settling -= 1

    async def _settle(self, admission: Admission, outcome: Outcome) -> LedgerRow:
        price = self.pricing.get(outcome.model_served) or self.price_of(admission.model)
        side_micros = sum(cost_micros(self.price_of(c.model), c.usage) for c in outcome.side_calls)
        # alert thresholds only: settings cached at admit are good enough (no extra round trip)
        nodes = (
            {n.id: n for n in (await self._nodes_of(admission.principal, stale_ok=True))}
            if admission.holds
            else {}
        )
        first = True
        try:
            hot = self.hot_budgets
            if hot is not None and (admission.holds or hot.durable_settle):
                result = await hot.settle(admission, outcome, price, side_micros)
                fired = await self._alerts_after(result.spent_after, nodes)
            else:
                result, fired = await self.db.run(
                    self._settle_tx, admission, outcome, price, nodes, side_micros
                )
            first = result.first
        finally:
            if first and admission.limit_nodes:
                actual = sum(
                    u.prompt_tokens + u.completion_tokens
                    for u in [outcome.usage, *(c.usage for c in outcome.side_calls)]
                )
                await self.limits.settle(
                    admission.id, admission.limit_nodes, admission.reserved_tokens, actual
                )
        if first:
            if result.row.cost_micros > admission.reserved_micros:
                log.warning(
                    "admission %s settled %d micro-units above its reservation of %d "
                    "(served more than admitted)",
                    admission.id,
                    result.row.cost_micros - admission.reserved_micros,
                    admission.reserved_micros,
                )
            if admission.session_id:
                await self.breaker.record_spend(
                    f"{admission.principal.key_id}:{admission.session_id}", result.row.cost_micros
                )
            for alert in fired:
                self.alerts.fire(alert)
            try:
                await self._check_spend_rate(admission, result.row.cost_micros)
            except Exception:  # an alert's bookkeeping never fails a settled request
                log.exception("spend-rate alert check failed")
        if result.written is not None:
            # the row is durable before the caller answers; a database that stays down delays no
            # answer longer than this (the row stays queued, its write-ahead row covers a crash)
            try:
                await asyncio.wait_for(asyncio.shield(result.written), SETTLE_COMMIT_WAIT_S)
            except TimeoutError:
                log.warning(
                    "admission %s: its ledger row is not committed yet, answering anyway", admission.id
                )
        return result.row

    async def _alerts_after(
        self, spent_after: list[tuple[int, str, int]], nodes: dict[int, Node]
    ) -> list[BudgetAlert]:
        """The alerts a hot-path settle crossed: each level recorded once per (node, level, period) in
        the database, which is asked only the first time this gateway sees that level passed."""
        crossed = []
        for node_id, period, spent in spent_after:
            n = nodes.get(node_id)
            if n is None or not n.settings.budget_micros:
                continue
            for level in n.settings.alert_levels():
                key = (node_id, period, level)
                if key not in self._alerted and spent >= level * n.settings.budget_micros:
                    self._alerted.add(key)
                    crossed.append((n, period, spent, level))
        fired = []
        for n, period, spent, level in crossed:
            budget = n.settings.budget_micros or 0
            if await self.db.run(ledger.record_alert, n.id, "budget", level, period, spent, budget):
                fired.append(BudgetAlert(n.path, period, spent, budget, level))
        return fired

    @staticmethod
    def _settle_tx(
        conn,
        admission: Admission,
        outcome: Outcome,
        price: Price,
        nodes: dict[int, Node],
        side_micros: int = 0,
    ):  # noqa: ANN001, ANN205
        result = ledger.settle(conn, admission, outcome, price, side_micros)
        fired: list[BudgetAlert] = []
        for node_id, period, spent in result.spent_after:
            n = nodes.get(node_id)
            budget = n.settings.budget_micros if n is not None else None
            if not budget:
                continue
            for level in n.settings.alert_levels():  # every threshold crossed, each once per period
                if spent >= level * budget and ledger.record_alert(
                    conn, node_id, "budget", level, period, spent, budget
                ):
                    fired.append(BudgetAlert(n.path, period, spent, budget, level))
        return result, fired

    async def _check_spend_rate(self, admission: Admission, cost: int) -> None:
        """The spend-rate alert of every node on the key's path; one database insert, only when a
        node's rate is above its rule (in process otherwise)."""
        rates = self.spend_rates
        if rates is None or cost <= 0:
            return
        over = []
        for node_id, path in zip(
            admission.principal.node_ids, _paths(admission.principal.node_path), strict=False
        ):
            crossed = rates.add(node_id, cost)
            if crossed is not None:
                over.append((node_id, path, *crossed))
        if not over:
            return
        hour = datetime.fromtimestamp(rates.clock(), UTC).strftime("%Y-%m-%dT%H")
        multiple = rates.rule.multiple

        def tx(conn):  # noqa: ANN001, ANN202
            return [
                BudgetAlert(path, hour, spend, limit, multiple, kind="spend_rate")
                for node_id, path, spend, limit in over
                if ledger.record_alert(conn, node_id, "spend_rate", multiple, hour, spend, limit)
            ]

        for alert in await self.db.run(tx):
            self.alerts.fire(alert)

    async def release(self, admission: Admission) -> None:
        """A refusal after admit with nothing produced: settle with zero usage."""
        await self.settle(
            admission,
            Outcome(model_served=admission.model, usage=TokenUsage(), status="released", http_status=0),
        )

    # ------------------------------------------------------------------ admin

    def _forget_cached_keys(self) -> None:
        self._by_hash.clear()
        self._by_key.clear()
        self._lookups.clear()  # requests from now on look the key up afresh
        self._key_generation += 1

    @staticmethod
    def _settings(limits: NodeSettings | dict[str, Any] | None) -> NodeSettings:
        return limits if isinstance(limits, NodeSettings) else NodeSettings.from_dict(limits)

    async def create_node(
        self, parent_path: str | tuple[str, ...] | None, name: str, limits: NodeSettings | dict | None = None
    ) -> Node:
        return await self.db.run(tree.create_node, parent_path, name, self._settings(limits))

    async def update_node(self, path: str | tuple[str, ...], changes: dict[str, Any]) -> Node:
        node = await self.db.run(tree.update_node, path, changes)
        self._forget_cached_keys()
        return node

    async def get_node(self, path: str | tuple[str, ...]) -> Node:
        return await self.db.run(tree.get_node, path)

    async def node_status(self, path: str | tuple[str, ...]) -> dict[str, Any]:
        """A node's settings plus its current period's spent and reserved micro-units."""

        def tx(conn):  # noqa: ANN001, ANN202
            node = tree.get_node(conn, path)
            out = node.to_dict()
            if node.settings.budget_micros is not None:
                period = budgets.period_key(node.settings.budget_period or "month", datetime.now(UTC))
                spent, reserved = budgets.node_usage(conn, node.id, period)
                out.update(period=period, spent_micros=spent, reserved_micros=reserved)
            return out

        out = await self.db.run(tx)
        if self.hot_budgets is not None and "period" in out:
            live = await self.hot_budgets.usage(out["id"], out["period"])
            if live is not None:
                out.update(spent_micros=live[0], reserved_micros=live[1])
        return out

    async def create_key(
        self,
        node_path: str | tuple[str, ...],
        name: str,
        limits: NodeSettings | dict | None = None,
        scopes: list[str] | tuple[str, ...] | None = None,
    ) -> tuple[str, keys.KeyInfo]:
        return await self.db.run(keys.create_key, node_path, name, self._settings(limits), scopes)

    async def get_key(self, key_id: str) -> keys.KeyInfo | None:
        return await self.db.run(keys.get_key, key_id)

    async def admin_reader(self, api_key: str) -> keys.KeyInfo | None:
        """The live key behind `api_key` when it carries the read-only admin scope, else None."""
        return await self.db.run(keys.lookup_scoped, api_key, keys.ADMIN_READ)

    async def open_console_session(
        self, role: console_sessions.Role, key_id: str | None, ttl_s: float
    ) -> console_sessions.ConsoleSession:
        return await self.db.run(console_sessions.open_session, role, key_id, ttl_s)

    async def console_session(self, session_id: str) -> console_sessions.ConsoleSession | None:
        return await self.db.run(console_sessions.find_session, session_id)

    async def close_console_session(self, session_id: str) -> None:
        await self.db.run(console_sessions.close_session, session_id)

    async def revoke_key(self, key_id: str) -> keys.KeyInfo:
        info = await self.db.run(keys.revoke_key, key_id)
        self._forget_cached_keys()
        return info

    async def list_nodes(self, kind: str | None = "node") -> list[Node]:
        """Tenant nodes (kind "node"), keys' own nodes ("key"), or all of them (None)."""
        return await self.db.run(tree.list_nodes, kind)

    async def list_keys(self, under: str | None = None) -> list[keys.KeyInfo]:
        return await self.db.run(keys.list_keys, under)

    async def usage(
        self,
        group_by: list[str] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        tenant: str | None = None,
        under: str | None = None,
    ) -> list[dict[str, Any]]:
        return await self.db.run(usage_report, group_by, since, until, tenant, under)
