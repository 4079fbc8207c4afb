"""The live strong share follows the operator's target on a drifting synthetic stream."""

from __future__ import annotations

import numpy as np
import pytest

from tokenops.fusion.calibration import ShareCalibrator


@pytest.mark.parametrize("target", [0.2, 0.5])
def test_live_share_converges_to_target_while_scores_drift(target: float) -> None:
    rng = np.random.default_rng(0)
    cal = ShareCalibrator(
        target, window=400, tolerance=0.05, min_samples=50, every=200, initial_threshold=0.9
    )
    phases = [
        rng.uniform(0, 1, 2000),  # calm traffic
        rng.beta(5, 2, 2000),  # harder traffic: scores drift up
        rng.beta(2, 6, 2000),  # easy traffic: scores drift down
    ]
    for scores in phases:
        decisions = [cal.decide(float(s)).strong for s in scores]
        tail = np.mean(decisions[-1000:])  # after the calibrator has caught up with the new phase
        assert abs(tail - target) < 0.07, (target, tail)
    assert cal.recalibrations >= 3


def test_a_fixed_threshold_would_not_follow_the_drift() -> None:
    # the control: without recalibration the share is far off once scores drift
    rng = np.random.default_rng(1)
    threshold = float(np.quantile(rng.uniform(0, 1, 2000), 0.8))
    assert np.mean(rng.beta(5, 2, 2000) > threshold) > 0.3


def test_seeded_threshold_and_edge_targets() -> None:
    cal = ShareCalibrator(0.25)
    cal.seed(np.linspace(0, 1, 101))
    assert cal.threshold == pytest.approx(0.75)
    assert ShareCalibrator(0.0).decide(1.0).strong is False
    assert ShareCalibrator(1.0).decide(0.0).strong is True
    with pytest.raises(ValueError):
        ShareCalibrator(1.5)
