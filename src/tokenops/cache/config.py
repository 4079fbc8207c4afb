"""The semantic cache's configuration: one typed section (`cache:` in tokenops.yaml).

This module owns the knobs and their validation only; `tokenops.config.Settings` embeds `CacheConfig`
as a section, so the values come from the YAML file and `TOKENOPS_CACHE__*` variables like every other
setting. It does not build the cache (cache.py does).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Guard = Literal["numbers", "negations", "entities"]

# chosen from benchmarks/cache_vs_gptcache.py's threshold sweep (docs/cache.md, "Measured"): the lowest
# threshold with no false hit on the hard negatives once the guards run, which keeps the hit rate high
DEFAULT_SIMILARITY_THRESHOLD = 0.85


class VerifierConfig(BaseModel):
    """A small model that confirms a semantic hit (cache/verifier.py): any OpenAI-compatible chat
    endpoint that returns top log-probabilities, e.g. `tokenops engine` serving the bundled SmolLM2."""

    model_config = ConfigDict(extra="forbid")

    base_url: str  # e.g. http://127.0.0.1:8101/v1
    model: str
    api_key: str = "none"
    min_p_yes: float = Field(default=0.5, gt=0.0, lt=1.0)  # P(yes) among yes/no needed to serve the hit
    max_checks: int = Field(default=1, ge=1, le=8)  # guard-passing candidates asked about per lookup
    timeout_s: float = Field(default=10.0, gt=0)


class CacheConfig(BaseModel):
    """Knobs of `tokenops.cache.ResponseCache`."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    semantic: bool = True  # False: exact layer only (no embedder is loaded)
    similarity_threshold: float = Field(default=DEFAULT_SIMILARITY_THRESHOLD, gt=0.0, le=1.0)
    candidates: int = Field(default=4, ge=1, le=64)  # nearest entries the guards may examine per lookup
    guards: list[Guard] = Field(default_factory=lambda: ["numbers", "negations", "entities"])
    ttl_s: float = Field(default=3600.0, gt=0)
    max_entries: int = Field(default=10_000, ge=1)
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)  # responses + prompts + vectors
    max_response_bytes: int = Field(default=1024 * 1024, ge=1)  # larger answers are not stored
    # prompts longer than the embedder's window would be compared on a truncated prefix: exact layer only
    semantic_max_tokens: int = Field(default=256, ge=8, le=512)
    # what the backend assumes when a request omits temperature (OpenAI and our engine: 1.0, i.e. sampled)
    default_temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    sampled_tenants: list[str] = Field(default_factory=list)  # tenants whose sampled requests may be cached
    # load the embedding model when the gateway starts (torch + MiniLM: seconds of CPU, ~300 MB) rather
    # than on the first deterministic request; off by default so a gateway that only sees sampled
    # traffic never pays for it
    warm_at_start: bool = False
    verifier: VerifierConfig | None = None  # set: a semantic hit is served only once the verifier agrees
    index: Literal["memory", "redis"] = "memory"
    redis_url: str | None = None  # default: the top-level redis_url
    redis_prefix: str = "tokenops:cache"
