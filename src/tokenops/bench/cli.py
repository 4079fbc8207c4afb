"""The `tokenops bench` sub-commands: run, sweep, compare, stub, trace.

This module only parses options and calls into the bench package; heavy imports (aiohttp, numpy,
matplotlib, uvicorn) happen inside the command bodies so that `tokenops --help` stays instant.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(
    no_args_is_help=True, help="Load generator and SLO metrics for OpenAI-compatible endpoints."
)
trace_app = typer.Typer(no_args_is_help=True, help="Write and inspect Mooncake-format JSONL traces.")
app.add_typer(trace_app, name="trace")

# Options shared by `run`, `sweep` and `trace generate`.
Url = Annotated[str, typer.Option(help="Base URL of the OpenAI-compatible target (with or without /v1).")]
Model = Annotated[
    str | None, typer.Option(help="Model name sent in each request (default: the target's first).")
]
Endpoint = Annotated[str, typer.Option(help="chat (/v1/chat/completions) or completions (/v1/completions).")]
Workload = Annotated[str, typer.Option(help="random, shared-prefix, multi-turn, agentic or trace.")]
Seed = Annotated[int, typer.Option(help="Seed of the workload and of the arrival process.")]
InputLen = Annotated[
    str | None,
    typer.Option(help="Input length distribution: 512, uniform:a,b, normal:m,s, exp:m, lognormal:med,sigma."),
]
OutputLen = Annotated[
    str | None, typer.Option(help="Output length distribution (max_tokens of each request).")
]
Groups = Annotated[int | None, typer.Option(help="shared-prefix: number of distinct system prompts.")]
PrefixLen = Annotated[int | None, typer.Option(help="shared-prefix / multi-turn: shared prefix tokens.")]
Turns = Annotated[str | None, typer.Option(help="multi-turn: turns per session (distribution).")]
Think = Annotated[
    str | None, typer.Option(help="multi-turn: think time between turns, seconds (distribution).")
]
Rounds = Annotated[str | None, typer.Option(help="agentic: rounds per session (distribution).")]
ToolOut = Annotated[str | None, typer.Option(help="agentic: tool output tokens per round (distribution).")]
ToolDelay = Annotated[str | None, typer.Option(help="agentic: tool run time, seconds (distribution).")]
SystemLen = Annotated[
    int | None, typer.Option(help="agentic: system prompt tokens (shared by all sessions).")
]
TaskLen = Annotated[int | None, typer.Option(help="agentic: task prompt tokens.")]
Trace = Annotated[Path | None, typer.Option(help="trace: the JSONL trace file to replay.")]
BlockSize = Annotated[int, typer.Option(help="Tokens per hash id when prompts are rebuilt (Mooncake: 512).")]
Concurrency = Annotated[
    int | None, typer.Option(help="Closed loop at this concurrency; with --rate, the cap.")
]
Rate = Annotated[
    float | None, typer.Option(help="Open loop: sessions started per second (inf: all at once).")
]
Burst = Annotated[float, typer.Option(help="Gamma shape of inter-arrival times: 1 Poisson, <1 burstier.")]
NumReq = Annotated[int | None, typer.Option("--num-requests", "-n", help="Stop after this many requests.")]
Duration = Annotated[float | None, typer.Option(help="Stop sending new requests after this many seconds.")]
Warmup = Annotated[int, typer.Option(help="Requests sent first and left out of the metrics.")]
Slo = Annotated[str | None, typer.Option(help="SLOs for goodput, e.g. ttft=500ms,tpot=50ms,e2e=10s.")]
TimeScale = Annotated[float, typer.Option(help="trace: multiply timestamps by this (0.5: twice as fast).")]
ApiKey = Annotated[str | None, typer.Option(envvar="OPENAI_API_KEY", help="Bearer token for the target.")]
Header = Annotated[list[str] | None, typer.Option(help="Extra request header NAME:VALUE (repeatable).")]


def _workload(
    workload: str,
    seed: int,
    block_size: int,
    **opts: Any,
) -> Any:
    from tokenops.bench.runner import WorkloadSpec

    names = {"trace": "path", "think": "think_s", "tool_delay": "tool_delay_s", "tool_out": "tool_output_len"}
    options = {
        names.get(k, k): (str(v) if isinstance(v, Path) else v) for k, v in opts.items() if v is not None
    }
    return WorkloadSpec(workload, seed, block_size, options)


def _headers(header: list[str] | None) -> dict[str, str]:
    out = {}
    for h in header or []:
        name, sep, value = h.partition(":")
        if not sep:
            raise typer.BadParameter(f"header {h!r} must be NAME:VALUE")
        out[name.strip()] = value.strip()
    return out


def _resolve_model(url: str, model: str | None, api_key: str | None) -> str:
    """The given model, else the first one the target lists at /v1/models."""
    if model:
        return model
    import httpx

    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = httpx.get(base + "/models", headers=headers, timeout=10).json()["data"]
        return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(
            f"no --model given and {base}/models gave none ({type(exc).__name__}: {exc})"
        ) from None


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg="red", err=True)
    raise typer.Exit(2)


@app.command()
def run(
    url: Url = "http://127.0.0.1:8000",
    model: Model = None,
    endpoint: Endpoint = "chat",
    workload: Workload = "random",
    seed: Seed = 0,
    input_len: InputLen = None,
    output_len: OutputLen = None,
    groups: Groups = None,
    prefix_len: PrefixLen = None,
    turns: Turns = None,
    think: Think = None,
    rounds: Rounds = None,
    tool_out: ToolOut = None,
    tool_delay: ToolDelay = None,
    system_len: SystemLen = None,
    task_len: TaskLen = None,
    trace: Trace = None,
    block_size: BlockSize = 512,
    concurrency: Concurrency = None,
    rate: Rate = None,
    burstiness: Burst = 1.0,
    num_requests: NumReq = None,
    duration: Duration = None,
    warmup: Warmup = 0,
    slo: Slo = None,
    time_scale: TimeScale = 1.0,
    no_stream: Annotated[bool, typer.Option(help="Send non-streaming requests (TTFT = E2E).")] = False,
    ignore_eos: Annotated[bool, typer.Option(help="Ask vLLM/SGLang for exactly max_tokens.")] = False,
    api_key: ApiKey = None,
    header: Header = None,
    price_in: Annotated[float | None, typer.Option(help="$ per million input tokens.")] = None,
    price_out: Annotated[float | None, typer.Option(help="$ per million output tokens.")] = None,
    price_cached: Annotated[float | None, typer.Option(help="$ per million cached input tokens.")] = None,
    hourly_cost: Annotated[float | None, typer.Option(help="$ per hour of the serving hardware.")] = None,
    params: Annotated[float | None, typer.Option(help="Model parameter count, for MFU (e.g. 1.7e9).")] = None,
    peak_tflops: Annotated[float | None, typer.Option(help="Hardware dense peak TFLOP/s, for MFU.")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the JSON result here.")] = None,
    png: Annotated[Path | None, typer.Option(help="Write a PNG report here.")] = None,
    no_records: Annotated[bool, typer.Option(help="Leave per-request records out of the JSON.")] = False,
    quiet: Annotated[
        bool, typer.Option(help="No progress bar and no table; print the JSON summary.")
    ] = False,
) -> None:
    """Run one load test and print its metrics (vLLM bench serve's definitions)."""
    from tokenops.bench.driver import LoadConfig
    from tokenops.bench.metrics import SLO, Pricing
    from tokenops.bench.report import print_summary, save_json, write_png
    from tokenops.bench.runner import run_bench

    try:
        spec = _workload(
            workload, seed, block_size, input_len=input_len, output_len=output_len, groups=groups,
            prefix_len=prefix_len, turns=turns, think=think, rounds=rounds, tool_out=tool_out,
            tool_delay=tool_delay, system_len=system_len, task_len=task_len, trace=trace,
        )  # fmt: skip
        next(spec.make(), None)  # surface a bad workload option before anything else
        if num_requests is None and duration is None:
            num_requests = 100
        model = _resolve_model(url, model, api_key)
        cfg = LoadConfig(
            base_url=url, model=model, endpoint=endpoint, concurrency=concurrency, rate=rate,
            burstiness=burstiness,
            fixed_schedule=workload == "trace" and rate is None and concurrency is None,
            time_scale=time_scale, num_requests=num_requests, duration_s=duration, warmup=warmup, seed=seed,
            stream=not no_stream, ignore_eos=ignore_eos, api_key=api_key, headers=_headers(header),
            block_size=block_size, progress=not quiet,
        )  # fmt: skip
        slo_ = SLO.parse(slo)
        pricing = None
        if price_in is not None or price_out is not None or hourly_cost is not None:
            pricing = Pricing(price_in or 0.0, price_out or 0.0, price_cached, hourly_cost)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    result = run_bench(
        cfg, spec, slo=slo_, pricing=pricing, params=params, peak_tflops=peak_tflops, include_records=True
    )
    if png:
        write_png(result, png)
    if no_records:
        result.pop("records", None)
    if output:
        save_json(result, output)
    if quiet:
        brief = {k: v for k, v in result.items() if k not in ("records", "throughput_over_time", "config")}
        sys.stdout.write(json.dumps(brief, indent=1, default=str) + "\n")
    else:
        print_summary(result, f"tokenops bench: {workload} -> {url}")
        if result["failed"]:
            errors = {r["error"] for r in result.get("records", []) if r.get("error")}
            typer.secho(f"{result['failed']} failed; e.g. {sorted(errors)[:3]}", fg="yellow", err=True)


@app.command()
def sweep(
    url: Url = "http://127.0.0.1:8000",
    model: Model = None,
    endpoint: Endpoint = "chat",
    workload: Workload = "random",
    seed: Seed = 0,
    input_len: InputLen = None,
    output_len: OutputLen = None,
    groups: Groups = None,
    prefix_len: PrefixLen = None,
    turns: Turns = None,
    think: Think = None,
    rounds: Rounds = None,
    tool_out: ToolOut = None,
    tool_delay: ToolDelay = None,
    system_len: SystemLen = None,
    task_len: TaskLen = None,
    trace: Trace = None,
    block_size: BlockSize = 512,
    concurrency: Concurrency = None,
    burstiness: Burst = 1.0,
    num_requests: NumReq = None,
    duration: Duration = None,
    slo: Annotated[
        str, typer.Option(help="SLOs that define a good request, e.g. ttft=500ms,tpot=50ms.")
    ] = "",
    attainment: Annotated[float, typer.Option(help="Share of good requests a rate must reach.")] = 0.9,
    rates: Annotated[
        str | None, typer.Option(help="Comma-separated rates to try instead of searching.")
    ] = None,
    start_rate: Annotated[float, typer.Option(help="Search: first rate (doubled until it fails).")] = 1.0,
    max_rate: Annotated[float, typer.Option(help="Search: highest rate to try.")] = 1024.0,
    refine: Annotated[int, typer.Option(help="Search: bisection steps after the first failing rate.")] = 3,
    api_key: ApiKey = None,
    header: Header = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the sweep JSON here.")] = None,
    png: Annotated[Path | None, typer.Option(help="Write a PNG report (goodput vs rate) here.")] = None,
) -> None:
    """Find the highest request rate whose SLO attainment stays above the threshold."""
    from rich.console import Console
    from rich.table import Table

    from tokenops.bench.driver import LoadConfig
    from tokenops.bench.metrics import SLO
    from tokenops.bench.report import build_result, save_json, write_png
    from tokenops.bench.sweep import sweep_load

    try:
        slo_ = SLO.parse(slo)
        if slo_ is None:
            raise ValueError("a sweep needs --slo, e.g. --slo ttft=500ms,tpot=50ms")
        spec = _workload(
            workload, seed, block_size, input_len=input_len, output_len=output_len, groups=groups,
            prefix_len=prefix_len, turns=turns, think=think, rounds=rounds, tool_out=tool_out,
            tool_delay=tool_delay, system_len=system_len, task_len=task_len, trace=trace,
        )  # fmt: skip
        next(spec.make(), None)  # surface a bad workload option before anything else
        if num_requests is None and duration is None:
            num_requests = 200
        model = _resolve_model(url, model, api_key)
        cfg = LoadConfig(
            base_url=url, model=model, endpoint=endpoint, concurrency=concurrency, rate=1.0,
            burstiness=burstiness, num_requests=num_requests, duration_s=duration, seed=seed,
            api_key=api_key, headers=_headers(header), block_size=block_size,
        )  # fmt: skip
        rate_list = [float(r) for r in rates.split(",")] if rates else None
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    console = Console()
    best: dict[str, Any] = {}

    def on_point(rate: float, s: dict[str, Any], res: Any) -> None:
        console.print(
            f"rate {rate:8.2f}/s  goodput {s['request_goodput']:7.2f}/s  "
            f"attainment {s['slo_attainment']:6.1%}  "
            f"p99 ttft {s['p99_ttft_ms']:8.1f} ms  p99 tpot {s['p99_tpot_ms']:7.2f} ms"
        )
        if s["slo_attainment"] >= attainment and rate >= best.get("rate", -1):
            best.update(rate=rate, result=build_result(res, s, workload=spec.to_json()))

    out = sweep_load(
        cfg, spec.make, slo_, attainment=attainment, rates=rate_list, start_rate=start_rate,
        max_rate=max_rate, refine=refine, on_point=on_point,
    )  # fmt: skip
    out["workload"] = spec.to_json()
    t = Table(title=f"sweep: best rate {out['best_rate']} req/s at attainment >= {attainment:.0%}")
    for col in ("rate", "goodput", "throughput", "attainment", "p99 TTFT ms", "p99 TPOT ms"):
        t.add_column(col, justify="right")
    for p in out["points"]:
        t.add_row(
            f"{p['rate']:.2f}", f"{p['request_goodput']:.2f}", f"{p['request_throughput']:.2f}",
            f"{p['slo_attainment']:.1%}", f"{p['p99_ttft_ms']:.1f}", f"{p['p99_tpot_ms']:.2f}",
        )  # fmt: skip
    console.print(t)
    if output:
        save_json(out, output)
    if png and best:
        write_png(best["result"], png, sweep=out)


@app.command()
def compare(
    a: Annotated[Path, typer.Argument(help="Baseline result JSON (A).")],
    b: Annotated[Path, typer.Argument(help="Result JSON to compare (B).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the rows as JSON.")] = False,
) -> None:
    """Print the ratios B/A of two `tokenops bench run` results."""
    from rich.console import Console

    from tokenops.bench.compare import compare as compare_results
    from tokenops.bench.compare import compare_table
    from tokenops.bench.report import load_json

    try:
        ra, rb = load_json(a), load_json(b)
    except (OSError, ValueError) as exc:
        _fail(f"cannot read result: {exc}")
    rows = compare_results(ra, rb)
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=1) + "\n")
    else:
        Console().print(compare_table(rows, a.stem, b.stem))


@app.command()
def stub(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8001,
    tokens: Annotated[
        int, typer.Option(help="Output tokens per answer when the request gives no max_tokens.")
    ] = 16,
    ttft_ms: Annotated[float, typer.Option(help="Delay before the first token, in ms.")] = 0.0,
    itl_ms: Annotated[float, typer.Option(help="Delay between tokens, in ms.")] = 0.0,
    load_itl_ms: Annotated[
        float, typer.Option(help="Extra delay between tokens per request in flight, ms.")
    ] = 0.0,
    model: Annotated[
        list[str] | None, typer.Option(help="Model name listed by /v1/models (repeatable).")
    ] = None,
    fail_status: Annotated[
        int | None, typer.Option(help="Answer every request with this HTTP status.")
    ] = None,
    drop_after: Annotated[int | None, typer.Option(help="Cut every stream after this many tokens.")] = None,
) -> None:
    """Serve a fast OpenAI-compatible stub upstream that streams N tokens at a set pace."""
    from tokenops.bench.stub import StubConfig, serve_stub

    cfg = StubConfig(
        models=model or ["stub"],
        output_tokens=tokens,
        ttft_s=ttft_ms / 1000,
        itl_s=itl_ms / 1000,
        load_itl_s=load_itl_ms / 1000,
        fail_status=fail_status,
        drop_after=drop_after,
    )
    serve_stub(host, port, cfg)


@trace_app.command("generate")
def trace_generate(
    out: Annotated[Path, typer.Argument(help="The JSONL file to write.")],
    workload: Workload = "random",
    seed: Seed = 0,
    input_len: InputLen = None,
    output_len: OutputLen = None,
    groups: Groups = None,
    prefix_len: PrefixLen = None,
    turns: Turns = None,
    think: Think = None,
    rounds: Rounds = None,
    tool_out: ToolOut = None,
    tool_delay: ToolDelay = None,
    system_len: SystemLen = None,
    task_len: TaskLen = None,
    block_size: BlockSize = 512,
    sessions: Annotated[int, typer.Option(help="Number of sessions to write.")] = 100,
    rate: Annotated[float, typer.Option(help="Session start rate for the timestamps (per second).")] = 1.0,
    burstiness: Burst = 1.0,
) -> None:
    """Write a seeded workload as a Mooncake-format trace (timestamps from a Gamma arrival process)."""
    import itertools

    from tokenops.bench.arrivals import ArrivalProcess
    from tokenops.bench.traces import write_trace

    try:
        spec = _workload(
            workload, seed, block_size, input_len=input_len, output_len=output_len, groups=groups,
            prefix_len=prefix_len, turns=turns, think=think, rounds=rounds, tool_out=tool_out,
            tool_delay=tool_delay, system_len=system_len, task_len=task_len,
        )  # fmt: skip
        times = (
            ArrivalProcess(rate, burstiness, seed).times() if not math.isinf(rate) else itertools.repeat(0.0)
        )
        records = []
        for sess, t in zip(itertools.islice(spec.make(), sessions), times, strict=False):
            at = t * 1000
            for rec in sess:
                at += rec.delay  # later rounds: nominal time, the replay waits for the real answer
                rec.timestamp = round(at, 3)
                records.append(rec)
        records.sort(key=lambda r: r.timestamp)
        n = write_trace(out, records)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    typer.echo(f"wrote {n} requests in {sessions} sessions to {out}")


@trace_app.command("stats")
def trace_stats(
    path: Annotated[Path, typer.Argument(help="A Mooncake-format JSONL trace.")],
    block_size: BlockSize = 512,
) -> None:
    """Summarise a trace: requests, sessions, lengths, span and the share of blocks seen before."""
    from tokenops.bench.traces import group_sessions, read_trace

    try:
        recs = read_trace(path)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    seen: set[int] = set()
    hits = total = 0
    for r in sorted(recs, key=lambda r: r.timestamp):
        total += len(r.hash_ids)
        hits += sum(1 for h in r.hash_ids if h in seen)
        seen.update(r.hash_ids)
    n = len(recs) or 1
    stats = {
        "requests": len(recs),
        "sessions": len(group_sessions(recs)),
        "mean_input_length": sum(r.input_length for r in recs) / n,
        "mean_output_length": sum(r.output_length for r in recs) / n,
        "span_s": (max((r.timestamp for r in recs), default=0) - min((r.timestamp for r in recs), default=0))
        / 1000,
        "block_reuse": hits / total if total else 0.0,
    }
    sys.stdout.write(json.dumps(stats, indent=1) + "\n")
