"""A digest of every balancing decision and every request's timings the simulator produces on fixed
workloads, per policy: run it on two checkouts to show a change to the policies, the prefix index or
the simulator left their behaviour exactly as it was.

    PYTHONPATH=src .venv/bin/python benchmarks/sim_decisions_digest.py

Prints JSON: for each case (workload, policy, options, exact index or not) the number of decisions
and a SHA-256 over the (replica, reason, matched blocks) of each decision and the (start, end, token
times) of each request. Cases: sim_speed.py's 20,000-request random workload on 32 replicas for every
policy, and 3,000 requests of the shared-prefix and multi-turn workloads on 8 replicas with a
concurrency limit, the prefix policies also with a 500-entry index (evictions) and an exact index.
"""

from __future__ import annotations

import hashlib
import json

from sim_speed import PERF, POLICIES

from tokenops.bench.workloads import make_workload
from tokenops.cluster.policies import make_policy
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.fleet import Fleet, FleetConfig
from tokenops.sim.workload import sim_sessions


def digest(config: FleetConfig, policy: str, options: dict, sessions) -> dict:
    res = Fleet(config, make_policy(policy, **options), record_decisions=True).run(sessions)
    decisions = [(d.replica, d.reason, d.matched_blocks) for _, _, d in res.decisions]
    timings = [(r.start, r.end, tuple(r.chunk_times)) for r in res.records]
    return {
        "decisions": len(decisions),
        "sha256": hashlib.sha256(repr((decisions, timings)).encode()).hexdigest(),
    }


def main() -> None:
    out = {}
    wl = make_workload("random", seed=1, input_len="uniform:100,400", output_len="uniform:20,100")
    sessions = sim_sessions(wl, num_requests=20_000, rate=5.0 * 32, seed=1, block_size=16)
    config = FleetConfig(PERF, EngineShape(num_kv_blocks=2048), replicas=32)
    for p in POLICIES:
        out[f"random/{p}"] = digest(config, p, {"seed": 1} if p == "power_of_two" else {}, sessions)
    cases = (
        ("prefix_aware", {}, False), ("kv_aware", {}, False),
        ("prefix_aware", {"max_entries": 500}, False), ("kv_aware", {"max_entries": 500}, False),
        ("prefix_aware", {"learn": False}, True), ("kv_aware", {"learn": False}, True),
        ("session_affinity", {}, False), ("round_robin", {}, False), ("least_outstanding", {}, False),
    )  # fmt: skip
    for kind in ("shared-prefix", "multi-turn"):
        sessions = sim_sessions(
            make_workload(kind, seed=3), num_requests=3000, rate=40.0, seed=3, block_size=16
        )
        for p, options, exact in cases:
            config = FleetConfig(PERF, EngineShape(num_kv_blocks=512), replicas=8, exact_index=exact,
                                 concurrency_limit=16)  # fmt: skip
            name = f"{kind}/{p}" + "".join(f"/{k}={v}" for k, v in options.items())
            out[name] = digest(config, p, options, sessions)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
