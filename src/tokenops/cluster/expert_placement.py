"""Expert placement: replicate hot experts and pack the replicas onto expert servers, from measured
per-expert loads (`models.moe.expert_load`, served at `/v1/load`), so the slowest server is not
the bottleneck.

The policy follows DeepSeek's EPLB (github.com/deepseek-ai/EPLB, its global policy):
replication gives each extra slot, one at a time, to the expert with the highest load per replica;
packing places the replicas, heaviest first (an expert's load split evenly over its replicas),
each on the least-loaded server that still has a free slot and no replica of that expert. Like
greedy longest-processing-time scheduling it keeps the busiest server within one replica's load
of the mean whenever the distinct-replica constraint does not bind (`Placement.bound`). A plain
function over a list of loads: the live client, the CLI and the simulator call the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    servers: tuple[tuple[int, ...], ...]  # per server: the experts it holds, ascending
    replicas: tuple[int, ...]  # per expert: how many servers hold it
    server_load: tuple[float, ...]  # per server: the load it is expected to carry

    @property
    def imbalance(self) -> float:
        """Busiest server's load over the mean (1.0 is perfect balance)."""
        mean = sum(self.server_load) / len(self.server_load)
        return max(self.server_load) / mean if mean else 1.0

    def bound(self, load: Sequence[float]) -> float:
        """The guarantee: mean server load plus the heaviest replica's share."""
        mean = sum(self.server_load) / len(self.server_load)
        return mean + max(w / r for w, r in zip(load, self.replicas, strict=True))

    def expert_spec(self, server: int, layer: int | None = None) -> str:
        """`tokenops expert-server --experts` for one server ('1,4,7', or '0:1,4,7' for a layer)."""
        ids = ",".join(str(e) for e in self.servers[server])
        return ids if layer is None else f"{layer}:{ids}"


def replicate(load: Sequence[float], num_slots: int, max_replicas: int, min_replicas: int = 1) -> list[int]:
    """Replica counts (each >= `min_replicas`, sum == num_slots): every extra slot to the expert
    with the most load per replica (EPLB's replicate_experts), none past `max_replicas`."""
    if num_slots < len(load) * min_replicas:
        raise ValueError(f"{num_slots} slots cannot hold {len(load)} experts {min_replicas} times each")
    counts = [min_replicas] * len(load)
    for _ in range(num_slots - len(load) * min_replicas):
        candidates = [e for e in range(len(load)) if counts[e] < max_replicas]
        if not candidates:
            break
        hot = max(candidates, key=lambda e: (load[e] / counts[e], -e))
        counts[hot] += 1
    return counts


def place_experts(
    load: Sequence[float], num_servers: int, slots_per_server: int, min_replicas: int = 1
) -> Placement:
    """Replicate and pack `load` (per expert, e.g. tokens routed) onto `num_servers` servers of
    `slots_per_server` experts each; every expert lands on at least `min_replicas` servers (where
    there are that many servers), the hot ones on more."""
    if num_servers < 1 or slots_per_server < 1:
        raise ValueError("need at least one server with one slot")
    if any(w < 0 for w in load):
        raise ValueError("expert loads must be non-negative")
    floor = min(min_replicas, num_servers)
    counts = replicate(load, num_servers * slots_per_server, max_replicas=num_servers, min_replicas=floor)
    items = sorted(
        ((load[e] / counts[e], e) for e in range(len(load)) for _ in range(counts[e])),
        key=lambda it: (-it[0], it[1]),
    )
    held: list[list[int]] = [[] for _ in range(num_servers)]
    totals = [0.0] * num_servers
    for share, e in items:
        open_servers = [s for s in range(num_servers) if len(held[s]) < slots_per_server and e not in held[s]]
        if not open_servers:
            # only when counts exhaust the distinct-server constraint: drop this extra replica
            counts[e] -= 1
            continue
        s = min(open_servers, key=lambda s: (totals[s], len(held[s]), s))
        held[s].append(e)
        totals[s] += share
    # a dropped replica shifted its share onto the others of its expert: recount the loads
    totals = [sum(load[e] / counts[e] for e in h) for h in held]
    return Placement(tuple(tuple(sorted(h)) for h in held), tuple(counts), tuple(totals))
