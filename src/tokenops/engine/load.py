"""`LoadSnapshot`: one replica's load as routers, `/v1/load` and the `/metrics` gauges read it.

The engine builds one after each step (`LLMEngine.load`); the async bridge publishes the latest
copy so that HTTP handlers never touch the engine. `to_json` is the `/v1/load` body. This
module holds the record only: counting is the engine's, exposing it is the server's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_usage: float = 0.0
    tokens_in_flight: int = 0  # tokens (prompt + generated) held by unfinished requests
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_cache_dtype: str = "auto"
    kv_bytes_per_token: int = 0
    kv_evicted_blocks: int = 0  # blocks dropped by KV eviction since start
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    preemptions: int = 0
    at: float = 0.0  # time.time() when it was taken
    # MoE models: tokens routed to each expert since start, by layer (models.moe.expert_load)
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> dict[str, Any]:
        """The `/v1/load` body: `kv_usage` to six places, `at` named `timestamp`."""
        out = self.to_dict()
        out["kv_usage"] = round(float(self.kv_usage), 6)
        out["timestamp"] = out.pop("at")
        return out
