"""Fleet study: colocated vs static PD vs the conditional rules (Dynamo's, llm-d's) vs AMPD on
multi-round agentic sessions, in the simulator, on DistServe's OPT-13B TP1 A100 profile, over
prefill/decode splits.

    .venv/bin/python benchmarks/sim_pd_agentic.py [--workers 8] [--splits 2,3,4,5] [--sessions-per-s 1.0]
        [--transfer-gb-s 25] [--prefill-slots N --prefill-queue off|on|both] [--prefill-wait-s W]
        [--png docs/img/sim_pd_agentic.png]

Colocated runs all workers as both; each PD policy runs at every split of the same workers into a
prefill and a decode pool (`--splits`: prefill workers), since which split a deployment picks decides
whether the decode pool (its KV and its batch's ITL) or the prefill pool is the bottleneck, and the
policies differ only where the prefill pool is. Each policy is also reported at its own best split
(highest SLO attainment, then goodput), as a planner would deploy it. Static PD runs twice: as vLLM's
path ships it (the prefill worker recomputes the history its cache lacks, the whole prompt's KV goes
back) and with our incremental transfer (the history travels from the decode worker, only the new
blocks come back), so AMPD's lead splits into what the transfer gives and what its placement gives.

The source profile has no KV transfer figures: the script assumes 1 ms per transfer and 25 GB/s
(`--transfer-gb-s`; stated in the output). The KV pool per worker is what an A100-80GB leaves for
OPT-13B's KV after the weights, as vLLM sizes it (`kv_blocks`: 90% of the memory, less the fp16
weights and a 2 GiB activation reserve, in 16-token blocks of 2 x 40 layers x 5120 x 2 bytes per
token). Prints JSON: SLO attainment,
goodput and latency keys per policy and split, each policy's decision reasons, the best splits and
AMPD's ratios against each policy at the same split and at each one's best split.

`--prefill-slots N` lets each prefill worker run N legs at a time (the prefill pool's concurrency
limit); the rest wait at the gateway, first come first served, or with `--prefill-queue on` in the
live `PrefillQueue`'s order (`pd.prefill_queue`: least TTFT slack first within a lookahead of 5, a leg
passed over 3 times next); `both` runs each PD policy both ways, the queued runs under the policy's
name plus `+queue`. `--prefill-wait-s W`: a leg that waits W seconds for a slot gives up and its decode
worker prefills the request, as the live dispatch when its wait (`max_wait`, else the prefill pool's
`queue_timeout_s`, 30 s by default) runs out; without it a leg waits as long as it takes. The policies
see the legs waiting for each prefill worker (`WorkerLoad.waiting_legs`) as the live snapshot shows them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import time
from collections import Counter

from tokenops.bench.metrics import SLO
from tokenops.bench.workloads import make_workload
from tokenops.cluster.pd import make_pd_policy
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
PD_POLICIES = ("static_pd", "static_pd_incremental", "conditional_dynamo", "conditional_llm_d", "ampd")


def _best(by_split: dict[str, dict]) -> str:
    return max(by_split, key=lambda k: (by_split[k]["slo_attainment"], by_split[k]["request_goodput"]))


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--splits", default="2,3,4,5", help="prefill workers of each PD split")
    ap.add_argument("--sessions-per-s", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1, help="the workload's seed (sessions and arrivals)")
    ap.add_argument("--policies", default="colocated," + ",".join(PD_POLICIES))
    ap.add_argument("--transfer-gb-s", type=float, default=25.0, help="assumed KV transfer bandwidth")
    ap.add_argument("--prefill-slots", type=int, default=None, help="legs at a time per prefill worker")
    ap.add_argument("--prefill-queue", choices=("off", "on", "both"), default="off")
    ap.add_argument("--prefill-wait-s", type=float, default=None, help="a leg's longest wait for a slot")
    ap.add_argument("--png", help="plot SLO attainment by split per policy to this file")
    args = ap.parse_args()
    if args.prefill_queue != "off" and args.prefill_slots is None:
        ap.error("--prefill-queue orders the legs waiting for a slot: set --prefill-slots")
    queue_modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.prefill_queue]
    perf = dataclasses.replace(
        PerfModel.load(PROFILES / "opt-13b-a100-80g-tp1.json"),
        transfer_latency_s=0.001,
        transfer_bytes_per_s=args.transfer_gb_s * 1e9,
    )
    blocks = kv_blocks(A100_80GB_BYTES, OPT_13B_PARAMS * 2, perf.kv_bytes_per_token)
    shape = EngineShape(max_num_seqs=128, max_num_batched_tokens=2048, num_kv_blocks=blocks)
    slo = SLO(ttft=1.0, itl=0.1)
    wl = make_workload("agentic", seed=args.seed, block_size=16)
    sessions = sim_sessions(wl, num_requests=args.requests, rate=args.sessions_per_s, seed=args.seed,
                            block_size=16, trace_block=16)  # fmt: skip
    out: dict = {
        "profile": perf.name,
        "transfer_assumed": f"1 ms + bytes / {args.transfer_gb_s:g} GB/s",
        "kv_blocks": blocks,
        "slo": "TTFT 1 s and largest inter-token gap 100 ms",
        "sessions_per_s": args.sessions_per_s,
        "seed": args.seed,
        "workers": args.workers,
        "prefill_slots": args.prefill_slots,
        "prefill_wait_s": args.prefill_wait_s,
        "utc_start": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "load_start": os.getloadavg(),
        "results": {},
    }
    for name in args.policies.split(","):
        splits = [(args.workers, 0)] if name == "colocated" else [
            (args.workers - p, p) for p in map(int, args.splits.split(","))
        ]  # fmt: skip
        for (dec, pre), queued in itertools.product(splits, (False,) if name == "colocated" else queue_modes):
            cfg = FleetConfig(perf, shape, replicas=dec, prefill_replicas=pre, ttft_slo_s=1.0, itl_slo_s=0.1,
                              prefill_slots=args.prefill_slots, prefill_queue=queued,
                              prefill_wait_s=args.prefill_wait_s)  # fmt: skip
            fleet = Fleet(cfg, pd_policy=make_pd_policy(name, perf), record_decisions=True)
            res = fleet.run(sessions)
            s = res.summary(slo)
            reasons = Counter(d.reason for _, _, d in res.decisions)
            out["results"].setdefault(name + ("+queue" if queued else ""), {})[f"P{pre}D{dec}"] = {
                k: s[k] for k in KEYS
            } | {
                "reasons": dict(reasons),
                "preemptions": sum(v["preemptions"] for v in res.replicas.values()),
                "prefill_pool_utilisation": [
                    round(v["utilisation"], 3) for v in res.replicas.values() if v["role"] == "prefill"
                ],
                "legs_waited": len(fleet.leg_releases) + len(fleet.leg_timeouts),
                "legs_timed_out": len(fleet.leg_timeouts),
                "sim_wall_s": res.wall_s,
            }
    results = out["results"]
    best = {name: _best(by) for name, by in results.items()}
    out["best_split"] = {
        name: {"split": b} | {k: results[name][b][k] for k in KEYS[:2]} for name, b in best.items()
    }
    if "ampd" in results:
        ampd = results["ampd"]
        out["ampd_vs_at_same_split"] = {
            peer: {
                split: _ratio(ampd[split]["slo_attainment"], by[split]["slo_attainment"])
                for split in ampd
                if split in by
            }
            for peer, by in results.items()
            if peer not in ("ampd", "colocated")
        }
        top = out["best_split"]["ampd"]["slo_attainment"]
        out["ampd_best_vs_best"] = {
            peer: _ratio(top, v["slo_attainment"]) for peer, v in out["best_split"].items() if peer != "ampd"
        }
    out["utc_end"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    out["load_end"] = os.getloadavg()
    print(json.dumps(out, indent=2))
    if args.png:
        plot(out, args.png)


def plot(out: dict, path: str) -> None:
    """SLO attainment by split, one line per policy; colocated (no split) as a level line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, by_split in out["results"].items():
        if name == "colocated":
            (only,) = by_split.values()
            ax.axhline(only["slo_attainment"], color="grey", linestyle="--", label="colocated")
            continue
        splits = sorted(by_split, key=lambda k: int(k[1 : k.index("D")]))
        xs = [f"{k[1 : k.index('D')]} + {k[k.index('D') + 1 :]}" for k in splits]
        ax.plot(xs, [by_split[k]["slo_attainment"] for k in splits], marker="o", label=name)
    ax.set_xlabel("prefill + decode workers")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{out['workers']} workers, {out['sessions_per_s']:g} sessions/s, {out['profile']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
