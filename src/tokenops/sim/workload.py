"""What the simulated clients send: the bench's sessions (its generators and trace files, not a copy)
turned into rounds of token counts with the chained block hashes of their prompts, and the time each
session starts.

A trace's hash ids name blocks of `trace_block` tokens (512 in Mooncake's traces, the bench's block
size for generated workloads); the engine and the gateway hash blocks of `block_size` tokens, each
chained to the one before, as `prefix_index.block_hashes_from_tokens` does for token ids. Block j of a
prompt is named by the trace ids that overlap it and its offset, chained to block j - 1, so two prompts
share engine blocks exactly where their traces share content. A round's cache hashes run on into the
next round's prompt, whose prefix is this round's prompt and answer: that is what a finished request
leaves in the prefix cache. Sessions start on an open-loop arrival process (or at their trace
timestamps); later rounds follow the previous answer after the round's delay (think or tool time).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tokenops.bench.arrivals import ArrivalProcess
from tokenops.bench.traces import MOONCAKE_BLOCK_SIZE, TraceRecord


@dataclass(frozen=True, slots=True)
class SimRound:
    prompt_tokens: int
    max_tokens: int
    delay_s: float  # after the previous round's answer
    hashes: tuple[int, ...]  # the prompt's full blocks
    cache_hashes: tuple[int, ...]  # the blocks prompt + answer fill (a prefix of the next round's)


@dataclass(frozen=True, slots=True)
class SimSession:
    session_id: str
    arrival_s: float
    rounds: tuple[SimRound, ...]


def chain_hashes(
    hash_ids: list[int], tokens: int, block_size: int, trace_block: int, salt: object
) -> tuple[int, ...]:
    """Chained hashes of the full `block_size` blocks of a `tokens`-long sequence named by `hash_ids`;
    positions no id covers are unique to `salt` (the session)."""
    out: list[int] = []
    parent = 0
    n_ids = len(hash_ids)
    for j in range(tokens // block_size):
        lo, hi = j * block_size // trace_block, ((j + 1) * block_size - 1) // trace_block + 1
        if hi <= n_ids:
            key: object = hash_ids[lo] if hi - lo == 1 else tuple(hash_ids[lo:hi])
        else:
            key = (salt, j)
        parent = hash((parent, key, j * block_size % trace_block))
        out.append(parent)
    return tuple(out)


def to_sim_session(
    records: list[TraceRecord], arrival_s: float, block_size: int, trace_block: int, index: int
) -> SimSession:
    sid = records[0].session_id if records[0].session_id is not None else f"req-{index}"
    last = records[-1]
    # one chain for the whole session: every round's prompt is a prefix of the last round's
    longest = max(records, key=lambda r: len(r.hash_ids)).hash_ids
    full = chain_hashes(longest, last.input_length + last.output_length, block_size, trace_block, sid)
    rounds = []
    for k, rec in enumerate(records):
        seq_end = rec.input_length + rec.output_length
        if k + 1 < len(records):
            seq_end = min(seq_end, records[k + 1].input_length)
        rounds.append(
            SimRound(
                rec.input_length,
                rec.output_length,
                rec.delay / 1000 if k else 0.0,
                full[: rec.input_length // block_size],
                full[: seq_end // block_size],
            )
        )
    return SimSession(sid, arrival_s, tuple(rounds))


def sim_sessions(
    sessions: Iterable[list[TraceRecord]],
    *,
    num_requests: int,
    rate: float | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    block_size: int = 16,
    trace_block: int = MOONCAKE_BLOCK_SIZE,
) -> list[SimSession]:
    """Sessions until they hold `num_requests` rounds (the last one cut to fit). With `rate`, sessions
    start on a Gamma process (vLLM's burstiness); without it, at their trace timestamps (ms)."""
    if num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    times: Iterator[float] | None = ArrivalProcess(rate, burstiness, seed).times() if rate else None
    out: list[SimSession] = []
    left = num_requests
    for i, recs in enumerate(itertools.islice(sessions, num_requests)):
        recs = recs[:left]
        start = next(times) if times is not None else recs[0].timestamp / 1000
        out.append(to_sim_session(recs, start, block_size, trace_block, i))
        left -= len(recs)
        if left <= 0:
            break
    if times is None:
        out.sort(key=lambda s: s.arrival_s)
    return out
