"""One benchmark end to end, as a library call: workload spec + load config -> result document.

`tokenops bench run`, the sweep command and benchmarks/harness.py all go through `run_bench`, so a
result means the same thing whichever way it was produced. This module glues workloads.py,
driver.py, metrics.py and report.py; it holds no logic of its own beyond that wiring.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tokenops.bench.driver import LoadConfig, run_load
from tokenops.bench.metrics import SLO, Pricing, summarize
from tokenops.bench.report import build_result
from tokenops.bench.traces import MOONCAKE_BLOCK_SIZE, TraceRecord
from tokenops.bench.workloads import make_workload


@dataclass(slots=True)
class WorkloadSpec:
    """A named generator (see workloads.WORKLOADS) with its options; `make()` gives a fresh, seeded
    iterator, so two runs of one spec send the same requests."""

    kind: str = "random"
    seed: int = 0
    block_size: int = MOONCAKE_BLOCK_SIZE
    options: dict[str, Any] = field(default_factory=dict)

    def make(self) -> Iterator[list[TraceRecord]]:
        return make_workload(self.kind, seed=self.seed, block_size=self.block_size, **self.options)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "seed": self.seed, "block_size": self.block_size, **self.options}


def run_bench(
    cfg: LoadConfig,
    workload: WorkloadSpec,
    *,
    slo: SLO | None = None,
    pricing: Pricing | None = None,
    params: float | None = None,
    peak_tflops: float | None = None,
    include_records: bool = True,
) -> dict[str, Any]:
    """Run one load test and return its result document (vLLM keys at the top level)."""
    res = run_load(cfg, workload.make())
    summary = summarize(
        res.records, res.duration_s, slo=slo, pricing=pricing, params=params, peak_tflops=peak_tflops
    )
    return build_result(res, summary, workload=workload.to_json(), include_records=include_records)
