"""Plans: which real model(s) answer a request, and why.

This module owns `Plan` (the typed answer of `fusion.plan(request, admission)`), `RouteConfig` (a
virtual model such as `auto`: a cheap and a strong model, a router, a target strong share, and a
strategy: route, cascade or ensemble, the worst-case price it is admitted at, and for a
reasoning-capable route how hard its model thinks) and `FusionPlanner`, which scores a request with
the route's router and decides with the route's calibrator (and the effort policy, from the same
score). A request
that names a real model gets a one-model plan with reason "direct". It does not send requests
(executor.py runs a plan through a port) and reads no configuration file: the caller builds the
routes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from tokenops.fusion.calibration import ShareCalibrator
from tokenops.fusion.effort import EffortDecision, EffortPolicy
from tokenops.fusion.ops_rule import OpsRule
from tokenops.fusion.outcomes import OutcomeLearning, OutcomeRecorder, cascade_outcomes
from tokenops.fusion.routers import RouteFeatures, Router, features_from_body
from tokenops.fusion.strategies import CascadePolicy, EnsemblePolicy, PriceOf, WorstCasePrice

Strategy = Literal["single", "cascade", "ensemble"]


@dataclass(frozen=True, slots=True)
class Plan:
    """The model(s) that answer one request. `models[0]` answers a single plan; a cascade tries them
    in order; an ensemble asks them all. `reason` goes into the ledger row and a response header."""

    models: tuple[str, ...]
    reason: str
    strategy: Strategy = "single"
    route: str | None = None  # the virtual model asked for, if any
    router: str | None = None
    score: float | None = None
    threshold: float | None = None
    effort: EffortDecision | None = None  # a reasoning-capable route's thinking level

    @property
    def model(self) -> str:
        return self.models[0]

    @property
    def body_fields(self) -> dict[str, Any]:
        """Fields every upstream call of this plan carries (the reasoning level)."""
        return dict(self.effort.fields) if self.effort is not None else {}

    def header(self) -> str:
        """The `x-tokenops-route` header value: `route=auto; model=m; reason=...`. A multi-model plan
        names its strategy instead of the models: the gateway appends each model it tried."""
        parts = [f"route={self.route}"] if self.route else []
        if self.strategy == "single":
            parts.append(f"model={self.model}")
        else:
            parts.append(f"strategy={self.strategy}")
        parts.append(f"reason={self.reason}")
        if self.effort is not None:
            parts.append(self.effort.header())
        return "; ".join(parts)


@dataclass(slots=True)
class RouteConfig:
    """A virtual model."""

    name: str
    cheap: str
    strong: str
    router: Router
    target_strong_share: float = 0.3
    strategy: Strategy = "single"  # "cascade": cheap first, strong on escalation; "ensemble": all at once
    calibrator: ShareCalibrator | None = None
    task_header: str = "x-tokenops-task"
    cascade: CascadePolicy | None = None  # default: cheap then strong; only an empty answer escalates
    ensemble: EnsemblePolicy | None = None  # default: cheap and strong, majority vote
    effort: EffortPolicy | None = None  # a reasoning-capable route: off / low / high from the score
    learning: OutcomeLearning | None = None  # a cascade whose verdicts are kept as router labels
    ops: OpsRule | None = None  # near its budget or in a low class: cheap whatever the router says

    def __post_init__(self) -> None:
        if self.calibrator is None:
            self.calibrator = ShareCalibrator(self.target_strong_share)
        if self.strategy == "cascade" and self.cascade is None:
            self.cascade = CascadePolicy((self.cheap, self.strong))
        if self.strategy == "ensemble" and self.ensemble is None:
            self.ensemble = EnsemblePolicy((self.cheap, self.strong))

    @property
    def policy(self) -> CascadePolicy | EnsemblePolicy | None:
        """What the executor runs a multi-model plan of this route by (None: one model)."""
        if self.strategy == "cascade":
            return self.cascade
        return self.ensemble if self.strategy == "ensemble" else None

    def worst_case(self, price_of: PriceOf) -> WorstCasePrice | None:
        """The price a cascade or ensemble is admitted at: the worst case over every step, each at
        its model's price. None for a single-model route (admitted at its strong model's price)."""
        if self.strategy == "cascade":
            assert self.cascade is not None
            return self.cascade.worst_case(price_of, self.strong)
        if self.strategy == "ensemble":
            assert self.ensemble is not None
            return self.ensemble.worst_case(price_of)
        return None


class RequestLike(Protocol):
    """What the planner reads of a request: the gateway's `InboundRequest` has these."""

    kind: str
    body: dict[str, Any]
    model: str


@dataclass(slots=True)
class FusionPlanner:
    routes: dict[str, RouteConfig] = field(default_factory=dict)
    recorder: OutcomeRecorder | None = None  # where learning routes' cascade outcomes go

    def learn(self, plan: Plan, verdicts: list[Any], tenant: str | None, question: str) -> None:
        """Keep a cascade's verdicts on its cheap model as labels, if the route learns and the
        tenant opted in (written off the request path)."""
        route = self.routes.get(plan.route or "")
        if self.recorder is None or route is None or route.learning is None or not verdicts:
            return
        self.recorder.submit(
            cascade_outcomes(route.name, route.cheap, verdicts, tenant, question, route.learning)
        )

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()

    def is_virtual(self, model: str) -> bool:
        return model in self.routes

    def reservation_model(self, model: str) -> str:
        """The real model to admit (reserve budget) against: a route's strong model, the dearer of the two."""
        route = self.routes.get(model)
        return route.strong if route else model

    def plan(self, request: RequestLike, admission: Any = None, *, task: str | None = None) -> Plan:
        route = self.routes.get(request.model)
        if route is None:
            return Plan((request.model,), "direct")
        principal = getattr(admission, "principal", None)
        tenant = getattr(principal, "tenant", None)
        if route.ops is not None and route.strategy != "ensemble":
            why = route.ops.cheap_because(
                getattr(admission, "budget_left", None), getattr(admission, "priority", None)
            )
            if why is not None:
                return self.plan_cheap(route, why)
        features = features_from_body(request.kind, request.body, tenant=tenant, task=task)
        return self.plan_features(route, features, client_effort=request.body.get("reasoning_effort"))

    def plan_cheap(self, route: RouteConfig, reason: str) -> Plan:
        """The ops state overrules the router: a route's cheap model, a cascade from its cheap tier."""
        if route.strategy == "cascade":
            assert route.cascade is not None
            return Plan(route.cascade.tiers(None), reason + ", cheap first", "cascade", route=route.name)
        return Plan((route.cheap,), reason, route=route.name)

    def plan_features(self, route: RouteConfig, features: RouteFeatures, client_effort: Any = None) -> Plan:
        score = float(route.router.score([features])[0])
        assert route.calibrator is not None
        d = route.calibrator.decide(score)
        effort = route.effort.decide(score, features.tenant, client_effort) if route.effort else None
        common = {
            "route": route.name,
            "router": route.router.name,
            "score": score,
            "threshold": d.threshold,
            "effort": effort,
        }
        if route.strategy == "cascade":
            assert route.cascade is not None
            reason = f"{route.router.name} score {score:.2f} vs {d.threshold:.2f}"
            # the router may skip the cheap tiers: a request it scores hard starts at the strong model
            models = route.cascade.tiers(route.strong if d.strong else None)
            return Plan(
                models, reason + (", strong first" if d.strong else ", cheap first"), "cascade", **common
            )
        if route.strategy == "ensemble":
            assert route.ensemble is not None
            return Plan(route.ensemble.models, f"ensemble ({route.ensemble.aggregate})", "ensemble", **common)
        if d.strong:
            return Plan(
                (route.strong,), f"{route.router.name} score {score:.2f} > {d.threshold:.2f}", **common
            )
        return Plan((route.cheap,), f"{route.router.name} score {score:.2f} <= {d.threshold:.2f}", **common)
