"""Threshold calibration: the operator sets the share of requests allowed on the strong model; the
score threshold follows the traffic.

This module owns `ShareCalibrator`: it keeps a window of recent router scores and of the decisions
it made, sets the threshold to the (1 - target share) quantile of the recent scores, and calibrates
again whenever the live strong share over the window drifts further than a tolerance from the target
(and every `every` decisions regardless, so a slow drift is followed too). It does not score
requests (routers.py) or name models (plan.py). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class TierChoice:
    """Whether a request goes to the strong tier, from its router score and the calibrated threshold."""

    strong: bool
    score: float
    threshold: float


class ShareCalibrator:
    def __init__(
        self,
        target_share: float,
        *,
        window: int = 500,
        tolerance: float = 0.05,
        min_samples: int = 50,
        every: int = 200,
        initial_threshold: float = 0.5,
    ) -> None:
        if not 0.0 <= target_share <= 1.0:
            raise ValueError("target_share must be between 0 and 1")
        self.target_share = target_share
        self.tolerance = tolerance
        self.min_samples = min_samples
        self.every = every
        self.threshold = initial_threshold
        self.recalibrations = 0
        self._scores: deque[float] = deque(maxlen=window)
        self._decisions: deque[bool] = deque(maxlen=window)
        self._since = 0
        self._lock = threading.Lock()

    @property
    def live_share(self) -> float:
        with self._lock:
            return sum(self._decisions) / len(self._decisions) if self._decisions else 0.0

    def seed(self, scores: list[float] | np.ndarray) -> None:
        """Start from scores seen offline (a held-out split), so the first requests are routed well."""
        with self._lock:
            self._scores.extend(float(s) for s in scores)
            self._recalibrate()

    def decide(self, score: float) -> TierChoice:
        """Strong (score above the threshold) or cheap, and learn from the score."""
        with self._lock:
            self._scores.append(float(score))
            self._since += 1
            # a target of 0 or 1 is a hard rule, not a quantile
            strong = self.target_share >= 1.0 or (self.target_share > 0.0 and score > self.threshold)
            self._decisions.append(strong)
            live = sum(self._decisions) / len(self._decisions)
            drifted = (
                len(self._decisions) >= self.min_samples and abs(live - self.target_share) > self.tolerance
            )
            if len(self._scores) >= self.min_samples and (drifted or self._since >= self.every):
                self._recalibrate()
                if drifted:
                    # the old decisions describe the old threshold: judge the new one on fresh traffic
                    self._decisions.clear()
            return TierChoice(strong, float(score), self.threshold)

    def _recalibrate(self) -> None:
        if not self._scores:
            return
        self.threshold = float(
            np.quantile(np.fromiter(self._scores, dtype=np.float64), 1.0 - self.target_share)
        )
        self.recalibrations += 1
        self._since = 0
