"""Find the highest request rate that still meets the SLOs.

A sweep runs the same seeded workload at several offered rates and judges each by its SLO
attainment (the share of requests that met every SLO) against a threshold, as DistServe-style
goodput studies do. Without a given list of rates it searches: doubling from `start_rate` until a
rate fails (or `max_rate`), then bisecting between the last pass and the first fail. The search is
a plain function of an `evaluate(rate) -> summary` callable, so it is tested without a server;
`sweep_load` plugs in the real driver.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from tokenops.bench.driver import LoadConfig, LoadResult, run_load
from tokenops.bench.metrics import SLO, Pricing, summarize
from tokenops.bench.traces import TraceRecord

POINT_KEYS = (
    "request_throughput",
    "request_goodput",
    "slo_attainment",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "p99_itl_ms",
    "p99_e2el_ms",
    "completed",
    "failed",
)


def search_rates(
    evaluate: Callable[[float], dict[str, Any]],
    *,
    attainment: float = 0.9,
    rates: list[float] | None = None,
    start_rate: float = 1.0,
    max_rate: float = 1024.0,
    refine: int = 3,
) -> dict[str, Any]:
    """Evaluate rates and return {points, best_rate, attainment}; points are sorted by rate and hold
    the POINT_KEYS of each summary."""
    points: dict[float, dict[str, Any]] = {}

    def point(rate: float) -> bool:
        if rate not in points:
            s = evaluate(rate)
            points[rate] = {"rate": rate, **{k: s.get(k) for k in POINT_KEYS}}
        return (points[rate]["slo_attainment"] or 0.0) >= attainment

    if rates:
        for r in sorted(rates):
            point(r)
    else:
        lo, hi = None, None
        r = start_rate
        while r <= max_rate:
            if point(r):
                lo = r
                r *= 2
            else:
                hi = r
                break
        if lo is not None and hi is not None:
            for _ in range(refine):
                mid = (lo + hi) / 2
                if point(mid):
                    lo = mid
                else:
                    hi = mid
    passing = [p["rate"] for p in points.values() if (p["slo_attainment"] or 0.0) >= attainment]
    return {
        "attainment": attainment,
        "best_rate": max(passing) if passing else None,
        "points": [points[r] for r in sorted(points)],
    }


def sweep_load(
    cfg: LoadConfig,
    workload: Callable[[], Iterator[list[TraceRecord]]],
    slo: SLO,
    *,
    attainment: float = 0.9,
    rates: list[float] | None = None,
    start_rate: float = 1.0,
    max_rate: float = 1024.0,
    refine: int = 3,
    pricing: Pricing | None = None,
    on_point: Callable[[float, dict[str, Any], LoadResult], None] | None = None,
) -> dict[str, Any]:
    """Sweep the offered rate of `cfg` (a fresh workload from `workload()` at each rate)."""

    def evaluate(rate: float) -> dict[str, Any]:
        res = run_load(dataclasses.replace(cfg, rate=rate), workload())
        s = summarize(res.records, res.duration_s, slo=slo, pricing=pricing)
        if on_point:
            on_point(rate, s, res)
        return s

    out = search_rates(
        evaluate, attainment=attainment, rates=rates, start_rate=start_rate, max_rate=max_rate, refine=refine
    )
    out["slo"] = slo.to_json()
    return out
