"""The ops state a route's plan may bow to: a tenant near its budget, or a request in a low priority
class, goes to the cheap model whatever the router scored (when the route is configured to allow it).
The reason it names goes into the plan, so the response header and the ledger row say why."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OpsRule:
    budget_used_at_least: float | None = None  # fraction of the tightest budget on the key's path
    priority_at_least: int | None = None  # this class or a lower one (a higher number)

    def cheap_because(self, budget_left: float | None, priority: int | None) -> str | None:
        """Why this request goes cheap, or None when the router decides. `budget_left` is the
        admission's fraction of the tightest budget neither spent nor reserved (None: no budget)."""
        if self.budget_used_at_least is not None and budget_left is not None:
            used = 1.0 - budget_left
            if used >= self.budget_used_at_least:
                return f"ops budget {used:.0%} used >= {self.budget_used_at_least:.0%}"
        if self.priority_at_least is not None and priority is not None and priority >= self.priority_at_least:
            return f"ops priority class {priority} >= {self.priority_at_least}"
        return None


__all__ = ["OpsRule"]
