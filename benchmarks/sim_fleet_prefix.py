"""Fleet study: prefix-aware and KV-aware balancing against round robin at 8, 32 and 128 replicas
on a shared-prefix multi-turn workload, in the simulator (DistServe's OPT-13B A100 profile).

    .venv/bin/python benchmarks/sim_fleet_prefix.py [--per-replica 150] [--png docs/img/sim_fleet_prefix.png]

Load per replica is fixed, so the fleets differ only in size. Prints JSON (bench keys per policy and
fleet size) and writes a PNG of p50 / p99 TTFT and cache hit rate against fleet size.
"""

from __future__ import annotations

import argparse
import json
import os

from tokenops.bench.metrics import SLO
from tokenops.bench.workloads import make_workload
from tokenops.cluster.perf_model import PerfModel
from tokenops.cluster.policies import make_policy
from tokenops.sim.cli import PROFILES
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.fleet import Fleet, FleetConfig
from tokenops.sim.workload import sim_sessions

POLICIES = ("round_robin", "prefix_aware", "kv_aware")
KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "cache_hit_rate", "slo_attainment")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-replica", type=int, default=150, help="requests per replica")
    ap.add_argument("--rate-per-replica", type=float, default=0.6, help="sessions/s per replica")
    ap.add_argument("--sizes", default="8,32,128")
    ap.add_argument("--png", default="docs/img/sim_fleet_prefix.png")
    args = ap.parse_args()
    perf = PerfModel.load(PROFILES / "opt-13b-a100-80g-tp1.json")
    shape = EngineShape(max_num_seqs=128, max_num_batched_tokens=2048, num_kv_blocks=3000)
    slo = SLO(ttft=0.5, tpot=0.05)
    out: dict = {"profile": perf.name, "engine": shape.__repr__(), "results": {}}
    for n in (int(x) for x in args.sizes.split(",")):
        wl = make_workload("multi-turn", seed=1, block_size=16, prefix_len=2048, groups=max(4, n // 2),
                           input_len="uniform:64,256", output_len="uniform:32,200", turns="uniform:2,8",
                           think_s="exp:3")  # fmt: skip
        sessions = sim_sessions(wl, num_requests=args.per_replica * n, rate=args.rate_per_replica * n,
                                seed=1, block_size=16, trace_block=16)  # fmt: skip
        for p in POLICIES:
            res = Fleet(FleetConfig(perf, shape, replicas=n), make_policy(p)).run(sessions)
            s = res.summary(slo)
            out["results"].setdefault(p, {})[n] = {k: s[k] for k in KEYS} | {"sim_wall_s": res.wall_s}
    out["load"] = os.getloadavg()
    print(json.dumps(out, indent=2))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for p, by_n in out["results"].items():
            ns = sorted(by_n)
            for ax, key in zip(axes, ("median_ttft_ms", "p99_ttft_ms", "cache_hit_rate"), strict=True):
                ax.plot(ns, [by_n[n][key] for n in ns], marker="o", label=p)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("replicas")
                ax.set_title(key)
        axes[0].legend()
        fig.tight_layout()
        os.makedirs(os.path.dirname(args.png), exist_ok=True)
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
