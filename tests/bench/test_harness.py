"""benchmarks/harness.py: two stub targets (one a URL, one a command it starts), alternating rounds."""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path

import pytest

from tokenops.bench.driver import LoadConfig
from tokenops.bench.runner import WorkloadSpec
from tokenops.bench.stub import run_stub_in_thread

ROOT = Path(__file__).resolve().parents[2]


def _harness():
    spec = importlib.util.spec_from_file_location("harness", ROOT / "benchmarks" / "harness.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["harness"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_summarize_rounds_arithmetic():
    h = _harness()
    rounds = [{"A": {"output_throughput": 10.0}, "B": {"output_throughput": v}} for v in (12.0, 14.0, 20.0)]
    m = h.summarize_rounds(rounds)["output_throughput"]
    assert m["ratios"] == pytest.approx([1.2, 1.4, 2.0])
    assert m["ratio_median"] == pytest.approx(1.4) and m["ratio_min"] == pytest.approx(1.2)
    assert m["ratio_iqr"] == pytest.approx(1.7 - 1.3)
    assert m["a_median"] == 10.0 and m["b_median"] == 14.0


def test_harness_url_against_command(tmp_path):
    h = _harness()
    url, stop = run_stub_in_thread(itl_s=0.001, block_size=16)
    tokenops = Path(sys.executable).parent / "tokenops"  # the installed console script
    cmd = f"{shlex.quote(str(tokenops))} bench stub --port {{port}} --itl-ms 4"
    try:
        out = h.run_harness(
            h.Target("fast", url, "stub"),
            h.Target("slow", cmd, "stub"),
            LoadConfig("", concurrency=2, num_requests=6, block_size=16),
            WorkloadSpec("random", 0, 16, {"input_len": "20", "output_len": "5"}),
            rounds=2,
            start_timeout_s=60,
        )
    finally:
        stop()
    assert out["rounds"] == 2 and len(out["runs"]) == 2
    assert all(run[side]["completed"] == 6 for run in out["runs"] for side in "AB")
    e2e = out["metrics"]["mean_e2el_ms"]
    assert e2e["b_median"] >= 4 * 4.0  # B's stub sleeps at least 4 ms between each of 5 tokens
    assert len(e2e["ratios"]) == 2 and e2e["ratio_min"] <= e2e["ratio_median"] <= e2e["ratio_max"]
