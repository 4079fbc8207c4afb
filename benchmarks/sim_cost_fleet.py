"""Fleet study: cost per million output tokens against fleet size and the batch limit under a fixed
SLO, in the simulator (DistServe's OPT-13B A100 profile by default).

For each fleet size and `max_num_seqs`, the highest arrival rate per replica whose SLO attainment
stays at or above `--attainment` is found by bisection (each probe a seeded simulated run of
`--per-replica` requests per replica, least-outstanding balancing); the cost is the fleet's hourly
price over the output tokens per hour it serves at that rate (the offered load: every request is
served, the SLO decides at which rate).

    .venv/bin/python benchmarks/sim_cost_fleet.py [--sizes 1,4,16,64] [--seqs 16,64,256] \\
        [--png docs/img/sim_cost_fleet.png] [--json benchmarks/results/sim_cost_fleet.json]

Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import UTC, datetime

from tokenops.bench.metrics import SLO
from tokenops.bench.workloads import make_workload
from tokenops.cluster.perf_model import PerfModel
from tokenops.cluster.policies import make_policy
from tokenops.sim.cli import PROFILES
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.fleet import Fleet, FleetConfig
from tokenops.sim.workload import sim_sessions


def run(perf: PerfModel, shape: EngineShape, n: int, rate: float, requests: int, slo: SLO) -> dict:
    wl = make_workload("random", seed=1, input_len="uniform:200,1000", output_len="uniform:50,300")
    sessions = sim_sessions(wl, num_requests=requests, rate=rate * n, seed=1, block_size=16)
    res = Fleet(FleetConfig(perf, shape, replicas=n), make_policy("least_outstanding")).run(sessions)
    return res.summary(slo)


def best_rate(perf, shape, n, requests, slo, attainment, lo=0.05, hi=40.0, steps=9) -> tuple[float, dict]:
    """The highest per-replica rate in [lo, hi] meeting `attainment` (bisection on a log scale)."""
    best = (lo, run(perf, shape, n, lo, requests, slo))
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        s = run(perf, shape, n, mid, requests, slo)
        if s["slo_attainment"] >= attainment:
            best, lo = (mid, s), mid
        else:
            hi = mid
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="opt-13b-a100-80g-tp1")
    ap.add_argument("--sizes", default="1,4,16,64")
    ap.add_argument("--seqs", default="16,64,256", help="max_num_seqs values")
    ap.add_argument("--per-replica", type=int, default=150, help="requests per replica per probe")
    ap.add_argument("--slo", default="ttft=1s,tpot=50ms")
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--hourly", type=float, default=1.8, help="price of one replica per hour (assumed)")
    ap.add_argument(
        "--kv-blocks", type=int, default=3773, help="KV blocks per replica (OPT-13B on A100-80GB)"
    )
    ap.add_argument("--png", default="docs/img/sim_cost_fleet.png")
    ap.add_argument("--json")
    args = ap.parse_args()
    began, load_start = datetime.now(UTC).isoformat(timespec="seconds"), os.getloadavg()
    perf = PerfModel.load(PROFILES / f"{args.profile}.json")
    slo = SLO.parse(args.slo)
    out: dict = {"profile": perf.name, "slo": args.slo, "attainment": args.attainment, "hourly": args.hourly,
                 "results": {}}  # fmt: skip
    for seqs in (int(x) for x in args.seqs.split(",")):
        shape = EngineShape(
            max_num_seqs=seqs, max_num_batched_tokens=max(2048, seqs), num_kv_blocks=args.kv_blocks
        )
        for n in (int(x) for x in args.sizes.split(",")):
            rate, s = best_rate(perf, shape, n, max(300, args.per_replica * n), slo, args.attainment)
            # the offered load, all of it served: a finite run's own throughput also counts its drain
            tokens_per_s = rate * n * s["total_output_tokens"] / s["completed"]
            out["results"].setdefault(seqs, {})[n] = {
                "rate_per_replica": rate,
                "slo_attainment": s["slo_attainment"],
                "output_tokens_per_s_per_replica": tokens_per_s / n,
                "p99_ttft_ms": s["p99_ttft_ms"],
                "p99_tpot_ms": s["p99_tpot_ms"],
                "cost_per_million_output_tokens": args.hourly * n / (tokens_per_s * 3600) * 1e6,
            }
    out.update(began_utc=began, ended_utc=datetime.now(UTC).isoformat(timespec="seconds"),
               load_start=load_start, load_end=os.getloadavg())  # fmt: skip
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for seqs, by_n in out["results"].items():
            ns = sorted(by_n)
            ax.plot(ns, [by_n[n]["cost_per_million_output_tokens"] for n in ns], marker="o",
                    label=f"max_num_seqs {seqs}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set(xlabel="replicas", ylabel="$ per million output tokens",
               title=f"{perf.name}, SLO {args.slo} at {args.attainment:.0%}")  # fmt: skip
        ax.legend()
        fig.tight_layout()
        os.makedirs(os.path.dirname(args.png), exist_ok=True)
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
