"""Seeded workload generators, all expressed as trace records so every workload can be saved, replayed
and exchanged with guidellm and AIPerf.

Generators yield sessions, each a list of `TraceRecord`s (one per round): random input/output lengths
from distributions, shared prefixes (N groups of system prompts), multi-turn chat, agentic sessions
(model call, then a tool call with a delay, the tool's output appended, context growing each round),
or a trace file. `to_session` turns records into the `Session` the driver sends: round 0 is the
prompt rebuilt from its hash ids, each later round only the new text (user message or tool output),
since the driver appends the real previous answer itself. Timing of arrivals is not decided here
(see arrivals.py), except that traces carry their own timestamps.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from tokenops.bench.traces import (
    MOONCAKE_BLOCK_SIZE,
    TraceRecord,
    group_sessions,
    prompt_from_hash_ids,
    read_trace,
)


@dataclass(frozen=True, slots=True)
class Dist:
    """A length or delay distribution: `512`, `uniform:128,1024`, `normal:512,64`, `exp:300`,
    `lognormal:512,0.5` (median, sigma). Lengths are rounded and clipped to at least `floor`."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str | int | float | Dist) -> Dist:
        if isinstance(spec, Dist):
            return spec
        if isinstance(spec, int | float):
            return cls("fixed", float(spec))
        m = re.fullmatch(r"\s*(?:(\w+):)?\s*([0-9.eE+-]+)\s*(?:,\s*([0-9.eE+-]+))?\s*", spec)
        if not m:
            raise ValueError(
                f"bad distribution {spec!r}: use N, uniform:a,b, normal:mean,std, exp:mean "
                "or lognormal:median,sigma"
            )
        kind = (m.group(1) or "fixed").lower()
        a, b = float(m.group(2)), float(m.group(3) or 0.0)
        if kind not in ("fixed", "uniform", "normal", "exp", "lognormal"):
            raise ValueError(f"unknown distribution {kind!r}: use fixed, uniform, normal, exp or lognormal")
        if kind in ("uniform", "normal", "lognormal") and m.group(3) is None:
            raise ValueError(f"{kind} needs two parameters, e.g. {kind}:100,20")
        if kind == "uniform" and b < a:
            raise ValueError("uniform:a,b needs a <= b")
        return cls(kind, a, b)

    @property
    def mean(self) -> float:
        return {
            "fixed": self.a,
            "uniform": (self.a + self.b) / 2,
            "normal": self.a,
            "exp": self.a,
            "lognormal": self.a * math.exp(self.b**2 / 2),
        }[self.kind]

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        if self.kind == "normal":
            return rng.gauss(self.a, self.b)
        if self.kind == "exp":
            return rng.expovariate(1 / self.a) if self.a > 0 else 0.0
        return rng.lognormvariate(math.log(self.a), self.b)

    def length(self, rng: random.Random, floor: int = 1) -> int:
        return max(floor, round(self.sample(rng)))

    def seconds(self, rng: random.Random) -> float:
        return max(0.0, self.sample(rng))


@dataclass(slots=True)
class Turn:
    """One round of a session: the new message text, its role, the answer length asked for and the
    delay (think or tool time) to wait after the previous round finished."""

    text: str
    max_tokens: int
    role: str = "user"
    delay_s: float = 0.0
    input_length: int = 0


@dataclass(slots=True)
class Session:
    session_id: str
    turns: list[Turn] = field(default_factory=list)
    arrival_s: float = 0.0  # the trace timestamp of round 0, in seconds


def to_session(records: list[TraceRecord], block_size: int = MOONCAKE_BLOCK_SIZE, index: int = 0) -> Session:
    """Rebuild a session's messages from its trace records (see the module docstring)."""
    first = records[0]

    def own_id(round_: int) -> list[int]:
        # a trace without hash ids (lengths only) must not share text by accident: negative ids,
        # unique to this session and round, never collide with a trace's own (non-negative) ids
        return [-(index * 4096 + round_ + 1)]

    turns = [
        Turn(
            prompt_from_hash_ids(first.hash_ids or own_id(0), first.input_length, block_size),
            first.output_length,
            input_length=first.input_length,
        )
    ]
    for k, (prev, rec) in enumerate(itertools.pairwise(records), 1):
        # the new text is what the context grew by, beyond the previous prompt and its answer
        new_len = max(1, rec.input_length - prev.input_length - prev.output_length)
        seen = set(prev.hash_ids)
        new_ids = [h for h in rec.hash_ids if h not in seen] or own_id(k)
        role = str(rec.extra.get("role", "user"))
        turns.append(
            Turn(
                prompt_from_hash_ids(new_ids, new_len, block_size),
                rec.output_length,
                role,
                rec.delay / 1000,
                rec.input_length,
            )
        )
    sid = first.session_id if first.session_id is not None else f"req-{index}"
    return Session(sid, turns, first.timestamp / 1000)


class _Ids:
    """Fresh hash ids, disjoint from shared-prefix ids and from other seeds' ids."""

    def __init__(self, seed: int) -> None:
        self._next = (seed % 1_000_000 + 1) * 1_000_000_000

    def take(self, n: int) -> list[int]:
        out = list(range(self._next, self._next + n))
        self._next += n
        return out


def _blocks(n_tokens: int, block_size: int) -> int:
    return max(1, math.ceil(n_tokens / block_size))


def random_requests(
    input_len: Dist | str = "512",
    output_len: Dist | str = "128",
    *,
    seed: int = 0,
    block_size: int = MOONCAKE_BLOCK_SIZE,
) -> Iterator[list[TraceRecord]]:
    """Single-turn requests with independent random lengths and no shared content."""
    ind, outd = Dist.parse(input_len), Dist.parse(output_len)
    rng, ids = random.Random(seed), _Ids(seed)
    for i in itertools.count():
        n = ind.length(rng)
        yield [TraceRecord(0.0, n, outd.length(rng), ids.take(_blocks(n, block_size)), f"s{seed}-{i}")]


def shared_prefix(
    groups: int = 4,
    prefix_len: int = 1024,
    input_len: Dist | str = "256",
    output_len: Dist | str = "128",
    *,
    seed: int = 0,
    block_size: int = MOONCAKE_BLOCK_SIZE,
) -> Iterator[list[TraceRecord]]:
    """Single-turn requests, each opening with one of `groups` system prompts of `prefix_len` tokens
    (rounded up to whole blocks so the shared part is exactly shared), then a unique question."""
    if groups < 1:
        raise ValueError("groups must be >= 1")
    ind, outd = Dist.parse(input_len), Dist.parse(output_len)
    rng, ids = random.Random(seed), _Ids(seed)
    pblocks = _blocks(prefix_len, block_size)
    for i in itertools.count():
        g = rng.randrange(groups)
        n = ind.length(rng)
        hash_ids = list(range(g * pblocks, (g + 1) * pblocks)) + ids.take(_blocks(n, block_size))
        rec = TraceRecord(0.0, pblocks * block_size + n, outd.length(rng), hash_ids, f"s{seed}-{i}")
        rec.extra["group"] = g
        yield [rec]


def multi_turn(
    turns: Dist | str = "uniform:2,6",
    input_len: Dist | str = "128",
    output_len: Dist | str = "128",
    think_s: Dist | str = "0",
    *,
    prefix_len: int = 0,
    groups: int = 1,
    seed: int = 0,
    block_size: int = MOONCAKE_BLOCK_SIZE,
) -> Iterator[list[TraceRecord]]:
    """Chat sessions: each round a new user message after a think time; the context holds all
    previous messages and answers, so every round's prompt extends the previous one. With
    `prefix_len`, session i opens with system prompt i % `groups` (each `prefix_len` tokens)."""
    return _sessions(
        turns, input_len, output_len, think_s, "user", prefix_len, seed, block_size, groups=groups
    )


def agentic(
    rounds: Dist | str = "uniform:4,12",
    tool_output_len: Dist | str = "lognormal:400,0.8",
    output_len: Dist | str = "uniform:30,200",
    tool_delay_s: Dist | str = "exp:0.5",
    *,
    system_len: int = 2048,
    task_len: int = 256,
    seed: int = 0,
    block_size: int = MOONCAKE_BLOCK_SIZE,
) -> Iterator[list[TraceRecord]]:
    """Agent sessions, as a coding agent runs: a long system prompt (shared by all sessions: the
    agent's instructions and tool definitions) and a task; then rounds of a model call (a short
    answer, e.g. a tool call) followed by the tool's run (a delay) whose output is appended."""
    return _sessions(
        rounds,
        tool_output_len,
        output_len,
        tool_delay_s,
        "tool",
        system_len,
        seed,
        block_size,
        first_len=task_len,
    )


def _sessions(
    turns: Dist | str,
    input_len: Dist | str,
    output_len: Dist | str,
    delay_s: Dist | str,
    role: str,
    prefix_len: int,
    seed: int,
    block_size: int,
    first_len: int | None = None,
    groups: int = 1,
) -> Iterator[list[TraceRecord]]:
    if groups < 1:
        raise ValueError("groups must be >= 1")
    turnd, ind, outd, delayd = (
        Dist.parse(turns),
        Dist.parse(input_len),
        Dist.parse(output_len),
        Dist.parse(delay_s),
    )
    rng, ids = random.Random(seed), _Ids(seed)
    pblocks = _blocks(prefix_len, block_size) if prefix_len else 0
    for i in itertools.count():
        sid = f"s{seed}-{i}"
        g = i % groups
        n_first = first_len if first_len is not None else ind.length(rng)
        context = pblocks * block_size + n_first
        hash_ids = list(range(g * pblocks, (g + 1) * pblocks)) + ids.take(_blocks(n_first, block_size))
        out = outd.length(rng)
        records = [TraceRecord(0.0, context, out, list(hash_ids), sid, 0)]
        for k in range(1, turnd.length(rng)):
            new = ind.length(rng)
            prev_ctx = context + out
            context = prev_ctx + new
            hash_ids = hash_ids + ids.take(max(1, _blocks(context, block_size) - len(hash_ids)))
            out = outd.length(rng)
            rec = TraceRecord(0.0, context, out, list(hash_ids), sid, k, round(delayd.seconds(rng) * 1000, 3))
            if role != "user":
                rec.extra["role"] = role
            records.append(rec)
        yield records


def trace_sessions(path: str) -> Iterator[list[TraceRecord]]:
    """The sessions of a trace file, in order of their first timestamp."""
    yield from group_sessions(read_trace(path))


WORKLOADS = ("random", "shared-prefix", "multi-turn", "agentic", "trace")


def make_workload(
    kind: str, *, seed: int = 0, block_size: int = MOONCAKE_BLOCK_SIZE, **opts: object
) -> Iterator[list[TraceRecord]]:
    """The generator named `kind` with the options that apply to it (others are ignored)."""
    import inspect

    fn = {
        "random": random_requests,
        "shared-prefix": shared_prefix,
        "multi-turn": multi_turn,
        "agentic": agentic,
    }.get(kind)
    if kind == "trace":
        if not opts.get("path"):
            raise ValueError("the trace workload needs a trace file (--trace PATH)")
        return trace_sessions(str(opts["path"]))
    if fn is None:
        raise ValueError(f"unknown workload {kind!r}: use one of {', '.join(WORKLOADS)}")
    accepted = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in opts.items() if k in accepted and v is not None}
    return fn(seed=seed, block_size=block_size, **kwargs)  # type: ignore[operator]
