"""`tokenops sim calibrate|run`, `tokenops plan` and `tokenops tune`: the simulator's, the planner's and
the engine knob search's commands.
Heavy imports stay inside the command bodies so `tokenops --help` stays instant."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Fleet simulator and its calibration.")

PROFILES = Path(__file__).with_name("profiles")


def load_profile(spec: str):
    """A profile file, or the name of a shipped one (`tokenops sim profiles` lists them)."""
    from tokenops.cluster.perf_model import PerfModel

    path = Path(spec)
    if not path.exists():
        path = PROFILES / f"{spec}.json"
    if not path.exists():
        shipped = ", ".join(sorted(p.stem for p in PROFILES.glob("*.json")))
        raise typer.BadParameter(f"no profile file {spec!r}; shipped profiles: {shipped}")
    return PerfModel.load(path)


@app.command("calibrate")
def calibrate_command(
    url: str = typer.Option(..., help="Base URL of a running OpenAI-compatible engine (ours, vLLM, ...)."),
    model: str = typer.Option("smollm2-135m-instruct", help="Model name to send."),
    out: str = typer.Option("profile.json", help="Where to write the fitted profile."),
    name: str = typer.Option("", help="Profile name (default: the model name)."),
    prompt_lengths: str = typer.Option(
        "16,64,128,150,192,256,448", help="Prefill grid, prompt words (points on both sides of a bend)."
    ),
    batch_sizes: str = typer.Option("1,4,16", help="Decode grid, concurrent streams."),
    decode_tokens: int = typer.Option(24, help="Tokens each decode stream generates."),
    repeats: int = typer.Option(3, help="Repeats of each grid point."),
) -> None:
    """Profile a running engine over a small grid and write its performance-model profile."""
    from tokenops.sim.calibrate import calibrate

    grid = {
        "prompt_lengths": tuple(int(x) for x in prompt_lengths.split(",")),
        "batch_sizes": tuple(int(x) for x in batch_sizes.split(",")),
        "decode_tokens": decode_tokens,
        "repeats": repeats,
    }
    perf = calibrate(url, model, name or model, f"tokenops sim calibrate --url {url}", **grid)
    perf.save(out)
    typer.echo(json.dumps(perf.to_dict(), indent=2))


@app.command("profiles")
def profiles_command() -> None:
    """List the shipped profiles and their sources."""
    from tokenops.cluster.perf_model import PerfModel

    for p in sorted(PROFILES.glob("*.json")):
        typer.echo(f"{p.stem}: {PerfModel.load(p).source}")


@app.command("run")
def run_command(
    profile: str = typer.Option(..., help="Profile file or shipped profile name."),
    workload: str = typer.Option("random", help="random, shared-prefix, multi-turn, agentic or trace."),
    trace: str | None = typer.Option(None, help="Trace file (Mooncake JSONL) for --workload trace."),
    num_requests: int = typer.Option(2000, help="Requests to simulate."),
    rate: float | None = typer.Option(None, help="Sessions per second (default: trace timestamps)."),
    burstiness: float = typer.Option(1.0, help="Gamma shape of inter-arrival times (1 = Poisson)."),
    replicas: int = typer.Option(1, help="Replicas (the decode pool under a PD policy)."),
    prefill_replicas: int = typer.Option(0, help="Prefill replicas (with --pd)."),
    policy: str = typer.Option("round_robin", help="Balancing policy (cluster.policies names)."),
    pd: str | None = typer.Option(
        None,
        help="PD policy: colocated, static_pd, static_pd_incremental (or static), conditional_dynamo, "
        "conditional_llm_d, ampd.",
    ),
    max_num_seqs: int = typer.Option(64),
    max_num_batched_tokens: int = typer.Option(512),
    num_kv_blocks: int = typer.Option(4096),
    block_size: int = typer.Option(16),
    max_chunk_tokens: int | None = typer.Option(
        None, help="Cap on one prefill's chunk per step (default: the whole step budget)."
    ),
    max_prefill_step_tokens: int | None = typer.Option(
        None,
        help="A step with no row one token from its sample lets its first prefill run to this many "
        "tokens, as the engine's option of that name (default: the step budget).",
    ),
    input_len: str = typer.Option("uniform:100,400", help="Prompt length distribution (generated)."),
    output_len: str = typer.Option("uniform:20,200", help="Output length distribution (generated)."),
    slo: str | None = typer.Option(None, help="e.g. ttft=500ms,tpot=50ms"),
    hourly: float | None = typer.Option(None, help="Hardware $/hour per replica, for cost per 1M tokens."),
    seed: int = typer.Option(0),
    out: str | None = typer.Option(None, help="Write the summary JSON here too."),
) -> None:
    """Simulate a fleet on a workload and print the bench's summary (vLLM keys) plus replica stats."""
    from tokenops.bench.metrics import SLO, Pricing
    from tokenops.bench.workloads import make_workload
    from tokenops.cluster.policies import make_policy
    from tokenops.sim.engine_model import EngineShape
    from tokenops.sim.fleet import Fleet, FleetConfig
    from tokenops.sim.workload import sim_sessions

    try:
        shape = EngineShape(max_num_seqs, max_num_batched_tokens, block_size, num_kv_blocks,
                            max_chunk_tokens=max_chunk_tokens,
                            max_prefill_step_tokens=max_prefill_step_tokens)  # fmt: skip
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    perf = load_profile(profile)
    wl = make_workload(workload, seed=seed, block_size=block_size, path=trace, input_len=input_len,
                       output_len=output_len)  # fmt: skip
    sessions = sim_sessions(
        wl, num_requests=num_requests, rate=rate, burstiness=burstiness, seed=seed, block_size=block_size,
        trace_block=512 if workload == "trace" else block_size,
    )  # fmt: skip
    fleet = Fleet(
        FleetConfig(perf, shape, replicas=replicas, prefill_replicas=prefill_replicas),
        make_policy(policy, **({"seed": seed} if policy == "power_of_two" else {})),
        _pd_policy(pd, perf) if pd else None,
    )
    res = fleet.run(sessions)
    n = replicas + (prefill_replicas if pd else 0)
    pricing = Pricing(hourly=hourly * n) if hourly is not None else None
    summary = res.summary(SLO.parse(slo), pricing)
    text = json.dumps(summary, indent=2, default=str)
    if out is not None:
        Path(out).write_text(text + "\n")
    typer.echo(text)


def plan_command(
    types: str = typer.Option(..., help="Replica types: profile[:gpus[:max_num_seqs]],... (files or names)."),
    rate: float = typer.Option(..., help="Requests per second to plan for."),
    prompt_tokens: float = typer.Option(..., help="Mean uncached prompt tokens per request."),
    output_tokens: float = typer.Option(..., help="Mean output tokens per request."),
    gpus: int = typer.Option(..., help="GPU budget."),
    slo: str = typer.Option("ttft=1s,tpot=100ms", help="TTFT and TPOT targets."),
    history: str | None = typer.Option(
        None, help="Load following: observed rates of past intervals (comma separated); plans the next."
    ),
    check: int = typer.Option(0, help="Simulate this many requests on the chosen plan (static PD)."),
    seed: int = typer.Option(0),
) -> None:
    """Choose prefill and decode replica counts per type (a MILP, HiGHS) and optionally simulate them."""
    from tokenops.bench.metrics import SLO
    from tokenops.sim.planner import Load, ReplicaType, follow_load, plan

    targets = SLO.parse(slo)
    if targets is None or targets.ttft is None or targets.tpot is None:
        raise typer.BadParameter("--slo needs both ttft and tpot")
    rtypes = []
    for spec in types.split(","):
        name, *rest = spec.split(":")
        perf = load_profile(name)
        g = int(rest[0]) if rest else int(perf.meta.get("gpus", 1))
        rtypes.append(ReplicaType(perf.name, perf, g, int(rest[1]) if len(rest) > 1 else 256))
    load = Load(rate, prompt_tokens, output_tokens)
    out: dict = {}
    if history:
        forecast, chosen = follow_load(rtypes, [float(x) for x in history.split(",")], load, gpus,
                                       targets.ttft, targets.tpot)  # fmt: skip
        out["forecast_rate"] = forecast
    else:
        chosen = plan(rtypes, load, gpus, targets.ttft, targets.tpot)
    if chosen is None:
        typer.echo(json.dumps({**out, "plan": None, "reason": "no plan fits the GPU budget and SLOs"}))
        raise typer.Exit(1)
    from dataclasses import asdict

    out["plan"] = asdict(chosen)
    if check:
        out["simulated"] = check_plan(chosen, rtypes, load, check, targets, seed)
    typer.echo(json.dumps(out, indent=2))


def check_plan(chosen, rtypes, load, n: int, slo, seed: int) -> dict:
    """Run the plan in the simulator as static PD under the planned load; the SLO keys of its summary."""
    from tokenops.bench.workloads import make_workload
    from tokenops.cluster.pd import StaticPD
    from tokenops.sim.engine_model import EngineShape
    from tokenops.sim.fleet import Fleet, FleetConfig
    from tokenops.sim.workload import sim_sessions

    by_name = {t.name: t for t in rtypes}
    pt, dt = by_name[chosen.prefill.type], by_name[chosen.decode.type]
    wl = make_workload("random", seed=seed, block_size=16, input_len=f"exp:{load.prompt_tokens}",
                       output_len=f"exp:{load.output_tokens}")  # fmt: skip
    sessions = sim_sessions(wl, num_requests=n, rate=load.rate, seed=seed, block_size=16, trace_block=16)
    shape = EngineShape(max_num_seqs=dt.max_num_seqs, max_num_batched_tokens=max(2048, dt.max_num_seqs),
                        num_kv_blocks=1 << 16)  # fmt: skip
    cfg = FleetConfig(dt.perf, shape, replicas=chosen.decode.count, prefill_replicas=chosen.prefill.count,
                      prefill_perf=pt.perf)  # fmt: skip
    s = Fleet(cfg, pd_policy=StaticPD(dt.perf)).run(sessions).summary(slo)
    keys = ("p95_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p95_tpot_ms", "slo_attainment",
            "request_goodput")  # fmt: skip
    return {k: s[k] for k in keys}


def _pd_policy(name: str, perf):
    """The PD policy `name` as `make_pd_policy` builds it (the conditional rules with the thresholds
    their projects ship or guide to); a bad name is a usage error listing the valid ones."""
    from tokenops.cluster.pd import make_pd_policy

    try:
        return make_pd_policy(name, perf)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e


def plan_pd_command(
    profile: str = typer.Option(..., help="Profile file or shipped profile name (every worker's type)."),
    policy: str = typer.Option(
        "ampd",
        help="PD policy: static_pd (as vLLM ships it), static_pd_incremental (or static), "
        "conditional_dynamo, conditional_llm_d, ampd.",
    ),
    workers: int = typer.Option(8, help="Workers to split into a prefill and a decode pool."),
    sessions_per_s: float = typer.Option(..., help="Sessions starting per second."),
    workload: str = typer.Option("agentic", help="Multi-round workload: agentic or multi-turn."),
    requests: int = typer.Option(
        3000, help="Rounds of the workload the load is measured on (and --check runs)."
    ),
    slo: str = typer.Option("ttft=1s,itl=100ms", help="TTFT target and a decode target (itl or tpot)."),
    max_num_seqs: int = typer.Option(128),
    max_num_batched_tokens: int = typer.Option(2048, help="The engines' token budget (--check)."),
    num_kv_blocks: int = typer.Option(0, help="KV blocks per worker (0: no KV limit)."),
    block_size: int = typer.Option(16),
    transfer_ms: float | None = typer.Option(None, help="KV transfer latency, when the profile lacks it."),
    transfer_gb_s: float | None = typer.Option(
        None, help="KV transfer bandwidth, when the profile lacks it."
    ),
    prefill_slots: int | None = typer.Option(
        None, help="Legs at a time per prefill worker (the prefill pool's slot limit; none: unlimited)."
    ),
    prefill_wait_s: float | None = typer.Option(
        None, help="A leg's longest wait for a slot before its decode worker prefills (with --prefill-slots)."
    ),
    check: bool = typer.Option(False, "--check", help="Simulate every split and print its SLO attainment."),
    seed: int = typer.Option(0),
) -> None:
    """Choose the prefill/decode split of a fleet for a PD policy on a multi-round workload, from the
    performance model (and with --check, beside what the simulator gives each split)."""
    import dataclasses

    from tokenops.bench.metrics import SLO
    from tokenops.bench.workloads import make_workload
    from tokenops.sim.engine_model import EngineShape
    from tokenops.sim.pd_split import PlannedPolicy, SessionLoad, pd_split
    from tokenops.sim.workload import sim_sessions

    if workload not in ("agentic", "multi-turn"):
        raise typer.BadParameter(f"--workload {workload!r}: the split planner takes agentic or multi-turn")
    try:
        targets = SLO.parse(slo)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    decode_slo = targets and (targets.itl or targets.tpot)
    if targets is None or targets.ttft is None or decode_slo is None:
        raise typer.BadParameter("--slo needs ttft and one of itl or tpot")
    if workers < 2:
        raise typer.BadParameter("--workers: a PD split needs at least two")
    if sessions_per_s <= 0 or requests < 1:
        raise typer.BadParameter("--sessions-per-s must be positive and --requests at least 1")
    if prefill_slots is not None and prefill_slots < 1:
        raise typer.BadParameter("--prefill-slots must be at least 1")
    if prefill_wait_s is not None and (prefill_slots is None or prefill_wait_s < 0):
        raise typer.BadParameter("--prefill-wait-s is a wait for a slot: set --prefill-slots, and >= 0")
    try:  # the engines' limits, checked before any work (--check simulates them)
        shape = EngineShape(max_num_seqs, max_num_batched_tokens, block_size, num_kv_blocks or 1 << 20)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    perf = load_profile(profile)
    if transfer_ms is not None:
        perf = dataclasses.replace(perf, transfer_latency_s=transfer_ms / 1000)
    if transfer_gb_s is not None:
        perf = dataclasses.replace(perf, transfer_bytes_per_s=transfer_gb_s * 1e9)
    pd = _pd_policy(policy, perf)
    if not isinstance(pd, PlannedPolicy):
        raise typer.BadParameter(f"--policy {policy}: the split planner takes a policy with a prefill pool")
    wl = make_workload(workload, seed=seed, block_size=block_size)
    sessions = sim_sessions(wl, num_requests=requests, rate=sessions_per_s, seed=seed, block_size=block_size,
                            trace_block=block_size)  # fmt: skip
    load = SessionLoad.from_sessions(sessions, sessions_per_s, block_size)
    kv_tokens = num_kv_blocks * block_size or None
    slots = {"prefill_slots": prefill_slots, "prefill_wait_s": prefill_wait_s}
    chosen = pd_split(perf, load, pd, workers, targets.ttft, decode_slo, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, kv_tokens=kv_tokens,
                      **slots)  # fmt: skip
    out = {
        "policy": chosen.policy,
        "requests_per_s": load.rate,
        "shared_prefix_tokens": load.shared_prefix_tokens,
        "split": f"P{chosen.best.prefill}D{chosen.best.decode}",
        "plan": dataclasses.asdict(chosen.best),
        "splits": {f"P{e.prefill}D{e.decode}": dataclasses.asdict(e) for e in chosen.splits},
    }
    if check:
        sim = check_split(perf, shape, policy, workers, sessions, targets, **slots)
        for name, s in sim.items():
            out["splits"][name]["simulated"] = s
        best = max(sim, key=lambda k: (sim[k]["slo_attainment"], sim[k]["request_goodput"]))
        out["simulated_best"] = best
        out["plan_vs_simulated_best"] = sim[out["split"]]["slo_attainment"] - sim[best]["slo_attainment"]
    typer.echo(json.dumps(out, indent=2, default=str))


def check_split(perf, shape, policy: str, workers: int, sessions, slo, **fleet) -> dict[str, dict]:
    """Every split of `workers` in the simulator under `policy` (a fresh policy object each run): the
    SLO keys of each summary, by split name."""
    from tokenops.sim.fleet import Fleet, FleetConfig

    out = {}
    for p in range(1, workers):
        cfg = FleetConfig(perf, shape, replicas=workers - p, prefill_replicas=p, ttft_slo_s=slo.ttft,
                          itl_slo_s=slo.itl or float("inf"), **fleet)  # fmt: skip
        s = Fleet(cfg, pd_policy=_pd_policy(policy, perf)).run(sessions).summary(slo)
        out[f"P{p}D{workers - p}"] = {k: s[k] for k in ("slo_attainment", "request_goodput", "p99_ttft_ms")}
    return out


def _ints(spec: str) -> tuple[int, ...]:
    return tuple(int(x) for x in spec.split(",") if x)


def tune_command(
    profile: str = typer.Option(..., help="Profile file or shipped profile name."),
    kv_gib: float = typer.Option(..., help="GPU (or host) memory left for the KV cache per replica, GiB."),
    workload: str = typer.Option("random", help="random, shared-prefix, multi-turn or agentic."),
    num_requests: int = typer.Option(1000, help="Requests to simulate per candidate."),
    rate: float = typer.Option(..., help="Sessions per second."),
    replicas: int = typer.Option(1),
    slo: str = typer.Option("ttft=1s,itl=100ms", help="Targets goodput is counted under."),
    max_num_seqs: str = typer.Option("32,64,128"),
    max_num_batched_tokens: str = typer.Option("512,2048"),
    chunk: str = typer.Option("", help="Prefill chunk caps to try (empty: the whole budget only)."),
    block_size: str = typer.Option("16"),
    kv_dtype: str = typer.Option("fp16", help="KV dtypes to try: fp16, bf16, fp8, int8."),
    input_len: str = typer.Option("uniform:100,400"),
    output_len: str = typer.Option("uniform:20,200"),
    top: int = typer.Option(5, help="Candidates to print besides the best."),
    seed: int = typer.Option(0),
    verify_live: bool = typer.Option(
        False, "--verify-live", help="Run our engine with the best knobs and the baseline's on this machine."
    ),
    baseline: str = typer.Option(
        "max_num_seqs=64,max_num_batched_tokens=512,block_size=16,kv_dtype=fp16",
        help="The knobs the best is verified against (default: the engine's own defaults).",
    ),
    live_requests: int = typer.Option(60, help="Requests of each live run (--verify-live)."),
    model: str = typer.Option("smollm2-135m-instruct", help="The model our engine serves (--verify-live)."),
) -> None:
    """Search engine knobs for the highest goodput under the SLOs, in the simulator; with
    --verify-live, then run our engine with the best knobs and with the baseline's and print the
    simulated and the live goodput side by side (JSON on stdout, a table on stderr)."""
    from tokenops.bench.metrics import SLO
    from tokenops.bench.workloads import make_workload
    from tokenops.sim.tune import TuneSpace, tune
    from tokenops.sim.workload import sim_sessions

    perf = load_profile(profile)
    targets = SLO.parse(slo)
    if targets is None:
        raise typer.BadParameter("--slo needs at least one target")
    try:
        space = TuneSpace(_ints(max_num_seqs), _ints(max_num_batched_tokens),
                          _ints(chunk) or (None,), _ints(block_size), tuple(kv_dtype.split(",")))  # fmt: skip
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e

    def sessions(bs: int):
        wl = make_workload(workload, seed=seed, block_size=bs, input_len=input_len, output_len=output_len)
        return sim_sessions(
            wl, num_requests=num_requests, rate=rate, seed=seed, block_size=bs, trace_block=bs
        )

    try:
        results = tune(perf, sessions, space, targets, kv_gib * 2**30, replicas=replicas)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    if not results:
        raise typer.BadParameter("no candidate: every max_num_batched_tokens is below every max_num_seqs")
    rows = [r.knobs() | {"request_goodput": r.request_goodput, "slo_attainment": r.slo_attainment,
                         "p99_ttft_ms": r.p99_ttft_ms, "median_tpot_ms": r.median_tpot_ms,
                         "preemptions": r.preemptions} for r in results]  # fmt: skip
    out = {"profile": perf.name, "candidates": len(rows), "best": rows[0], "next": rows[1 : top + 1]}
    if verify_live:

        def live_workload(bs: int):
            return make_workload(workload, seed=seed, block_size=bs, input_len=input_len,
                                 output_len=output_len)  # fmt: skip

        out["verify_live"] = _verify_live(
            perf, results[0], baseline, sessions, targets, kv_gib, replicas, rate, live_requests, model, seed,
            live_workload,
        )  # fmt: skip
        _verify_table(out["verify_live"])
    typer.echo(json.dumps(out, indent=2))


def _verify_live(perf, best, baseline, sessions, targets, kv_gib, replicas, rate, n, model, seed, workload):
    from tokenops.sim.tune import TuneSpace, engine_args, tune, verify_live

    if replicas != 1:
        raise typer.BadParameter("--verify-live runs one engine: use --replicas 1")
    knobs = dict(part.split("=", 1) for part in baseline.split(",") if part)
    try:
        space = TuneSpace((int(knobs["max_num_seqs"]),), (int(knobs["max_num_batched_tokens"]),), (None,),
                          (int(knobs["block_size"]),), (knobs["kv_dtype"],))  # fmt: skip
        (base,) = tune(perf, sessions, space, targets, kv_gib * 2**30)
        for r in (best, base):
            engine_args(r.shape, r.kv_dtype)
    except (KeyError, ValueError) as e:
        raise typer.BadParameter(f"--baseline or the best candidate: {e}") from e
    runs = verify_live(perf, {"best": (best.shape, best.kv_dtype), "baseline": (base.shape, base.kv_dtype)},
                       workload, rate, n, targets, model, seed)  # fmt: skip
    for name, r in (("best", best), ("baseline", base)):
        runs[name]["request_goodput"]["search"] = r.request_goodput
    return runs


def _verify_table(runs: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tokenops tune: simulated vs live")
    for col in ("knobs", "metric", "search", "sim (replay)", "live"):
        table.add_column(col)
    for name, run in runs.items():
        for key in ("request_goodput", "slo_attainment", "p99_ttft_ms", "median_tpot_ms"):
            v = run[key]
            cells = [v.get("search"), v["sim"], v["live"]]
            table.add_row(name if key == "request_goodput" else "", key,
                          *("" if c is None else f"{c:.3g}" for c in cells))  # fmt: skip
    Console(stderr=True).print(table)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="sim")
    root.command("plan")(plan_command)
    root.command("plan-pd")(plan_pd_command)
    root.command("tune")(tune_command)
