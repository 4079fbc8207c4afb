"""Multi-model fusion (layer 1): which model(s) answer a request.

Capability profiles from seeded task suites (suites.py, profiles.py), routers that score a request
(routers.py), a threshold calibrated to a target strong-model share (calibration.py), the planner the
gateway calls (plan.py: `FusionPlanner.plan(request, admission) -> Plan`), the policies of cascades
and ensembles (strategies.py), the one executor of every plan (executor.py, through a port: the
gateway's over the cluster, or sdk_port.py's over the openai SDK) and router evaluation (evaluate.py,
router_eval.py). The package imports
nothing at import time (the `tokenops` command imports `fusion.cli` and must start fast): the names
below load their modules on first use, and the embedder is built on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenops.fusion.calibration import ShareCalibrator
    from tokenops.fusion.plan import FusionPlanner, Plan, RouteConfig

__all__ = ["FusionPlanner", "Plan", "RouteConfig", "ShareCalibrator"]


def __getattr__(name: str) -> Any:
    if name == "ShareCalibrator":
        from tokenops.fusion.calibration import ShareCalibrator

        return ShareCalibrator
    if name in ("FusionPlanner", "Plan", "RouteConfig"):
        from tokenops.fusion import plan

        return getattr(plan, name)
    raise AttributeError(f"module 'tokenops.fusion' has no attribute {name!r}")
