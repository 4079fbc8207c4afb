"""The order in which legs waiting for a prefill worker's slots are released: `PrefillQueue`, a
plain object over the waiting jobs that the live prefill gate (`cluster.pd_dispatch.PrefillGate`) and
the fleet simulator both run. It reorders for TTFT without starving a long prompt; it does not place
legs (the PD policies in `cluster.pd` do) or hold slots (the gate does)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenops.cluster.pd import PrefillJob
from tokenops.cluster.perf_model import PerfModel


@dataclass(slots=True)
class _Queued:
    job: PrefillJob
    deferrals: int = 0


class PrefillQueue:
    """A prefill worker's queue, reordered for TTFT: `pop` looks at the first `lookahead` (at most 5)
    jobs and takes the most urgent one that can still meet the TTFT SLO (least slack = SLO - waited -
    modelled prefill time), or the shortest when none can; every job passed over counts a deferral,
    and a job deferred `max_deferrals` times is taken next, so a long prompt cannot starve."""

    def __init__(
        self,
        perf: PerfModel,
        ttft_slo_s: float,
        *,
        worker: str = "",
        lookahead: int = 5,
        max_deferrals: int = 3,
    ) -> None:
        if not 1 <= lookahead <= 5:
            raise ValueError("lookahead must be between 1 and 5")
        if max_deferrals < 0:
            raise ValueError("max_deferrals must be >= 0")
        self.perf = perf
        self.ttft_slo_s = ttft_slo_s
        self.worker = worker  # whose cache a job's cached tokens are counted on
        self.lookahead = lookahead
        self.max_deferrals = max_deferrals
        self._jobs: list[_Queued] = []

    def __len__(self) -> int:
        return len(self._jobs)

    def push(self, job: PrefillJob) -> None:
        self._jobs.append(_Queued(job))

    def discard(self, job: PrefillJob) -> None:
        """Take `job` (this very object) out unserved: its wait ran out or it was cancelled."""
        self._jobs = [q for q in self._jobs if q.job is not job]

    def deferrals(self, request_id: str) -> int:
        return next((q.deferrals for q in self._jobs if q.job.request_id == request_id), 0)

    def pop(self, now: float) -> PrefillJob | None:
        if not self._jobs:
            return None
        window = self._jobs[: self.lookahead]
        pick = next((i for i, q in enumerate(window) if q.deferrals >= self.max_deferrals), None)
        if pick is None:
            cost = [
                self.perf.prefill_time(q.job.uncached_on(self.worker), q.job.cached_on(self.worker))
                for q in window
            ]
            slack = [
                self.ttft_slo_s - (now - q.job.arrived_at) - c for q, c in zip(window, cost, strict=True)
            ]
            feasible = [i for i in range(len(window)) if slack[i] >= 0]
            if feasible:
                pick = min(feasible, key=lambda i: (slack[i], i))
            else:
                pick = min(range(len(window)), key=lambda i: (cost[i], i))
        for q in window[:pick]:
            q.deferrals += 1
        return self._jobs.pop(pick).job
