"""Calibration: measure a running OpenAI-compatible engine (ours, vLLM, SGLang) from outside and fit
the one `PerfModel` to it.

Two small grids, each point repeated: prefill, one request at a time with a fresh prompt of L tokens
and `max_tokens=1` (its time to first token is one prefill step plus the request's own overhead), and
decode, B concurrent streams of short prompts generating a fixed number of tokens with `ignore_eos`
(the median gap between their tokens, while all B decode, is one decode step of B rows). The fit is
non-negative least squares on relative error, with a decode row's cost fitted apart from a prefill
token's, and one extra term, the per-request overhead outside
the engine's steps (HTTP, tokenising, the first chunk's trip), which only time to first token pays;
where a straight line misses, the fit looks for the row count where the step cost bends (the
engine's layers changing path) and fits both sides. The prompt grid has points on both sides of
our engine's bend on AMX (160 rows). This module owns the measuring and that fit; the model's form is
`cluster.perf_model`'s.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import httpx
import numpy as np

from tokenops.bench.traces import VOCAB
from tokenops.cluster.perf_model import PerfModel, StepSample, StepShape, TransferSample


@dataclass(frozen=True, slots=True)
class Measurement:
    kind: str  # "prefill" (a time to first token), "decode" or "mixed" (an inter-token gap)
    shape: StepShape
    seconds: float


def _prompt(words: int, rng: random.Random) -> str:
    # a fresh first word keeps the prefix cache from serving a repeated prompt
    return f"q{rng.randrange(1 << 40)} " + " ".join(rng.choices(VOCAB, k=max(0, words - 1)))


async def _stream(
    http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, times: list[float] | None = None
) -> tuple[float, list[float], int]:
    """One streamed completion: (send time, chunk arrival times, prompt tokens from usage). `times`,
    when given, is filled as chunks arrive, so a caller can watch a stream in progress."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    times = [] if times is None else times
    prompt_tokens = 0
    start = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"calibration request failed: {resp.status_code} {await resp.aread()!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                prompt_tokens = int(obj["usage"].get("prompt_tokens") or 0)
            if any(c.get("text") for c in obj.get("choices") or ()):
                times.append(time.perf_counter())
    return start, times, prompt_tokens


async def _decode_step(
    http: httpx.AsyncClient, model: str, rng: random.Random, rows: int, words: int, tokens: int
) -> Measurement | None:
    """`rows` concurrent streams of `words`-word prompts: the mean gap between their tokens while all
    of them decode is one decode step of `rows` rows. The mean, not the median: a client's time per
    output token is the mean gap, and on a shared machine the gaps have a long right tail."""
    runs = await asyncio.gather(*(_stream(http, model, _prompt(words, rng), tokens) for _ in range(rows)))
    if any(len(ts) < 3 for _, ts, _ in runs):
        return None
    first_done = max(ts[1] for _, ts, _ in runs)  # all rows are decoding after this
    last_start = min(ts[-1] for _, ts, _ in runs)  # ... and until the first one ends
    gaps = [
        y - x for _, ts, _ in runs for x, y in zip(ts, ts[1:], strict=False)
        if x >= first_done and y <= last_start
    ]  # fmt: skip
    if not gaps:
        return None
    ctx = statistics.mean(p for _, _, p in runs) + tokens / 2
    return Measurement("decode", StepShape.decode(rows, round(rows * ctx)), statistics.fmean(gaps))


async def _mixed_step(
    http: httpx.AsyncClient, model: str, rng: random.Random, rows: int, words: int, tokens: int
) -> Measurement | None:
    """A prompt of `words` words sent while `rows` streams decode: the gap of the decoding streams
    that ends with the probe's first token is one step computing the whole prompt and `rows` decode
    rows together, the step a live engine takes whenever a request arrives mid-generation."""
    background = [[] for _ in range(rows)]
    tasks = [
        asyncio.create_task(_stream(http, model, _prompt(24, rng), tokens, times)) for times in background
    ]
    while any(len(ts) < 3 for ts in background) and not all(t.done() for t in tasks):
        await asyncio.sleep(0.002)
    _, probe_times, probe_tokens = await _stream(http, model, _prompt(words, rng), 1)
    runs = await asyncio.gather(*tasks)
    if not probe_times:
        return None
    t = probe_times[0]
    gaps = []
    for _, ts, _ in runs:
        # the background token delivered with the probe's: the same step's outputs, read by this
        # client a little apart, far less than a step apart
        k = min(range(len(ts)), key=lambda i: abs(ts[i] - t))
        if k == 0 or k == len(ts) - 1 or abs(ts[k] - t) > 0.25 * (ts[k] - ts[k - 1]):
            return None  # the probe's step was not one where every stream decoded
        gaps.append(ts[k] - ts[k - 1])
    ctx = statistics.mean(p for _, _, p in runs) + 3
    shape = StepShape.prefill(probe_tokens or words) + StepShape.decode(rows, round(rows * ctx))
    return Measurement("mixed", shape, statistics.median(gaps))


async def measure(
    url: str,
    model: str,
    *,
    prompt_lengths: tuple[int, ...] = (16, 64, 128, 150, 192, 256, 448),
    batch_sizes: tuple[int, ...] = (1, 4, 16),
    decode_prompt_lengths: tuple[int, ...] = (24, 192),
    mixed_batch_sizes: tuple[int, ...] = (1, 4),
    decode_tokens: int = 24,
    repeats: int = 3,
    seed: int = 0,
) -> list[Measurement]:
    """Three small grids per repeat: prefills alone (time to first token), decode steps by batch size
    and context, and mixed steps (a prefill of each length beside decode rows)."""
    rng = random.Random(seed)
    out: list[Measurement] = []
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=600.0) as http:
        await _stream(http, model, _prompt(32, rng), 4)  # warm-up: first-call costs are not a step
        for _ in range(repeats):
            for n in prompt_lengths:
                start, times, tokens = await _stream(http, model, _prompt(n, rng), 1)
                if times:
                    out.append(Measurement("prefill", StepShape.prefill(tokens or n), times[0] - start))
            for b in batch_sizes:
                for words in decode_prompt_lengths:
                    m = await _decode_step(http, model, rng, b, words, decode_tokens)
                    if m is not None:
                        out.append(m)
            for b in mixed_batch_sizes:
                for n in prompt_lengths:
                    m = await _mixed_step(http, model, rng, b, n, decode_tokens)
                    if m is not None:
                        out.append(m)
    return out


async def warm(url: str, model: str) -> None:
    """A few requests of growing length: an engine's first request pays one-time setup (over a second
    on a 2-core CPU) that is no step's cost and would otherwise land on one measured request."""
    rng = random.Random(2)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=600.0) as http:
        for n in (16, 64, 192):
            await _stream(http, model, _prompt(n, rng), 4)


async def _probe_steps(http: httpx.AsyncClient, model: str, rng: random.Random) -> list[float]:
    """A few step times of the probed engine: prefills alone and decode steps of 1 and 4 rows."""
    out = []
    for n in (64, 192):
        start, times, _ = await _stream(http, model, _prompt(n, rng), 1)
        if times:
            out.append(times[0] - start)
    for b in (1, 4):
        m = await _decode_step(http, model, rng, b, 24, 24)
        out.append(m.seconds if m is not None else float("nan"))
    return out


async def measure_contention(
    url: str, neighbours: list[str], model: str, repeats: int = 3, seed: int = 1
) -> dict:
    """How much slower the engine at `url` steps while engines sharing its host (`neighbours`) are
    busy: the same few prefills and decode steps, alternately with the neighbours idle and with each
    of them decoding four long streams; the slowdown is the median over points of busy / idle."""
    rng = random.Random(seed)
    idle: list[list[float]] = []
    busy: list[list[float]] = []
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=600.0) as http:
        clients = [httpx.AsyncClient(base_url=u.rstrip("/"), timeout=600.0) for u in neighbours]
        try:
            await _stream(http, model, _prompt(32, rng), 4)
            for _ in range(repeats):
                idle.append(await _probe_steps(http, model, rng))
                started: list[list[float]] = [[] for _ in range(4 * len(clients))]
                load = [
                    asyncio.create_task(_stream(c, model, _prompt(24, rng), 1024, started[4 * i + k]))
                    for i, c in enumerate(clients) for k in range(4)
                ]  # fmt: skip
                while any(len(ts) < 2 for ts in started) and not all(t.done() for t in load):
                    await asyncio.sleep(0.01)
                busy.append(await _probe_steps(http, model, rng))
                for t in load:
                    t.cancel()
                await asyncio.gather(*load, return_exceptions=True)
                await asyncio.sleep(0.5)  # the cancelled streams leave the neighbours' batches
        finally:
            for c in clients:
                await c.aclose()
    ratios = [
        b / a
        for ib, ia in zip(busy, idle, strict=True)
        for b, a in zip(ib, ia, strict=True)
        if a > 0 and b > 0  # a decode probe that failed is NaN and drops out here
    ]
    return {
        "slowdown": statistics.median(ratios) if ratios else 1.0,
        "ratios": ratios,
        "idle_s": idle,
        "busy_s": busy,
    }


def measure_transfers(
    prefill_url: str, decode_url: str, model: str, lengths: tuple[int, ...] = (64, 256, 576), repeats: int = 3
) -> tuple[list[TransferSample], int]:
    """KV pulls between a prefill and a decode engine (the two legs of a PD request, fresh prompts of
    each length): the decode leg's measured pull per sample, and the KV bytes per token they showed;
    `PerfModel.fit_transfers` takes both."""
    rng = random.Random(3)
    samples, bytes_per_token = [], 0
    with httpx.Client(timeout=300.0) as http:
        block = int(http.get(f"{decode_url}/v1/load").json()["block_size"])
        for n in lengths * repeats:
            prompt = [rng.randrange(100, 10_000) for _ in range(n)]
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            remote = {**body, "kv_transfer_params": {"do_remote_decode": True}}
            leg = http.post(f"{prefill_url}/v1/completions", json=remote)
            leg.raise_for_status()
            handle = leg.json()["kv_transfer_params"]
            answer = http.post(f"{decode_url}/v1/completions", json={**body, "kv_transfer_params": handle})
            answer.raise_for_status()
            kv = answer.json()["kv_transfer"]
            if kv.get("fallback") or not kv["blocks"]:
                raise RuntimeError(f"the decode engine did not pull the KV: {kv}")
            tokens = kv["blocks"] * block
            bytes_per_token = kv["bytes"] // tokens
            samples.append(TransferSample(tokens, kv["seconds"]))
    return samples, bytes_per_token


# a bend is tried only where the straight line misses some measurement by more than BEND_MIN_ERROR,
# and kept only where it cuts the fit's squared relative error to BEND_MIN_GAIN of the line's
BEND_MIN_ERROR = 0.05
BEND_MIN_GAIN = 0.7


def fit(measurements: list[Measurement], base: PerfModel) -> PerfModel:
    """NNLS on relative error over the step terms (decode rows apart) plus the per-request overhead;
    and, where a step's cost bends at a row count (the engine's layers change path), the bend: every
    row count measured with prompt tokens is tried as `wide_from_rows` (at least two distinct row
    counts on each side), where the line misses by more than BEND_MIN_ERROR, and the best is kept if
    it beats the line by BEND_MIN_GAIN."""
    if len(measurements) < 5:
        raise ValueError("calibration needs at least five measurements")
    y = np.array([m.seconds for m in measurements])
    rows = np.array([m.shape.prefill_tokens + m.shape.decode_rows for m in measurements])
    coef, errors = _fit_bent(measurements, y, None)
    bend, best = None, BEND_MIN_GAIN * float(errors @ errors)
    counts = sorted({int(r) for r, m in zip(rows, measurements, strict=True) if m.shape.prefill_tokens})
    for t in counts[2:-1] if errors.max() > BEND_MIN_ERROR else ():
        if len({int(r) for r in rows[rows >= t]}) < 2:
            continue
        c, e = _fit_bent(measurements, y, t)
        if float(e @ e) < best:
            bend, best, coef, errors = t, float(e @ e), c, e
    model = replace(
        base, base_s=float(coef[0]), per_token_s=float(coef[1]), decode_row_s=float(coef[2]),
        prefill_attention_s=float(coef[3]), decode_attention_s=float(coef[4]),
        request_overhead_s=float(coef[5]), wide_from_rows=bend, wide_base_s=float(coef[6]),
        wide_per_token_s=float(coef[7]),
    )  # fmt: skip
    meta = dict(base.meta)
    meta["calibration"] = {
        "samples": len(measurements),
        "median_relative_error": float(np.median(errors)),
        "max_relative_error": float(errors.max()),
        "grid": sorted({(m.kind, m.shape.prefill_tokens or m.shape.decode_rows) for m in measurements}),
        "bend_at_rows": bend,
    }
    return replace(model, meta=meta)


def _features(measurements: list[Measurement], bend: int | None) -> np.ndarray:
    """Per measurement: base, prefill tokens, decode rows, the two attention terms, the request
    overhead (time to first token only), then the bend's extra base and its prefill tokens; decode rows
    get their own coefficient: through a server each row also pays its detokenising and streaming."""
    out = []
    for m in measurements:
        s = m.shape
        wide = bend is not None and s.prefill_tokens + s.decode_rows >= bend
        out.append((
            1.0, 0.0 if wide else s.prefill_tokens, s.decode_rows, s.prefill_attention, s.decode_context,
            1.0 if m.kind == "prefill" else 0.0, 1.0 if wide else 0.0, s.prefill_tokens if wide else 0.0,
        ))  # fmt: skip
    return np.array(out)


def _fit_bent(measurements: list[Measurement], y: np.ndarray, bend: int | None) -> tuple[np.ndarray, float]:
    """NNLS on relative error with the bend at `bend` rows (None: a straight line): (coefficients,
    each measurement's relative error)."""
    from scipy.optimize import nnls

    x = _features(measurements, bend)
    coef, _ = nnls(x / y[:, None], np.ones_like(y))
    return coef, np.abs(x @ coef - y) / y


def step_samples(measurements: list[Measurement], overhead_s: float) -> list[StepSample]:
    """The measurements as step samples (time to first token less the request overhead)."""
    return [
        StepSample(m.shape, m.seconds - (overhead_s if m.kind == "prefill" else 0.0)) for m in measurements
    ]


def calibrate(url: str, model: str, name: str, source: str, **grid: Any) -> PerfModel:
    """Measure the engine at `url` and return its fitted profile."""
    ms = asyncio.run(measure(url, model, **grid))
    return fit(ms, PerfModel(name=name, source=source))
