"""Retraining a learning route's router while the gateway serves: a schedule's one round.

This module owns `Relearner`: one per cascade route with `learn.retrain` set. Each round it reads
the route's stored cascade outcomes, retrains (retrain.py) once enough new ones have arrived since
the last round, and puts the new router and its calibrated threshold in place of the old ones only
when the new router predicts the held-out escalations at least as well as the one serving (AUC,
the measure both a probability and a rank router have). A swap also writes the router where the
route's `router_model` points, so a restart serves it. Every gateway reading the same database
retrains on the same outcomes with the same seed and so reaches the same router. The round runs
off the event loop (it embeds texts and trains); the gateway schedules it (gateway/app.py).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from tokenops.fusion.calibration import ShareCalibrator
from tokenops.fusion.outcomes import CascadeOutcome
from tokenops.fusion.plan import RouteConfig
from tokenops.fusion.retrain import Retrained, retrain
from tokenops.fusion.routers import EmbedFn, LabelledExample

log = logging.getLogger("tokenops.fusion")

RoundResult = Literal["swapped", "kept", "waiting", "failed"]


@dataclass(frozen=True, slots=True)
class RetrainSchedule:
    every_s: float = 3600.0  # how often a round runs
    min_new_outcomes: int = 50  # outcomes stored since the last retraining before another
    last: int | None = None  # train on the latest this many outcomes (None: all)
    held_out: float = 0.2
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Round:
    result: RoundResult
    reason: str
    outcomes: int  # how many outcomes the route had stored
    retrained: Retrained | None = None


class OutcomeSource(Protocol):
    """What a round reads: `OutcomeStore` has these."""

    def outcomes(self, route: str | None = None, *, limit: int | None = None) -> list[CascadeOutcome]: ...

    def count(self, route: str) -> int: ...

    def close(self) -> None: ...


class Relearner:
    """A route's retraining rounds; `run_round` is called on a schedule, from a worker thread."""

    def __init__(
        self,
        route: RouteConfig,
        schedule: RetrainSchedule,
        source: OutcomeSource,
        *,
        save_to: Path | None = None,
        profile_labels: list[LabelledExample] | None = None,
        embed: EmbedFn | None = None,
    ) -> None:
        self.route = route
        self.schedule = schedule
        self.source = source
        self.save_to = save_to
        self.profile_labels = profile_labels
        self.embed = embed
        self.trained_on_count = 0  # outcomes there were at the last retraining (swapped or kept)

    def run_round(self) -> Round:
        count = self.source.count(self.route.name)
        new = count - self.trained_on_count
        if new < self.schedule.min_new_outcomes:
            return Round("waiting", f"{new} new outcomes of {self.schedule.min_new_outcomes}", count)
        outcomes = self.source.outcomes(self.route.name, limit=self.schedule.last)
        try:
            result = retrain(
                outcomes,
                target_strong_share=self.route.target_strong_share,
                profile_labels=self.profile_labels,
                old=self.route.router,
                held_out=self.schedule.held_out,
                seed=self.schedule.seed,
                embed=self.embed,
                min_outcomes=self.schedule.min_new_outcomes,
            )
        except ValueError as exc:  # too few outcomes, or one verdict only: nothing to learn yet
            return Round("waiting", str(exc), count)
        self.trained_on_count = count
        new_auc, old_auc = result.new.auc, result.old.auc if result.old else None
        if new_auc is None:
            return Round("kept", "the held-out outcomes have one verdict only: nothing to compare on", count)
        if old_auc is not None and new_auc < old_auc:
            return Round(
                "kept", f"held-out AUC {new_auc:.3f} below the serving router's {old_auc:.3f}", count
            )
        self._swap(result)
        was = f" (was {old_auc:.3f})" if old_auc is not None else ""
        return Round("swapped", f"held-out AUC {new_auc:.3f}{was}", count, result)

    def _swap(self, result: Retrained) -> None:
        if self.save_to is not None:
            # written beside and renamed over: a gateway starting meanwhile never reads half a file
            fd, tmp = tempfile.mkstemp(suffix=".npz", dir=self.save_to.parent)
            os.close(fd)
            result.router.save(tmp, threshold=result.threshold)
            os.replace(tmp, self.save_to)
        # plain attribute swaps: a request planned meanwhile may pair one router with the other's
        # threshold once, which the calibrator's window absorbs
        self.route.calibrator = ShareCalibrator(
            self.route.target_strong_share, initial_threshold=result.threshold
        )
        self.route.router = result.router
