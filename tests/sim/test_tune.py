"""`tokenops tune`: the engine knob search in the simulator, and its command."""

import json

import pytest
from typer.testing import CliRunner

from tokenops.bench.metrics import SLO
from tokenops.bench.workloads import make_workload
from tokenops.cli import app
from tokenops.cluster.policies import make_policy
from tokenops.sim.cli import load_profile
from tokenops.sim.fleet import Fleet, FleetConfig
from tokenops.sim.tune import TuneSpace, candidates, kv_blocks_for, tune
from tokenops.sim.workload import sim_sessions

PERF = load_profile("opt-13b-a100-80g-tp1")
SLO_ = SLO(ttft=1.0, itl=0.1)


def _sessions(bs: int):
    wl = make_workload(
        "random", seed=0, block_size=bs, input_len="uniform:100,400", output_len="uniform:20,200"
    )
    return sim_sessions(wl, num_requests=300, rate=4.0, seed=0, block_size=bs, trace_block=bs)


def test_candidates_size_the_kv_pool_by_dtype_and_skip_shapes_the_engine_refuses():
    space = TuneSpace(max_num_seqs=(8, 64), max_num_batched_tokens=(32, 512), kv_dtype=("fp16", "fp8"))
    shapes = candidates(PERF, space, 4 * 2**30)
    assert len(shapes) == 6  # (64, 32) is refused: 64 decodes cannot fit a 32-token budget
    assert all(s.max_num_batched_tokens >= s.max_num_seqs for s, _ in shapes)
    fp16 = kv_blocks_for(PERF, 4 * 2**30, 16, "fp16")
    assert fp16 == 4 * 2**30 // (819200 * 16)
    assert kv_blocks_for(PERF, 4 * 2**30, 16, "fp8") in (2 * fp16, 2 * fp16 + 1)
    with pytest.raises(ValueError, match="kv_dtype"):
        TuneSpace(kv_dtype=("fp4",))


def test_tune_ranks_by_goodput_and_the_best_reproduces_in_the_fleet():
    space = TuneSpace(max_num_seqs=(8, 64), max_num_batched_tokens=(512, 2048), kv_dtype=("fp16", "fp8"))
    results = tune(PERF, _sessions, space, SLO_, 4 * 2**30)
    assert len(results) == 8
    goodputs = [round(r.request_goodput, 9) for r in results]
    assert goodputs == sorted(goodputs, reverse=True)
    best = results[0]
    # a KV pool this small preempts under fp16; fp8's doubled pool does not, and wins
    assert best.kv_dtype == "fp8" and best.shape.max_num_seqs == 64
    fp16 = next(
        r
        for r in results
        if r.kv_dtype == "fp16"
        and r.shape.max_num_seqs == 64
        and r.shape.max_num_batched_tokens == best.shape.max_num_batched_tokens
    )
    assert fp16.preemptions > best.preemptions
    # eight concurrent sequences cannot carry 4 sessions/s within the TTFT SLO
    assert all(r.request_goodput < best.request_goodput for r in results if r.shape.max_num_seqs == 8)
    again = Fleet(FleetConfig(PERF, best.shape), make_policy("round_robin")).run(_sessions(16)).summary(SLO_)
    assert again["request_goodput"] == pytest.approx(best.request_goodput)


def test_the_tune_command_prints_the_best_knobs_and_names_a_bad_option():
    runner = CliRunner()
    args = [
        "tune",
        "--profile",
        "opt-13b-a100-80g-tp1",
        "--kv-gib",
        "4",
        "--rate",
        "4",
        "--num-requests",
        "200",
        "--max-num-seqs",
        "8,64",
        "--max-num-batched-tokens",
        "2048",
        "--kv-dtype",
        "fp16,fp8",
        "--top",
        "1",
    ]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["candidates"] == 4 and len(out["next"]) == 1
    assert out["best"]["kv_dtype"] == "fp8" and out["best"]["max_num_seqs"] == 64
    bad = runner.invoke(app, [*args[:-4], "--kv-dtype", "fp4"])
    assert bad.exit_code == 2 and "fp4" in bad.output


@pytest.mark.timeout(400)
def test_verify_live_runs_our_engine_with_the_best_and_the_baseline_knobs_beside_the_simulator():
    runner = CliRunner()
    args = [
        "tune", "--profile", "smollm2-135m-instruct-cpu-epyc-avx2-2core", "--kv-gib", "0.05", "--rate", "2",
        "--num-requests", "40", "--max-num-seqs", "1,8", "--max-num-batched-tokens", "256",
        "--input-len", "uniform:32,96", "--output-len", "8", "--slo", "ttft=5s,itl=1s", "--top", "1",
        "--verify-live", "--live-requests", "6",
        "--baseline", "max_num_seqs=2,max_num_batched_tokens=128,block_size=16,kv_dtype=fp16",
    ]  # fmt: skip
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    runs = out["verify_live"]
    assert set(runs) == {"best", "baseline"}
    assert runs["best"]["knobs"] == {k: out["best"][k] for k in runs["best"]["knobs"]}
    assert runs["baseline"]["knobs"]["max_num_seqs"] == 2
    for run in runs.values():
        # the engine ran the simulated KV pool, and every live request finished
        assert run["engine_reported"]["kv_blocks_total"] == run["knobs"]["num_kv_blocks"]
        assert run["failed"] == 0
        good = run["request_goodput"]
        assert good["live"] > 0 and good["sim"] > 0 and good["search"] > 0
        # loose: the same order of magnitude (the shared machine's load moves the live side by 2x)
        assert 0.1 < run["median_tpot_ms"]["sim"] / run["median_tpot_ms"]["live"] < 10
    assert "simulated vs live" in res.stderr


def test_verify_live_refuses_knobs_our_engine_cannot_run_before_starting_it():
    res = CliRunner().invoke(app, [
        "tune", "--profile", "smollm2-135m-instruct-cpu-epyc-avx2-2core", "--kv-gib", "0.05", "--rate", "2",
        "--num-requests", "20", "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--kv-dtype", "fp8",
        "--verify-live",
    ])  # fmt: skip
    assert res.exit_code == 2 and "fp8" in res.output


def test_a_chunk_capped_candidate_runs_on_our_engine_with_the_same_cap():
    from tokenops.sim.engine_model import EngineShape
    from tokenops.sim.tune import engine_args

    args = engine_args(EngineShape(16, 1024, 16, 200, max_chunk_tokens=256), "fp16")
    assert args[args.index("--max-chunk-tokens") + 1] == "256"
    assert "--max-chunk-tokens" not in engine_args(EngineShape(16, 1024, 16, 200), "fp16")
    step = engine_args(EngineShape(16, 512, 16, 200, max_prefill_step_tokens=1024), "fp16")
    assert step[step.index("--max-prefill-step-tokens") + 1] == "1024"
    assert "--max-prefill-step-tokens" not in args
    # and the engine's command line takes the option (help lists it)
    res = CliRunner().invoke(app, ["engine", "--help"], env={"COLUMNS": "200"})
    assert "--max-chunk-tokens" in res.output
