"""Fleet study: colocated vs static PD vs conditional (Dynamo's rule) vs AMPD on multi-round agentic
sessions, in the simulator, on DistServe's OPT-13B TP1 A100 profile.

    .venv/bin/python benchmarks/sim_pd_agentic.py [--workers 8] [--sessions-per-s 1.0]

Colocated runs all workers as both; the PD policies split them half prefill, half decode. The source
profile has no KV transfer figures: the script assumes 25 GB/s and 1 ms per transfer (stated in the
output). Prints JSON: SLO attainment, goodput and latency keys per policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from tokenops.bench.metrics import SLO
from tokenops.bench.workloads import make_workload
from tokenops.cluster.pd import AMPD, Colocated, ConditionalPD, StaticPD
from tokenops.cluster.perf_model import PerfModel
from tokenops.sim.cli import PROFILES
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.fleet import Fleet, FleetConfig
from tokenops.sim.workload import sim_sessions

KEYS = ("slo_attainment", "request_goodput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--sessions-per-s", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=3000)
    args = ap.parse_args()
    perf = dataclasses.replace(PerfModel.load(PROFILES / "opt-13b-a100-80g-tp1.json"),
                               transfer_latency_s=0.001, transfer_bytes_per_s=25e9)  # fmt: skip
    shape = EngineShape(max_num_seqs=128, max_num_batched_tokens=2048, num_kv_blocks=3000)
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
    out: dict = {"profile": perf.name, "transfer_assumed": "1 ms + bytes / 25 GB/s", "results": {}}
    for name, (policy, dec, pre) in runs.items():
        cfg = FleetConfig(perf, shape, replicas=dec, prefill_replicas=pre, ttft_slo_s=1.0, itl_slo_s=0.1)
        res = Fleet(cfg, pd_policy=policy).run(sessions)
        s = res.summary(slo)
        out["results"][name] = {k: s[k] for k in KEYS} | {"sim_wall_s": res.wall_s}
    base = out["results"]["static_pd"]["request_goodput"]
    out["ampd_goodput_vs_static_pd"] = out["results"]["ampd"]["request_goodput"] / base if base else None
    out["load"] = os.getloadavg()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
