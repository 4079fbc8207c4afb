"""Live vs simulated: our engine under an open-loop workload, then the same requests in the simulator
calibrated on that engine; p50/p99 TTFT and TPOT and output throughput side by side.

    flock /tmp/bench.lock .venv/bin/python benchmarks/sim_validation.py [--replicas 2] [--requests 60]
    flock /tmp/bench.lock .venv/bin/python benchmarks/sim_validation.py --pd [--requests 40]

It starts `--replicas` `tokenops engine` processes (the bundled model) on free loopback ports (with
two or more, each limited to one torch thread so they share the cores without fighting), warms each
(an engine's first request pays over a second of one-time setup), calibrates on the first and, with
two or more, measures how much slower it steps while the others are busy (the replicas share the
host's cores; the simulator takes that as `host_contention`), drives the load with the bench driver
(with several engines, requests go to them in turn, the round robin the simulator then replays with
the live `RoundRobin` policy), and prints JSON: the fitted profile, the compared keys and their
errors (also without the contention term, `compare_without_contention`), and each request's live and
simulated TTFT and TPOT with its replica (`pairs`, `by_replica`), so a systematic difference can be
traced to prompt length, time, concurrency or one replica.

With `--pd` it starts a prefill engine and a decode engine instead (one torch thread each), fits the
KV transfer from pulls between them besides the step calibration (on the decode engine) and the
contention term, sends the load through the cluster's dispatch with a PD route (`Cluster.open`,
`StaticPD`: every prefill remote, as vLLM's PD path), and replays it in the simulator with the same
policy object on a 1 prefill + 1 decode fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
from datetime import UTC, datetime

import httpx

from tokenops.bench.driver import LoadConfig, LoadDriver
from tokenops.bench.workloads import make_workload
from tokenops.cluster.pd import StaticPD
from tokenops.cluster.policies import RoundRobin
from tokenops.sim.calibrate import calibrate, measure_contention, measure_transfers, warm
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.live import engines, open_loop, run_pd
from tokenops.sim.validation import validate


class TurnDriver(LoadDriver):
    """The bench driver sending each request to the next engine in turn (a client-side round robin)."""

    def __init__(self, cfg: LoadConfig, urls: list[str]) -> None:
        super().__init__(cfg)
        self.urls = [u.rstrip("/") + "/v1/completions" for u in urls]
        self.sent = 0

    async def send(self, http, *args, **kwargs):
        self.url = self.urls[self.sent % len(self.urls)]  # read before send's first await
        self.sent += 1
        return await super().send(http, *args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3, help="calibration repeats")
    ap.add_argument("--pd", action="store_true", help="a prefill + a decode engine through a PD route")
    ap.add_argument(
        "--engine-args", default="", help="options of every `tokenops engine`, e.g. '--quantization auto'"
    )
    ap.add_argument("--profile-out")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    began = datetime.now(UTC).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    out = pd_validation(args) if args.pd else colocated_validation(args)
    out.update(requests=args.requests, rate=args.rate, began_utc=began,
               ended_utc=datetime.now(UTC).isoformat(timespec="seconds"), load_start=load_start,
               load_end=os.getloadavg(), machine=_cpu())  # fmt: skip
    text = json.dumps(out, indent=2, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def colocated_validation(args) -> dict:
    threads = 1 if args.replicas > 1 else None
    with engines([tuple(args.engine_args.split())] * args.replicas, threads) as urls:
        load = httpx.get(urls[0] + "/v1/load", timeout=5).json()
        for url in urls:
            asyncio.run(warm(url, args.model))
        perf = calibrate(urls[0], args.model, f"{args.model}-validation", f"calibrate --url {urls[0]}",
                         repeats=args.repeats)  # fmt: skip
        contention = {"slowdown": 1.0}
        if args.replicas > 1:
            contention = asyncio.run(measure_contention(urls[0], urls[1:], args.model))
        # the slowdown was measured with every other replica busy; the term is per busy neighbour
        host_contention = max(0.0, contention["slowdown"] - 1.0) / max(1, args.replicas - 1)
        if args.profile_out:
            perf.save(args.profile_out)
        cfg = LoadConfig(base_url=urls[0], model=args.model, endpoint="completions", rate=args.rate,
                         num_requests=args.requests, ignore_eos=True, seed=1)  # fmt: skip
        wl = make_workload("random", seed=1, input_len="uniform:32,256", output_len="uniform:16,64")
        live = asyncio.run(TurnDriver(cfg, urls).run(wl))
        shape = EngineShape.of_engine(load)  # its pool and step limits as it resolved them
        policy = RoundRobin() if args.replicas > 1 else None
        out = validate(live.records, live.duration_s, perf, shape, args.replicas, policy, host_contention)
        if host_contention:
            plain = validate(live.records, live.duration_s, perf, shape, args.replicas, RoundRobin())
            out["compare_without_contention"] = plain["compare"]
        out["host_contention"] = host_contention
        out["contention"] = contention
        out["by_replica"] = by_replica(out["pairs"], args.replicas)
        out["profile"] = perf.to_dict()
        out["replicas"] = args.replicas
        out["engine_args"] = args.engine_args
        out["shape"] = dataclasses.asdict(shape)
    return out


def pd_validation(args) -> dict:
    extra = tuple(args.engine_args.split())
    roles = (
        ("--role", "prefill", "--engine-id", "p0", *extra),
        ("--role", "decode", "--engine-id", "d0", *extra),
    )
    with engines(roles, threads=1) as (p_url, d_url):
        load = httpx.get(d_url + "/v1/load", timeout=5).json()
        for url in (p_url, d_url):
            asyncio.run(warm(url, args.model))
        samples, bytes_per_token = measure_transfers(p_url, d_url, args.model)
        perf = calibrate(d_url, args.model, f"{args.model}-pd-validation", f"calibrate --url {d_url}",
                         repeats=args.repeats)  # fmt: skip
        perf = perf.fit_transfers(samples, bytes_per_token)
        contention = asyncio.run(measure_contention(d_url, [p_url], args.model))
        host_contention = max(0.0, contention["slowdown"] - 1.0)
        if args.profile_out:
            perf.save(args.profile_out)
        block = int(load.get("block_size") or 16)
        requests = open_loop(args.requests, args.rate, (32, 256), (16, 64), seed=1)
        records, duration = asyncio.run(run_pd([p_url], [d_url], args.model, requests, StaticPD(perf), block))
    shape = EngineShape.of_engine(load)
    out = validate(records, duration, perf, shape, 1, None, host_contention, StaticPD(perf), 1)
    plain = validate(records, duration, perf, shape, 1, None, 0.0, StaticPD(perf), 1)
    out["compare_without_contention"] = plain["compare"]
    out["failed"] = [r.error for r in records if not r.success]
    out["host_contention"] = host_contention
    out["contention"] = contention
    out["transfers"] = [{"tokens": s.tokens, "seconds": s.seconds} for s in samples]
    out["profile"] = perf.to_dict()
    out["replicas"] = "1 prefill + 1 decode (StaticPD)"
    out["engine_args"] = args.engine_args
    out["shape"] = dataclasses.asdict(shape)
    return out


def by_replica(pairs: list[dict], replicas: int) -> dict[str, dict[str, float]]:
    """Per live replica (requests went out in turn): the median simulated / live TTFT and TPOT."""
    out = {}
    for k in range(replicas):
        rows = [p for i, p in enumerate(pairs) if i % replicas == k]
        if rows:
            out[f"live-{k}"] = {
                "requests": len(rows),
                "sim_replicas": sorted({str(p["sim_replica"]) for p in rows}),
                "median_ttft_ratio": statistics.median(p["sim_ttft_ms"] / p["live_ttft_ms"] for p in rows),
                "median_tpot_ratio": statistics.median(p["sim_tpot_ms"] / p["live_tpot_ms"] for p in rows),
            }
    return out


def _cpu() -> str:
    from tokenops.cpu_info import cpuinfo_field

    return cpuinfo_field("model name")


if __name__ == "__main__":
    main()
