"""Soft alerts, fired once per (node, kind, level, period) — the database decides which settle fires
it (`ledger.record_alert`), so replicas and restarts never repeat one:

- budget: a node's spent crosses one of its thresholds (e.g. 50%, 80%, 100% of the budget);
- spend rate: a node's spend in the current minute is above a multiple of its average over the
  minutes before (the runaway-agent signal, before the session breaker or the budget stops it),
  at most once per node per clock hour.

Each goes out as a WARNING log line and, to every configured webhook, a POST with a Slack-compatible
body (`text` and `blocks`, plus the alert's fields under `alert`), sent in the background: a slow or
failing webhook never delays or fails a request. The spend-rate window is kept in process, so each
gateway replica judges the spend it settled itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("tokenops.ops.alerts")


@dataclass
class BudgetAlert:
    node_path: str
    period: str
    spent_micros: int
    budget_micros: int  # spend-rate: the rate that was crossed, micro-units per minute
    threshold: float  # budget: the fraction crossed; spend-rate: the multiple of the recent average
    kind: str = "budget_threshold"  # or "spend_rate"

    @property
    def message(self) -> str:
        if self.kind == "spend_rate":
            return (
                f"spend-rate alert: '{self.node_path}' spent {self.spent_micros} micro-units in the last "
                f"minute, above {self.threshold:g}x its recent average (limit {self.budget_micros}/min), "
                f"hour {self.period}"
            )
        pct = 100.0 * self.spent_micros / self.budget_micros if self.budget_micros else 100.0
        return (
            f"budget alert: '{self.node_path}' has spent {self.spent_micros} of {self.budget_micros} "
            "micro-units "
            f"({pct:.1f}%, threshold {self.threshold:.0%}) in period {self.period}"
        )

    def slack_payload(self) -> dict[str, Any]:
        """What a Slack incoming webhook (or a compatible one: Mattermost, Teams' Slack connector)
        shows; other receivers read the fields under `alert`."""
        title = "Spend rate" if self.kind == "spend_rate" else f"Budget {self.threshold:.0%}"
        return {
            "text": self.message,
            "blocks": [
                {"type": "header", "text": {"type": "plain_text", "text": f"{title}: {self.node_path}"}},
                {"type": "section", "text": {"type": "mrkdwn", "text": self.message}},
                {
                    "type": "context",
                    "elements": [
                        {"type": "mrkdwn", "text": f"kind `{self.kind}` · node `{self.node_path}`"},
                        {"type": "mrkdwn", "text": f"period `{self.period}`"},
                    ],
                },
            ],
            "alert": {**asdict(self), "message": self.message},
        }


@dataclass(frozen=True, slots=True)
class SpendRateRule:
    multiple: float  # fire when the last minute's spend is above this times the recent average
    window_minutes: int = 10  # the average is over the minutes before the current one
    min_micros: int = 1  # and the minute's spend is at least this (a quiet node's noise is no alarm)


class SpendRates:
    """Per node: spend per clock minute over the last `window_minutes + 1` minutes."""

    def __init__(self, rule: SpendRateRule, clock: Callable[[], float] = time.time) -> None:
        self.rule = rule
        self.clock = clock
        self._minutes: dict[int, deque[list[int]]] = {}  # node id -> [minute, micros] oldest first
        self._first_seen: dict[int, int] = {}

    def add(self, node_id: int, micros: int) -> tuple[int, int] | None:
        """Count `micros` spent now; returns (this minute's spend, the rate it crossed) when the
        node's spend rate is above the rule, else None. A node needs a whole window of history first."""
        minute = int(self.clock() // 60)
        w = self.rule.window_minutes
        buckets = self._minutes.setdefault(node_id, deque())
        self._first_seen.setdefault(node_id, minute)
        if buckets and buckets[-1][0] == minute:
            buckets[-1][1] += micros
        else:
            buckets.append([minute, micros])
        while buckets and buckets[0][0] < minute - w:
            buckets.popleft()
        if minute - self._first_seen[node_id] < w:
            return None
        now_spend = buckets[-1][1]
        average = sum(m for t, m in buckets if t < minute) / w
        limit = max(self.rule.min_micros, math.ceil(self.rule.multiple * average))
        return (now_spend, limit) if now_spend > limit else None


class AlertSink:
    def __init__(self, webhooks: list[str] | tuple[str, ...] = (), timeout_s: float = 5.0) -> None:
        self.webhooks = [u for u in dict.fromkeys(webhooks) if u]
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task] = set()
        self.sent: list[BudgetAlert] = []  # what fired in this process, newest last (for the admin API)

    def fire(self, alert: BudgetAlert) -> None:
        log.warning(alert.message)
        self.sent.append(alert)
        del self.sent[:-100]
        for url in self.webhooks:
            task = asyncio.get_running_loop().create_task(self._post(url, alert))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _post(self, url: str, alert: BudgetAlert) -> None:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                r = await client.post(url, json=alert.slack_payload())
                r.raise_for_status()
        except Exception as exc:  # a webhook is best effort: log and carry on
            # the host only: a Slack webhook's path is its secret, and httpx's messages quote the URL
            why = (
                f"HTTP {exc.response.status_code}"
                if isinstance(exc, httpx.HTTPStatusError)
                else type(exc).__name__
            )
            log.error("alert webhook to %s failed: %s", httpx.URL(url).host, why)

    async def drain(self) -> None:
        """Wait for webhook posts in flight (at shutdown and in tests)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
