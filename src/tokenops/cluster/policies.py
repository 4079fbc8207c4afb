"""Balancing policies: plain objects that take a request and a pool snapshot and return a decision.

Every policy has one method, `choose(request, pool) -> Decision`, does no I/O, and reads only the
snapshot and its own small state (a round-robin cursor, a hash ring, a prefix index), so the fleet
simulator runs the very objects the live pool runs. The pool guarantees `pool.replicas` is non-empty and
already excludes replicas whose breaker is open or that failed this request. This module does not
collect load, enforce concurrency or retry: see `pool.py`.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenops.cluster.prefix_index import KVEventApplier, PrefixIndex
from tokenops.cluster.snapshot import PoolSnapshot, ReplicaState, RequestInfo


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str
    reason: str  # short, for logs and the picks metric: "prefix-hit 12/14", "least-loaded", ...
    matched_blocks: int = 0


class Policy(Protocol):
    name: str

    def choose(self, request: RequestInfo, pool: PoolSnapshot) -> Decision: ...


def _encode(*parts: object) -> bytes:
    return "\x1f".join(map(str, parts)).encode()


def _h64(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(_encode(*parts), digest_size=8).digest(), "little")


def _rendezvous(key: object, candidates: Sequence[ReplicaState]) -> ReplicaState:
    """The candidate with the lowest `_h64(key, id)` (the first of equals): the key's part of the
    encoding is hashed once, and each candidate's id continues a copy of that hash."""
    keyed = hashlib.blake2b(_encode(key, ""), digest_size=8)
    from_bytes = int.from_bytes
    best, best_h = candidates[0], None
    for r in candidates:
        h = keyed.copy()
        h.update(r.id.encode())
        v = from_bytes(h.digest(), "little")
        if best_h is None or v < best_h:
            best, best_h = r, v
    return best


def _miss_key(request: RequestInfo, matched_blocks: int) -> object:
    """Tie-break key for a request the caches do not (fully) hold: the first block no replica holds.
    Prompts that differ only after a shared template header spread over the pool; conversations that
    share a system prompt nobody holds yet converge on one replica. Without blocks: the session."""
    hashes = request.block_hashes
    return hashes[min(matched_blocks, len(hashes) - 1)] if hashes else request.session_id


def _loads(pool: PoolSnapshot, replicas: Sequence[ReplicaState]) -> list[tuple[float, float]]:
    """(load, raw load) of each replica, read once per decision rather than once per use."""
    return pool.loads(replicas)


def _available(pool: PoolSnapshot) -> tuple[list[ReplicaState], list[tuple[float, float]]]:
    """The replicas not saturated (all of them when every one is) and their `_loads`, in one pass."""
    loads = pool.loads(pool.replicas)
    if max(loads)[0] != math.inf:  # the common case, without a pass in Python
        return list(pool.replicas), loads
    picked = [i for i, (load, _) in enumerate(loads) if load != math.inf]
    if not picked or len(picked) == len(loads):
        return list(pool.replicas), loads
    return [pool.replicas[i] for i in picked], [loads[i] for i in picked]


def _least_loaded(
    pool: PoolSnapshot,
    candidates: Sequence[ReplicaState],
    key: object,
    loads: Sequence[tuple[float, float]] | None = None,
) -> ReplicaState:
    """Lowest load; ties broken by rendezvous hash of `key`, so equal-load choices for different keys
    spread over the pool instead of all landing on the first replica. `loads`: `_loads(candidates)`."""
    # hash only the replicas tied at the lowest load: the same choice, without a digest per replica
    if loads is None:
        loads = _loads(pool, candidates)
    best = min(loads)
    if loads.count(best) == 1:
        return candidates[loads.index(best)]
    return _rendezvous(key, [r for r, load in zip(candidates, loads, strict=True) if load == best])


# ---------------------------------------------------------------------------------------------


class RoundRobin:
    """Smooth weighted round robin (nginx's): each replica gets its weight's share, interleaved."""

    name = "round_robin"

    def __init__(self) -> None:
        self._current: dict[str, float] = {}

    def choose(self, request: RequestInfo, pool: PoolSnapshot) -> Decision:
        candidates, _ = _available(pool)
        current = self._current
        total = 0.0
        best, best_current = candidates[0], -math.inf
        for r in candidates:  # the first of the highest current weights wins
            total += r.weight
            c = current[r.id] = current.get(r.id, 0.0) + r.weight
            if c > best_current:
                best, best_current = r, c
        current[best.id] -= total
        return Decision(best.id, "round-robin")


class LeastOutstanding:
    """Fewest outstanding requests per unit weight; saturated (stale, full) replicas last."""

    name = "least_outstanding"

    def __init__(self) -> None:
        self._tick = 0

    def choose(self, request: RequestInfo, pool: PoolSnapshot) -> Decision:
        # ties rotate: hashing the prompt would send every request that starts with the same
        # template to one replica whenever the pool is idle
        self._tick += 1
        return Decision(_least_loaded(pool, pool.replicas, self._tick).id, "least-outstanding")


class PowerOfTwo:
    """Sample two replicas (by weight), take the less loaded: near least-loaded quality with no herd
    effect when many gateways share stale load data."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RequestInfo, pool: PoolSnapshot) -> Decision:
        reps = [r for r in pool.replicas if not pool.is_saturated(r)] or list(pool.replicas)
        if len(reps) == 1:
            return Decision(reps[0].id, "only-replica")
        a = self._rng.choices(reps, weights=[r.weight for r in reps])[0]
        rest = [r for r in reps if r.id != a.id]
        b = self._rng.choices(rest, weights=[r.weight for r in rest])[0]
        load_a, load_b = (pool.replica_load(a), pool.raw_load(a)), (pool.replica_load(b), pool.raw_load(b))
        best = a if load_a <= load_b else b
        return Decision(best.id, "power-of-two")


class SessionAffinity:
    """Consistent hashing on the session id with bounded load (Mirrokni, Thorup, Zadimoghaddam 2018).

    A session maps to a point on a ring of virtual nodes (`vnodes` per unit weight) and goes to the first
    replica clockwise whose load stays within `(1 + epsilon)` times its weighted share of the pool's
    load; a replica over its share passes the session on, and the session returns home once loads fall
    back within bounds. Requests without a session go to `fallback`.
    """

    name = "session_affinity"

    def __init__(self, epsilon: float = 0.25, vnodes: int = 64, fallback: Policy | None = None) -> None:
        if epsilon <= 0:
            raise ValueError("epsilon must be > 0")
        self.epsilon = epsilon
        self.vnodes = vnodes
        self.fallback = fallback or LeastOutstanding()
        self._ring_key: tuple[tuple[str, float], ...] = ()
        self._seen: tuple[tuple[str, float], ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, pool: PoolSnapshot) -> None:
        # weights quantised to 0.1: a slow-start ramp rebuilds the ring ~10 times, not per request
        seen = tuple((r.id, r.weight) for r in pool.replicas)
        if seen == self._seen:
            return  # the same replicas and weights as last time: no need to sort and round them
        self._seen = seen
        key = tuple(sorted((rid, max(0.1, round(w, 1))) for rid, w in seen))
        if key == self._ring_key:
            return
        pts = sorted((_h64(rid, i), rid) for rid, w in key for i in range(max(1, round(self.vnodes * w))))
        self._ring_key, self._points, self._owners = key, [p for p, _ in pts], [o for _, o in pts]

    def choose(self, request: RequestInfo, pool: PoolSnapshot) -> Decision:
        if not request.session_id:
            d = self.fallback.choose(request, pool)
            return Decision(d.replica, f"no-session {d.reason}", d.matched_blocks)
        self._ring(pool)
        total_w = sum(r.weight for r in pool.replicas)
        # load in requests (not per weight); +1 counts the request being placed
        reps = pool.replicas
        loads = {r.id: load * r.weight for r, (load, _) in zip(reps, pool.loads(reps), strict=True)}
        finite = sum(v for v in loads.values() if math.isfinite(v)) + 1
        start = bisect.bisect(self._points, _h64(request.session_id))
        seen: set[str] = set()
        for i in range(len(self._points)):
            rid = self._owners[(start + i) % len(self._points)]
            if rid in seen:
                continue
            seen.add(rid)
            cap = math.ceil((1 + self.epsilon) * finite * pool.by_id[rid].weight / total_w)
            if loads[rid] + 1 <= cap:
                return Decision(rid, "session-home" if len(seen) == 1 else "session-spill")
        return Decision(_least_loaded(pool, pool.replicas, request.session_id).id, "session-all-full")


class PrefixAware:
    """Longest cached prefix wins, unless the pool is imbalanced; misses go to the least loaded.

    The pool counts as imbalanced when `max_load - min_load > balance_abs` and
    `max_load > balance_rel * min_load` (loads in outstanding requests per weight, as SGLang's
    cache-aware router does); then the least-loaded replica wins whatever it caches. A match shorter than
    `min_match_blocks`, or than `min_match_ratio` of the prompt's blocks (SGLang's `cache_threshold`;
    a generic template header shared by every prompt is not locality worth queueing for), is a miss.
    With `learn=True` (the default) every decision inserts the prompt's blocks for the chosen replica
    (approximate index); with our engine's KV events, set `learn=False` and feed `kv_events(replica)`
    instead (exact index).
    """

    name = "prefix_aware"

    def __init__(
        self,
        max_entries: int = 200_000,
        balance_abs: float = 8.0,
        balance_rel: float = 1.5,
        min_match_blocks: int = 1,
        min_match_ratio: float = 0.5,
        learn: bool = True,
        index: PrefixIndex | None = None,
    ) -> None:
        self.index = index or PrefixIndex(max_entries)
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.min_match_blocks = min_match_blocks
        self.min_match_ratio = min_match_ratio
        self.learn = learn

    def kv_events(self, replica: str) -> KVEventApplier:
        return KVEventApplier(self.index, replica)

    def imbalanced(self, pool: PoolSnapshot, candidates: Sequence[ReplicaState]) -> bool:
        return self._imbalanced([pool.replica_load(r) for r in candidates])

    def _imbalanced(self, loads: Sequence[float]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def choose(self, request: RequestInfo, pool: PoolSnapshot) -> Decision:
        candidates, loads = _available(pool)
        hashes = request.block_hashes
        matched = self.index.match(hashes, (r.id for r in candidates))
        best_len = max(matched.values(), default=0)
        key = _miss_key(request, best_len)
        hit = best_len >= self.min_match_blocks and best_len >= self.min_match_ratio * len(hashes)
        # the highest and lowest loads: the first items of the largest and smallest (load, raw) pairs
        if len(candidates) > 1 and self._imbalanced((max(loads)[0], min(loads)[0])):
            chosen, reason = _least_loaded(pool, candidates, key, loads), "imbalanced least-loaded"
        elif hit:
            held = [i for i, r in enumerate(candidates) if matched.get(r.id) == best_len]
            chosen = _least_loaded(pool, [candidates[i] for i in held], key, [loads[i] for i in held])
            reason = f"prefix-hit {best_len}/{len(hashes)}"
        else:
            chosen, reason = _least_loaded(pool, candidates, key, loads), "prefix-miss least-loaded"
        if self.learn:
            self.index.insert(hashes, chosen.id)
        return Decision(chosen.id, reason, matched.get(chosen.id, 0))


class KVAwareCost:
    """Lowest estimated cost wins: the prompt tokens this replica would have to prefill (those not in
    its cache) plus the work already queued on it.

        cost = (prompt_tokens - cached_blocks * block_tokens)
               + backlog_weight * (in_flight_prompt_tokens + decode_weight * in_flight_output_tokens) / weight

    Requests reported by the replica beyond the gateway's own in-flight count (other gateways) are
    costed at this gateway's average request size. The prefix index is shared with `PrefixAware`'s
    semantics: approximate from decisions, or exact from KV events with `learn=False`.
    """

    name = "kv_aware"

    def __init__(
        self,
        max_entries: int = 200_000,
        backlog_weight: float = 1.0,
        decode_weight: float = 0.5,
        learn: bool = True,
        index: PrefixIndex | None = None,
    ) -> None:
        self.index = index or PrefixIndex(max_entries)
        self.backlog_weight = backlog_weight
        self.decode_weight = decode_weight
        self.learn = learn

    def kv_events(self, replica: str) -> KVEventApplier:
        return KVEventApplier(self.index, replica)

    def cost(self, request: RequestInfo, pool: PoolSnapshot, r: ReplicaState, matched_blocks: int) -> float:
        return self._costs(request, (r,), pool.loads((r,)), {r.id: matched_blocks})[0][0]

    def _costs(
        self,
        request: RequestInfo,
        replicas: Sequence[ReplicaState],
        loads: Sequence[tuple[float, float]],
        matched: dict[str, int],
    ) -> list[tuple[float, float]]:
        """(cost, raw load) of each replica, given their `pool.loads` and matched blocks; a saturated
        replica costs infinity. One pass with the request's own terms worked out once."""
        prompt, block = request.prompt_tokens, request.block_tokens
        decode_weight, backlog_weight = self.decode_weight, self.backlog_weight
        fresh = prompt + decode_weight * request.max_tokens  # a request's size with nothing in flight
        get = matched.get
        inf = math.inf
        out = []
        for r, (load, raw) in zip(replicas, loads, strict=True):
            if load == inf:
                out.append((inf, raw))
                continue
            uncached = prompt - get(r.id, 0) * block if matched else prompt
            if uncached < 0:
                uncached = 0
            backlog = r.in_flight_prompt_tokens + decode_weight * r.in_flight_output_tokens
            reported = r.reported
            if reported is not None:
                n = r.in_flight
                others = reported.running + reported.waiting - n
                if others > 0:
                    backlog += others * (backlog / n if n else fresh)
            out.append((uncached + backlog_weight * backlog / r.weight, raw))
        return out

    def choose(self, request: RequestInfo, pool: PoolSnapshot) -> Decision:
        replicas = pool.replicas
        matched = self.index.match(request.block_hashes, (r.id for r in replicas))
        # lowest (cost, raw load), ties broken by rendezvous hash of the miss key: the hash is taken
        # only over the tied replicas, the same choice as hashing every one
        keys = self._costs(request, replicas, pool.loads(replicas), matched)
        best = min(keys)
        tied = [r for r, k in zip(replicas, keys, strict=True) if k == best]
        if len(tied) == 1:
            chosen = tied[0]
        else:
            key = _miss_key(request, max(matched.values(), default=0))
            chosen = _rendezvous(key, tied)
        if self.learn:
            self.index.insert(request.block_hashes, chosen.id)
        m = matched.get(chosen.id, 0)
        return Decision(chosen.id, f"kv-cost cached {m}/{len(request.block_hashes)} blocks", m)


POLICIES: dict[str, type] = {
    p.name: p for p in (RoundRobin, LeastOutstanding, PowerOfTwo, SessionAffinity, PrefixAware, KVAwareCost)
}

# the policies that read `RequestInfo.block_hashes`: the gateway hashes prompts only for their models
PREFIX_POLICIES = frozenset({PrefixAware.name, KVAwareCost.name})


def make_policy(name: str, **options: object) -> Policy:
    """Build a policy by its config name (`prefix_aware`, `session_affinity`, ...) with its knobs."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown balancing policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
    return cls(**options)
