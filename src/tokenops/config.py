"""One typed configuration for every `tokenops` command: a YAML file plus `TOKENOPS_*` environment overrides.

This module owns the shape of the configuration and where its values come from (defaults, then the YAML
file, then the environment, then explicit overrides from the command line). It does not act on any value:
the gateway, the ops layer and `tokenops serve` read the typed `Settings` they are handed. Environment
variables are read here and only here, once, so no function deep in the code reads the environment.

Environment overrides: `TOKENOPS_<FIELD>` for a top-level field (`TOKENOPS_PORT=9000`,
`TOKENOPS_DATABASE_URL=postgresql://...`), `TOKENOPS_<SECTION>__<FIELD>` for a nested one
(`TOKENOPS_QUEUE__MAX_WAIT_S=5`). `TOKENOPS_CONFIG` names the YAML file when `--config` is not given.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tokenops.cache.config import CacheConfig
from tokenops.cluster.config import ClusterConfig
from tokenops.cluster.pd import REMOTE_TTFT_SHARE, PDPolicyName

DEFAULT_CONFIG_FILE = "tokenops.yaml"
DEFAULT_DATA_DIR = "tokenops-data"
DEFAULT_MODEL = "smollm2-135m-instruct"
ENV_PREFIX = "TOKENOPS_"


class ConfigError(ValueError):
    """The configuration file or an override is invalid; the message names the field."""


class _Strict(BaseModel):
    # unknown keys are typos more often than not: refuse them with the key's name
    model_config = ConfigDict(extra="forbid")


class PriceConfig(_Strict):
    """Prices per million tokens in currency units; None means "same as input" / "same as output"."""

    input: float = Field(default=0.0, ge=0)
    cached_input: float | None = Field(default=None, ge=0)
    output: float = Field(default=0.0, ge=0)
    reasoning: float | None = Field(default=None, ge=0)
    incremental_prefill: float = Field(
        default=0.0, ge=0
    )  # surcharge on new input since the session's last turn


class EngineSpec(_Strict):
    """Local `tokenops engine` processes that `tokenops serve` starts and supervises for one model:
    `replicas` of them on consecutive ports from `port`, or, with `prefill` and `decode` set, that
    many `--role prefill` engines followed by that many `--role decode` ones (a local PD pair)."""

    model: str = DEFAULT_MODEL  # a bundled name, a local HF folder or a .gguf file
    host: str = "127.0.0.1"
    port: int = Field(default=8001, ge=1, le=65535)
    replicas: int = Field(default=1, ge=1, le=64)
    prefill: int = Field(default=0, ge=0, le=64)  # PD: this many prefill engines, then `decode` ones
    decode: int = Field(default=0, ge=0, le=64)
    args: dict[str, Any] = Field(default_factory=dict)  # engine knobs, passed as --key value
    startup_timeout_s: float = Field(default=300.0, gt=0)

    @model_validator(mode="after")
    def _ports_fit(self) -> EngineSpec:
        if (self.prefill > 0) != (self.decode > 0):
            raise ValueError("engine.prefill and engine.decode go together: a PD pair needs both pools")
        if self.prefill and "replicas" in self.model_fields_set:
            raise ValueError(
                "engine.replicas does not go with engine.prefill/decode (they count the engines)"
            )
        if "role" in self.args:
            raise ValueError("engine.args.role is set by engine.prefill/decode, not by hand")
        n = self.prefill + self.decode if self.prefill else self.replicas
        if self.port + n - 1 > 65535:
            raise ValueError(f"{n} engines from port {self.port} run past port 65535")
        return self

    @property
    def roles(self) -> list[tuple[int, str]]:
        """Each engine's port and `--role`: "both" for plain replicas."""
        if not self.prefill:
            return [(self.port + i, "both") for i in range(self.replicas)]
        roles = ["prefill"] * self.prefill + ["decode"] * self.decode
        return [(self.port + i, r) for i, r in enumerate(roles)]

    @property
    def ports(self) -> list[int]:
        return [p for p, _ in self.roles]

    def urls_of(self, *roles: str) -> list[str]:
        """The OpenAI base URL (ending in /v1) of each engine with one of `roles`."""
        return [f"http://{self.host}:{p}/v1" for p, r in self.roles if r in roles]

    @property
    def urls(self) -> list[str]:
        """The base URLs that take a whole request: every replica, or a PD pair's decode engines."""
        return self.urls_of("both", "decode")


class PDSpec(_Strict):
    """Prefill/decode disaggregation for one model (`tokenops.cluster.pd`): the prefill pool's and
    the decode pool's engine URLs (ending in /v1) and the policy that decides, per request, whether
    its prefill runs on a prefill worker or on the decode worker itself. Default pools: the model's
    local `engine.prefill` / `engine.decode` engines."""

    # static / static_pd_incremental: every prefill remote, the prefill worker pulling a session's
    # history from the decode worker; static_pd: vLLM's path, the prefill worker recomputes it
    policy: PDPolicyName = "static"
    prefill: list[str] = Field(default_factory=list)
    decode: list[str] = Field(default_factory=list)
    ttft_slo_s: float = Field(default=float("inf"), gt=0)  # AMPD weighs these
    itl_slo_s: float = Field(default=float("inf"), gt=0)
    # conditional_dynamo: prefill remotely above this many uncached tokens while the prefill queue is shorter
    max_local_prefill_length: int = Field(default=1000, ge=0)
    max_prefill_queue_size: int = Field(default=2, ge=0)
    # conditional_llm_d: remote from this uncached suffix on (the simulator's and planner's default too;
    # 0 is llm-d's code default, always remote)
    non_cached_tokens: int = Field(default=256, ge=0)
    perf_model: Path | None = None  # ampd: the engines' PerfModel profile (JSON, `PerfModel.save`)
    itl_window_tokens: int = Field(default=1, ge=1)  # ampd: the ITL SLO holds for the mean gap over these
    # ampd: with both ways on time, remote while its modelled TTFT is within this share of the TTFT SLO
    remote_ttft_share: float = Field(default=REMOTE_TTFT_SHARE, ge=0, le=1)
    # prefill legs waiting for a prefill worker's slot are released in `PrefillQueue` order (TTFT
    # slack, shortest first when none can meet the SLO, a leg passed over `prefill_max_deferrals`
    # times goes next) instead of first come first served; needs perf_model for the prefill times
    prefill_queue: bool = False
    prefill_lookahead: int = Field(default=5, ge=1, le=5)
    prefill_max_deferrals: int = Field(default=3, ge=0)
    # legs each prefill worker runs at once (the ceiling of its concurrency limit); more wait at the
    # gateway. Default: the model's max_inflight
    prefill_slots: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _ampd_has_costs(self) -> PDSpec:
        if self.policy == "ampd" and self.perf_model is None:
            raise ValueError("pd.policy ampd weighs modelled costs: set pd.perf_model to a PerfModel profile")
        if self.prefill_queue and self.perf_model is None:
            raise ValueError("pd.prefill_queue orders legs by modelled prefill time: set pd.perf_model")
        return self

    @field_validator("prefill", "decode")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL must start with http:// or https://, got {url!r}")
        return [u.rstrip("/") for u in v]


class ServedModel(_Strict):
    """One model as clients name it: where it is served, what it costs, how much it can hold."""

    backends: list[str] = Field(default_factory=list)  # OpenAI-compatible base URLs ending in /v1
    engine: EngineSpec | None = None  # or local engines that serve starts; their URLs join the backends
    pd: PDSpec | None = None  # prefill/decode pools; set by default for engine.prefill/decode
    served_name: str | None = None  # the name the backend knows the model by (default: the same name)
    # where the gateway finds this model's tokenizer for prefix-aware balancing in token blocks (a
    # bundled name, a local HF folder or .gguf file): for remote replicas running the same model.
    # Default: the model of the local `engine` replicas; neither: prompts are hashed as text.
    tokenizer: str | None = None
    api_key: str | None = None  # sent upstream as a bearer token (remote providers)
    context_window: int = Field(default=8192, ge=1)
    template_overhead_tokens: int = Field(
        default=64, ge=0
    )  # chat template tokens (e.g. a default system prompt)
    max_inflight: int = Field(default=64, ge=1)  # ceiling of each replica's adaptive concurrency limit
    pricing: PriceConfig = Field(default_factory=PriceConfig)
    # the body field through which the backend takes a thinking budget: the gateway sends the
    # request's max_reasoning_tokens, capped by the tenant tree, under this name. None: the backend
    # takes no budget (the body goes as the client sent it). Default: max_reasoning_tokens for
    # `tokenops engine` replicas (an `engine` spec), None for other backends.
    reasoning_budget_field: str | None = None
    # a client's non-streamed request is streamed from the backend and assembled into one answer in
    # the gateway, so a client that leaves mid-answer is billed what was produced (as a stream is);
    # false only for a backend that cannot stream
    stream_upstream: bool = True

    @field_validator("backends")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend URL must start with http:// or https://, got {url!r}")
        return [u.rstrip("/") for u in v]

    @model_validator(mode="after")
    def _has_backend(self) -> ServedModel:
        if "reasoning_budget_field" not in self.model_fields_set and self.engine is not None:
            self.reasoning_budget_field = "max_reasoning_tokens"
        local = self.engine is not None and self.engine.prefill > 0
        if local and self.pd is None:
            self.pd = PDSpec()
        if self.pd is not None:
            if local and not self.pd.prefill and not self.pd.decode:
                self.pd.prefill = self.engine.urls_of("prefill")
                self.pd.decode = self.engine.urls_of("decode")
            if not self.pd.decode:
                raise ValueError("pd.decode needs at least one decode engine URL (or engine.prefill/decode)")
            if not self.pd.prefill and self.pd.policy != "colocated":
                raise ValueError(f"pd.policy {self.pd.policy} needs at least one pd.prefill engine URL")
            if self.backends:
                raise ValueError("a pd model is served by its pd.decode engines: leave backends empty")
            if not local:
                self.backends = list(self.pd.decode)
        if not self.backends and self.engine is None:
            raise ValueError("a model needs at least one backend URL, an engine spec or pd pools")
        return self

    def backend_urls(self) -> list[str]:
        return self.backends + (self.engine.urls if self.engine else [])


class PriorityClass(_Strict):
    """How long a request of one priority class may wait for a backend slot, and how many may wait."""

    max_wait_s: float = Field(ge=0)
    max_queued: int = Field(ge=0)


def _default_classes() -> list[PriorityClass]:
    # class 0 waits longest and queues deepest; the lowest class is refused first under load
    return [
        PriorityClass(max_wait_s=30.0, max_queued=1000),
        PriorityClass(max_wait_s=10.0, max_queued=200),
        PriorityClass(max_wait_s=2.0, max_queued=50),
    ]


class QueueConfig(_Strict):
    """Waiting for a replica slot at the gateway (the cluster's pools hold the lines): priority classes,
    indexed by class number; a class whose line is full or whose wait ran out gets 429 backend_busy."""

    classes: list[PriorityClass] = Field(default_factory=_default_classes, min_length=1)
    retry_after_s: int = Field(default=1, ge=0)


class FairQueueConfig(_Strict):
    """Weighted fair admission at the gateway (tokenops.ops.fair_queue): at most `max_in_flight`
    admitted requests per model line (`per_model` overrides it); beyond that a request waits in its
    (tenant, priority class) flow and a freed slot goes to the next flow by priority band with aging
    and deficit round robin over tenants. A flow holding `max_queued_per_tenant` waiters, or a waiter
    past its class's `queue.classes[].max_wait_s`, gets 429. Off while neither `max_in_flight` nor
    `follow_pool` is set."""

    max_in_flight: int | None = Field(default=None, ge=1)
    per_model: dict[str, int] = Field(default_factory=dict)
    # a real model's line holds what its available replicas' (adaptive) concurrency limits sum to,
    # capped by max_in_flight / per_model when set: the fair wait then sits where the pool saturates
    follow_pool: bool = False
    weights: dict[str, float] = Field(default_factory=dict)  # tenant -> weight (default 1)
    aging_s: float | None = Field(default=10.0, gt=0)  # a waiter moves up one class per this long
    max_queued_per_tenant: int = Field(default=100, ge=0)
    cost: Literal["requests", "tokens"] = "requests"  # what a tenant's share is counted in

    @model_validator(mode="after")
    def _positive(self) -> FairQueueConfig:
        bad = {k: v for k, v in {**self.weights, **self.per_model}.items() if v <= 0}
        if bad:
            raise ValueError(f"fair_queue weights and per_model limits must be > 0, got {bad}")
        return self


class CascadeSpec(_Strict):
    """`strategy: cascade`: the models tried in order and the checker that escalates an answer."""

    models: list[str] | None = None  # cheapest first; default [cheap, strong]
    max_escalations: int = Field(default=1, ge=1)
    min_logprob: float | None = (
        None  # confidence: this quantile of the answer's token log-probs must reach it
    )
    logprob_quantile: float = Field(default=0.1, ge=0, le=1)
    verifier: str | None = None  # a model asked "is this answer correct?" (yes/no)
    reject_patterns: list[str] = Field(
        default_factory=list
    )  # regexes that reject an answer (refusals, "I don't know")
    min_chars: int = Field(default=1, ge=0)
    reject_truncated: bool = False  # an answer cut by max_tokens escalates
    samples: int = Field(default=0, ge=0, le=16)  # extra answers drawn to test agreement (0: off)
    min_agreement: float = Field(default=0.67, gt=0, le=1)  # share of all answers that must match the first
    temperature: float = Field(default=0.7, ge=0, le=2)  # of the extra samples

    @field_validator("reject_patterns")
    @classmethod
    def _regexes(cls, v: list[str]) -> list[str]:
        import re

        for p in v:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"reject pattern {p!r} is not a regular expression: {exc}") from None
        return v


class EnsembleSpec(_Strict):
    """`strategy: ensemble`: the models asked at once and how one answer is chosen."""

    # default [cheap, strong] ([cheap] for self_consistency); ties of a vote go to the latest
    models: list[str] | None = None
    aggregate: Literal["vote", "judge", "self_consistency", "best_of_n"] = "vote"
    judge: str | None = None  # the model that picks the best answer (aggregate: judge); default: strong
    # best_of_n: one call to models[0] for `samples` choices; the scorer picks one (logprob: highest mean
    # token log-prob; verifier: the first the verifier says yes to; judge: the judge's pick)
    scorer: Literal["logprob", "verifier", "judge"] = "logprob"
    verifier: str | None = None
    # self_consistency: up to `samples` answers at `temperature`, `round_size` at a time, round-robin over
    # models; stops once `agree` match or the leader cannot be caught
    samples: int = Field(default=8, ge=1, le=32)
    agree: int = Field(default=3, ge=1)
    round_size: int = Field(default=2, ge=1)
    temperature: float = Field(default=0.7, ge=0, le=2)


class ReasoningSpec(_Strict):
    """A reasoning-capable route: the router's score picks off / low / high thinking per request,
    within the tenant's cap (fusion/effort.py)."""

    low_at: float = Field(default=0.3, ge=0, le=1)  # scores below: no thinking
    high_at: float = Field(default=0.7, ge=0, le=1)  # scores from here: high effort
    spelling: Literal["effort", "budget"] = "effort"  # reasoning_effort, or max_reasoning_tokens
    low_budget: int = Field(default=1024, ge=1)
    high_budget: int = Field(default=8192, ge=1)
    default_cap: Literal["off", "low", "high"] = "high"
    tenant_caps: dict[str, Literal["off", "low", "high"]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _ordered(self) -> ReasoningSpec:
        if self.low_at > self.high_at:
            raise ValueError("reasoning.low_at must not exceed reasoning.high_at")
        if self.low_budget > self.high_budget:
            raise ValueError("reasoning.low_budget must not exceed reasoning.high_budget")
        return self


class RetrainSpec(_Strict):
    """The gateway retrains the route's learned router from its stored outcomes on a schedule, and
    serves the new one only if it predicts held-out escalations at least as well (fusion/relearn.py)."""

    every_s: float = Field(default=3600.0, gt=0)
    min_new_outcomes: int = Field(default=50, ge=2)
    last: int | None = Field(default=None, ge=2)  # train on the latest this many outcomes
    held_out: float = Field(default=0.2, gt=0, lt=1)


class LearnSpec(_Strict):
    """A cascade route that keeps its verdicts on the cheap model as router labels (opt-in per
    tenant); `answer_tenants` also keep the cheap answer's text (a distillation set)."""

    tenants: list[str] = Field(min_length=1)
    answer_tenants: list[str] = Field(default_factory=list)
    retrain: RetrainSpec | None = None

    @model_validator(mode="after")
    def _subset(self) -> LearnSpec:
        stray = sorted(set(self.answer_tenants) - set(self.tenants))
        if stray:
            raise ValueError(f"learn.answer_tenants {stray} must also be in learn.tenants")
        return self


class OpsRoutingSpec(_Strict):
    """A route's ops rule: to its cheap model (a cascade: from its cheap tier) when the tightest
    budget on the key's path is this much used, or the key's priority class is this low."""

    budget_used_at_least: float | None = Field(default=None, ge=0, le=1)
    priority_at_least: int | None = Field(default=None, ge=0, le=9)


class RouteSpec(_Strict):
    """A virtual model (e.g. `auto`): `tokenops.fusion` picks `cheap` or `strong` per request
    (`strategy: route`), tries cheap first and escalates (`cascade`), or asks several (`ensemble`)."""

    cheap: str
    strong: str
    router: str = "rules"  # rules | knn (needs labels) | learned (router_model .npz, or trained from labels)
    labels: Path | None = None  # labelled JSONL for knn / learned
    router_model: Path | None = None  # from `tokenops eval routers --save-router` or `tokenops eval retrain`
    # knn / learned without a saved model: train at start-up on labels read from the database: the
    # stored profiles of cheap and strong, and this route's stored cascade outcomes
    train_from: list[Literal["profiles", "outcomes"]] = Field(default_factory=list)
    target_strong_share: float = Field(default=0.3, ge=0, le=1)
    strategy: Literal["route", "cascade", "ensemble"] = "route"
    cascade: CascadeSpec = Field(default_factory=CascadeSpec)
    ensemble: EnsembleSpec = Field(default_factory=EnsembleSpec)
    reasoning: ReasoningSpec | None = None  # set: the route decides how hard its model thinks
    learn: LearnSpec | None = None  # a cascade keeping its outcomes for `tokenops eval retrain`
    ops: OpsRoutingSpec | None = None  # near budget or low class: cheap (not for ensembles)

    @model_validator(mode="after")
    def _strategy_models(self) -> RouteSpec:
        if self.learn is not None and self.strategy != "cascade":
            raise ValueError("'learn' needs strategy: cascade (only a cascade's escalations label requests)")
        for knobs in ("cascade", "ensemble"):
            if knobs in self.model_fields_set and self.strategy != knobs:
                raise ValueError(
                    f"'{knobs}' settings need strategy: {knobs} (the strategy is '{self.strategy}')"
                )
        if self.cascade.models is not None and len(self.cascade.models) < 2:
            raise ValueError("cascade.models needs at least two models, cheapest first")
        e = self.ensemble
        if e.aggregate == "best_of_n":
            if e.models is not None and len(e.models) != 1:
                raise ValueError("best_of_n samples one model: ensemble.models takes exactly one")
            if e.samples < 2:
                raise ValueError("best_of_n needs ensemble.samples >= 2")
            if e.scorer == "verifier" and e.verifier is None:
                raise ValueError("best_of_n with scorer: verifier needs ensemble.verifier")
            if e.scorer == "judge" and e.judge is None:
                e.judge = self.strong
        elif e.models is not None and len(e.models) < (1 if e.aggregate == "self_consistency" else 2):
            raise ValueError("ensemble.models needs at least two models (one is enough for self_consistency)")
        if self.ops is not None and self.strategy == "ensemble":
            raise ValueError("'ops' routing needs strategy route or cascade (an ensemble asks every model)")
        if self.ensemble.aggregate == "judge" and self.ensemble.judge is None:
            self.ensemble.judge = self.strong
        return self

    def models_named(self) -> list[str]:
        """Every real model this route may call."""
        names = [self.cheap, self.strong]
        if self.strategy == "cascade":
            names += [
                *(self.cascade.models or ()),
                *([self.cascade.verifier] if self.cascade.verifier else []),
            ]
        if self.strategy == "ensemble":
            e = self.ensemble
            names += [*(e.models or ()), *(m for m in (e.judge, e.verifier) if m)]
        return list(dict.fromkeys(names))


class SessionBreakerConfig(_Strict):
    """The runaway-agent breaker per session: trips on N identical requests in a window, or on a
    session's spend in a window; resets after a cool-down."""

    repeat_limit: int = Field(default=10, ge=1)
    window_s: float = Field(default=60.0, gt=0)
    spend_limit_micros: int | None = Field(default=None, ge=0)
    cooldown_s: float = Field(default=60.0, gt=0)


class ConnectionsConfig(_Strict):
    """Incoming connections (gateway/connections.py): a client has `header_timeout_s` to send its
    request headers and then `body_timeout_s` to send its body (else 408), an idle keep-alive
    connection is closed after `keep_alive_s`, and a connection beyond `max_connections` is refused
    with a 503 as it opens."""

    header_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)
    keep_alive_s: float = Field(default=5.0, gt=0)
    max_connections: int = Field(default=1000, ge=1)


class SpendRateConfig(_Strict):
    """The spend-rate alert: a node's spend in the current minute above `multiple` times its average
    over the `window_minutes` before (and at least `min_micros`), once per node per clock hour."""

    multiple: float = Field(gt=1)
    window_minutes: int = Field(default=10, ge=1, le=1440)
    min_micros: int = Field(default=1, ge=0)


class AlertsConfig(_Strict):
    """Where alerts go beyond the log: each webhook gets a Slack-compatible POST per alert."""

    webhooks: list[str] = Field(default_factory=list)
    spend_rate: SpendRateConfig | None = None  # None: no spend-rate alert


class AdmissionConfig(_Strict):
    """What an admission holds and how long, should its gateway die before settling it: budget
    reservations are released after `reservation_ttl_s` (longer than the longest request),
    concurrency leases expire `concurrency_lease_s` after their gateway last renewed them (it renews
    its running requests' leases every third of that), and a gateway restarted under the same
    `instance_id` releases its previous run's at once (default: host name and port)."""

    reservation_ttl_s: float = Field(default=3600.0, gt=0)
    concurrency_lease_s: float = Field(default=30.0, gt=0)
    instance_id: str | None = None
    # budget counters and reservations: Lua counters in Redis with the ledger written in batches
    # ("redis"), in this process for a gateway alone on its database ("memory"), or one guarded row
    # per node and period in the database ("database"); "auto" (the default): Redis when redis_url is
    # set, else the database
    budget_store: Literal["auto", "redis", "memory", "database"] = "auto"


class ResponsesConfig(_Strict):
    """`/v1/responses`: how long stored responses are kept, and when a session's history is compacted.

    A session is compacted once its next prompt would pass `compact_at` of the model's context window
    (or `max_history_tokens`, when set lower): older turns are summarised by the compaction model (a
    route's cheap model by default, else the model itself) while the most recent `keep_recent` share
    of the budget stays byte-identical."""

    ttl_s: float = Field(default=30 * 86400.0, gt=0)  # a stored response expires this long after it was made
    compact_at: float = Field(default=0.75, gt=0, le=1)
    max_history_tokens: int | None = Field(default=None, ge=64)
    keep_recent: float = Field(default=0.4, gt=0, lt=1)
    summary_tokens: int = Field(default=160, ge=16)
    compaction_model: str | None = None


class EmbeddingsConfig(_Strict):
    """`/v1/embeddings`: the bundled sentence embedder, served in the gateway under `model`, priced
    per million input tokens; models under `models` whose backends have the endpoint are passed through."""

    enabled: bool = True
    model: str = "all-minilm-l6-v2"
    input_price: float = Field(default=0.0, ge=0)
    max_inputs: int = Field(default=256, ge=1)


class DistillConfig(_Strict):
    """The distillation set: for the tenants named here (none by default), the prompts and the strong
    model's answers where a cascade escalated or an ensemble agreed go to the ops database's
    `ops_distill_examples` table; `tokenops distill export` writes them as chat JSONL."""

    tenants: list[str] = Field(default_factory=list)


class Settings(_Strict):
    """The whole configuration."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    data_dir: Path = Path(DEFAULT_DATA_DIR)
    database_url: str | None = None  # default: sqlite file under data_dir
    database_schema: str | None = None  # PostgreSQL only: keep the tables in this schema
    redis_url: str | None = None  # shared limit counters (and the cache index) across gateway replicas
    redis_prefix: str = "tokenops:ops:"  # key namespace in Redis (one per deployment)
    admin_key: str | None = None  # accepted on /admin/ in addition to the one serve generates
    alert_webhook: str | None = None  # budget alerts (thresholds are per tenant node) are POSTed here
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)  # more webhooks, the spend-rate alert
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    log_level: str = "info"
    queue: QueueConfig = Field(default_factory=QueueConfig)
    fair_queue: FairQueueConfig = Field(default_factory=FairQueueConfig)  # tenant-fair waiting
    connections: ConnectionsConfig = Field(default_factory=ConnectionsConfig)  # header/idle timeouts, cap
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)  # crash leftovers: TTLs, instance
    breaker: SessionBreakerConfig = Field(default_factory=SessionBreakerConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)  # balancing, health, retries, fallback
    cache: CacheConfig = Field(default_factory=CacheConfig)  # exact + semantic response cache
    models: dict[str, ServedModel] = Field(
        # the bundled model on the embedded engine, weights as quantize.auto.AUTO_TABLE picks for this CPU
        default_factory=lambda: {
            DEFAULT_MODEL: ServedModel(engine=EngineSpec(args={"quantization": "auto"}), context_window=8192)
        }
    )
    routes: dict[str, RouteSpec] = Field(default_factory=dict)  # virtual models planned by tokenops.fusion
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)  # stored responses, compaction
    embeddings: EmbeddingsConfig = Field(default_factory=EmbeddingsConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)  # opt-in per tenant

    @model_validator(mode="after")
    def _shared_cache_with_redis(self) -> Settings:
        # several gateways that share Redis share the cache index too, unless the config says otherwise
        if self.redis_url and "index" not in self.cache.model_fields_set:
            self.cache.index = "redis"
        for name in self.cluster.models:
            if name not in self.models:
                raise ValueError(f"cluster.models names '{name}', which is not under models")
        for name, route in self.routes.items():
            if name in self.models:
                raise ValueError(f"routes.{name} has the name of a configured model; pick another")
            for real in route.models_named():
                if real not in self.models:
                    raise ValueError(f"routes.{name} names '{real}', which is not under models")
        return self

    @property
    def instance_id(self) -> str | None:
        """This gateway's name among the gateways sharing a ledger, stable across restarts; None on
        an ephemeral port (port 0) without one configured: no later run is the same instance."""
        if self.admission.instance_id:
            return self.admission.instance_id
        return f"{socket.gethostname()}:{self.port}" if self.port else None

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'tokenops.db').resolve()}"

    def pricing(self) -> dict[str, dict[str, float | None]]:
        """Each model's rates per million tokens; `ops.pricing.price_table` turns them into prices (the
        ops layer owns the price type and its arithmetic, and this module imports nothing of ops)."""
        rates = {name: m.pricing.model_dump() for name, m in self.models.items()}
        if self.embeddings.enabled and self.embeddings.model not in rates:
            rates[self.embeddings.model] = {"input": self.embeddings.input_price}
        return rates


def _coerce_env(value: str) -> Any:
    # YAML scalars: "9000" -> 9000, "true" -> True, "[a, b]" -> list; anything unparsable stays a string
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def env_overrides(environ: dict[str, str] | os._Environ[str]) -> dict[str, Any]:
    """Nested dict of overrides from `TOKENOPS_*` variables (`__` separates nesting levels)."""
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key == ENV_PREFIX + "CONFIG":
            continue
        path = [p.lower() for p in key[len(ENV_PREFIX) :].split("__") if p]
        if not path or path[0] not in Settings.model_fields:
            continue  # other TOKENOPS_* variables belong to other tools
        node = out
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = _coerce_env(value)
    return out


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def load_settings(
    path: str | Path | None = None,
    *,
    environ: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Settings:
    """Defaults <- YAML file <- environment <- explicit overrides. Raises ConfigError naming the bad field."""
    env = dict(os.environ) if environ is None else environ
    file = (
        Path(path) if path else Path(env[ENV_PREFIX + "CONFIG"]) if env.get(ENV_PREFIX + "CONFIG") else None
    )
    if file is None and Path(DEFAULT_CONFIG_FILE).is_file():
        file = Path(DEFAULT_CONFIG_FILE)
    data: dict[str, Any] = {}
    if file is not None:
        try:
            loaded = yaml.safe_load(file.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {file}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {file} must hold a mapping at the top level")
        data = loaded
    data = _merge(data, env_overrides(env))
    data = _merge(data, {k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"invalid config value at '{loc}': {err['msg']}") from exc
