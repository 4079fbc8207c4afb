"""Calibration: measure a running OpenAI-compatible engine (ours, vLLM, SGLang) from outside and fit
the one `PerfModel` to it.

Two small grids, each point repeated: prefill, one request at a time with a fresh prompt of L tokens
and `max_tokens=1` (its time to first token is one prefill step plus the request's own overhead), and
decode, B concurrent streams of short prompts generating a fixed number of tokens with `ignore_eos`
(the median gap between their tokens, while all B decode, is one decode step of B rows). The fit is
non-negative least squares on relative error, with a decode row's cost fitted apart from a prefill
token's, and one extra term, the per-request overhead outside
the engine's steps (HTTP, tokenising, the first chunk's trip), which only time to first token pays.
This module owns the measuring and that fit; the model's form is `cluster.perf_model`'s.
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
from tokenops.cluster.perf_model import PerfModel, StepSample, StepShape


@dataclass(frozen=True, slots=True)
class Measurement:
    kind: str  # "prefill" (a time to first token) or "decode" (an inter-token gap)
    shape: StepShape
    seconds: float


def _prompt(words: int, rng: random.Random) -> str:
    # a fresh first word keeps the prefix cache from serving a repeated prompt
    return f"q{rng.randrange(1 << 40)} " + " ".join(rng.choices(VOCAB, k=max(0, words - 1)))


async def _stream(
    http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int
) -> tuple[float, list[float], int]:
    """One streamed completion: (send time, chunk arrival times, prompt tokens from usage)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    times: list[float] = []
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


async def measure(
    url: str,
    model: str,
    *,
    prompt_lengths: tuple[int, ...] = (16, 64, 192, 448),
    batch_sizes: tuple[int, ...] = (1, 4, 16),
    decode_tokens: int = 24,
    repeats: int = 3,
    seed: int = 0,
) -> list[Measurement]:
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
                runs = await asyncio.gather(
                    *(_stream(http, model, _prompt(24, rng), decode_tokens) for _ in range(b))
                )
                first_done = max(t[1][1] for t in runs if len(t[1]) > 1)  # all b are decoding after this
                last_start = min(t[1][-1] for t in runs)  # ... and until the first one ends
                gaps = [
                    y - x for _, ts, _ in runs for x, y in zip(ts, ts[1:], strict=False)
                    if x >= first_done and y <= last_start
                ]  # fmt: skip
                if not gaps:
                    continue
                ctx = statistics.mean(p for _, _, p in runs) + decode_tokens / 2
                out.append(
                    Measurement("decode", StepShape.decode(b, round(b * ctx)), statistics.median(gaps))
                )
    return out


def fit(measurements: list[Measurement], base: PerfModel) -> PerfModel:
    """NNLS on relative error over the step terms (decode rows apart) plus the per-request overhead."""
    from scipy.optimize import nnls

    if len(measurements) < 5:
        raise ValueError("calibration needs at least five measurements")
    # decode rows get their own coefficient: through a server each row also pays its detokenising
    # and streaming, which a prefill token does not
    x = np.array([
        (1.0, m.shape.prefill_tokens, m.shape.decode_rows, m.shape.prefill_attention, m.shape.decode_context,
         1.0 if m.kind == "prefill" else 0.0)
        for m in measurements
    ])  # fmt: skip
    y = np.array([m.seconds for m in measurements])
    coef, _ = nnls(x / y[:, None], np.ones_like(y))
    model = replace(
        base, base_s=float(coef[0]), per_token_s=float(coef[1]), decode_row_s=float(coef[2]),
        prefill_attention_s=float(coef[3]), decode_attention_s=float(coef[4]),
        request_overhead_s=float(coef[5]),
    )  # fmt: skip
    pred = x @ coef
    errors = np.abs(pred - y) / y
    meta = dict(base.meta)
    meta["calibration"] = {
        "samples": len(measurements),
        "median_relative_error": float(np.median(errors)),
        "max_relative_error": float(errors.max()),
        "grid": sorted({(m.kind, m.shape.prefill_tokens or m.shape.decode_rows) for m in measurements}),
    }
    return replace(model, meta=meta)


def step_samples(measurements: list[Measurement], overhead_s: float) -> list[StepSample]:
    """The measurements as step samples (time to first token less the request overhead)."""
    return [
        StepSample(m.shape, m.seconds - (overhead_s if m.kind == "prefill" else 0.0)) for m in measurements
    ]


def calibrate(url: str, model: str, name: str, source: str, **grid: Any) -> PerfModel:
    """Measure the engine at `url` and return its fitted profile."""
    ms = asyncio.run(measure(url, model, **grid))
    return fit(ms, PerfModel(name=name, source=source))
