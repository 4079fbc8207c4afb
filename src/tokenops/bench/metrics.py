"""Per-request timings and per-run SLO metrics, with vLLM `bench serve`'s definitions and JSON keys.

This module owns the arithmetic: from a `RequestRecord` (send time, the arrival time of every content
chunk, end time, usage) to TTFT, TPOT, ITL and end-to-end latency, and from a list of records to the
run summary (percentiles, throughput, RPM/TPM, goodput, SLO attainment, cost, MFU). It does no I/O
and never reads a clock: the driver records times, this module only subtracts them.

Definitions (as vLLM's `benchmarks/serve.py`):
- TTFT: send -> first chunk that carries content (text or reasoning); a request with no content
  chunk has no TTFT and is left out of TTFT statistics (and fails a TTFT SLO).
- TPOT: (e2e - TTFT) / (output_tokens - 1), only for requests with at least 2 output tokens; for
  goodput a 0- or 1-token request counts as TPOT 0.
- ITL: every gap between consecutive content chunks, pooled over all requests.
- E2E ("e2el"): send -> last byte of the response.
- TTFB (a tokenops addition): send -> first bytes of the response body. TTFT - TTFB separates what
  the server spends before the first token from the client's and network's share.
- Output tokens come from the server's usage when it returns one, else one per content chunk.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tokenops.token_types import CACHED_INPUT, OUTPUT, UNCACHED_INPUT, TokenType

PERCENTILES: tuple[float, ...] = (50, 90, 95, 99)
SLO_KEYS = ("ttft", "tpot", "itl", "e2e")


@dataclass(slots=True)
class RequestRecord:
    """What the driver saw of one request; times are seconds on one monotonic clock."""

    start: float
    end: float
    chunk_times: list[float] = field(default_factory=list)
    first_byte: float | None = None  # first bytes of the response body (SSE: usually the role chunk)
    success: bool = True
    error: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    session_id: str | None = None
    round: int = 0
    text: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def ttfb(self) -> float | None:
        return self.first_byte - self.start if self.first_byte is not None else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def output_len(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_times)

    @property
    def tpot(self) -> float | None:
        n, ttft = self.output_len, self.ttft
        if n < 2 or ttft is None:
            return None
        return (self.e2e - ttft) / (n - 1)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("text")
        return d


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets in seconds; a request is good when it meets every one that is set.

    `itl` bounds the request's largest inter-chunk gap (a stall), a tokenops addition to vLLM's three.
    """

    ttft: float | None = None
    tpot: float | None = None
    itl: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, spec: str | None) -> SLO | None:
        """Parse `ttft=500ms,tpot=50ms,e2e=2s` (also `ttft:500`, plain numbers are ms)."""
        if not spec:
            return None
        out: dict[str, float] = {}
        for part in re.split(r"[,\s]+", spec.strip()):
            if not part:
                continue
            m = re.fullmatch(r"(\w+)\s*[=:]\s*([0-9.]+)\s*(ms|s|us)?", part)
            if not m:
                raise ValueError(f"bad SLO term {part!r}: use e.g. ttft=500ms,tpot=50ms,e2e=2s")
            key = {"e2el": "e2e", "latency": "e2e"}.get(m.group(1).lower(), m.group(1).lower())
            if key not in SLO_KEYS:
                raise ValueError(f"unknown SLO metric {m.group(1)!r}: use one of {', '.join(SLO_KEYS)}")
            scale = {"ms": 1e-3, "s": 1.0, "us": 1e-6, None: 1e-3}[m.group(3)]
            out[key] = float(m.group(2)) * scale
        return cls(**out)

    def met_by(self, r: RequestRecord) -> bool:
        if not r.success:
            return False
        if self.ttft is not None and (r.ttft is None or r.ttft > self.ttft):
            return False
        if self.tpot is not None and (r.tpot or 0.0) > self.tpot:
            return False
        if self.itl is not None and max(r.itl, default=0.0) > self.itl:
            return False
        return not (self.e2e is not None and r.e2e > self.e2e)

    def to_json(self) -> dict[str, float]:
        return {f"{k}_ms": v * 1000 for k in SLO_KEYS if (v := getattr(self, k)) is not None}


@dataclass(frozen=True, slots=True)
class Pricing:
    """Dollar prices per million tokens (as providers publish them) and/or the hardware's hourly cost."""

    input_per_m: float = 0.0
    output_per_m: float = 0.0
    cached_input_per_m: float | None = None
    hourly: float | None = None

    def rate(self, token_type: TokenType) -> float:
        """Per million tokens of `token_type`: its own price, else its fallback's, else free."""
        own = getattr(self, f"{token_type.price_field}_per_m", None)
        if own is None and token_type.price_fallback is not None:
            own = getattr(self, f"{token_type.price_fallback}_per_m", None)
        return 0.0 if own is None else own


def _pkey(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _stats(name: str, values_s: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    """mean/median/std/pN of a list of seconds, in milliseconds, under vLLM's key names."""
    arr = np.asarray(values_s, dtype=float) * 1000.0
    out: dict[str, float] = {}
    if arr.size == 0:
        out[f"mean_{name}_ms"] = out[f"median_{name}_ms"] = out[f"std_{name}_ms"] = 0.0
        for p in percentiles:
            out[f"p{_pkey(p)}_{name}_ms"] = 0.0
        return out
    out[f"mean_{name}_ms"] = float(arr.mean())
    out[f"median_{name}_ms"] = float(np.median(arr))
    out[f"std_{name}_ms"] = float(arr.std())
    for p in percentiles:
        out[f"p{_pkey(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def output_tokens_per_second(
    records: Sequence[RequestRecord], origin: float, bin_s: float = 1.0
) -> list[float]:
    """Output tokens completed in each `bin_s` window after `origin` (one token per content chunk,
    scaled to the request's usage count when chunks carry several tokens)."""
    if not records:
        return []
    end = max(r.end for r in records)
    bins = np.zeros(max(1, math.ceil((end - origin) / bin_s)))
    for r in records:
        if not r.chunk_times:
            continue
        per_chunk = r.output_len / len(r.chunk_times)
        idx = np.clip(((np.asarray(r.chunk_times) - origin) / bin_s).astype(int), 0, len(bins) - 1)
        np.add.at(bins, idx, per_chunk)
    return (bins / bin_s).tolist()


def max_concurrency_seen(records: Sequence[RequestRecord]) -> int:
    events = sorted(
        [(r.start, 1) for r in records] + [(r.end, -1) for r in records], key=lambda e: (e[0], e[1])
    )
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    slo: SLO | None = None,
    percentiles: Iterable[float] = PERCENTILES,
    pricing: Pricing | None = None,
    params: float | None = None,
    peak_tflops: float | None = None,
) -> dict[str, Any]:
    """The run's metrics under vLLM `bench serve` keys, plus tokenops' additions.

    `duration_s` is the measured window (first send to last completion). `params` (model parameter
    count) and `peak_tflops` (the hardware's dense peak, all devices) give an MFU estimate of
    2 * params FLOPs per processed token (prompt and output), ignoring attention's quadratic part.
    """
    percentiles = tuple(percentiles)
    ok = [r for r in records if r.success]
    failed = len(records) - len(ok)
    dur = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    cached_tokens = sum(r.cached_tokens or 0 for r in ok)
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    itls = [g for r in ok for g in r.itl]
    e2es = [r.e2e for r in ok]
    ttfbs = [t for r in ok if (t := r.ttfb) is not None]

    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": failed,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_tokens": cached_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": output_tokens / dur,
        "total_token_throughput": (input_tokens + output_tokens) / dur,
        "rpm": len(ok) / dur * 60,
        "tpm": (input_tokens + output_tokens) / dur * 60,
        "output_tpm": output_tokens / dur * 60,
        "cache_hit_rate": cached_tokens / input_tokens if input_tokens else 0.0,
    }
    if slo is not None:
        good = sum(1 for r in records if slo.met_by(r))
        out["request_goodput"] = good / dur
        out["good_requests"] = good
        out["slo_attainment"] = good / len(records) if records else 0.0
        out["slo"] = slo.to_json()
    else:
        out["request_goodput"] = None
    tput = output_tokens_per_second(ok, min((r.start for r in ok), default=0.0))
    out["max_output_tokens_per_s"] = max(tput, default=0.0)
    out["max_concurrent_requests"] = max_concurrency_seen(records)
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2es), ("ttfb", ttfbs)):
        out.update(_stats(name, vals, percentiles))
    if pricing is not None:
        # a client sees completion tokens whole: reasoning is billed at the output price here
        by_type = {
            UNCACHED_INPUT: input_tokens - cached_tokens,
            CACHED_INPUT: cached_tokens,
            OUTPUT: output_tokens,
        }
        cost = sum(n * pricing.rate(t) for t, n in by_type.items()) / 1e6
        out["cost_usd"] = cost
        total = input_tokens + output_tokens
        out["cost_per_million_tokens"] = cost / total * 1e6 if total else 0.0
        if pricing.hourly is not None:
            hw = pricing.hourly * duration_s / 3600
            out["hardware_cost_usd"] = hw
            out["hardware_cost_per_million_output_tokens"] = (
                hw / output_tokens * 1e6 if output_tokens else None
            )
    if params is not None and peak_tflops:
        achieved = 2.0 * params * (input_tokens + output_tokens) / dur
        out["achieved_tflops"] = achieved / 1e12
        out["mfu"] = achieved / (peak_tflops * 1e12)
    return out
