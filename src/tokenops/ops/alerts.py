"""Soft budget alerts: when a node's spent crosses its alert threshold (e.g. 80% of the budget) the
alert fires once per (node, period) — the database decides which settle fires it
(`ledger.record_alert`) — as a WARNING log line and, when a webhook URL is configured, a JSON POST
sent in the background (a slow or failing webhook never delays or fails a request)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass

log = logging.getLogger("tokenops.ops.alerts")


@dataclass
class BudgetAlert:
    node_path: str
    period: str
    spent_micros: int
    budget_micros: int
    threshold: float
    kind: str = "budget_threshold"

    @property
    def message(self) -> str:
        pct = 100.0 * self.spent_micros / self.budget_micros if self.budget_micros else 100.0
        return (
            f"budget alert: '{self.node_path}' has spent {self.spent_micros} of {self.budget_micros} "
            "micro-units "
            f"({pct:.1f}%, threshold {self.threshold:.0%}) in period {self.period}"
        )


class AlertSink:
    def __init__(self, webhook_url: str | None = None, timeout_s: float = 5.0) -> None:
        self.webhook_url = webhook_url
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task] = set()
        self.sent: list[BudgetAlert] = []  # what fired in this process, newest last (for the admin API)

    def fire(self, alert: BudgetAlert) -> None:
        log.warning(alert.message)
        self.sent.append(alert)
        del self.sent[:-100]
        if self.webhook_url:
            task = asyncio.get_running_loop().create_task(self._post(alert))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _post(self, alert: BudgetAlert) -> None:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                r = await client.post(self.webhook_url, json={**asdict(alert), "message": alert.message})
                r.raise_for_status()
        except Exception as exc:  # a webhook is best effort: log and carry on
            log.error("budget alert webhook failed: %s", exc)

    async def drain(self) -> None:
        """Wait for webhook posts in flight (at shutdown and in tests)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
