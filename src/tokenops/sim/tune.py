"""Engine knob search in the simulator: every combination of `max_num_seqs`, `max_num_batched_tokens`,
prefill chunk cap, block size and KV dtype is run on the same sessions, and ranked by goodput under
the given SLOs (ties: higher SLO attainment, then lower p99 TTFT).

The KV pool of each candidate is what a fixed KV memory budget holds at its block size and KV dtype
(bytes per token from the profile, scaled by the dtype's width); the performance model charges the
same step times whatever the KV dtype, so a narrower dtype buys capacity here, not speed. This module
owns the search and the ranking; the engine's behaviour is engine_model.py's, the fleet's fleet.py's.

`verify_live` checks a choice on our engine: it starts the engine with the chosen knobs and with a
baseline's (the same KV pool in blocks), sends both the same open-loop workload, and puts each live
goodput beside the simulator's replay of that very run (its send times and token counts).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenops.bench.metrics import SLO, summarize
from tokenops.cluster.perf_model import PerfModel
from tokenops.cluster.policies import make_policy
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.fleet import Fleet, FleetConfig
from tokenops.sim.workload import SimSession

KV_DTYPE_BYTES = {"fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0}  # per element, against fp16's 2
ENGINE_KV_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "int8": "int8"}  # our engine has no fp8 KV


@dataclass(frozen=True, slots=True)
class TuneSpace:
    """The values to try for each knob; a candidate is one value of each."""

    max_num_seqs: Sequence[int] = (32, 64, 128)
    max_num_batched_tokens: Sequence[int] = (512, 2048)
    max_chunk_tokens: Sequence[int | None] = (None,)  # None: a prefill may take the whole budget
    block_size: Sequence[int] = (16,)
    kv_dtype: Sequence[str] = ("fp16",)

    def __post_init__(self) -> None:
        unknown = [d for d in self.kv_dtype if d not in KV_DTYPE_BYTES]
        if unknown:
            raise ValueError(f"unknown kv_dtype {unknown[0]!r}: use one of {', '.join(KV_DTYPE_BYTES)}")


@dataclass(frozen=True, slots=True)
class TuneResult:
    shape: EngineShape
    kv_dtype: str
    request_goodput: float
    slo_attainment: float
    p99_ttft_ms: float | None
    median_tpot_ms: float | None
    preemptions: int

    def knobs(self) -> dict:
        s = self.shape
        return {"max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
                "max_chunk_tokens": s.max_chunk_tokens, "block_size": s.block_size,
                "kv_dtype": self.kv_dtype, "num_kv_blocks": s.num_kv_blocks}  # fmt: skip


def kv_blocks_for(perf: PerfModel, kv_bytes: float, block_size: int, kv_dtype: str) -> int:
    """Blocks a KV memory budget holds: the profile's bytes per token are fp16's."""
    if perf.kv_bytes_per_token <= 0:
        raise ValueError(f"profile {perf.name!r} has no kv_bytes_per_token to size the KV pool with")
    per_token = perf.kv_bytes_per_token * KV_DTYPE_BYTES[kv_dtype] / 2.0
    return int(kv_bytes // (per_token * block_size))


def candidates(perf: PerfModel, space: TuneSpace, kv_bytes: float) -> list[tuple[EngineShape, str]]:
    out = []
    for seqs, budget, chunk, bs, dtype in itertools.product(space.max_num_seqs, space.max_num_batched_tokens,
                                                            space.max_chunk_tokens, space.block_size,
                                                            space.kv_dtype):  # fmt: skip
        if budget < seqs:
            continue  # every running decode takes a token of the budget: the engine refuses this shape
        blocks = kv_blocks_for(perf, kv_bytes, bs, dtype)
        if blocks < 1:
            continue
        out.append((EngineShape(seqs, budget, bs, blocks, max_chunk_tokens=chunk), dtype))
    return out


def tune(
    perf: PerfModel,
    sessions: Callable[[int], Sequence[SimSession]],
    space: TuneSpace,
    slo: SLO,
    kv_bytes: float,
    replicas: int = 1,
    policy: str = "round_robin",
) -> list[TuneResult]:
    """Every candidate's result, best first. `sessions(block_size)` builds the workload, since the
    block hashes a prefix cache matches depend on the block size."""
    results = []
    by_block: dict[int, Sequence[SimSession]] = {}
    for shape, dtype in candidates(perf, space, kv_bytes):
        if shape.block_size not in by_block:
            by_block[shape.block_size] = sessions(shape.block_size)
        fleet = Fleet(FleetConfig(perf, shape, replicas=replicas), make_policy(policy))
        res = fleet.run(by_block[shape.block_size])
        s = res.summary(slo)
        results.append(TuneResult(
            shape, dtype, s["request_goodput"] or 0.0, s["slo_attainment"] or 0.0, s.get("p99_ttft_ms"),
            s.get("median_tpot_ms"), sum(v["preemptions"] for v in res.replicas.values()),
        ))  # fmt: skip
    inf = float("inf")
    # goodputs equal but for float noise (same good requests over the same span) tie
    results.sort(key=lambda r: (-round(r.request_goodput, 9), -r.slo_attainment, r.p99_ttft_ms or inf))
    return results


def engine_args(shape: EngineShape, kv_dtype: str) -> list[str]:
    """`tokenops engine` options that run a candidate's knobs (the KV pool exactly in blocks)."""
    if kv_dtype not in ENGINE_KV_DTYPE:
        raise ValueError(f"our engine has no {kv_dtype} KV cache: use one of {', '.join(ENGINE_KV_DTYPE)}")
    return [
        "--max-num-seqs", str(shape.max_num_seqs),
        "--max-num-batched-tokens", str(shape.max_num_batched_tokens),
        "--block-size", str(shape.block_size), "--num-kv-blocks", str(shape.num_kv_blocks),
        "--kv-cache-dtype", ENGINE_KV_DTYPE[kv_dtype],
        *(["--max-chunk-tokens", str(shape.max_chunk_tokens)] if shape.max_chunk_tokens else []),
        *(["--max-prefill-step-tokens", str(shape.max_prefill_step_tokens)]
          if shape.max_prefill_step_tokens else []),
    ]  # fmt: skip


def verify_live(
    perf: PerfModel,
    candidates_: dict[str, tuple[EngineShape, str]],
    workload: Callable[[int], object],
    rate: float,
    num_requests: int,
    slo: SLO,
    model: str = "smollm2-135m-instruct",
    seed: int = 0,
) -> dict[str, dict]:
    """Per named candidate (knobs): our engine started with them, `workload(block_size)` sent at
    `rate` sessions/s, and its live request goodput beside the simulator's replay of that run."""
    import httpx

    from tokenops.bench.driver import LoadConfig, run_load
    from tokenops.sim.calibrate import warm
    from tokenops.sim.live import engines
    from tokenops.sim.validation import replay

    for shape, dtype in candidates_.values():
        engine_args(shape, dtype)  # refuse what the engine cannot run before starting anything
    out = {}
    for name, (shape, dtype) in candidates_.items():
        with engines([engine_args(shape, dtype)]) as (url,):
            load = httpx.get(url + "/v1/load", timeout=10).json()
            asyncio.run(warm(url, model))
            cfg = LoadConfig(base_url=url, model=model, endpoint="completions", rate=rate,
                             num_requests=num_requests, ignore_eos=True, seed=seed)  # fmt: skip
            live = run_load(cfg, workload(shape.block_size))
        # the limits the engine resolved (its prefill step depends on its CPU), the candidate's elsewhere
        sim = replay(live.records, perf, EngineShape.of_engine(load, shape)).summary(slo)
        got = summarize(live.records, live.duration_s, slo=slo)
        out[name] = {
            "knobs": TuneResult(shape, dtype, 0, 0, None, None, 0).knobs(),
            "engine_reported": {k: load.get(k) for k in ("kv_blocks_total", "block_size", "scheduler")},
            "failed": got["failed"],
        }
        for key in ("request_goodput", "slo_attainment", "p99_ttft_ms", "median_tpot_ms"):
            out[name][key] = {"live": got.get(key), "sim": sim.get(key)}
    return out
