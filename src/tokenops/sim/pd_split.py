"""The prefill/decode split of a fixed fleet for a PD policy on multi-round agent sessions: how many
of `workers` identical workers prefill and how many decode, from the one `PerfModel` and the load the
policy puts on each pool (static PD as vLLM ships it recomputes a session's history on its prefill
worker unless that worker still caches it; ours ships only the new tokens; AMPD keeps the rounds its
local rule allows on their decode worker). Each split is scored by its bottleneck (TTFT and decode
step time over their SLOs, the decode pool's KV); `tokenops plan-pd` prints the choice and `--check`
simulates every split beside it. `planner.py` sizes fleets by type; this module only splits one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tokenops.cluster.pd import AMPD, PDSnapshot, PrefillJob, StaticPD, WorkerLoad
from tokenops.cluster.perf_model import PerfModel


@dataclass(frozen=True, slots=True)
class SessionRound:
    prompt_tokens: int
    new_tokens: int  # what the session's decode worker lacks: the prompt less its history there
    output_tokens: int
    delay_s: float = 0.0  # after the previous round's answer (the tool's run)
    previous_output_tokens: int | None = None  # the previous round's answer (None: a first round)


@dataclass(frozen=True, slots=True)
class SessionLoad:
    """A multi-round workload as the split planner sees it: the request (round) rate and the token
    counts of a sample of its rounds; `shared_prefix_tokens` are cached on every worker (an agent's
    system prompt), so no round recomputes them."""

    rate: float
    rounds: tuple[SessionRound, ...]
    shared_prefix_tokens: int = 0

    @classmethod
    def from_sessions(cls, sessions: Sequence, sessions_per_s: float, block_size: int = 16) -> SessionLoad:
        """From the simulator's sessions (`sim.workload.SimSession`): a later round's new tokens are
        its prompt less the full blocks the previous round left cached; the shared prefix is the
        leading blocks every session's first prompt has in common."""
        firsts = [s.rounds[0].hashes for s in sessions if s.rounds]
        if not firsts:
            raise ValueError("no rounds to plan for")
        shared = 0
        while all(len(h) > shared and h[shared] == firsts[0][shared] for h in firsts):
            shared += 1
        shared_tokens = shared * block_size if len(firsts) > 1 else 0
        rounds = []
        for s in sessions:
            held, before = shared_tokens, None
            for r in s.rounds:
                new = r.prompt_tokens - min(held, r.prompt_tokens)
                rounds.append(SessionRound(r.prompt_tokens, new, r.max_tokens, r.delay_s, before))
                held, before = len(r.cache_hashes) * block_size, r.max_tokens
        return cls(sessions_per_s * len(rounds) / len(firsts), tuple(rounds), shared_tokens)


@dataclass(frozen=True, slots=True)
class SplitEstimate:
    prefill: int
    decode: int
    local_share: float  # rounds prefilled on their decode worker (AMPD's local placements)
    prefill_utilisation: float  # of each prefill worker
    decode_utilisation: float  # of each decode worker's time (its rows and local prefills, beyond the base)
    decode_batch: float  # mean running sequences per decode worker
    ttft_p95_s: float  # over all rounds (a local round's taken as within it)
    tpot_s: float  # mean decode step time with the local prefills in it
    kv_utilisation: float  # the decode batch's contexts over a decode worker's KV (0: no KV limit given)
    bottleneck: float  # the worst of TTFT / its SLO, TPOT / the decode SLO and the KV utilisation


@dataclass(frozen=True, slots=True)
class SplitPlan:
    policy: str
    best: SplitEstimate
    splits: tuple[SplitEstimate, ...]


def _remote_leg(
    load: SessionLoad, r: SessionRound, policy: StaticPD | AMPD, hit: bool
) -> tuple[int, int, int, int]:
    """A remote round's prefill as the policy ships it: tokens computed, cached tokens they attend
    to, history pulled to the prefill worker and KV shipped back. With the incremental transfer
    (AMPD's remote rounds, `StaticPD(incremental=True)`) only the new tokens are computed and shipped
    back, the history pulled from the decode worker. As vLLM ships it the prefill worker recomputes
    what its own cache lacks (everything but the shared prefix, or with `hit` its previous prompt
    still cached: the new tokens and the previous answer, which the decode worker made) and the whole
    prompt's KV goes back."""
    held = r.prompt_tokens - r.new_tokens
    if isinstance(policy, AMPD) or policy.incremental:
        return r.new_tokens, held, held - min(load.shared_prefix_tokens, held), r.new_tokens
    if hit and r.previous_output_tokens is not None:
        computed = min(r.prompt_tokens, r.new_tokens + r.previous_output_tokens)
        return computed, r.prompt_tokens - computed, 0, r.prompt_tokens
    cached = min(load.shared_prefix_tokens, r.prompt_tokens)
    return r.prompt_tokens - cached, cached, 0, r.prompt_tokens


def _prefill_hits(
    load: SessionLoad,
    rounds: Sequence[SessionRound],
    lam_p: float,
    tpot: float,
    kv_tokens: int,
) -> list[bool]:
    """Which of vLLM static PD's remote rounds find their session's previous prompt still in the
    prefill worker's cache, taking a session's rounds back to the worker holding it (optimistic:
    `least_queued_prefill` moves a session off a worker whose backlog outweighs the saving), by Che's
    approximation of an LRU cache: a block survives while fewer than the cache's tokens are written
    after it, i.e. for t_C = kv_tokens / the tokens the worker computes per second; a round hits when
    the previous answer and the tool's run took less than t_C. Hits write fewer tokens, so t_C is the
    least fixed point, iterated up from no hits."""
    gap = [r.delay_s + (r.previous_output_tokens or 0) * tpot for r in rounds]
    hits = [False] * len(rounds)
    for _ in range(30):
        written = sum(_remote_leg(load, r, StaticPD(), h)[0] for r, h in zip(rounds, hits, strict=True))
        t_c = kv_tokens / (lam_p * written / len(rounds)) if written else math.inf
        nxt = [r.previous_output_tokens is not None and g < t_c for r, g in zip(rounds, gap, strict=True)]
        if nxt == hits:
            break
        hits = nxt
    return hits


def _local(policy: AMPD, r: SessionRound, batch: float, ctx: float, itl_slo_s: float) -> bool:
    """AMPD's own choice (`AMPD.place`) for this round at the planned decode batch: its decode worker
    running `batch` sequences of `ctx` tokens, an idle prefill worker that holds the session's
    history as the decode worker does, no TTFT SLO (the planner scores TTFT itself). No session id,
    so the policy binds nothing."""
    held = r.prompt_tokens - r.new_tokens
    rows = round(batch)
    snapshot = PDSnapshot(
        prefill=(WorkerLoad("p", role="prefill"),),
        decode=(WorkerLoad("d", role="decode", running=rows, context_tokens=round(rows * ctx)),),
        itl_slo_s=itl_slo_s,
    )
    job = PrefillJob("plan", r.prompt_tokens, round=1, cached_tokens={"d": held, "p": held})
    return not policy.place(job, snapshot).remote


def split_estimate(
    perf: PerfModel,
    load: SessionLoad,
    policy: StaticPD | AMPD,
    prefill: int,
    decode: int,
    ttft_slo_s: float,
    decode_slo_s: float,
    *,
    max_num_seqs: int = 256,
    kv_tokens: int | None = None,
) -> SplitEstimate:
    """The latencies of `prefill` + `decode` workers serving `load` under `policy`: `StaticPD` ships
    every round (as its `incremental` flag says); `AMPD` keeps the rounds its local rule allows on the
    decode worker.

    Decode: each worker's step time where Little's law and the step agree, with the local prefills'
    tokens in its steps: per unit time they take u = lambda_d * (their token cost per round), so
    tpot = base / (1 - k * lambda_d * out - u). AMPD's local share is what its rule allows at that
    batch, and the batch grows with the share, so the batch is the fixed point (bisection: a larger
    batch allows fewer local rounds, which make a smaller batch). Prefill: M/M/1 per worker on the
    remote rounds' mean prefill time; the P95 TTFT is over all rounds, the local ones taken as
    meeting it, so with a remote share r it is the sojourn exceeded by 5% / r of the remote rounds,
    ln(20 r) / (mu - lambda), plus the mean KV transfers, the requests' overhead and the decode
    worker's first step. A decode batch past `max_num_seqs` counts as overloaded (infinite TPOT); its
    contexts over `kv_tokens` are the third ratio of the bottleneck (past 1 the decode workers
    preempt)."""
    if not isinstance(policy, StaticPD | AMPD):
        raise ValueError(f"the split planner models static PD and AMPD, not {policy.name!r}")
    rounds = load.rounds
    n = len(rounds)
    lam_d = load.rate / decode
    out = sum(r.output_tokens for r in rounds) / n
    ctx = sum(r.prompt_tokens + r.output_tokens / 2 for r in rounds) / n
    row = perf.per_token_s if perf.decode_row_s is None else perf.decode_row_s
    k = row + perf.decode_attention_s * ctx
    # a local prefill's cost inside a decode step: the step's base is paid anyway
    local_cost = [
        perf.prefill_time(r.new_tokens, r.prompt_tokens - r.new_tokens) - perf.base_s for r in rounds
    ]

    def decode_at(local: list[bool]) -> tuple[float, float, float]:
        a = k * lam_d * out + lam_d * sum(c for c, loc in zip(local_cost, local, strict=True) if loc) / n
        if a >= 1:
            return math.inf, math.inf, a
        tpot = perf.base_s / (1 - a)
        return tpot, lam_d * out * tpot, a

    def local_at(batch: float) -> list[bool]:
        if isinstance(policy, AMPD) and prefill:
            return [_local(policy, r, batch, ctx, decode_slo_s) for r in rounds]
        return [prefill == 0] * n

    local = local_at(0.0)
    if isinstance(policy, AMPD) and prefill:
        lo, hi = 0.0, float(max_num_seqs)
        for _ in range(30):
            mid = (lo + hi) / 2
            made = decode_at(local_at(mid))[1]
            lo, hi = (mid, hi) if made > mid else (lo, mid)
        local = local_at(hi)
    tpot, batch, decode_util = decode_at(local)
    if batch > max_num_seqs:
        tpot = math.inf
    kv = batch * ctx / kv_tokens if kv_tokens else 0.0
    first_step = tpot if math.isfinite(tpot) else 0.0
    remote = [r for r, loc in zip(rounds, local, strict=True) if not loc]
    util, ttft = 0.0, perf.request_overhead_s + first_step
    if remote and prefill:
        lam_p = load.rate * len(remote) / n / prefill
        hits = [False] * len(remote)
        if isinstance(policy, StaticPD) and not policy.incremental and kv_tokens and math.isfinite(tpot):
            hits = _prefill_hits(load, remote, lam_p, tpot, kv_tokens)
        service = transfer = 0.0
        for r, hit in zip(remote, hits, strict=True):
            new, cached, pulled, shipped = _remote_leg(load, r, policy, hit)
            service += perf.prefill_time(new, cached)
            transfer += perf.transfer_time(pulled) + perf.transfer_time(shipped)
        service, transfer = service / len(remote), transfer / len(remote)
        util = lam_p * service
        # the P95 over all rounds: the local ones meet it, so it is a higher quantile of the remote ones
        tail = 20 * len(remote) / n
        wait = (math.log(tail) if tail > 1 else 0.0) / (1 / service - lam_p) if util < 1 else math.inf
        ttft = wait + transfer + 2 * perf.request_overhead_s + first_step
    return SplitEstimate(prefill, decode, sum(local) / n, util, decode_util, batch, ttft, tpot, kv,
                         max(ttft / ttft_slo_s, tpot / decode_slo_s, kv))  # fmt: skip


def pd_split(
    perf: PerfModel,
    load: SessionLoad,
    policy: StaticPD | AMPD,
    workers: int,
    ttft_slo_s: float,
    decode_slo_s: float,
    *,
    max_num_seqs: int = 256,
    kv_tokens: int | None = None,
) -> SplitPlan:
    """The split of `workers` identical workers into a prefill and a decode pool with the lowest
    bottleneck (then the lower of the two pools' utilisations, so an overloaded fleet still gets the
    split nearest to serving). One type at a fixed count leaves one dimension, and AMPD's local share
    ties the pools together (it depends on the decode batch), so every split is estimated rather than
    the two pools chosen apart as the MILP does."""
    if workers < 2:
        raise ValueError("a PD split needs at least two workers")
    ests = tuple(
        split_estimate(
            perf,
            load,
            policy,
            p,
            workers - p,
            ttft_slo_s,
            decode_slo_s,
            max_num_seqs=max_num_seqs,
            kv_tokens=kv_tokens,
        )  # fmt: skip
        for p in range(1, workers)
    )
    best = min(ests, key=lambda e: (e.bottleneck, max(e.prefill_utilisation, e.decode_utilisation)))
    return SplitPlan(policy.name, best, ests)
