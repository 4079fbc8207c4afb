"""Capacity planning: how many prefill and decode replicas of which type serve a load within SLOs
under a GPU budget, as a mixed-integer linear program solved by HiGHS (`scipy.optimize.milp`), and a
load-following mode that forecasts the next interval's rate and plans for it.

Each candidate pool is one replica type at one count, with the latency the `PerfModel` predicts for
it at the planned load: a prefill pool's P95 time to first token (each replica an M/M/1 queue of
prefills, P95 sojourn = ln(20) / (mu - lambda)), a decode pool's time per output token (the batch
size where Little's law and the decode step time agree). One activation binary per candidate says
it is the pool built; exactly one prefill and one decode candidate are active, their GPUs fit the
budget, and the objective is the worst of the two latencies over its SLO (the bottleneck pool, as
AMPD's planner minimises), with a GPU count tie-break. The latency of an inactive candidate must not
bind, so the bottleneck variable is bounded by the sum of latency times activation over candidates
(exactly one term is non-zero). The plan is an estimate: check it in the simulator (`check_plan`).
This module owns the formulation and the queueing estimates, not the simulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenops.cluster.perf_model import PerfModel


@dataclass(frozen=True, slots=True)
class ReplicaType:
    """A deployable replica: its profile, the GPUs it takes (TP x PP) and its batch limit."""

    name: str
    perf: PerfModel
    gpus: int = 1
    max_num_seqs: int = 256


@dataclass(frozen=True, slots=True)
class Load:
    rate: float  # requests per second
    prompt_tokens: float  # mean uncached prompt tokens per request
    output_tokens: float  # mean output tokens
    context_tokens: float | None = None  # mean context during decode (default prompt + output / 2)


@dataclass(frozen=True, slots=True)
class Candidate:
    role: str  # "prefill" | "decode"
    type: str
    count: int
    gpus: int
    latency_s: float  # P95 TTFT (prefill) or TPOT (decode) at the planned load


@dataclass(frozen=True, slots=True)
class Plan:
    prefill: Candidate
    decode: Candidate
    bottleneck: float  # worst latency / SLO of the two pools
    gpus: int
    status: str


def prefill_p95(perf: PerfModel, load: Load, count: int) -> float:
    """P95 time to first token of a pool of `count` replicas sharing the load evenly (M/M/1 each)."""
    service = perf.prefill_time(round(load.prompt_tokens)) + perf.request_overhead_s
    lam = load.rate / count
    mu = 1.0 / service
    return math.log(20) / (mu - lam) if lam < mu else math.inf


def decode_tpot(perf: PerfModel, load: Load, count: int, max_num_seqs: int) -> float:
    """Time per output token where the batch is what Little's law gives at that TPOT:

    tpot = base + k * batch,  batch = lambda * output_tokens * tpot,  k = row + attention * ctx
    => tpot = base / (1 - k * lambda * output_tokens)   (stable only while k * lambda * out < 1)

    with the profile's bend in the base once the batch reaches it (`PerfModel.busy_step_time`).
    """
    ctx = load.context_tokens
    if ctx is None:
        ctx = load.prompt_tokens + load.output_tokens / 2
    lam = load.rate / count
    row = perf.per_token_s if perf.decode_row_s is None else perf.decode_row_s
    k = row + perf.decode_attention_s * ctx
    tpot = perf.busy_step_time(k * lam * load.output_tokens, lam * load.output_tokens)
    if math.isinf(tpot):
        return math.inf
    batch = lam * load.output_tokens * tpot
    if batch > max_num_seqs:
        return math.inf
    return tpot if batch >= 1 else perf.base_s + k


def candidates(
    types: Sequence[ReplicaType], load: Load, gpu_budget: int, max_count: int = 64
) -> list[Candidate]:
    out = []
    for t in types:
        for n in range(1, min(max_count, gpu_budget // t.gpus) + 1):
            p = prefill_p95(t.perf, load, n)
            d = decode_tpot(t.perf, load, n, t.max_num_seqs)
            if math.isfinite(p):
                out.append(Candidate("prefill", t.name, n, n * t.gpus, p))
            if math.isfinite(d):
                out.append(Candidate("decode", t.name, n, n * t.gpus, d))
    return out


def solve(
    cands: Sequence[Candidate],
    gpu_budget: int,
    ttft_slo_s: float,
    tpot_slo_s: float,
    *,
    fewest_gpus: bool = False,
) -> Plan | None:
    """The MILP over activation binaries z_c (one per candidate) and the bottleneck w:

    min  w + eps * sum gpus_c z_c      (fewest_gpus: min sum gpus_c z_c subject to w <= 1)
    s.t. sum_{c prefill} z_c = 1,  sum_{c decode} z_c = 1
         sum gpus_c z_c <= budget
         w >= sum_{c prefill} (lat_c / ttft_slo) z_c,  w >= sum_{c decode} (lat_c / tpot_slo) z_c
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    pre = [i for i, c in enumerate(cands) if c.role == "prefill"]
    dec = [i for i, c in enumerate(cands) if c.role == "decode"]
    if not pre or not dec:
        return None
    n = len(cands)
    w = n  # index of the bottleneck variable
    eps = 1e-4 / max(1, gpu_budget)  # at most 1e-4 of bottleneck: only ever breaks ties
    cost = np.zeros(n + 1)
    cost[:n] = [(1.0 if fewest_gpus else eps) * c.gpus for c in cands]
    cost[w] = 0.0 if fewest_gpus else 1.0
    rows, lo, hi = [], [], []

    def row(coefs: dict[int, float], low: float, high: float) -> None:
        r = np.zeros(n + 1)
        for i, v in coefs.items():
            r[i] = v
        rows.append(r)
        lo.append(low)
        hi.append(high)

    row({i: 1.0 for i in pre}, 1, 1)
    row({i: 1.0 for i in dec}, 1, 1)
    row({i: float(c.gpus) for i, c in enumerate(cands)}, -np.inf, gpu_budget)
    row({w: 1.0, **{i: -cands[i].latency_s / ttft_slo_s for i in pre}}, 0, np.inf)
    row({w: 1.0, **{i: -cands[i].latency_s / tpot_slo_s for i in dec}}, 0, np.inf)
    integrality = np.ones(n + 1)
    integrality[w] = 0
    res = milp(
        cost,
        constraints=LinearConstraint(np.array(rows), lo, hi),
        integrality=integrality,
        bounds=Bounds(np.zeros(n + 1), np.r_[np.ones(n), 1.0 if fewest_gpus else np.inf]),
        options={"mip_rel_gap": 0.0},  # the GPU tie-break is far below HiGHS' default gap
    )
    if res.x is None:
        return None
    z = res.x[:n] > 0.5
    p = next(cands[i] for i in pre if z[i])
    d = next(cands[i] for i in dec if z[i])
    return Plan(p, d, float(res.x[w]), p.gpus + d.gpus, res.message)


def plan(
    types: Sequence[ReplicaType],
    load: Load,
    gpu_budget: int,
    ttft_slo_s: float,
    tpot_slo_s: float,
    *,
    fewest_gpus: bool = False,
) -> Plan | None:
    """The best plan for `load` (lowest bottleneck, or with `fewest_gpus` the cheapest within SLO)."""
    cands = candidates(types, load, gpu_budget)
    return solve(cands, gpu_budget, ttft_slo_s, tpot_slo_s, fewest_gpus=fewest_gpus)


def forecast_rate(history: Sequence[float], alpha: float = 0.5, beta: float = 0.3) -> float:
    """Holt's linear trend forecast of the next interval's rate (never below zero)."""
    if not history:
        raise ValueError("forecasting needs at least one observed interval")
    level = history[0]
    trend = history[1] - history[0] if len(history) > 1 else 0.0
    for x in history[1:]:
        prev = level
        level = alpha * x + (1 - alpha) * (level + trend)
        trend = beta * (level - prev) + (1 - beta) * trend
    return max(0.0, level + trend)


def follow_load(
    types: Sequence[ReplicaType],
    history: Sequence[float],
    load: Load,
    gpu_budget: int,
    ttft_slo_s: float,
    tpot_slo_s: float,
    headroom: float = 1.1,
) -> tuple[float, Plan | None]:
    """Dynamo-style SLA planning: forecast the next interval's rate and give the fewest GPUs that meet
    both SLOs at it (with headroom); None when the budget cannot."""
    rate = forecast_rate(history) * headroom
    next_load = Load(max(rate, 1e-6), load.prompt_tokens, load.output_tokens, load.context_tokens)
    return rate, plan(types, next_load, gpu_budget, ttft_slo_s, tpot_slo_s, fewest_gpus=True)
