"""The cluster's section of the configuration, and building a running `Cluster` from it.

`ClusterConfig` is the `cluster:` section of the platform's `Settings`; per model it names the balancing
policy and its knobs, replica weights and load-report kinds, fallback models and degradation rules, plus
pool-wide breaker, concurrency, retry and polling knobs.
`build_cluster(models, config)` turns the gateway's model table (backend URLs, served name, API key,
`max_inflight`, optional local engine replicas) and this section into pools, policies and a `Cluster`. This
module validates and assembles; it does not run anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenops.cluster.concurrency import AIMDConfig, GradientConfig
from tokenops.cluster.degrade import DegradePolicy, DegradeRule
from tokenops.cluster.dispatch import Cluster, RetryConfig
from tokenops.cluster.health import OutlierConfig, ReplicaBreakerSettings
from tokenops.cluster.kv_event_stream import KVEventsEndpoint
from tokenops.cluster.pd_dispatch import PDRoute, pd_policy, prefill_gate
from tokenops.cluster.policies import POLICIES, PREFIX_POLICIES, make_policy
from tokenops.cluster.pool import ReplicaKind, ReplicaPool, ReplicaSpec
from tokenops.cluster.prompt_tokenizer import PromptTokenizer
from tokenops.cluster.session_rounds import LocalSessionRounds, RedisSessionRounds


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KVEventsSource(_Strict):
    """A vLLM replica's KV event stream (its `--kv-events-config` endpoints, as this host reaches them)."""

    endpoint: str  # the PUB socket, e.g. tcp://10.0.0.5:5557
    replay_endpoint: str | None = None  # the ROUTER socket, e.g. tcp://10.0.0.5:5558
    topic: str = ""


class ModelPoolConfig(_Strict):
    policy: str = "prefix_aware"
    policy_options: dict[str, Any] = Field(default_factory=dict)  # e.g. {balance_abs: 8, balance_rel: 1.5}
    weights: dict[str, float] = Field(default_factory=dict)  # backend URL -> weight (default 1)
    kinds: dict[str, ReplicaKind] = Field(default_factory=dict)  # backend URL -> how to read its load
    kv_events: dict[str, KVEventsSource] = Field(default_factory=dict)  # vLLM backend URL -> its KV events
    # the replicas' KV block size in tokens, for prefix hashing (vLLM's --block-size); default: the local
    # engine's block_size arg, else 16
    block_size: int | None = Field(default=None, ge=1)
    fallback: list[str] = Field(default_factory=list)  # models to try, in order, when this pool is down
    degrade_to: str | None = None
    overload_at: float = Field(default=0.9, gt=0)
    budget_below: float = Field(default=0.1, ge=0, le=1)
    shed_at: dict[int, float] = Field(default_factory=dict)  # priority class -> utilisation that sheds it

    @model_validator(mode="after")
    def _known_policy(self) -> ModelPoolConfig:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(sorted(POLICIES))}")
        if any(w <= 0 for w in self.weights.values()):
            raise ValueError("replica weights must be > 0")
        return self


class ReplicaBreakerConfig(_Strict):
    """The `cluster.breaker:` block: each replica's circuit breaker (`health.ReplicaBreakerSettings`)."""

    failure_threshold: int = Field(default=3, ge=1)
    open_s: float = Field(default=5.0, gt=0)
    max_open_s: float = Field(default=30.0, gt=0)
    probe_successes: int = Field(default=2, ge=1)
    slow_start_s: float = Field(default=10.0, ge=0)


class ConcurrencySettings(_Strict):
    algorithm: Literal["aimd", "gradient"] = "aimd"
    initial: int = Field(default=16, ge=1)
    min: int = Field(default=1, ge=1)
    backoff: float = Field(default=0.9, gt=0, lt=1)
    latency_threshold_s: float = Field(default=30.0, gt=0)  # aimd: time to first byte that counts as overload
    tolerance: float = Field(default=1.5, ge=1)  # gradient: short-term TTFB may reach this x long-term
    smoothing: float = Field(default=0.2, gt=0, le=1)  # gradient: weight of each new estimate


class RetrySettings(_Strict):
    attempts: int = Field(default=3, ge=1)
    backoff_base_s: float = Field(default=0.05, ge=0)
    backoff_max_s: float = Field(default=1.0, ge=0)
    first_byte_timeout_s: float = Field(default=120.0, gt=0)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    read_timeout_s: float = Field(default=600.0, gt=0)  # longest silence between chunks once streaming


class ClusterConfig(_Strict):
    models: dict[str, ModelPoolConfig] = Field(default_factory=dict)  # models not named get the defaults
    breaker: ReplicaBreakerConfig = Field(default_factory=ReplicaBreakerConfig)
    concurrency: ConcurrencySettings = Field(default_factory=ConcurrencySettings)
    retry: RetrySettings = Field(default_factory=RetrySettings)
    health_check_interval_s: float = Field(default=2.0, gt=0)
    health_check_timeout_s: float = Field(default=5.0, gt=0)  # generous: a busy CPU engine answers late
    load_poll_interval_s: float = Field(default=1.0, gt=0)
    stale_after_s: float = Field(default=5.0, gt=0)
    queue_timeout_s: float = Field(default=30.0, ge=0)


class ModelLike(Protocol):
    """What `build_cluster` reads from the gateway's per-model config (`tokenops.config.ServedModel`)."""

    served_name: str | None
    api_key: str | None
    max_inflight: int
    engine: Any
    tokenizer: str | None

    def backend_urls(self) -> list[str]: ...


def prompt_tokenizer(model: ModelLike, block_size: int | None = None) -> PromptTokenizer | None:
    """The model's tokenizer for prefix hashing: its `tokenizer:` key, else the model its local
    `tokenops engine` replicas run, hashed in their KV block size (`block_size` engine arg, 16 by
    default, as in our engine and vLLM). None when neither is known: prompts are hashed as text."""
    engine = model.engine
    source = getattr(model, "tokenizer", None) or (engine.model if engine is not None else None)
    if not source:
        return None
    args = engine.args if engine is not None else {}
    block = block_size or args.get("block_size", args.get("block-size", 16))
    return PromptTokenizer(source, int(block))


def _kv_events(source: KVEventsSource | None) -> KVEventsEndpoint | None:
    if source is None:
        return None
    return KVEventsEndpoint(source.endpoint, source.replay_endpoint, source.topic)


def _replica_spec(url: str, rid: str, pc: ModelPoolConfig, m: ModelLike, engines: set[str]) -> ReplicaSpec:
    return ReplicaSpec(
        url=url,
        id=rid,
        weight=pc.weights.get(url, 1.0),
        kind=pc.kinds.get(url, "tokenops" if url in engines else "openai"),
        served_model=m.served_name,
        api_key=m.api_key,
        kv_events=_kv_events(pc.kv_events.get(url)),
    )


def _limits(c: ConcurrencySettings, max_inflight: int) -> AIMDConfig | GradientConfig:
    """Each replica's adaptive concurrency limit, its ceiling `max_inflight`."""
    ceiling = max(1, max_inflight)
    bounds = {
        "initial": min(c.initial, ceiling),
        "min_limit": min(c.min, ceiling, c.initial),
        "max_limit": ceiling,
    }
    if c.algorithm == "gradient":
        return GradientConfig(**bounds, tolerance=c.tolerance, smoothing=c.smoothing, backoff=c.backoff)
    return AIMDConfig(**bounds, backoff=c.backoff, latency_threshold=c.latency_threshold_s)


def build_cluster(
    models: Mapping[str, ModelLike],
    config: ClusterConfig | None = None,
    *,
    redis_url: str | None = None,
    redis_prefix: str = "tokenops:ops:",
) -> Cluster:
    """Pools for every model, with the configured policy, knobs, fallbacks and degradation rules; a
    model with `pd` pools gets a prefill pool and its PD route too (session rounds in Redis when
    `redis_url` is set, so every gateway counts the same rounds)."""
    config = config or ClusterConfig()
    named = set(config.models)
    for pc in config.models.values():
        named |= set(pc.fallback) | ({pc.degrade_to} if pc.degrade_to else set())
    unknown = sorted(named - set(models))
    if unknown:
        raise ValueError(f"the cluster config names models that are not configured: {', '.join(unknown)}")
    b, c = config.breaker, config.concurrency
    breaker = ReplicaBreakerSettings(
        failure_threshold=b.failure_threshold,
        open_seconds=b.open_s,
        max_open_seconds=max(b.max_open_s, b.open_s),
        probe_successes=b.probe_successes,
        slow_start_seconds=b.slow_start_s,
    )
    pools: dict[str, ReplicaPool] = {}
    routes: dict[str, PDRoute] = {}
    fallbacks: dict[str, list[str]] = {}
    rules: dict[str, DegradeRule] = {}
    for name, m in models.items():
        pc = config.models.get(name, ModelPoolConfig())
        pd = getattr(m, "pd", None)
        engine_urls = {u.rstrip("/") for u in m.engine.urls} if m.engine is not None else set()
        if pd is not None:  # PD pools speak the engines' contract: their /v1/load is read too
            engine_urls |= set(pd.prefill) | set(pd.decode)
        specs = [
            _replica_spec(url, f"{name}#{i}", pc, m, engine_urls) for i, url in enumerate(m.backend_urls())
        ]
        prefill_specs = [
            _replica_spec(url, f"{name}/prefill#{i}", pc, m, engine_urls)
            for i, url in enumerate(pd.prefill if pd else ())
        ]
        limits = _limits(c, m.max_inflight)
        # a prefill worker runs at most `pd.prefill_slots` legs at once; the rest wait at the gateway
        prefill_slots = pd.prefill_slots if pd is not None else None
        prefill_limits = limits if prefill_slots is None else _limits(c, prefill_slots)
        tokenizer = prompt_tokenizer(m, pc.block_size) if pc.policy in PREFIX_POLICIES else None
        options = dict(pc.policy_options)
        reporting = all(s.kind == "tokenops" or s.kv_events is not None for s in [*specs, *prefill_specs])
        if tokenizer is not None and "learn" not in options and reporting:
            # every replica reports what it caches (our engines' KV events, vLLM's ZeroMQ stream) and
            # the gateway hashes what they hash: exact mode (measured at least as good as learning
            # from decisions, docs/cluster.md)
            options["learn"] = False
        policy = make_policy(pc.policy, **options)
        # a PD model's prefill pool shares the policy, so its prefix index covers both pools
        decode_pool, prefill_pool = (
            ReplicaPool(
                name,
                replicas,
                policy,
                breaker=breaker,
                concurrency=pool_limits,
                outlier=OutlierConfig(),
                stale_after=config.stale_after_s,
                queue_timeout=config.queue_timeout_s,
                prompt_tokenizer=tokenizer,
            )
            if replicas
            else None
            for replicas, pool_limits in ((specs, limits), (prefill_specs, prefill_limits))
        )
        assert decode_pool is not None
        pools[name] = decode_pool
        if pd is not None:
            rounds = (
                RedisSessionRounds(
                    redis_url, f"{redis_prefix}pd:round:{name}:", f"{redis_prefix}pd:decode:{name}:"
                )
                if redis_url
                else LocalSessionRounds()
            )
            routes[name] = PDRoute(
                pd_policy(pd),
                prefill_pool,
                rounds=rounds,
                ttft_slo_s=pd.ttft_slo_s,
                itl_slo_s=pd.itl_slo_s,
                gate=prefill_gate(pd),
            )
        if pc.fallback:
            fallbacks[name] = list(pc.fallback)
        if pc.degrade_to or pc.shed_at:
            rules[name] = DegradeRule(pc.degrade_to, pc.overload_at, pc.budget_below, dict(pc.shed_at))
    r = config.retry
    retry = RetryConfig(
        attempts=r.attempts,
        backoff_base=r.backoff_base_s,
        backoff_max=r.backoff_max_s,
        first_byte_timeout=r.first_byte_timeout_s,
        connect_timeout=r.connect_timeout_s,
        read_timeout=r.read_timeout_s,
    )
    return Cluster(
        pools,
        fallbacks=fallbacks,
        degrade=DegradePolicy(rules),
        retry=retry,
        health_check_interval=config.health_check_interval_s,
        health_check_timeout=config.health_check_timeout_s,
        load_poll_interval=config.load_poll_interval_s,
        pd=routes,
    )
