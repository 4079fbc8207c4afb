"""Simulator speed: simulated requests per wall second on one core for a 32-replica fleet, per
balancing policy, and the event loop alone against SimPy (when importable) on the same step pattern.

    flock /tmp/bench.lock .venv/bin/python benchmarks/sim_speed.py [--requests 20000] [--repeats 3]

Prints JSON: for each policy the median over repeats of requests/s (the run, not the summary) and
of the summary's own time; for the loop, events/s of our heap loop and of SimPy's timeouts. Each
repeat starts after a full garbage collection, so it does not run beside the last one's fleet.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time

from tokenops.bench.workloads import make_workload
from tokenops.cluster.perf_model import PerfModel
from tokenops.cluster.policies import make_policy
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.events import EventLoop
from tokenops.sim.fleet import Fleet, FleetConfig
from tokenops.sim.workload import sim_sessions

PERF = PerfModel(name="bench", base_s=0.012, per_token_s=0.0004, prefill_attention_s=2e-8,
                 decode_attention_s=3e-7)  # fmt: skip
POLICIES = ("round_robin", "power_of_two", "least_outstanding", "session_affinity", "prefix_aware",
            "kv_aware")  # fmt: skip


def fleet_speed(policy: str, n: int, replicas: int, repeats: int) -> dict:
    wl = make_workload("random", seed=1, input_len="uniform:100,400", output_len="uniform:20,100")
    sessions = sim_sessions(wl, num_requests=n, rate=5.0 * replicas, seed=1, block_size=16)
    runs, summaries = [], []
    res = None
    for _ in range(repeats):
        opts = {"seed": 1} if policy == "power_of_two" else {}
        # the previous repeat's fleet is cyclic garbage (engines hold the fleet's callbacks) that the
        # collector keeps until a full pass: each repeat starts from a collected heap, as a lone run does
        del res
        gc.collect()
        res = Fleet(
            FleetConfig(PERF, EngineShape(num_kv_blocks=2048), replicas=replicas), make_policy(policy, **opts)
        ).run(sessions)
        runs.append(len(res.records) / res.wall_s)
        t = time.perf_counter()
        s = res.summary()
        summaries.append(time.perf_counter() - t)
    return {
        "requests_per_wall_s": statistics.median(runs),
        "all_runs": runs,
        "summary_s": statistics.median(summaries),
        "events": res.events,
        "simulated_s": res.duration_s,
        "median_ttft_ms": s["median_ttft_ms"],
    }


def loop_speed(events: int, replicas: int = 32) -> dict:
    loop = EventLoop()
    left = [events]

    def step(i: int) -> None:
        left[0] -= 1
        if left[0] > 0:
            loop.after(0.01 + i * 1e-5, step, i)

    for i in range(replicas):
        loop.at(0.0, step, i)
    t = time.perf_counter()
    loop.run()
    out = {"heap_events_per_s": loop.events_run / (time.perf_counter() - t)}
    try:
        import simpy
    except ImportError:
        out["simpy"] = "not installed"
        return out
    env = simpy.Environment()
    count = [events]

    def replica(i: int):
        while count[0] > 0:
            count[0] -= 1
            yield env.timeout(0.01 + i * 1e-5)

    for i in range(replicas):
        env.process(replica(i))
    t = time.perf_counter()
    env.run()
    out["simpy_events_per_s"] = events / (time.perf_counter() - t)
    out["simpy_version"] = simpy.__version__
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args()
    out = {
        "machine": platform.processor() or platform.machine(),
        "load_before": os.getloadavg(),
        "replicas": args.replicas,
        "requests": args.requests,
        "fleet": {
            p: fleet_speed(p, args.requests, args.replicas, args.repeats) for p in args.policies.split(",")
        },
        "event_loop": loop_speed(500_000),
        "load_after": os.getloadavg(),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
