"""PD policies live on this machine, streamed through the cluster's dispatch: two engine processes of one
torch thread each as 1 prefill + 1 decode (static PD as vLLM ships it and with our incremental
transfer, Dynamo's conditional rule, AMPD) or as 2 colocated engines, the same threads in all (`--pin`:
one core each), driven by multi-round agent sessions (a shared system prompt and `--context-len` tokens
of each session's own, tool outputs appended each round, tool waits; `--session-interval-s` staggers
the sessions' starts, 0 starts them together). Each engine answers one throwaway prompt before a run,
so a run does not pay a fresh process's first-request costs; it opens with the run's system prompt,
which every engine then holds, as a deployment's shared system prompt is cached
(`--cold-system-prompt`: not). Reports TTFT and ITL apart (p50/p99), SLO attainment (a request meets
its SLO when its TTFT and its mean ITL are both within theirs), goodput (requests meeting the SLO per
second), the share of incremental prefills kept on the decode worker, the KV bytes shipped and the
prompt tokens the prefill legs computed, as medians over `--repeats` runs with fresh engines, the
policies interleaved, and every request's trace (round, placement and its reason, TTFT, mean ITL).
Prints JSON.

AMPD's costs come from the one performance model: `tokenops sim calibrate`'s measuring and fit run at
start against an engine configured as the run's (or `--perf-model` names a profile), with the KV
transfer's latency and bandwidth fitted from pulls between a prefill and a decode engine. The SLOs
follow a stated rule: `--slo-scale` times the machine's own isolated figures, measured at start on an
idle engine through the same dispatch (a session's first prompt, uncached: its TTFT, and its mean
ITL); AMPD weighs the ITL SLO as the run scores it, the mean over a request's output.

    flock /tmp/bench.lock .venv/bin/python benchmarks/pd_policies.py --sessions 4 --rounds 3 --repeats 3

`--prefill-slots N` lets the prefill engine run N legs at once (the gateway's `pd.prefill_slots`), so
the rest wait at the gateway, where the policies' snapshot counts them; `--prefill-queue` releases
them in `PrefillQueue` order (`pd.prefill_queue`). Each policy runs as the gateway builds it from its
`pd:` config, `--policies` naming them as `pd.policy` does (`static_pd` as vLLM ships it, the prefill
engine recomputing the history it lacks; `static_pd_incremental` ours, pulling it from the decode engine;
`ampd@S` AMPD with `remote_ttft_share` S in place of its default).

To split repeats over several holds of the lock, pass the first run's `perf_model` (saved with
`--save-perf-model`) and its SLOs (`--ttft-slo-s`, `--itl-slo-s`) to the later ones.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenops.cluster import Cluster, ClusterConfig, DispatchRequest, RequestInfo, build_cluster
from tokenops.cluster.perf_model import PerfModel, TransferSample
from tokenops.cluster.prefix_index import block_hashes_from_tokens
from tokenops.config import load_settings
from tokenops.engine.loader import load_model
from tokenops.sim.calibrate import calibrate
from tokenops.sim.live import engines, stream_events

BLOCK = 16  # the engines' KV block size, which the gateway hashes prompts in


def _engine(model: str, role: str, kv_mib: int = 384) -> list[str]:
    """The `tokenops engine` arguments of one of the run's engines (`sim.live.engines` starts it with
    one torch thread)."""
    return ["--model", model, "--served-model-name", "m", "--role", role, "--max-model-len", "4096",
            "--block-size", str(BLOCK), "--max-num-batched-tokens", "512",
            "--kv-cache-memory", f"{kv_mib}MiB"]  # fmt: skip


def _perf_model(vocab: int, args) -> PerfModel:
    """The one performance model of the run's engines: a profile file, or calibrated now; then the
    KV transfer fitted from pulls of a few prompt lengths between a prefill and a decode engine."""
    if args.perf_model:
        perf = PerfModel.load(args.perf_model)
    else:
        with engines([_engine(args.model, "both")], threads=1) as (url,):
            perf = calibrate(
                url,
                "m",
                "pd-policies-engine",
                "tokenops sim calibrate's measuring, run by benchmarks/pd_policies.py at its start",
                prompt_lengths=(16, 64, 192, 448),
                batch_sizes=(1, 2, 4),
                mixed_batch_sizes=(1, 2, 4),
                repeats=2,
            )
    if perf.kv_bytes_per_token and perf.transfer_bytes_per_s != float("inf"):
        return perf
    rng = random.Random(3)
    samples, bytes_per_token = [], 0
    with engines([_engine(args.model, "prefill"), _engine(args.model, "decode")], threads=1) as (
        p_url,
        d_url,
    ):
        for n in (64, 256, 576) * 3:
            prompt = [rng.randrange(3, vocab) for _ in range(n)]
            body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
            leg = httpx.post(
                f"{p_url}/v1/completions",
                json={**body, "kv_transfer_params": {"do_remote_decode": True}},
                timeout=300,
            ).json()
            answer = httpx.post(
                f"{d_url}/v1/completions",
                json={**body, "kv_transfer_params": leg["kv_transfer_params"]},
                timeout=300,
            ).json()
            kv = answer["kv_transfer"]
            tokens = kv["blocks"] * BLOCK
            bytes_per_token = kv["bytes"] // tokens
            samples.append(TransferSample(tokens, kv["seconds"]))
    return perf.fit_transfers(samples, bytes_per_token)


def _cluster(
    name: str, urls: list[str], roles: tuple[str, ...], slo: tuple[float, float], pd_args: dict
) -> Cluster:
    """The cluster a gateway builds from a model's `pd:` config with the policy `name`: the SLOs,
    AMPD's profile and window, and the prefill slots and queue in `pd_args`."""
    prefill = [u + "/v1" for u, r in zip(urls, roles, strict=True) if r == "prefill"]
    decode = [u + "/v1" for u, r in zip(urls, roles, strict=True) if r != "prefill"]
    policy, _, share = name.partition("@")  # `ampd@0.5`: AMPD with that `remote_ttft_share`
    pd = {"policy": policy, "prefill": prefill, "decode": decode, "ttft_slo_s": slo[0]}
    pd |= {"itl_slo_s": slo[1], **pd_args} | ({"remote_ttft_share": float(share)} if share else {})
    settings = load_settings(None, environ={}, overrides={"models": {"m": {"pd": pd}}})
    # the prefix index from the engines' KV events (the prompts are hashed in their token blocks), so
    # the policies see what each worker holds, not what was placed there
    config = ClusterConfig.model_validate({"models": {"m": {"policy_options": {"learn": False}}}})
    return build_cluster(settings.models, config)


async def _isolated(url: str, vocab: int, args) -> dict:
    """A session's first prompt (the system prompt uncached) alone on an idle engine, through the
    same dispatch as the run: its TTFT and mean ITL, medians of three fresh prompts."""
    cluster = _cluster("colocated", [url], ("both",), (float("inf"), float("inf")), {})
    async with httpx.AsyncClient() as client:
        await cluster.poller.poll_once(client)
    rng = random.Random(11)
    rows = []
    for i in range(4):  # the first warms the engine up and is dropped
        prompt = [rng.randrange(3, vocab) for _ in range(args.system_len + args.context_len)]
        rows.append(await _request(cluster, f"iso{i}", prompt, args.output_len))
    await cluster.aclose()
    rows = rows[1:]
    return {
        "ttft_s": statistics.median(r["ttft_s"] for r in rows),
        "itl_s": statistics.median(statistics.fmean(r["itl_s"]) for r in rows),
    }


def _system_prompt(args, vocab: int) -> list[int]:
    """The system prompt every session of a run shares (the same tokens in every run)."""
    rng = random.Random(1)
    return [rng.randrange(3, vocab) for _ in range(args.system_len)]


def _warm_up(urls: list[str], vocab: int, args) -> None:
    """A fresh engine's first prompt runs about a second slower than the next (allocation, the
    kernels' first calls): each engine answers one throwaway prompt of a first round's length
    before the run, so the run measures the engines as a deployment that has been up a while. That
    prompt opens with the run's system prompt, so it is in every engine's cache, as a deployment's
    shared system prompt is (`--cold-system-prompt`: a throwaway prompt of its own instead, and the
    run's first rounds find it nowhere)."""
    rng = random.Random(7)
    head = [] if args.cold_system_prompt else _system_prompt(args, vocab)
    for url in urls:
        prompt = head + [
            rng.randrange(3, vocab) for _ in range(args.system_len + args.context_len - len(head))
        ]
        body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, timeout=300).raise_for_status()


def _kv_received(urls: list[str]) -> int:
    total = 0.0
    for url in urls:
        for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for s in fam.samples:
                if s.name == "tokenops_engine_kv_transfer_bytes_received_total":
                    total += s.value
    return int(total)


async def _request(cluster: Cluster, sid: str, prompt: list[int], out_tokens: int) -> dict:
    info = RequestInfo(
        "m",
        session_id=sid,
        block_hashes=tuple(block_hashes_from_tokens(prompt, BLOCK)),
        block_tokens=BLOCK,
        prompt_tokens=len(prompt),
        max_tokens=out_tokens,
    )
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": out_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    stamps: list[float] = []
    async with cluster.open(DispatchRequest(info, "/completions", body)) as up:
        async for now, msg in stream_events(up):
            choices = msg.get("choices") or []
            if choices and choices[0].get("text"):
                stamps.append(now)
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    decision = up.pd.decision if up.pd else None
    est = decision.estimate if decision else None
    legs = up.pd.legs if up.pd else []
    return {
        "ttft_s": stamps[0] - start if stamps else float("inf"),
        "itl_s": gaps,
        "remote": bool(decision and decision.remote),
        "reason": decision.reason if decision else None,
        # AMPD's modelled figures for this placement: TTFT either way, the decode batch's mean gap if local
        "estimate": est
        and {
            "local_ttft_s": round(est.local_ttft_s, 4),
            "remote_ttft_s": round(est.remote_ttft_s, 4),
            "local_itl_s": round(est.local_itl_s, 4),
            "remote_leg_s": round(est.remote_leg_s, 4),  # the prefill leg alone, before its pace
        },
        "decode": up.replica,
        "prompt_tokens": len(prompt),
        # what the prefill leg computed (vLLM's static PD recomputes the history the prefill engine lacks)
        "prefill_computed": up.pd.prefill_computed if up.pd else 0,
        # the prefill leg's wait at the gateway for a slot of its worker (None: no leg sent)
        "prefill_queued_s": legs[0].get("queued_s") if legs else None,
        # when the prefill leg answered, from the placing: the rest of a remote TTFT is the decode leg
        "prefill_answered_s": legs[0].get("answered_s") if legs else None,
        "start_s": start,
    }


async def _session(cluster, sid, system, rng, args, vocab, rows, start_after_s):
    await asyncio.sleep(start_after_s)
    history = system + [rng.randrange(3, vocab) for _ in range(args.context_len)]
    for r in range(args.rounds):
        row = await _request(cluster, sid, history, args.output_len)
        row.update(session=sid, round=r)
        rows.append(row)
        # the agent's own output (the same greedy tokens whichever policy) and the tool's, then its wait
        history = history + [rng.randrange(3, vocab) for _ in range(args.output_len)]
        history = history + [rng.randrange(3, vocab) for _ in range(args.tool_len)]
        await asyncio.sleep(args.tool_wait_s)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _run(name: str, urls: list[str], roles: tuple[str, str], args, slo, vocab, pd_args) -> dict:
    cluster = _cluster(name, urls, roles, slo, pd_args)
    async with httpx.AsyncClient() as client:
        await cluster.poller.poll_once(client)
    cluster.poller.start()
    system = _system_prompt(args, vocab)
    rows: list[dict] = []
    kv_before = _kv_received(urls)
    start = time.perf_counter()
    await asyncio.gather(
        *(
            _session(
                cluster,
                f"s{i}",
                system,
                random.Random(100 + i),
                args,
                vocab,
                rows,
                i * args.session_interval_s,
            )
            for i in range(args.sessions)
        )
    )
    wall = time.perf_counter() - start
    await cluster.aclose()
    ttft_slo, itl_slo = slo
    for r in rows:
        r["itl_mean_s"] = statistics.fmean(r["itl_s"]) if r["itl_s"] else None
        r["met_ttft"] = r["ttft_s"] <= ttft_slo
        r["met_itl"] = r["itl_mean_s"] is None or r["itl_mean_s"] <= itl_slo
        r["start_s"] -= start
    met = [r for r in rows if r["met_ttft"] and r["met_itl"]]
    ttft = [r["ttft_s"] for r in rows]
    itl = [g for r in rows for g in r["itl_s"]]
    incremental = [r for r in rows if r["round"] > 0]
    waits = [r["prefill_queued_s"] for r in rows if r["prefill_queued_s"] is not None]
    return {
        "requests": len(rows),
        "slo_attainment": len(met) / len(rows),
        "goodput_rps": len(met) / wall,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "itl_p50_s": _pct(itl, 0.5),
        "itl_p99_s": _pct(itl, 0.99),
        "incremental_kept_local": sum(not r["remote"] for r in incremental) / len(incremental)
        if incremental
        else None,
        "kv_bytes_shipped": _kv_received(urls) - kv_before,
        "prefill_tokens_computed": sum(r["prefill_computed"] for r in rows),
        # prefill legs that waited at the gateway for a slot (over 10 ms), and the longest wait
        "prefill_legs_waited": sum(w > 0.01 for w in waits),
        "prefill_wait_max_s": max(waits, default=0.0),
        "met_ttft": sum(r["met_ttft"] for r in rows) / len(rows),
        "met_itl": sum(r["met_itl"] for r in rows) / len(rows),
        "wall_s": wall,
        "trace": [
            {
                k: r[k]
                for k in (
                    "session",
                    "round",
                    "start_s",
                    "decode",
                    "remote",
                    "reason",
                    "estimate",
                    "prompt_tokens",
                    "prefill_computed",
                    "prefill_queued_s",
                    "prefill_answered_s",
                )
            }
            | {"ttft_s": round(r["ttft_s"], 4), "itl_mean_s": r["itl_mean_s"] and round(r["itl_mean_s"], 4)}
            for r in sorted(rows, key=lambda r: r["start_s"])
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument(
        "--context-len", type=int, default=64, help="a session's own tokens after the system prompt"
    )
    ap.add_argument("--tool-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--tool-wait-s", type=float, default=0.2)
    ap.add_argument(
        "--session-interval-s",
        type=float,
        default=0.0,
        help="session i starts i x this after the run (0: all at once)",
    )
    ap.add_argument(
        "--cold-system-prompt",
        action="store_true",
        help="the engines' warm-up prompts leave the run's system prompt uncached (a cold start)",
    )
    ap.add_argument("--pin", action="store_true", help="the two engines on cores 0 and 1, one each")
    ap.add_argument("--slo-scale", type=float, default=2.0, help="SLO = this x the isolated figure")
    ap.add_argument("--ttft-slo-s", type=float, help="instead of the scaled isolated TTFT")
    ap.add_argument("--itl-slo-s", type=float, help="instead of the scaled isolated mean ITL")
    ap.add_argument("--perf-model", help="a PerfModel profile instead of calibrating at start")
    ap.add_argument(
        "--prefill-kv-mib",
        type=int,
        default=384,
        help="the prefill engine's KV pool (too small: it loses sessions)",
    )
    ap.add_argument("--save-perf-model", help="write the model the run used here")
    ap.add_argument(
        "--prefill-slots",
        type=int,
        help="legs the prefill engine runs at once (pd.prefill_slots); more wait at the gateway",
    )
    ap.add_argument(
        "--prefill-queue",
        action="store_true",
        help="release waiting prefill legs in PrefillQueue order (pd.prefill_queue), not in arrival order",
    )
    ap.add_argument("--policies", default="colocated,static_pd,static_pd_incremental,conditional_dynamo,ampd")
    args = ap.parse_args()
    load_start = os.getloadavg()
    utc_start = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    vocab = load_model(args.model).config.vocab_size
    perf = _perf_model(vocab, args)
    if args.save_perf_model:
        perf.save(args.save_perf_model)
    with engines([_engine(args.model, "both")], threads=1) as (url,):
        isolated = asyncio.run(_isolated(url, vocab, args))
    slo = (
        args.ttft_slo_s or args.slo_scale * isolated["ttft_s"],
        args.itl_slo_s or args.slo_scale * isolated["itl_s"],
    )
    runs: dict[str, list[dict]] = {}
    # the gateway reads AMPD's and the prefill queue's costs from a profile file, removed however the
    # runs end
    with tempfile.TemporaryDirectory(prefix="pd-policies-") as tmp:
        profile = os.path.join(tmp, "perf_model.json")
        perf.save(profile)
        pd_args = {
            "perf_model": profile,
            "itl_window_tokens": max(1, args.output_len - 1),  # the SLO is on the mean gap of the output
            "prefill_slots": args.prefill_slots,
            "prefill_queue": args.prefill_queue,
        }
        for _ in range(args.repeats):
            for name in args.policies.split(","):
                roles = ("both", "both") if name == "colocated" else ("prefill", "decode")
                kv = args.prefill_kv_mib if roles[0] == "prefill" else 384
                pair = [_engine(args.model, roles[0], kv), _engine(args.model, roles[1])]
                with engines(pair, threads=1, pin=args.pin) as (a, b):
                    _warm_up([a, b], vocab, args)
                    runs.setdefault(name, []).append(
                        asyncio.run(_run(name, [a, b], roles, args, slo, vocab, pd_args))
                    )
                print(f"{name}: SLO attainment {runs[name][-1]['slo_attainment']:.2f}", file=sys.stderr)
    scalar = [k for k, v in next(iter(runs.values()))[0].items() if k != "trace"]
    medians = {
        name: {k: statistics.median(r[k] for r in rs) if rs[0][k] is not None else None for k in scalar}
        for name, rs in runs.items()
    }
    ratios = {}
    for ampd in (name for name in medians if name.partition("@")[0] == "ampd"):
        for peer in ("static_pd", "static_pd_incremental", "colocated", "conditional_dynamo"):
            if peer in medians and medians[peer]["slo_attainment"]:
                ratios[f"{ampd}_vs_{peer}_slo_attainment"] = (
                    medians[ampd]["slo_attainment"] / medians[peer]["slo_attainment"]
                )
    print(
        json.dumps(
            {
                "benchmark": "pd_policies",
                "args": vars(args),
                "perf_model": dataclasses.asdict(perf),
                "isolated": isolated,
                "slo": {
                    "rule": {
                        k: "explicit" if given else f"{args.slo_scale} x isolated"
                        for k, given in (("ttft", args.ttft_slo_s), ("itl", args.itl_slo_s))
                    },
                    "ttft_s": slo[0],
                    "itl_mean_s": slo[1],
                },
                "utc_start": utc_start,
                "utc_end": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                "loadavg_start": load_start,
                "loadavg_end": os.getloadavg(),
                "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                "medians": medians,
                "ratios": ratios,
                "runs": runs,
            },
            indent=2,
            default=str,
        )
    )


if __name__ == "__main__":
    main()
