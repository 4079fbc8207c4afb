"""The gateway application: its state (`Gateway`) and the ASGI app that dispatches to the endpoints.

This module owns the wiring: which path goes to which endpoint, the lifespan that opens the ops
façade, starts the cluster (replica pools, load poller, health checks) and the response cache and
closes them, and the small endpoints that are not on the hot path (`/health`, `/metrics`,
`/openapi.json`). The request path itself lives in routes.py and stages.py, the admin API in admin.py,
the web console in console/.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenops.cache import ResponseCache
from tokenops.cluster import Cluster, build_cluster
from tokenops.cluster.background import BackgroundTask
from tokenops.cluster.policies import PREFIX_POLICIES
from tokenops.config import Settings
from tokenops.gateway.admin import AdminAuth, build_admin_app
from tokenops.gateway.admission_gate import AdmissionGate
from tokenops.gateway.console.app import build_console_app
from tokenops.gateway.embeddings_endpoint import EmbeddingsEndpoint
from tokenops.gateway.http import (
    Receive,
    Scope,
    Send,
    base_headers,
    next_request_id,
    send_bytes,
    send_error,
    send_json,
)
from tokenops.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from tokenops.gateway.probes import LoopProbe, upstream_trace_config
from tokenops.gateway.responses import ResponsesEndpoint
from tokenops.gateway.routes import CompletionsEndpoint, ModelsEndpoint
from tokenops.protocol import APIError

if TYPE_CHECKING:
    from tokenops.fusion.plan import FusionPlanner
    from tokenops.fusion.relearn import Relearner

log = logging.getLogger("tokenops.gateway")

OPENAPI_FILE = Path(__file__).with_name("openapi.yaml")


async def open_operations(settings: Settings) -> Any:
    """The ops façade for these settings (database and migrations, Redis counters, alerts, breaker)."""
    from tokenops.ops.alerts import SpendRateRule
    from tokenops.ops.pricing import price_table
    from tokenops.ops.service import Operations, OpsSettings, SessionBreakerSettings

    if settings.resolved_database_url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    ops_settings = OpsSettings(
        database_url=settings.resolved_database_url,
        database_schema=settings.database_schema,
        redis_url=settings.redis_url,
        redis_prefix=settings.redis_prefix,
        alert_webhook=settings.alert_webhook,
        alert_webhooks=list(settings.alerts.webhooks),
        spend_rate=SpendRateRule(**settings.alerts.spend_rate.model_dump())
        if settings.alerts.spend_rate
        else None,
        breaker=SessionBreakerSettings(**settings.breaker.model_dump()),
        reservation_ttl_s=settings.admission.reservation_ttl_s,
        concurrency_lease_s=settings.admission.concurrency_lease_s,
        instance_id=settings.instance_id,
        budget_store=settings.admission.budget_store,
    )
    return await Operations.open(ops_settings, price_table(settings.pricing()))


def open_cluster(settings: Settings) -> Cluster:
    """Replica pools for every model, with the configured balancing, health, retries and fallbacks."""
    cluster = build_cluster(
        settings.models, settings.cluster, redis_url=settings.redis_url, redis_prefix=settings.redis_prefix
    )
    # the 429 backend_busy contract keeps the queue section's Retry-After
    cluster.retry = dataclasses.replace(cluster.retry, busy_retry_after=settings.queue.retry_after_s)
    return cluster


def open_fusion(settings: Settings) -> FusionPlanner | None:
    """The fusion planner for the configured routes (virtual models), or None when there are none."""
    if not settings.routes:
        return None
    from tokenops.fusion.calibration import ShareCalibrator
    from tokenops.fusion.effort import EffortPolicy
    from tokenops.fusion.ops_rule import OpsRule
    from tokenops.fusion.outcomes import OutcomeLearning, OutcomeRecorder, OutcomeStore
    from tokenops.fusion.plan import FusionPlanner, RouteConfig
    from tokenops.fusion.routers import make_router
    from tokenops.fusion.stored_labels import stored_examples
    from tokenops.fusion.strategies import AnswerCheck, CascadePolicy, EnsemblePolicy

    ONE_MODEL = ("self_consistency", "best_of_n")  # aggregates that sample one model by default

    db_url = settings.resolved_database_url

    def route_config(name: str, r: Any) -> RouteConfig:
        c, e = r.cascade, r.ensemble
        examples = stored_examples(db_url, name, r.cheap, r.strong, r.train_from) if r.train_from else None
        retrains = r.learn is not None and r.learn.retrain is not None
        # a route that retrains serves its last retrained router after a restart
        kind = "learned" if retrains and r.router_model and r.router_model.is_file() else r.router
        router = make_router(kind, labels=r.labels, model_path=r.router_model, examples=examples)
        # a retrained router carries the threshold calibrated with it: the calibrator starts there
        start = getattr(router, "threshold", None)
        return RouteConfig(
            name,
            r.cheap,
            r.strong,
            router,
            target_strong_share=r.target_strong_share,
            calibrator=ShareCalibrator(r.target_strong_share, initial_threshold=start)
            if start is not None
            else None,
            strategy="single" if r.strategy == "route" else r.strategy,
            cascade=CascadePolicy(
                tuple(c.models or (r.cheap, r.strong)),
                AnswerCheck(
                    c.min_logprob,
                    c.logprob_quantile,
                    tuple(c.reject_patterns),
                    c.min_chars,
                    c.reject_truncated,
                ),
                c.max_escalations,
                c.verifier,
                c.samples,
                c.min_agreement,
                c.temperature,
            )
            if r.strategy == "cascade"
            else None,
            ensemble=EnsemblePolicy(
                tuple(e.models or ((r.cheap,) if e.aggregate in ONE_MODEL else (r.cheap, r.strong))),
                e.aggregate,
                e.judge,
                e.samples,
                e.agree,
                e.round_size,
                e.temperature,
                e.scorer,
                e.verifier,
            )
            if r.strategy == "ensemble"
            else None,
            effort=EffortPolicy(**r.reasoning.model_dump()) if r.reasoning is not None else None,
            learning=OutcomeLearning(frozenset(r.learn.tenants), frozenset(r.learn.answer_tenants))
            if r.learn is not None
            else None,
            ops=OpsRule(r.ops.budget_used_at_least, r.ops.priority_at_least) if r.ops else None,
        )

    routes = {name: route_config(name, r) for name, r in settings.routes.items()}
    learns = any(r.learning is not None for r in routes.values())
    return FusionPlanner(routes, OutcomeRecorder(OutcomeStore(db_url)) if learns else None)


def open_relearners(settings: Settings, fusion: FusionPlanner | None) -> list[Relearner]:
    """The scheduled retraining of every learning route with `learn.retrain` set."""
    from tokenops.fusion.outcomes import OutcomeStore
    from tokenops.fusion.relearn import Relearner, RetrainSchedule
    from tokenops.fusion.stored_labels import stored_examples

    if fusion is None:
        return []
    specs = {n: r for n, r in settings.routes.items() if r.learn is not None and r.learn.retrain is not None}
    if not specs:
        return []
    db_url = settings.resolved_database_url
    store = OutcomeStore(db_url)  # one reader for every route's rounds (closed with the gateway)
    out = []
    for name, r in specs.items():
        assert r.learn is not None and r.learn.retrain is not None
        profiles = (
            stored_examples(db_url, name, r.cheap, r.strong, ["profiles"])
            if "profiles" in r.train_from
            else None
        )
        out.append(
            Relearner(
                fusion.routes[name],
                RetrainSchedule(**r.learn.retrain.model_dump()),
                store,
                save_to=r.router_model,
                profile_labels=profiles,
            )
        )
    return out


async def relearn_every(relearner: Relearner, metrics: GatewayMetrics) -> None:
    """A learning route's retraining rounds, one per interval, each off the event loop."""
    name = relearner.route.name
    while True:
        await asyncio.sleep(relearner.schedule.every_s)
        try:
            r = await asyncio.to_thread(relearner.run_round)
        except Exception:  # a database or training error skips a round, never ends the schedule
            log.exception("retraining route %s failed", name)
            metrics.router_retrains.labels(name, "failed").inc()
            continue
        metrics.router_retrains.labels(name, r.result).inc()
        log.log(
            logging.INFO if r.result == "swapped" else logging.DEBUG,
            "route %s: %s, %s",
            name,
            r.result,
            r.reason,
        )


def not_found(path: str) -> APIError:
    return APIError(
        404,
        f"Unknown path '{path}'. The gateway serves /v1/chat/completions, /v1/completions, /v1/responses, "
        "/v1/embeddings and /v1/models.",
        code="unknown_url",
    )


def method_not_allowed(method: str, path: str, allowed: str) -> APIError:
    return APIError(
        405,
        f"{method} is not allowed on '{path}'; use {allowed}.",
        code="method_not_allowed",
        headers={"allow": allowed},
    )


class Gateway:
    """One gateway process's state, and its ASGI entry point."""

    def __init__(
        self,
        settings: Settings,
        *,
        ops: Any = None,
        admin_key_hashes: tuple[str, ...] = (),
        probes: bool = False,
    ) -> None:
        self.settings = settings
        self.probing = probes  # the diagnostic probes (probes.py): loop lag and upstream trace hooks
        self._loop_probe: LoopProbe | None = None
        self.ops = ops
        self._owns_ops = ops is None
        self.started_at = int(time.time())
        self.metrics = GatewayMetrics()
        self.cluster = open_cluster(settings)
        self.metrics.watch_cluster(self.cluster)
        self.fusion = open_fusion(settings)  # None without routes: requests skip planning entirely
        self.relearners = open_relearners(settings, self.fusion)
        self._relearning = [
            BackgroundTask(lambda r=r: relearn_every(r, self.metrics), f"relearn-{r.route.name}")
            for r in self.relearners
        ]
        # tenant-fair waiting for an admission slot per model line (a pass-through while unconfigured)
        self.gate = AdmissionGate(
            settings.fair_queue,
            settings.queue.classes,
            settings.queue.retry_after_s,
            pool_capacity=lambda model: p.capacity() if (p := self.cluster.pools.get(model)) else None,
        )
        # models whose balancing policy reads the prompt's prefix (only their prompts are hashed), with
        # the tokenizer that hashes them in the engine's token blocks (None: text blocks)
        self.prefix_models = {
            name: pool.prompt_tokenizer
            for name, pool in self.cluster.pools.items()
            if getattr(pool.policy, "name", "") in PREFIX_POLICIES
        }
        c = settings.cache
        # None when disabled: requests then skip every cache step (no scope, no headers parsed)
        self.cache: ResponseCache | None = (
            ResponseCache.from_config(c, redis_url=settings.redis_url, registry=self.metrics.registry)
            if c.enabled
            else None
        )
        self._warming: asyncio.Future[None] | None = None
        self.admin_auth = AdminAuth(settings.admin_key, admin_key_hashes)
        self._chat = CompletionsEndpoint(self, "chat")
        self._completions = CompletionsEndpoint(self, "completion")
        self._models = ModelsEndpoint(self)
        self._responses = ResponsesEndpoint(self, self._chat)
        self._admin = build_admin_app(self)
        self._console = build_console_app(self)
        self._routes = {
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/completions": ("POST", self._completions),
            "/v1/models": ("GET", self._models),
            "/v1/responses": ("POST", self._responses),
            "/v1/embeddings": ("POST", EmbeddingsEndpoint(self)),
            "/health": ("GET", self._health),
            "/metrics": ("GET", self._metrics),
            "/openapi.json": ("GET", self._openapi),
        }

    async def startup(self) -> None:
        if self.ops is None:
            self.ops = await open_operations(self.settings)
        await self.cluster.start()
        if self.probing:
            p = self.metrics.enable_probes()
            self._loop_probe = LoopProbe(p.loop_lag, p.loop_pass)
            self._loop_probe.start()
            # the session's trace configs are read per request: the hooks apply from the next one on
            self.cluster.client.trace_configs.append(upstream_trace_config())
        for task in self._relearning:
            task.start()
        if self.cache is not None and self.settings.cache.warm_at_start:
            # the embedder loads in a worker thread while the gateway already serves: a lookup that
            # needs it meanwhile waits for the same load (the embedder's lock), nothing blocks start-up
            self._warming = asyncio.ensure_future(asyncio.to_thread(self.cache.warm))

    async def shutdown(self) -> None:
        if self._loop_probe is not None:
            await self._loop_probe.stop()
        await self.cluster.aclose()
        for task in self._relearning:
            await task.stop()
        if self.relearners:
            self.relearners[0].source.close()  # the one store every route's rounds read
        if self.fusion is not None:
            await asyncio.to_thread(self.fusion.close)  # the last cascade outcomes are written
        if self.cache is not None:
            if self._warming is not None:
                await asyncio.gather(self._warming, return_exceptions=True)
            await self.cache.close()
        if self._owns_ops and self.ops is not None:
            await self.ops.close()
            self.ops = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            route = self._routes.get(path)
            if route is None:
                if path.startswith("/admin"):
                    await self._admin(scope, receive, send)
                    return
                if path.startswith("/console"):
                    await self._console(scope, receive, send)
                    return
                if path.startswith("/v1/models/"):
                    route = self._routes["/v1/models"]
                elif path.startswith("/v1/responses/") and path.rstrip("/") != "/v1/responses":
                    if scope["method"] not in ("GET", "DELETE"):
                        allowed = "GET, DELETE"
                        await send_error(
                            send, method_not_allowed(scope["method"], path, allowed), next_request_id()
                        )
                        return
                    await self._responses(scope, receive, send)
                    return
                elif path.endswith("/") and path.rstrip("/") in self._routes:
                    route = self._routes[path.rstrip("/")]
                else:
                    await send_error(send, not_found(path), next_request_id())
                    return
            method, endpoint = route
            if scope["method"] != method and not (method == "GET" and scope["method"] == "HEAD"):
                await send_error(send, method_not_allowed(scope["method"], path, method), next_request_id())
                return
            await endpoint(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.exception("gateway startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"status": "ok"}, base_headers(next_request_id()))

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 200, self.metrics.render(), [], (b"content-type", CONTENT_TYPE.encode()))

    async def _openapi(self, scope: Scope, receive: Receive, send: Send) -> None:
        import yaml

        await send_json(send, 200, yaml.safe_load(OPENAPI_FILE.read_text()), [])


def create_app(
    settings: Settings, *, ops: Any = None, admin_key_hashes: tuple[str, ...] = (), probes: bool = False
) -> Gateway:
    """The gateway's ASGI app. Pass `ops` to share an already open façade (tests, embedding);
    `probes` turns on the diagnostic probes (probes.py)."""
    return Gateway(settings, ops=ops, admin_key_hashes=admin_key_hashes, probes=probes)
