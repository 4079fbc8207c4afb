"""Where a request runs in a fleet: replica pools, load signals, balancing policies, health, circuit
breakers, adaptive concurrency, retries before the first byte, fallback and degradation.

The gateway's entry point is `Cluster.open(DispatchRequest(...))` (see docs/cluster.md); policies are
plain objects over snapshots (`policies.py`, `snapshot.py`, `pd.py`) with no I/O, so the fleet
simulator (`tokenops.sim`) calls the same objects as the live pools.
"""

from tokenops.cluster.config import ClusterConfig, build_cluster
from tokenops.cluster.degrade import DEGRADE_HEADER, DegradeDecision, DegradeInput, DegradePolicy, DegradeRule
from tokenops.cluster.dispatch import Attempt, Cluster, DispatchRequest, RetryConfig, Upstream, UpstreamBroken
from tokenops.cluster.policies import (
    Decision,
    KVAwareCost,
    LeastOutstanding,
    Policy,
    PowerOfTwo,
    PrefixAware,
    RoundRobin,
    SessionAffinity,
    make_policy,
)
from tokenops.cluster.pool import Lease, PoolOverloaded, PoolUnavailable, ReplicaPool, ReplicaSpec
from tokenops.cluster.prefix_index import PrefixIndex, block_hashes_from_text, block_hashes_from_tokens
from tokenops.cluster.prompt_tokenizer import PromptTokenizer
from tokenops.cluster.snapshot import PoolSnapshot, ReplicaState, ReportedLoad, RequestInfo
from tokenops.cluster.supervisor import ProcessSpec, Supervisor, engine_specs

__all__ = [
    "DEGRADE_HEADER",
    "Attempt",
    "Cluster",
    "ClusterConfig",
    "Decision",
    "DegradeDecision",
    "DispatchRequest",
    "DegradeInput",
    "DegradePolicy",
    "DegradeRule",
    "KVAwareCost",
    "Lease",
    "LeastOutstanding",
    "Policy",
    "PoolOverloaded",
    "PoolSnapshot",
    "PoolUnavailable",
    "PowerOfTwo",
    "PrefixAware",
    "PrefixIndex",
    "ProcessSpec",
    "PromptTokenizer",
    "ReplicaPool",
    "ReplicaSpec",
    "ReplicaState",
    "ReportedLoad",
    "RequestInfo",
    "RetryConfig",
    "RoundRobin",
    "SessionAffinity",
    "Supervisor",
    "Upstream",
    "UpstreamBroken",
    "block_hashes_from_text",
    "block_hashes_from_tokens",
    "build_cluster",
    "engine_specs",
    "make_policy",
]
