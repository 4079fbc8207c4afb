"""Sweep search (pure), result JSON and PNG, compare ratios, and the CLI end to end against the stub."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tokenops.bench.cli import app
from tokenops.bench.compare import compare
from tokenops.bench.stub import run_stub_in_thread
from tokenops.bench.sweep import search_rates


def fake_server(capacity: float):
    """Attainment 1 up to `capacity` req/s, then falling: a server model with no clock."""
    calls = []

    def evaluate(rate):
        calls.append(rate)
        att = 1.0 if rate <= capacity else max(0.0, 1 - (rate - capacity) / capacity)
        return {"slo_attainment": att, "request_goodput": rate * att, "request_throughput": rate}

    return evaluate, calls


def test_search_doubles_then_bisects():
    evaluate, calls = fake_server(capacity=11.0)
    out = search_rates(evaluate, attainment=0.9, start_rate=1.0, refine=4)
    assert calls[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert 8.0 <= out["best_rate"] <= 12.1  # 11 * (1 + 0.1) is the last passing rate
    assert out["best_rate"] == max(p["rate"] for p in out["points"] if p["slo_attainment"] >= 0.9)
    assert [p["rate"] for p in out["points"]] == sorted(p["rate"] for p in out["points"])


def test_search_explicit_rates_and_nothing_passes():
    evaluate, calls = fake_server(capacity=5.0)
    out = search_rates(evaluate, rates=[20.0, 3.0, 6.0])
    assert calls == [3.0, 6.0, 20.0] and out["best_rate"] == 3.0
    evaluate, _ = fake_server(capacity=0.1)
    assert search_rates(evaluate, start_rate=1.0)["best_rate"] is None


def test_compare_directions():
    a = {"request_throughput": 10.0, "p99_ttft_ms": 100.0, "failed": 0, "mean_itl_ms": 5.0}
    b = {"request_throughput": 12.0, "p99_ttft_ms": 150.0, "failed": 0, "mean_itl_ms": 4.0}
    rows = {r["metric"]: r for r in compare(a, b)}
    assert (
        rows["request_throughput"]["ratio"] == pytest.approx(1.2)
        and rows["request_throughput"]["better"] == "B"
    )
    assert rows["p99_ttft_ms"]["better"] == "A"
    assert rows["mean_itl_ms"]["better"] == "B"
    assert rows["failed"]["better"] == "="


@pytest.fixture(scope="module")
def stub_url():
    url, stop = run_stub_in_thread(ttft_s=0.005, itl_s=0.002, block_size=16)
    yield url
    stop()


def test_cli_run_compare_and_png(stub_url, tmp_path):
    runner = CliRunner()
    base = ["run", "--url", stub_url, "-n", "12", "--concurrency", "3", "--input-len", "uniform:10,40",
            "--output-len", "4", "--block-size", "16", "--slo", "ttft=10s",
            "--price-in", "1", "--price-out", "2"]  # fmt: skip
    r = runner.invoke(app, [*base, "-o", str(tmp_path / "a.json"), "--png", str(tmp_path / "a.png")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, [*base, "--quiet", "--rate", "100", "-o", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    brief = json.loads(r.stdout)
    assert brief["completed"] == 12 and brief["total_output_tokens"] == 48 and "records" not in brief
    a = json.loads((tmp_path / "a.json").read_text())
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms",
                "request_throughput", "output_throughput", "request_goodput",
                "cost_per_million_tokens"):  # fmt: skip
        assert key in a
    assert len(a["records"]) == 12 and a["good_requests"] == 12
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    r = runner.invoke(app, ["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["metric"]: row for row in json.loads(r.stdout)}
    assert rows["request_throughput"]["ratio"] > 0


def test_cli_sweep_and_trace(stub_url, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["sweep", "--url", stub_url, "-n", "8", "--input-len", "10", "--output-len", "3",
                            "--slo", "e2e=30s", "--rates", "20,40", "-o", str(tmp_path / "s.json"),
                            "--png", str(tmp_path / "s.png")])  # fmt: skip
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["best_rate"] == 40.0 and [p["rate"] for p in s["points"]] == [20.0, 40.0]
    assert (tmp_path / "s.png").exists()
    trace = tmp_path / "t.jsonl"
    r = runner.invoke(app, ["trace", "generate", str(trace), "--workload", "multi-turn", "--turns", "2",
                            "--input-len", "10", "--output-len", "2", "--block-size", "16", "--sessions", "3",
                            "--rate", "50"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert len(trace.read_text().splitlines()) == 6
    r = runner.invoke(app, ["trace", "stats", str(trace)])
    assert json.loads(r.stdout)["sessions"] == 3
    r = runner.invoke(app, ["run", "--url", stub_url, "--workload", "trace", "--trace", str(trace),
                            "--block-size", "16", "--quiet", "--time-scale", "0.1", "-n", "6"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["completed"] == 6


def test_cli_bad_input_is_a_clear_error():
    runner = CliRunner()
    r = runner.invoke(app, ["run", "--input-len", "zipf:1,2", "-n", "1"])
    assert r.exit_code == 2 and "unknown distribution" in r.output
    r = runner.invoke(app, ["sweep", "-n", "1"])
    assert r.exit_code == 2 and "needs --slo" in r.output
