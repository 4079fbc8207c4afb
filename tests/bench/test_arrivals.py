"""Arrival processes on a fixed seed: mean rate and burstiness (no wall clock)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokenops.bench.arrivals import ArrivalProcess, arrival_times


@pytest.mark.parametrize("rate,burstiness", [(10.0, 1.0), (50.0, 0.25), (2.0, 4.0)])
def test_mean_rate_and_cv(rate, burstiness):
    t = np.array(arrival_times(20_000, rate, burstiness, seed=7))
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert np.all(gaps >= 0) and np.all(np.diff(t) >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # Gamma(shape=b): coefficient of variation 1/sqrt(b); Poisson (b=1) has CV 1
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_seeded_and_repeatable():
    assert arrival_times(100, 5.0, seed=1) == arrival_times(100, 5.0, seed=1)
    assert arrival_times(100, 5.0, seed=1) != arrival_times(100, 5.0, seed=2)


def test_infinite_rate_sends_all_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5


def test_bad_parameters():
    with pytest.raises(ValueError):
        ArrivalProcess(0.0)
    with pytest.raises(ValueError):
        ArrivalProcess(1.0, burstiness=0)
