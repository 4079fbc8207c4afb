"""Per-request timeline of a live PD run, for tracing where a remote prefill's first token waits.

    flock /tmp/bench.lock .venv/bin/python benchmarks/sim_pd_trace.py [--requests 40] [--rate 1] \
        [--out benchmarks/results/sim_pd_trace.json]

It starts a prefill and a decode engine (one torch thread each, as `sim_validation.py --pd`) with
tracing hooks installed in their processes (wrapping, not changing, the engine's own methods), sends
the same open-loop workload through `Cluster.open` with `StaticPD`, and prints JSON: for each request
the gateway's prefill leg, the prefill engine's steps over its prompt, the decode leg's arrival, the
KV pull, the KV import and admission on the decode engine, and the decode engine's steps that gave
its first tokens (start, end, tokens computed, tokens cached before, rows in the step); every time in
ms after the request was sent. The raw events are kept under
`events` so other questions can be asked of the same run. Times are `time.perf_counter()`, one clock
for every process on the host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
from collections import defaultdict
from typing import Any

import httpx

KEY_TOKENS = 4  # a prompt's first token ids name it in every process (prompts are random)


def _emit(out, kind: str, **fields: Any) -> None:
    out.write(json.dumps({"kind": kind, **fields}) + "\n")
    out.flush()


def install_engine_hooks(path: str) -> None:
    """Wrap the engine's steps, admissions, KV pulls and KV serving to write events to `path`."""
    import functools

    from tokenops.engine import kv_transfer, llm_engine, server

    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
    clock = time.perf_counter

    def key(ids) -> list[int]:
        return list(ids[:KEY_TOKENS])

    eng = llm_engine.LLMEngine
    schedule, step, add, import_kv = eng._schedule, eng.step, eng.add_request, eng.import_kv

    def traced_schedule(self):
        batch = schedule(self)
        self._trace_batch = [
            (s.seq.request_id, s.num_new_tokens, s.seq.num_computed_tokens) for s in batch.scheduled
        ]
        return batch

    def traced_step(self):
        self._trace_batch = []
        t0 = clock()
        outs = step(self)
        if self._trace_batch:
            _emit(out, "step", t0=t0, t1=clock(), batch=self._trace_batch)
        return outs

    def traced_add(self, request_id, prompt_token_ids, *a, **kw):
        t = clock()
        add(self, request_id, prompt_token_ids, *a, **kw)
        _emit(out, "add", t=t, t1=clock(), id=request_id, key=key(prompt_token_ids),
              prompt=len(prompt_token_ids), imported=kw.get("kv_import") is not None)  # fmt: skip

    def traced_import(self, token_ids, kv):
        t = clock()
        written = import_kv(self, token_ids, kv)
        _emit(out, "import", t=t, t1=clock(), key=key(token_ids), blocks=len(written))
        return written

    eng._schedule, eng.step, eng.add_request, eng.import_kv = (
        traced_schedule, traced_step, traced_add, traced_import,
    )  # fmt: skip

    srv = server.EngineServer
    generate, pull_for = srv._generate, srv._pull_for

    @functools.wraps(generate)
    async def traced_generate(self, request, kind, req, prompts, *a, **kw):
        t = clock()
        try:
            return await generate(self, request, kind, req, prompts, *a, **kw)
        finally:
            _emit(out, "http", t=t, t1=clock(), key=key(prompts[0]) if prompts else [])

    @functools.wraps(pull_for)
    async def traced_pull(self, leg, ids, gen):
        t = clock()
        try:
            return await pull_for(self, leg, ids, gen)
        finally:
            _emit(out, "pull", t=t, t1=clock(), key=key(ids), report=gen.kv_fields.get("kv_transfer"))

    srv._generate, srv._pull_for = traced_generate, traced_pull

    kts = kv_transfer.KVTransferServer
    handle = kts._handle

    async def traced_handle(self, reader, writer):
        t = clock()
        try:
            return await handle(self, reader, writer)
        finally:
            _emit(out, "serve_kv", t=t, t1=clock())

    kts._handle = traced_handle


def start_traced_engine(args: list[str], trace: str) -> tuple[subprocess.Popen, str]:
    from tokenops.sim.live import start_engine

    preamble = (
        f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
        f"import sim_pd_trace; sim_pd_trace.install_engine_hooks({trace!r})"
    )
    return start_engine(args, threads=1, preamble=preamble)


def trace_gateway(events: list[dict]) -> None:
    """Wrap the cluster's prefill leg and upstream send to record when each starts and answers."""
    from tokenops.cluster import dispatch

    cls = dispatch.Cluster
    prefill_leg, send = cls._prefill_leg, cls._send
    clock = time.perf_counter

    async def traced_leg(self, route, call, body, placement):
        t = clock()
        try:
            return await prefill_leg(self, route, call, body, placement)
        finally:
            events.append({"kind": "gw_prefill", "t": t, "t1": clock(), "sid": call.info.session_id})

    async def traced_send(self, attempt, content=None):
        t = clock()
        try:
            return await send(self, attempt, content)
        finally:
            events.append({"kind": "gw_decode", "t": t, "t1": clock(), "sid": attempt.call.info.session_id})

    cls._prefill_leg, cls._send = traced_leg, traced_send


def timelines(requests, records, gw: list[dict], engines: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """Each request's milestones, ms after its send."""
    by_key = {tuple(r.prompt[:KEY_TOKENS]): i for i, r in enumerate(requests)}
    rows: dict[int, dict[str, Any]] = defaultdict(dict)
    for e in gw:
        i = int(e["sid"].split("-")[1])
        rows[i][e["kind"]] = (e["t"], e["t1"])
    for role, evs in engines.items():
        ids = {}
        for e in evs:
            if e["kind"] == "add":
                i = by_key.get(tuple(e["key"]))
                if i is not None:
                    ids[e["id"]] = i
                    rows[i][f"{role}_add"] = (e["t"], e["t1"])
            elif e["kind"] in ("http", "pull", "import"):
                i = by_key.get(tuple(e["key"]))
                if i is not None:
                    rows[i][f"{role}_{e['kind']}"] = (e["t"], e["t1"])
                    if e["kind"] == "pull":
                        rows[i]["pull_report"] = e.get("report")
        steps = [e for e in evs if e["kind"] == "step"]
        for e in steps:
            for rid, n, computed in e["batch"]:
                i = ids.get(rid)
                if i is None:
                    continue
                r = rows[i]
                r.setdefault(f"{role}_steps", []).append((e["t0"], e["t1"], n, computed, len(e["batch"])))
    # a pull that starts while the prefill engine steps: how long until that step ends
    prefill_steps = [e for e in engines.get("prefill", []) if e["kind"] == "step"]
    for r in rows.values():
        pull = r.get("decode_pull")
        if pull is not None:
            busy = [e["t1"] for e in prefill_steps if e["t0"] <= pull[0] < e["t1"]]
            r["prefill_step_left_at_pull"] = busy[0] - pull[0] if busy else 0.0
    out = []
    t0 = min(r.start for r in records)
    for i, rec in enumerate(records):
        r = rows.get(i, {})
        base = rec.start

        def ms(x, base=base):
            return round((x - base) * 1000, 1)

        row: dict[str, Any] = {"i": i, "sent_s": round(base - t0, 3), "prompt": len(requests[i].prompt),
                               "ttft_ms": ms(rec.chunk_times[0]) if rec.chunk_times else None}  # fmt: skip
        for k, v in r.items():
            if k.endswith("_steps"):
                row[k] = [(ms(a), ms(b), n, c, rows_) for a, b, n, c, rows_ in v[:2]]
            elif k == "pull_report":
                row[k] = v
            elif k == "prefill_step_left_at_pull":
                row[k] = round(v * 1000, 1)
            else:
                row[k] = (ms(v[0]), ms(v[1]))
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    from tokenops.cluster.pd import StaticPD
    from tokenops.cluster.perf_model import PerfModel
    from tokenops.sim.calibrate import warm
    from tokenops.sim.live import open_loop, run_pd

    tmp = f"/tmp/sim_pd_trace_{os.getpid()}"
    traces = {"prefill": tmp + "_prefill.jsonl", "decode": tmp + "_decode.jsonl"}
    procs = []
    try:
        p_proc, p_url = start_traced_engine(["--role", "prefill", "--engine-id", "p0"], traces["prefill"])
        procs.append(p_proc)
        d_proc, d_url = start_traced_engine(["--role", "decode", "--engine-id", "d0"], traces["decode"])
        procs.append(d_proc)
        for url in (p_url, d_url):
            asyncio.run(warm(url, args.model))
        block = int(httpx.get(d_url + "/v1/load", timeout=5).json().get("block_size") or 16)
        for path in traces.values():  # only the load's events
            open(path, "w").close()
        gw: list[dict] = []
        trace_gateway(gw)
        requests = open_loop(args.requests, args.rate, (32, 256), (16, 64), seed=1)
        records, duration = asyncio.run(
            run_pd([p_url], [d_url], args.model, requests, StaticPD(PerfModel()), block)
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    engines = {role: [json.loads(line) for line in open(path)] for role, path in traces.items()}
    out = {
        "requests": args.requests, "rate": args.rate, "duration_s": duration,
        "failed": [r.error for r in records if not r.success],
        "timelines": timelines(requests, records, gw, engines),
        "events": {"gateway": gw, **engines},
    }  # fmt: skip
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
