"""The one performance model: how long an engine step, a prefill and a KV transfer take on one replica
type, as linear functions of token counts fitted from measurements.

A continuous-batching step runs some prefill chunks and some decode rows together. Its time is

    base + per_token * prefill tokens + decode_row * decode rows     # decode_row = per_token unless set
         + prefill_attention * sum(new * (cached + new / 2))   # each new token attends to what precedes it
         + decode_attention * sum(context of each decode row)

the alpha-beta form DistServe, Vidur and BLIS start from: a fixed cost (weights read once per step,
launch and Python overhead), a per-token cost (the matmuls), and attention terms that grow with context.
An engine whose layers change path with the step's size (ours with int4 on AMX: one native call on the
int8 tiles below 160 rows, a dequantising pass and one bf16 GEMM from there) bends that line: from
`wide_from_rows` rows (prefill tokens plus decode rows) a step pays `wide_base_s` more and its prefill
tokens `wide_per_token_s` each instead of `per_token_s`.
A KV transfer costs `latency + tokens * kv_bytes_per_token / bandwidth`. The fleet simulator, the
capacity planner and the live PD policies all hold a `PerfModel`; this module owns the form, the fit
and the profile file, not the measuring (see `tokenops.sim` for calibration against a live engine).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one engine step computes: the quantities the model's terms multiply."""

    prefill_tokens: int = 0  # new prompt tokens computed this step (all chunks)
    prefill_attention: float = 0.0  # sum over chunks of new * (cached + new / 2)
    decode_rows: int = 0  # sequences that produce one token this step
    decode_context: int = 0  # sum of the decode rows' context lengths

    @staticmethod
    def prefill(new_tokens: int, cached_tokens: int = 0) -> StepShape:
        return StepShape(new_tokens, new_tokens * (cached_tokens + new_tokens / 2))

    @staticmethod
    def decode(rows: int, context_tokens: int) -> StepShape:
        return StepShape(decode_rows=rows, decode_context=context_tokens)

    def __add__(self, other: StepShape) -> StepShape:
        return StepShape(
            self.prefill_tokens + other.prefill_tokens,
            self.prefill_attention + other.prefill_attention,
            self.decode_rows + other.decode_rows,
            self.decode_context + other.decode_context,
        )

    def features(self) -> tuple[float, float, float, float]:
        """The model's regressors, in the order of `PerfModel`'s step coefficients."""
        return (
            1.0,
            float(self.prefill_tokens + self.decode_rows),
            float(self.prefill_attention),
            float(self.decode_context),
        )


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step (or a whole prefill, or a decode step of a batch) and its time in seconds."""

    shape: StepShape
    seconds: float


@dataclass(frozen=True, slots=True)
class TransferSample:
    tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class PerfModel:
    """Step and transfer times of one replica type. Coefficients are seconds per unit."""

    name: str = "unnamed"
    base_s: float = 0.0
    per_token_s: float = 0.0
    prefill_attention_s: float = 0.0
    decode_attention_s: float = 0.0
    kv_bytes_per_token: int = 0
    transfer_latency_s: float = 0.0
    transfer_bytes_per_s: float = float("inf")
    # what a request spends outside the engine's steps before it is queued (HTTP, tokenising), as seen
    # by a client; calibration fits it from time to first token, the simulator adds it on dispatch
    request_overhead_s: float = 0.0
    # a decode row's own cost when it differs from a prefill token's (published GPU tables fit them
    # apart: decode rows are bandwidth-bound); None: `per_token_s`, the form calibration fits
    decode_row_s: float | None = None
    # the bend (module docstring): None, no bend
    wide_from_rows: int | None = None
    wide_base_s: float = 0.0
    wide_per_token_s: float = 0.0
    source: str = ""  # where the coefficients come from: a calibration run, a published table
    meta: dict = field(default_factory=dict, compare=False)

    def step_time(self, shape: StepShape) -> float:
        return self.step_seconds(
            shape.prefill_tokens, shape.prefill_attention, shape.decode_rows, shape.decode_context
        )

    def step_seconds(
        self, prefill_tokens: int, prefill_attention: float, decode_rows: int, decode_context: int
    ) -> float:
        """`step_time` of a step given by its quantities (the simulator's per-step call, no shape built)."""
        if prefill_tokens == 0 and decode_rows == 0:
            return 0.0
        row = self.per_token_s if self.decode_row_s is None else self.decode_row_s
        base, per_token = self.base_s, self.per_token_s
        if self.bends_at(prefill_tokens + decode_rows):
            base, per_token = base + self.wide_base_s, self.wide_per_token_s
        return (
            base
            + per_token * prefill_tokens
            + row * decode_rows
            + self.prefill_attention_s * prefill_attention
            + self.decode_attention_s * decode_context
        )

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """A prefill alone on an idle replica (one step; chunking adds one `base_s` per extra chunk)."""
        return self.step_time(StepShape.prefill(new_tokens, cached_tokens))

    def decode_step_time(self, rows: int, context_tokens: int) -> float:
        return self.step_time(StepShape.decode(rows, context_tokens))

    def busy_step_time(self, load: float, rows_per_s: float) -> float:
        """The step time T of a replica whose steps carry `load` seconds of work per second beyond their
        base (`load` = per-row cost x rows per second) and whose batch is `rows_per_s * T` rows (Little's
        law): T = base / (1 - load), with `wide_base_s` in the base once that batch reaches
        `wide_from_rows`. Where both branches hold, the lower one: a batch grows into the bend from
        below. math.inf once load >= 1 (the batch never drains)."""
        if load >= 1:
            return math.inf
        t = self.base_s / (1 - load)
        if self.bends_at(rows_per_s * t):
            t = (self.base_s + self.wide_base_s) / (1 - load)
        return t

    def bends_at(self, rows: float) -> bool:
        """Whether a step of `rows` rows (prefill tokens plus decode rows) is past the bend."""
        return self.wide_from_rows is not None and rows >= self.wide_from_rows

    def transfer_time(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.transfer_latency_s + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    # -- fitting -----------------------------------------------------------------------------------

    def fit_steps(self, samples: Sequence[StepSample]) -> PerfModel:
        """Non-negative least squares on the step terms, relative error weighted (each sample divided
        by its own time) so short decode steps count as much as long prefills. The unbent form (no
        `wide_from_rows`); `tokenops.sim.calibrate.fit` finds and fits a bend."""
        if len(samples) < 2:
            raise ValueError("fitting step times needs at least two samples")
        from scipy.optimize import nnls

        x = np.array([s.shape.features() for s in samples], dtype=np.float64)
        y = np.array([s.seconds for s in samples], dtype=np.float64)
        if np.any(y <= 0):
            raise ValueError("step samples must have positive times")
        coef, _ = nnls(x / y[:, None], np.ones_like(y))
        return replace(
            self,
            base_s=float(coef[0]),
            per_token_s=float(coef[1]),
            prefill_attention_s=float(coef[2]),
            decode_attention_s=float(coef[3]),
            wide_from_rows=None,
            wide_base_s=0.0,
            wide_per_token_s=0.0,
        )

    def fit_transfers(self, samples: Sequence[TransferSample], kv_bytes_per_token: int) -> PerfModel:
        """Latency and bandwidth from measured transfers of known token counts."""
        if len(samples) < 2:
            raise ValueError("fitting transfer times needs at least two samples")
        from scipy.optimize import nnls

        x = np.array([[1.0, s.tokens * kv_bytes_per_token] for s in samples], dtype=np.float64)
        y = np.array([s.seconds for s in samples], dtype=np.float64)
        coef, _ = nnls(x, y)
        per_byte = float(coef[1])
        return replace(
            self,
            kv_bytes_per_token=kv_bytes_per_token,
            transfer_latency_s=float(coef[0]),
            transfer_bytes_per_s=1.0 / per_byte if per_byte > 0 else float("inf"),
        )

    def relative_errors(self, samples: Iterable[StepSample]) -> list[float]:
        return [abs(self.step_time(s.shape) - s.seconds) / s.seconds for s in samples]

    # -- profile files -----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["transfer_bytes_per_s"] == float("inf"):
            d["transfer_bytes_per_s"] = None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PerfModel:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown performance-model fields: {sorted(unknown)}")
        d = dict(d)
        if d.get("transfer_bytes_per_s") is None:
            d["transfer_bytes_per_s"] = float("inf")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> PerfModel:
        return cls.from_dict(json.loads(Path(path).read_text()))
