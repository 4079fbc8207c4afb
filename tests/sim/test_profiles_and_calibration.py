"""Shipped profiles reproduce their published source, and the calibration fit recovers known
coefficients (and the per-request overhead) from synthetic measurements."""

import json

import numpy as np
import pytest

from tokenops.cluster.perf_model import PerfModel, StepSample, StepShape
from tokenops.sim.calibrate import Measurement, fit
from tokenops.sim.cli import PROFILES


@pytest.mark.parametrize("path", sorted(PROFILES.glob("*a100*.json")), ids=lambda p: p.stem)
def test_a_distserve_profile_gives_distserve_step_times(path):
    perf = PerfModel.load(path)
    raw = json.loads(path.read_text())["meta"]["distserve_ms"]
    a, b, c = raw["prefill_a_b_c"]
    da, db, dc = raw["decoding_smallbs_a_b_c"]
    for rows, ctx in ((1, 512), (16, 16 * 1024), (64, 64 * 300)):
        assert perf.decode_step_time(rows, ctx) * 1000 == pytest.approx(da + db * ctx + dc * rows)
    for n in (128, 512, 2048):
        # same terms, only the intercept is the decode one
        assert perf.prefill_time(n) * 1000 == pytest.approx(a + b * n + c * n * n + (da - a))
    assert "DistServe" in perf.source


def test_calibration_fit_recovers_step_coefficients_and_request_overhead_with_mixed_steps():
    true = PerfModel(base_s=0.015, per_token_s=0.0008, prefill_attention_s=4e-8, decode_attention_s=2e-6,
                     request_overhead_s=0.004, decode_row_s=0.003)  # fmt: skip
    rng = np.random.default_rng(0)
    ms = []
    for n in (16, 64, 192, 448):
        shape = StepShape.prefill(n)
        ms.append(Measurement("prefill", shape, true.step_time(shape) + true.request_overhead_s))
    for b in (1, 4, 16, 32):
        for ctx in (64, 512):
            shape = StepShape.decode(b, b * ctx)
            noisy = true.step_time(shape) * (1 + 1e-4 * rng.standard_normal())
            ms.append(Measurement("decode", shape, noisy))
    for b in (1, 4):
        for n in (64, 448):
            # a prompt computed beside b decode rows: one step, no request overhead
            shape = StepShape.prefill(n) + StepShape.decode(b, b * 40)
            ms.append(Measurement("mixed", shape, true.step_time(shape)))
    got = fit(ms, PerfModel(name="fit"))
    for f in ("base_s", "per_token_s", "decode_row_s", "decode_attention_s", "request_overhead_s"):
        assert getattr(got, f) == pytest.approx(getattr(true, f), rel=0.02), f
    assert got.meta["calibration"]["max_relative_error"] < 0.01
    assert got.wide_from_rows is None  # a straight line fits: no bend


def test_calibration_finds_where_the_step_cost_bends_and_fits_both_sides():
    # from 160 rows the engine's layers take another path: 12 ms more a step, half the cost per prompt
    # token (int4 on AMX: a dequantising pass, then one bf16 GEMM instead of the int8 tiles)
    true = PerfModel(base_s=0.006, per_token_s=0.0004, decode_attention_s=1e-6, request_overhead_s=0.004,
                     decode_row_s=0.0005, wide_from_rows=160, wide_base_s=0.012,
                     wide_per_token_s=0.0002)  # fmt: skip
    ms = []
    for n in (28, 76, 140, 162, 204, 268, 460):
        shape = StepShape.prefill(n)
        ms.append(Measurement("prefill", shape, true.step_time(shape) + true.request_overhead_s))
    for b in (1, 4, 16):
        shape = StepShape.decode(b, b * 100)
        ms.append(Measurement("decode", shape, true.step_time(shape)))
    for b in (1, 4):
        for n in (28, 76, 140, 204, 460):
            shape = StepShape.prefill(n) + StepShape.decode(b, b * 40)
            ms.append(Measurement("mixed", shape, true.step_time(shape)))
    got = fit(ms, PerfModel(name="fit"))
    assert got.wide_from_rows == 162  # the first measured row count past the bend
    assert got.meta["calibration"]["bend_at_rows"] == 162
    for f in ("base_s", "per_token_s", "decode_row_s", "wide_base_s", "wide_per_token_s"):
        assert getattr(got, f) == pytest.approx(getattr(true, f), rel=0.02), f
    assert got.request_overhead_s == pytest.approx(true.request_overhead_s, rel=0.02)
    assert got.meta["calibration"]["max_relative_error"] < 0.01
    # a straight line through the same steps misses some by far more
    steps = [StepSample(m.shape, m.seconds) for m in ms if m.kind != "prefill"]
    line = PerfModel(name="line").fit_steps(steps)
    assert line.wide_from_rows is None and max(line.relative_errors(steps)) > 0.05
    # the bent model's step times: a row short of the bend on the line, at it past the bend
    assert got.prefill_time(161) == pytest.approx(0.006 + 161 * 0.0004, rel=0.02)
    assert got.prefill_time(162) == pytest.approx(0.006 + 0.012 + 162 * 0.0002, rel=0.02)
