"""Fleet study: Expert-as-a-Service against monolithic expert-parallel groups for a GPU-sized MoE
model (DeepSeek-V3 or Mixtral-8x22B shapes on H100s, `tokenops.sim.eaas`), in three parts:

1. GPU-hours over a day whose decode demand follows a cosine between 20% of the peak and the peak,
   both fleets resized every `--interval-s` to the fewest GPUs that meet the TPOT SLO: monolithic in
   whole groups of G GPUs, EaaS one attention client or expert server at a time (experts held once,
   twice, or twice with a spare server's headroom). Prompts of `--prompt-tokens` are prefilled in
   the same steps (chunked), both with and without that prefill; the expert loads drift over the day
   (`drifting_loads`) and both fleets re-place their experts every interval from the last one's loads;
2. the same day at one peak with the placement made once (00:00), hourly, or every interval;
3. decode throughput over time, step by step, while one GPU is down for `--down-s` seconds: a GPU of a
   monolithic group halts its group; an EaaS expert server's experts go to their other replicas.

    .venv/bin/python benchmarks/sim_eaas_fleet.py [--model deepseek-v3] [--png docs/img/sim_eaas_fleet.png]

Prints JSON. The numbers are a roofline model's (no GPU measurement of either layout exists here).
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import UTC, datetime

from tokenops.sim.eaas import H100, MODELS, Workload, diurnal, drifting_loads, failure_timeline, gpu_hours

VARIANTS = (  # label, min_replicas, spare
    ("EaaS, experts x1", 1, False),
    ("EaaS, experts x2", 2, False),
    ("EaaS, experts x2 + spare", 2, True),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-v3", choices=sorted(MODELS))
    ap.add_argument("--peaks", default="25000,100000,200000", help="peak decode tokens/s")
    ap.add_argument("--groups", default="16,32", help="monolithic group sizes (GPUs)")
    ap.add_argument("--tpot-ms", type=float, default=50.0)
    ap.add_argument("--prompt-tokens", type=float, default=2048, help="mean prompt (0: decode only)")
    ap.add_argument("--output-tokens", type=float, default=512, help="mean output tokens per request")
    ap.add_argument("--interval-s", type=float, default=1800.0, help="autoscaling interval")
    ap.add_argument("--drift-sigma", type=float, default=0.5, help="spread of the drifting expert loads")
    ap.add_argument("--failure-load", type=float, default=100000, help="tokens/s during the failure run")
    ap.add_argument("--down-s", type=float, default=300.0)
    ap.add_argument("--png", default="docs/img/sim_eaas_fleet.png")
    ap.add_argument("--json", help="write the JSON here too")
    args = ap.parse_args()
    began = datetime.now(UTC).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    model = MODELS[args.model]
    # a decode row's mean context: its prompt and half its output
    context = args.prompt_tokens + args.output_tokens / 2 if args.prompt_tokens else 2048.0
    wl = Workload(context, args.tpot_ms / 1000, args.prompt_tokens, args.output_tokens)
    decode_only = Workload(context, args.tpot_ms / 1000)
    interval = args.interval_s
    intervals = int(24 * 3600 / interval)
    loads = drifting_loads(model.experts, intervals, args.drift_sigma, interval_s=interval)
    out: dict = {"model": model.name, "source": model.source, "gpu": H100.source, "workload": repr(wl),
                 "interval_s": interval, "drift_sigma": args.drift_sigma}  # fmt: skip

    day: dict = {}
    for phase, w in (("with prefill", wl), ("decode only", decode_only)):
        for peak in (float(x) for x in args.peaks.split(",")):
            day[(phase, peak)] = _day(
                model, w, diurnal(peak, interval_s=interval), interval, args.groups, loads
            )
    out["day"] = {
        f"{phase}, peak {int(p)}": {k: {kk: vv for kk, vv in v.items() if kk != "gpus"} if isinstance(v, dict)
                                    else v for k, v in row.items()}
        for (phase, p), row in day.items()
    }  # fmt: skip
    g = int(args.groups.split(",")[0])
    peak = 100000.0
    drift: dict = {}
    for label, every in (("placed once", None), ("re-placed hourly", max(1, int(3600 / interval))),
                         ("re-placed every interval", 1)):  # fmt: skip
        r = gpu_hours(
            model, H100, wl, diurnal(peak, interval_s=interval), interval, g, 2, False, loads, every
        )
        drift[label] = {
            f"monolithic G={g} gpu_hours": r["monolithic_gpu_hours"],
            "EaaS x2 gpu_hours": r["eaas_gpu_hours"],
            "saving": r["saving"],
            "monolithic_imbalance_max": max(r["monolithic_imbalance"]),
            "monolithic_imbalance_mean": sum(r["monolithic_imbalance"]) / len(r["monolithic_imbalance"]),
        }
    out["placement_under_drift"] = {"peak": peak, **drift}

    failures = {}
    g = int(args.groups.split(",")[0])
    for label, reps, spare in VARIANTS[1:]:
        f = failure_timeline(model, H100, wl, args.failure_load, g, recover_after_s=args.down_s, spare=spare,
                             min_replicas=reps)  # fmt: skip
        failures[label] = f
    out["failure"] = {
        label: {
            "monolithic_groups": f["groups"], "monolithic_gpus": f["groups"] * f["group"].gpus_per_group,
            "monolithic_dip": f["monolithic_dip"], "eaas_gpus": f["eaas"].gpus,
            "eaas_clients": f["eaas"].clients, "eaas_servers": f["eaas"].servers, "eaas_dip": f["eaas_dip"],
            "eaas_step_ms": f["eaas_step_s"] * 1000,
            "eaas_degraded_step_ms": f["eaas_degraded_step_s"] * 1000,
        }
        for label, f in failures.items()
    }  # fmt: skip
    out.update(began_utc=began, ended_utc=datetime.now(UTC).isoformat(timespec="seconds"),
               load_start=load_start, load_end=os.getloadavg())  # fmt: skip
    text = json.dumps(out, indent=2, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.png:
        plot(args.png, model.name, day, failures, interval, args.failure_load)


def _day(model, wl: Workload, demand: list[float], interval: float, groups: str, loads) -> dict:
    """GPU-hours of each layout over one day of `demand`, the experts re-placed every interval."""
    row: dict = {}
    for g in (int(x) for x in groups.split(",")):
        try:
            r = gpu_hours(model, H100, wl, demand, interval, g, loads=loads)
        except ValueError as exc:
            row[f"monolithic G={g}"] = str(exc)
            continue
        row[f"monolithic G={g}"] = {"gpu_hours": r["monolithic_gpu_hours"], "gpus": r["monolithic_gpus"]}
    for label, reps, spare in VARIANTS:
        g = int(groups.split(",")[0])
        r = gpu_hours(model, H100, wl, demand, interval, g, reps, spare, loads)
        row[label] = {"gpu_hours": r["eaas_gpu_hours"], "gpus": r["eaas_gpus"]}
    base = min(v["gpu_hours"] for k, v in row.items() if k.startswith("monolithic") and isinstance(v, dict))
    for v in row.values():
        if isinstance(v, dict):
            v["vs_best_monolithic"] = 1 - v["gpu_hours"] / base
    return row


def plot(path: str, name: str, day: dict, failures: dict, interval: float, failure_load: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    first = next(iter(day.values()))
    labels = list(first) + ["monolithic"]
    color = {k: f"C{i}" for i, k in enumerate(labels)}
    peaks = sorted({p for _, p in day})
    peak = 100000.0 if 100000.0 in peaks else max(peaks)
    shown = day[("with prefill", peak)]
    hours = [(i + 0.5) * interval / 3600 for i in range(len(next(iter(shown.values()))["gpus"]))]
    for label, v in shown.items():
        if isinstance(v, dict):
            axes[0].step(hours, v["gpus"], where="mid", label=label, color=color[label])
    axes[0].set(xlabel="hour of day", ylabel="GPUs",
                title=f"{name}: GPUs to meet the SLO (peak {peak:,.0f} tok/s, with prefill)")  # fmt: skip
    axes[0].legend(fontsize=7)
    for phase, style in (("with prefill", "-"), ("decode only", "--")):
        for label in first:
            if label.startswith("EaaS"):
                axes[1].plot(peaks, [day[(phase, p)][label]["vs_best_monolithic"] * 100 for p in peaks],
                             marker="o", ls=style, color=color[label], label=f"{label}, {phase}")  # fmt: skip
    axes[1].axhline(37.5, ls=":", c="grey", label="paper: up to 37.5%")
    axes[1].axhline(0, c="black", lw=0.5)
    axes[1].set_xscale("log")
    axes[1].set(xlabel="peak decode tokens/s", ylabel="GPU-hours saved vs best monolithic (%)",
                title="GPU-hours over the day (expert loads drifting)")  # fmt: skip
    axes[1].legend(fontsize=6)
    run = next(iter(failures.values()))
    t = [(i + 0.5) * run["bin_s"] for i in range(len(run["monolithic_tokens_per_s"]))]
    axes[2].plot(t, run["monolithic_tokens_per_s"], label="monolithic (a GPU halts its group)",
                 color=color["monolithic"])  # fmt: skip
    for label, f in failures.items():
        axes[2].plot(t, f["eaas_tokens_per_s"], label=f"{label} (an expert server down)", color=color[label])
    axes[2].set(xlabel="s", ylabel="decode tokens/s", title=f"one GPU down, load {failure_load:,.0f} tok/s")
    axes[2].set_ylim(bottom=0)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
