"""The performance model's form, fit and profile file."""

import math

import numpy as np
import pytest

from tokenops.cluster.perf_model import PerfModel, StepSample, StepShape, TransferSample

TRUE = PerfModel(
    name="synthetic",
    base_s=0.012,
    per_token_s=0.0004,
    prefill_attention_s=2e-8,
    decode_attention_s=3e-7,
)


def _samples(noise: float, seed: int = 0) -> list[StepSample]:
    rng = np.random.default_rng(seed)
    shapes = [StepShape.prefill(n, c) for n in (16, 64, 256, 1024) for c in (0, 512, 2048)]
    shapes += [StepShape.decode(b, b * ctx) for b in (1, 4, 16, 32) for ctx in (128, 1024, 4096)]
    shapes += [StepShape.prefill(128, 256) + StepShape.decode(8, 8 * 900)]
    return [StepSample(s, TRUE.step_time(s) * (1 + noise * rng.standard_normal())) for s in shapes]


def test_fit_recovers_known_coefficients_from_exact_samples():
    fitted = PerfModel(name="fit").fit_steps(_samples(0.0))
    for f in ("base_s", "per_token_s", "prefill_attention_s", "decode_attention_s"):
        assert getattr(fitted, f) == pytest.approx(getattr(TRUE, f), rel=1e-6), f


def test_fit_under_noise_predicts_within_a_few_percent():
    fitted = PerfModel().fit_steps(_samples(0.02, seed=3))
    errors = fitted.relative_errors(_samples(0.0))
    assert max(errors) < 0.08
    assert all(getattr(fitted, f) >= 0 for f in ("base_s", "per_token_s", "prefill_attention_s"))


def test_terms_add_for_a_mixed_step_and_an_empty_step_costs_nothing():
    p, d = StepShape.prefill(100, 50), StepShape.decode(4, 4000)
    assert TRUE.step_time(p + d) == pytest.approx(TRUE.step_time(p) + TRUE.step_time(d) - TRUE.base_s)
    assert TRUE.step_time(StepShape()) == 0.0
    # attention of a prefill chunk grows with what it attends to
    assert TRUE.prefill_time(100, 1000) > TRUE.prefill_time(100, 0)


def test_transfer_fit_and_time():
    true = PerfModel(kv_bytes_per_token=1000, transfer_latency_s=0.002, transfer_bytes_per_s=2e9)
    samples = [TransferSample(t, true.transfer_time(t)) for t in (16, 256, 4096, 65536)]
    fitted = PerfModel().fit_transfers(samples, kv_bytes_per_token=1000)
    assert fitted.transfer_latency_s == pytest.approx(0.002, rel=1e-6)
    assert fitted.transfer_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert fitted.transfer_time(0) == 0.0
    assert math.isinf(PerfModel().transfer_bytes_per_s) and PerfModel().transfer_time(10) == 0.0


def test_profile_round_trip_and_unknown_fields(tmp_path):
    path = tmp_path / "profile.json"
    TRUE.save(path)
    assert PerfModel.load(path) == TRUE
    with pytest.raises(ValueError, match="unknown"):
        PerfModel.from_dict({"name": "x", "per_tokn_s": 1.0})


def test_fit_refuses_too_few_or_bad_samples():
    with pytest.raises(ValueError):
        PerfModel().fit_steps([StepSample(StepShape.prefill(10), 0.1)])
    with pytest.raises(ValueError):
        PerfModel().fit_steps([StepSample(StepShape.prefill(10), 0.1), StepSample(StepShape.prefill(20), 0)])
