"""Ratios between two bench results (B over A), with which side each metric favours.

It owns the list of headline metrics, their direction (throughput: higher is better; latency and
cost: lower is better) and the comparison table. It reads result dicts (report.py's JSON); it does
not run anything.
"""

from __future__ import annotations

from typing import Any

HIGHER_IS_BETTER = (
    "request_throughput",
    "request_goodput",
    "slo_attainment",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "cache_hit_rate",
    "mfu",
)
LOWER_IS_BETTER = tuple(
    f"{stat}_{name}_ms"
    for name in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "p90", "p99")
) + ("failed", "cost_per_million_tokens", "hardware_cost_per_million_output_tokens")
METRICS = HIGHER_IS_BETTER + LOWER_IS_BETTER


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not isinstance(a, int | float) or not isinstance(b, int | float):
        return None
    if a == 0:
        return 1.0 if b == 0 else None
    return b / a


def compare(a: dict[str, Any], b: dict[str, Any], metrics: tuple[str, ...] = METRICS) -> list[dict[str, Any]]:
    """One row per metric present in both: values, ratio B/A and the better side ('A', 'B' or '=')."""
    rows = []
    for m in metrics:
        va, vb = a.get(m), b.get(m)
        if va is None or vb is None:
            continue
        r = ratio(va, vb)
        if r is None or abs(r - 1.0) < 1e-9:
            better = "="
        elif m in HIGHER_IS_BETTER:
            better = "B" if r > 1 else "A"
        else:
            better = "B" if r < 1 else "A"
        rows.append({"metric": m, "a": va, "b": vb, "ratio": r, "better": better})
    return rows


def compare_table(rows: list[dict[str, Any]], name_a: str = "A", name_b: str = "B") -> Any:
    from rich.table import Table

    t = Table(title=f"{name_b} / {name_a}", header_style="bold")
    for col in ("metric", name_a, name_b, "ratio B/A", "better"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for row in rows:
        r = row["ratio"]
        style = "green" if row["better"] == "B" else "red" if row["better"] == "A" else ""
        t.add_row(
            row["metric"],
            f"{row['a']:.4g}",
            f"{row['b']:.4g}",
            "-" if r is None else f"[{style}]{r:.3f}x[/]" if style else f"{r:.3f}x",
            {"A": name_a, "B": name_b}.get(row["better"], "="),
        )
    return t
