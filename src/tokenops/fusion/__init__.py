"""Multi-model fusion (layer 1): which model(s) answer a request.

Capability profiles from seeded task suites (suites.py, profiles.py), routers that score a request
(routers.py), a threshold calibrated to a target strong-model share (calibration.py), the planner the
gateway calls (plan.py: `FusionPlanner.plan(request, admission) -> Plan`), cascades (cascade.py),
ensembles (ensemble.py) and router evaluation (evaluate.py, router_eval.py). The package imports
nothing heavy at import time; the embedder is built on first use.
"""

from tokenops.fusion.calibration import ShareCalibrator
from tokenops.fusion.plan import FusionPlanner, Plan, RouteConfig

__all__ = ["FusionPlanner", "Plan", "RouteConfig", "ShareCalibrator"]
