"""The PD split planner against the simulator: for each rate and PD policy, the split `tokenops
plan-pd` chooses (`sim.pd_split.pd_split`, from the performance model) beside the SLO attainment the
simulator gives every split, on the agentic study of `sim_pd_agentic.py` (the same sessions, OPT-13B
TP1 A100 profile with its assumed 1 ms + 25 GB/s transfer, KV pool, engine shape and SLO).

    .venv/bin/python benchmarks/plan_pd_split.py [--rates 0.75,1.0,1.25] [--workers 8] [--prefill-slots N]
        [--prefill-wait-s W] [--seeds 1,2,3] [--simulated EARLIER.json]

The planner and the simulator both run with the prefill pool's slot limit (`--prefill-slots`) and a
leg's longest wait for a slot (`--prefill-wait-s`). `--simulated` takes the simulated figures from an
earlier output of this script with the same rates, policies, slots and wait (the simulator is
deterministic), so a change to the planner is checked without simulating again. Prints JSON: per
rate and policy the plan's split and bottleneck estimate, the simulated attainment of every split,
the simulated best, and the plan's attainment less the best's. With several `--seeds` each split is
simulated on each seed's sessions and judged by the mean attainment (the per-seed figures are kept):
near the fleet's capacity one seed's figure moves by several points with small changes to the model.
The planner plans from the first seed's sessions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from sim_pd_agentic import A100_80GB_BYTES, OPT_13B_PARAMS, kv_blocks

from tokenops.bench.metrics import SLO
from tokenops.bench.workloads import make_workload
from tokenops.cluster.pd import make_pd_policy
from tokenops.cluster.perf_model import PerfModel
from tokenops.sim.cli import PROFILES, check_split
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.pd_split import SessionLoad, pd_split
from tokenops.sim.workload import sim_sessions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="0.75,1.0,1.25", help="sessions per second")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument(
        "--policies", default="static_pd,static_pd_incremental,conditional_dynamo,conditional_llm_d,ampd"
    )
    ap.add_argument("--prefill-slots", type=int, default=None, help="legs at a time per prefill worker")
    ap.add_argument("--prefill-wait-s", type=float, default=None, help="a leg's longest wait for a slot")
    ap.add_argument("--simulated", default=None, help="an earlier output whose simulated figures to reuse")
    ap.add_argument("--seeds", default="1", help="workload seeds; splits are judged by their mean")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    earlier = None
    if args.simulated:
        with open(args.simulated) as f:
            earlier = json.load(f)
        ran = (earlier["prefill_slots"], earlier.get("prefill_wait_s"))
        if ran != (args.prefill_slots, args.prefill_wait_s):
            ap.error("--simulated: that run had other prefill slots or wait")
        if earlier.get("seeds", [1]) != seeds:
            ap.error("--simulated: that run had other seeds")
    perf = dataclasses.replace(PerfModel.load(PROFILES / "opt-13b-a100-80g-tp1.json"),
                               transfer_latency_s=0.001, transfer_bytes_per_s=25e9)  # fmt: skip
    blocks = kv_blocks(A100_80GB_BYTES, OPT_13B_PARAMS * 2, perf.kv_bytes_per_token)
    shape = EngineShape(max_num_seqs=128, max_num_batched_tokens=2048, num_kv_blocks=blocks)
    slo = SLO(ttft=1.0, itl=0.1)
    out: dict = {
        "profile": perf.name,
        "kv_blocks": blocks,
        "workers": args.workers,
        "slo": "TTFT 1 s, largest inter-token gap 100 ms",
        "prefill_slots": args.prefill_slots,
        "prefill_wait_s": args.prefill_wait_s,
        "simulated_from": args.simulated,
        "utc_start": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "load_start": os.getloadavg(),
        "results": {},
    }
    out["seeds"] = seeds
    for rate in map(float, args.rates.split(",")):
        by_seed = [
            sim_sessions(
                make_workload("agentic", seed=seed, block_size=16),
                num_requests=args.requests, rate=rate, seed=seed, block_size=16, trace_block=16,
            )
            for seed in seeds
        ]  # fmt: skip
        load = SessionLoad.from_sessions(by_seed[0], rate)
        for name in args.policies.split(","):
            t0 = time.perf_counter()
            slots = {"prefill_slots": args.prefill_slots, "prefill_wait_s": args.prefill_wait_s}
            chosen = pd_split(perf, load, make_pd_policy(name, perf), args.workers, slo.ttft, slo.itl,
                              max_num_seqs=shape.max_num_seqs,
                              max_num_batched_tokens=shape.max_num_batched_tokens, kv_tokens=blocks * 16,
                              **slots)  # fmt: skip
            plan_s = time.perf_counter() - t0
            if earlier is not None:
                sim = earlier["results"][str(rate)][name]["simulated"]
            else:
                sim = _mean_over_seeds(
                    [
                        check_split(perf, shape, name, args.workers, sessions, slo, **slots)
                        for sessions in by_seed
                    ]
                )
            split = f"P{chosen.best.prefill}D{chosen.best.decode}"
            best = max(sim, key=lambda k: (sim[k]["slo_attainment"], sim[k]["request_goodput"]))
            out["results"].setdefault(str(rate), {})[name] = {
                "plan": split,
                "plan_bottleneck": chosen.best.bottleneck,
                "plan_local_share": chosen.best.local_share,
                "plan_s": plan_s,
                "estimates": {f"P{e.prefill}D{e.decode}": dataclasses.asdict(e) for e in chosen.splits},
                "simulated": sim,
                "simulated_best": best,
                "plan_attainment": sim[split]["slo_attainment"],
                "best_attainment": sim[best]["slo_attainment"],
                "plan_less_best": sim[split]["slo_attainment"] - sim[best]["slo_attainment"],
            }
    out["utc_end"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    out["load_end"] = os.getloadavg()
    print(json.dumps(out, indent=2, default=str))


def _mean_over_seeds(runs: list[dict]) -> dict:
    """Per split the mean attainment and goodput over the seeds' runs, with each seed's figures."""
    if len(runs) == 1:
        return runs[0]
    return {
        split: {
            "slo_attainment": sum(r[split]["slo_attainment"] for r in runs) / len(runs),
            "request_goodput": sum(r[split]["request_goodput"] for r in runs) / len(runs),
            "per_seed": [r[split] for r in runs],
        }
        for split in runs[0]
    }


if __name__ == "__main__":
    main()
