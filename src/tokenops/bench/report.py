"""Bench results as a JSON document, a terminal summary table and a PNG report.

The JSON result keeps vLLM `bench serve`'s metric keys at the top level (so vLLM tooling reads it)
and adds `config`, `workload`, `throughput_over_time` and, when asked, per-request `records` (which
the PNG's latency CDFs need). The PNG shows latency CDFs (TTFT, TPOT, ITL, E2E), output throughput
over time and, for a sweep, goodput and attainment against offered rate. This module only renders;
numbers come from metrics.py, runs from driver.py and sweep.py.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from tokenops.bench.driver import LoadResult
from tokenops.bench.metrics import RequestRecord, output_tokens_per_second

SCHEMA = "tokenops.bench/1"


def build_result(
    load: LoadResult,
    summary: dict[str, Any],
    *,
    workload: dict[str, Any] | None = None,
    include_records: bool = True,
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "date": _dt.datetime.fromtimestamp(load.started_at, _dt.UTC).isoformat(timespec="seconds"),
        "backend": "openai-chat" if load.config.get("endpoint") == "chat" else "openai",
        "base_url": load.config.get("base_url"),
        "model_id": load.config.get("model"),
        "request_rate": load.config.get("rate") if load.config.get("rate") is not None else "inf",
        "burstiness": load.config.get("burstiness"),
        "max_concurrency": load.config.get("concurrency"),
        "num_prompts": len(load.records),
    }
    result.update(summary)
    result["config"] = load.config
    result["workload"] = workload or {}
    # 1 s bins as vLLM, finer for short runs so the curve has some thirty points
    bin_s = 1.0 if load.duration_s >= 30 else max(0.05, round(load.duration_s / 30, 2))
    result["throughput_bin_s"] = bin_s
    result["throughput_over_time"] = output_tokens_per_second(load.records, 0.0, bin_s)
    if include_records:
        result["records"] = [r.to_json() for r in load.records]
    return result


def save_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, default=str) + "\n")


def load_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def records_of(result: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord(**r) for r in result.get("records", [])]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.4f}" if abs(v) < 10 else f"{v:,.2f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def summary_table(result: dict[str, Any], title: str = "tokenops bench") -> Any:
    """A rich Table of the headline numbers."""
    from rich.table import Table

    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("completed / failed", f"{result['completed']} / {result['failed']}"),
        ("duration (s)", result["duration"]),
        ("request throughput (req/s)", result["request_throughput"]),
        ("output throughput (tok/s)", result["output_throughput"]),
        ("total token throughput (tok/s)", result["total_token_throughput"]),
        ("RPM / TPM", f"{result['rpm']:,.1f} / {result['tpm']:,.0f}"),
        (
            "input / cached / output tokens",
            f"{result['total_input_tokens']:,} / {result['total_cached_tokens']:,} / "
            f"{result['total_output_tokens']:,}",
        ),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("goodput (req/s)", result["request_goodput"]))
        rows.append(("SLO attainment", f"{result['slo_attainment']:.1%}  {result.get('slo', {})}"))
    for k in ("cost_per_million_tokens", "hardware_cost_per_million_output_tokens", "mfu"):
        if result.get(k) is not None:
            rows.append((k.replace("_", " "), result[k]))
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        rows.append(
            (
                f"{label} ms mean / p50 / p90 / p99",
                " / ".join(_fmt(result.get(f"{s}_{name}_ms")) for s in ("mean", "median", "p90", "p99")),
            )
        )
    for k, v in rows:
        t.add_row(k, _fmt(v))
    return t


def print_summary(result: dict[str, Any], title: str = "tokenops bench") -> None:
    from rich.console import Console

    Console().print(summary_table(result, title))


def write_png(result: dict[str, Any], path: str | Path, sweep: dict[str, Any] | None = None) -> None:
    """Latency CDFs and throughput over time of one run; goodput against rate when `sweep` is given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    recs = [r for r in records_of(result) if r.success]
    series = {
        "TTFT": [r.ttft for r in recs if r.ttft is not None],
        "TPOT": [r.tpot for r in recs if r.tpot is not None],
        "ITL": [g for r in recs for g in r.itl],
        "E2E": [r.e2e for r in recs],
    }
    panels = 3 if sweep else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    ax = axes[0]
    for name, vals in series.items():
        if vals:
            x = np.sort(np.asarray(vals) * 1000)
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=name)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests (ITL: of gaps)")
    ax.set_title("latency CDFs")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax = axes[1]
    tput = list(result.get("throughput_over_time") or [])
    bin_s = result.get("throughput_bin_s", 1.0)
    ax.plot(np.arange(len(tput) + 1) * bin_s, tput + tput[-1:], drawstyle="steps-post")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("output throughput over time")
    ax.grid(True, alpha=0.3)
    if sweep:
        ax = axes[2]
        pts = sweep["points"]
        rates = [p["rate"] for p in pts]
        ax.plot(rates, [p["request_goodput"] for p in pts], "o-", label="goodput (req/s)")
        ax.plot(rates, [p["request_throughput"] for p in pts], "s--", alpha=0.6, label="throughput (req/s)")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("req/s")
        ax2 = ax.twinx()
        ax2.plot(rates, [p["slo_attainment"] for p in pts], "^:", color="gray", label="attainment")
        ax2.axhline(sweep["attainment"], color="gray", lw=0.8, ls="--")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("SLO attainment")
        if sweep.get("best_rate") is not None:
            ax.axvline(sweep["best_rate"], color="green", lw=0.8)
        ax.set_title("goodput vs rate")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left")
    fig.suptitle(f"{result.get('model_id')} @ {result.get('base_url')}  ({result.get('date')})", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
