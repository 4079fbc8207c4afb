"""The fleet simulator and the capacity planner: a discrete-event model of a fleet that runs the live
cluster's policy objects and the one `PerfModel`, and reports with the bench's metric code.

`workload` turns the bench's sessions into simulated rounds, `events` is the clock, `engine_model`
one replica, `fleet` the gateway and the replicas together. Nothing in `cluster` or `bench` imports
this package.
"""

from tokenops.sim.engine_model import EngineShape, ReplicaEngine, SimRequest
from tokenops.sim.fleet import Fleet, FleetConfig, SimResult
from tokenops.sim.workload import SimRound, SimSession, sim_sessions

__all__ = [
    "EngineShape",
    "Fleet",
    "FleetConfig",
    "ReplicaEngine",
    "SimRequest",
    "SimResult",
    "SimRound",
    "SimSession",
    "sim_sessions",
]
