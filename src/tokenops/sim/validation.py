"""Validation: replay a live run in the simulator and compare the two summaries.

The live run's own records are the trace (each request's send time, its prompt tokens from the
engine's usage and the tokens it produced), so the simulator sees the same arrivals and lengths the
engine saw; the only thing it adds is the calibrated `PerfModel` and the engine knobs. The comparison
is the relative error of p50 and p99 TTFT and TPOT and of output throughput, the numbers Vidur
reports. This module does not start engines or send load (the benchmark script and the bench driver
do); it only replays and compares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenops.bench.metrics import RequestRecord, summarize
from tokenops.cluster.pd import PDPolicy
from tokenops.cluster.perf_model import PerfModel
from tokenops.cluster.policies import Policy
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.fleet import Fleet, FleetConfig, SimResult
from tokenops.sim.workload import SimRound, SimSession

COMPARED = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "output_throughput")


def replay(
    records: Sequence[RequestRecord],
    perf: PerfModel,
    shape: EngineShape,
    replicas: int = 1,
    policy: Policy | None = None,
    host_contention: float = 0.0,
    pd_policy: PDPolicy | None = None,
    prefill_replicas: int = 0,
) -> SimResult:
    """Simulate the live run's requests at their live send times and lengths (`host_contention`: the
    replicas share one host's cores, see `FleetConfig`; with `pd_policy`, `replicas` decode workers
    and `prefill_replicas` prefill workers)."""
    ok = [r for r in records if r.success and r.prompt_tokens]
    if not ok:
        raise ValueError("no successful live records to replay")
    t0 = min(r.start for r in ok)
    sessions = [
        SimSession(f"live-{i}", r.start - t0, (SimRound(r.prompt_tokens or 1, r.output_len, 0.0, (), ()),))
        for i, r in enumerate(sorted(ok, key=lambda r: r.start))
    ]
    config = FleetConfig(
        perf, shape, replicas=replicas, prefill_replicas=prefill_replicas, poll_interval_s=None,
        host_contention=host_contention,
    )  # fmt: skip
    return Fleet(config, policy, pd_policy, record_decisions=True).run(sessions)


def compare(live: dict[str, Any], sim: dict[str, Any]) -> dict[str, dict[str, float]]:
    """For each compared metric: the live value, the simulated one and the relative error."""
    out = {}
    for k in COMPARED:
        lv, sv = float(live[k]), float(sim[k])
        out[k] = {"live": lv, "sim": sv, "rel_error": abs(sv - lv) / lv if lv else float("inf")}
    return out


def paired(live: Sequence[RequestRecord], sim: SimResult) -> list[dict[str, Any]]:
    """Each replayed request beside its live original (prompt and output tokens, TTFT and TPOT in
    ms, the simulated replica), so a systematic difference shows against prompt length, time or
    replica."""
    ok = sorted((r for r in live if r.success and r.prompt_tokens), key=lambda r: r.start)
    by_id = {r.session_id: r for r in sim.records}
    # a balancing decision names its replica, a PD decision its decode worker (and prefill worker)
    placed = {
        info.session_id: getattr(d, "replica", None) or "/".join(filter(None, (d.prefill, d.decode)))
        for info, _, d in sim.decisions
    }
    t0 = ok[0].start if ok else 0.0
    out = []
    for i, lr in enumerate(ok):
        sr = by_id.get(f"live-{i}")
        if sr is None or not sr.success:
            continue
        row = {
            "start_s": lr.start - t0, "prompt_tokens": lr.prompt_tokens, "output_tokens": lr.output_len,
            "sim_replica": placed.get(f"live-{i}"),
        }  # fmt: skip
        for name, rec in (("live", lr), ("sim", sr)):
            row[f"{name}_ttft_ms"] = rec.ttft * 1000 if rec.ttft is not None else None
            row[f"{name}_tpot_ms"] = rec.tpot * 1000 if rec.tpot is not None else None
        out.append(row)
    return out


def validate(
    records: Sequence[RequestRecord],
    duration_s: float,
    perf: PerfModel,
    shape: EngineShape,
    replicas: int = 1,
    policy: Policy | None = None,
    host_contention: float = 0.0,
    pd_policy: PDPolicy | None = None,
    prefill_replicas: int = 0,
) -> dict[str, Any]:
    """The comparison (`compare`, `max_rel_error`) and the per-request `pairs`."""
    live = summarize(records, duration_s)
    sim = replay(records, perf, shape, replicas, policy, host_contention, pd_policy, prefill_replicas)
    cmp = compare(live, sim.summary())
    return {
        "compare": cmp,
        "max_rel_error": max(v["rel_error"] for v in cmp.values()),
        "pairs": paired(records, sim),
    }
