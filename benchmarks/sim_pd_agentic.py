"""Fleet study: colocated vs static PD vs conditional (Dynamo's rule) vs AMPD on multi-round agentic
sessions, in the simulator, on DistServe's OPT-13B TP1 A100 profile.

    .venv/bin/python benchmarks/sim_pd_agentic.py [--workers 8] [--sessions-per-s 1.0]

Colocated runs all workers as both; the PD policies split them half prefill, half decode. The source
profile has no KV transfer figures: the script assumes 25 GB/s and 1 ms per transfer (stated in the
output). The KV pool per worker is what an A100-80GB leaves for OPT-13B's KV after the weights, as vLLM
sizes it (`kv_blocks`: 90% of the memory, less the fp16 weights and a 2 GiB activation reserve, in
16-token blocks of 2 x 40 layers x 5120 x 2 bytes per token). Prints JSON: SLO attainment, goodput and
latency keys per policy, and each policy's decision reasons.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections import Counter

from tokenops.bench.metrics import SLO
from tokenops.bench.workloads import make_workload
from tokenops.cluster.pd import AMPD, Colocated, ConditionalPD, StaticPD
from tokenops.cluster.perf_model import PerfModel
from tokenops.sim.cli import PROFILES
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.fleet import Fleet, FleetConfig
from tokenops.sim.workload import sim_sessions

OPT_13B_PARAMS = 12.85e9
A100_80GB_BYTES = 80 * 2**30


def kv_blocks(
    gpu_bytes: float,
    weight_bytes: float,
    kv_bytes_per_token: int,
    block_size: int = 16,
    utilisation: float = 0.9,
    reserve_bytes: float = 2 * 2**30,
) -> int:
    """KV blocks a GPU holds beside the weights, as vLLM's profiler sizes the pool."""
    return int((gpu_bytes * utilisation - weight_bytes - reserve_bytes) // (kv_bytes_per_token * block_size))


KEYS = ("slo_attainment", "request_goodput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--sessions-per-s", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=3000)
    args = ap.parse_args()
    perf = dataclasses.replace(PerfModel.load(PROFILES / "opt-13b-a100-80g-tp1.json"),
                               transfer_latency_s=0.001, transfer_bytes_per_s=25e9)  # fmt: skip
    blocks = kv_blocks(A100_80GB_BYTES, OPT_13B_PARAMS * 2, perf.kv_bytes_per_token)
    shape = EngineShape(max_num_seqs=128, max_num_batched_tokens=2048, num_kv_blocks=blocks)
    slo = SLO(ttft=1.0, itl=0.1)
    wl = lambda: make_workload("agentic", seed=1, block_size=16)  # noqa: E731
    sessions = sim_sessions(wl(), num_requests=args.requests, rate=args.sessions_per_s, seed=1,
                            block_size=16, trace_block=16)  # fmt: skip
    half = args.workers // 2
    runs = {
        "colocated": (Colocated(), args.workers, 0),
        "static_pd": (StaticPD(perf), half, half),
        "conditional": (ConditionalPD.dynamo(), half, half),
        "ampd": (AMPD(perf), half, half),
    }
    out: dict = {
        "profile": perf.name,
        "transfer_assumed": "1 ms + bytes / 25 GB/s",
        "kv_blocks": blocks,
        "results": {},
    }
    for name, (policy, dec, pre) in runs.items():
        cfg = FleetConfig(perf, shape, replicas=dec, prefill_replicas=pre, ttft_slo_s=1.0, itl_slo_s=0.1)
        res = Fleet(cfg, pd_policy=policy, record_decisions=True).run(sessions)
        s = res.summary(slo)
        reasons = Counter(d.reason for _, _, d in res.decisions)
        preemptions = sum(v["preemptions"] for v in res.replicas.values())
        out["results"][name] = {k: s[k] for k in KEYS} | {
            "reasons": dict(reasons),
            "preemptions": preemptions,
            "sim_wall_s": res.wall_s,
        }
    base = out["results"]["static_pd"]["request_goodput"]
    out["ampd_goodput_vs_static_pd"] = out["results"]["ampd"]["request_goodput"] / base if base else None
    out["load"] = os.getloadavg()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
