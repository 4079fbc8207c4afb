"""The prefill/decode split of a fixed fleet for a PD policy on multi-round agent sessions: how many
of `workers` identical workers prefill and how many decode, from the one `PerfModel` and the load the
policy puts on each pool (static PD as vLLM ships it recomputes a session's history on its prefill
worker unless that worker still caches it, and a busy pool moves sessions off the worker that does;
ours pulls only the history that worker lacks and ships only the new tokens; AMPD and the conditional
rules keep the rounds they themselves place locally on their decode worker), with the prefill pool's
slot limit and wait. Each split is scored by its bottleneck (TTFT, decode step time and the largest
gap over their SLOs, the decode pool's KV); `tokenops plan-pd` prints the choice and `--check`
simulates every split beside it. `planner.py` sizes fleets by type; this module only splits one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tokenops.cluster.pd import AMPD, ConditionalPD, PDSnapshot, PrefillJob, StaticPD, WorkerLoad
from tokenops.cluster.perf_model import PerfModel, StepShape

PlannedPolicy = StaticPD | AMPD | ConditionalPD
# queue levels the conditional rules are asked at: the last stands for it and every longer queue
QUEUE_LEVELS = 8


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
    local_share: float  # rounds prefilled on their decode worker (placed there, or their leg's wait ran out)
    prefill_utilisation: float  # of each prefill worker
    decode_utilisation: float  # of each decode worker's time (its rows and local prefills, beyond the base)
    decode_batch: float  # mean running sequences per decode worker
    ttft_p95_s: float  # over all rounds (a local round's taken as within it)
    tpot_s: float  # mean decode step time with the local prefills in it
    gap_p95_s: float  # P95 of a request's largest inter-token gap (a local prefill's step it sits through)
    timed_out_share: float  # remote legs whose wait for a prefill slot runs out (prefilled locally)
    kv_utilisation: float  # the decode batch's contexts over a decode worker's KV (0: no KV limit given)
    bottleneck: float  # the worst of TTFT / its SLO, TPOT and the gap / the decode SLO, KV utilisation


@dataclass(frozen=True, slots=True)
class SplitPlan:
    policy: str
    best: SplitEstimate
    splits: tuple[SplitEstimate, ...]


def _incremental(policy: PlannedPolicy) -> bool:
    """Whether a remote round pulls its history from the decode worker and ships back only its new
    tokens: AMPD's and the conditional rules' remote rounds, and `StaticPD(incremental=True)`."""
    return not isinstance(policy, StaticPD) or policy.incremental


def _remote_leg(
    load: SessionLoad, r: SessionRound, policy: PlannedPolicy, hit: bool
) -> tuple[int, int, int, int]:
    """A remote round's prefill as the policy ships it: tokens computed, cached tokens they attend
    to, history pulled to the prefill worker and KV shipped back; `hit`: the prefill worker still
    caches the session's previous prompt, so it lacks only the new tokens and the previous answer
    (which the decode worker made). With the incremental transfer only the new tokens are computed
    and shipped back, the history the prefill worker lacks pulled from the decode worker. As vLLM
    ships it the prefill worker recomputes what its own cache lacks and the whole prompt's KV goes
    back."""
    held = r.prompt_tokens - r.new_tokens
    shared = min(load.shared_prefix_tokens, r.prompt_tokens)
    lacks = r.prompt_tokens - shared
    if hit and r.previous_output_tokens is not None:
        lacks = min(lacks, r.new_tokens + r.previous_output_tokens)
    if _incremental(policy):
        return r.new_tokens, held, max(0, lacks - r.new_tokens), r.new_tokens
    return lacks, r.prompt_tokens - lacks, 0, r.prompt_tokens


def _prefill_hits(
    perf: PerfModel,
    load: SessionLoad,
    policy: PlannedPolicy,
    remote: Sequence[float],
    lam_p: float,
    prefill: int,
    tpot: float,
    kv_tokens: int,
) -> list[float]:
    """Each remote round's chance to find its session's previous prompt in its prefill worker's
    cache (so vLLM's path recomputes less, and the incremental transfer pulls less): the previous
    round went remote, its prompt survived there, and this round went back to that worker.

    Survival by Che's approximation of an LRU cache: a block survives while fewer than the cache's
    tokens are written after it (computed or pulled there), i.e. for t_C = kv_tokens / the tokens
    the worker writes per second; it has when the previous answer and the tool's run took less than
    t_C. Going back: `least_queued_prefill` moves a round to another worker when its own worker's
    backlog exceeds the least of the others' by more than the cache saves it (the previous prompt
    beyond the shared prefix). A worker's backlog is an M/M/1 queue's unfinished work at utilisation
    rho, P(V > x) = rho e^(-(1 - rho) x / s) for legs of s tokens lacked on average; the least of
    the other P - 1 is 0 with chance 1 - rho^(P-1), else exponential at P - 1 times the rate, so a
    round moves with chance rho e^(-(1 - rho) saving / s) (1 - rho^(P-1) / P). Hits write fewer
    tokens and load the workers less, so fewer rounds move; the fixed point is iterated (damped) up
    from no hits. `remote`: each round's chance of going remote, the rounds in session order."""
    rounds = load.rounds
    legs = [(_remote_leg(load, r, policy, True), _remote_leg(load, r, policy, False)) for r in rounds]
    written = [(h[0] + h[2], m[0] + m[2]) for h, m in legs]
    times = [(perf.prefill_time(h[0], h[1]), perf.prefill_time(m[0], m[1])) for h, m in legs]
    # what the session's own worker holds beyond the shared prefix, on a hit: the previous prompt
    saving = [m - h for h, m in written]
    before = [w if r.previous_output_tokens is not None else 0.0
              for r, w in zip(rounds, [0.0, *remote[:-1]], strict=True)]  # fmt: skip
    gap = [r.delay_s + (r.previous_output_tokens or 0) * tpot for r in rounds]
    share = sum(remote)
    hits = [0.0] * len(rounds)
    for _ in range(100):
        tokens = sum(w * (p * h + (1 - p) * m) for w, p, (h, m) in zip(remote, hits, written, strict=True))
        busy = sum(w * (p * h + (1 - p) * m) for w, p, (h, m) in zip(remote, hits, times, strict=True))
        tokens, busy = tokens / share, busy / share
        t_c = kv_tokens / (lam_p * tokens) if tokens else math.inf
        rho = min(lam_p * busy, 0.999)
        others = 1 - rho ** (prefill - 1) / prefill
        nxt = [
            b * (g < t_c) * (1 - rho * math.exp(-(1 - rho) * s / tokens) * others)
            for b, g, s in zip(before, gap, saving, strict=True)
        ]
        if max(abs(a - b) for a, b in zip(nxt, hits, strict=True)) < 1e-4:
            break
        hits = [(a + b) / 2 for a, b in zip(nxt, hits, strict=True)]
    return hits


def _placed_local(
    policy: PlannedPolicy,
    r: SessionRound,
    batch: float,
    ctx: float,
    itl_slo_s: float,
    queued: int = 0,
    ttft_slo_s: float = math.inf,
) -> bool:
    """The policy's own choice (`place`) for this round: its decode worker running `batch` sequences
    of `ctx` tokens, a prefill worker with `queued` prefills waiting that holds the session's
    history as the decode worker does. The planner scores TTFT itself; `ttft_slo_s` is for AMPD's
    tie-break, which weighs the prefill side's TTFT slack. No session id, so the policy binds
    nothing."""
    held = r.prompt_tokens - r.new_tokens
    rows = round(batch)
    snapshot = PDSnapshot(
        prefill=(WorkerLoad("p", role="prefill", queued_requests=queued),),
        decode=(WorkerLoad("d", role="decode", running=rows, context_tokens=round(rows * ctx)),),
        ttft_slo_s=ttft_slo_s,
        itl_slo_s=itl_slo_s,
    )
    job = PrefillJob("plan", r.prompt_tokens, round=1, cached_tokens={"d": held, "p": held})
    return not policy.place(job, snapshot).remote


def queue_placements(policy: PlannedPolicy, load: SessionLoad, itl_slo_s: float) -> list[list[bool]]:
    """Whether the policy places each round locally with its prefill worker's queue at each length
    (`QUEUE_LEVELS`), for the policies that do not weigh the decode batch (static PD, the conditional
    rules): an idle one will do."""
    ctx = sum(r.prompt_tokens + r.output_tokens / 2 for r in load.rounds) / len(load.rounds)
    return [[_placed_local(policy, r, 0.0, ctx, itl_slo_s, q) for q in range(QUEUE_LEVELS)]
            for r in load.rounds]  # fmt: skip


def _queue_levels(rho: float, prefill: int) -> list[float]:
    """The chance that the least queued of `prefill` workers has k prefills waiting (the last level:
    at least that many), each an independent M/M/1 queue at utilisation `rho` (P(waiting >= k) =
    rho^(k+1) for k >= 1; every level full past rho = 1). A conditional rule that checks queues
    sends a round to the least queued worker, so that worker's queue is what it sees."""
    at_least = [1.0] + [1.0 if rho >= 1 else rho ** (k + 1) for k in range(1, QUEUE_LEVELS)]
    g = [a**prefill for a in at_least] + [0.0]
    return [g[k] - g[k + 1] for k in range(QUEUE_LEVELS)]


def _gap_p95(
    lam_d: float, decode_s: float, tpot: float, steps: Sequence[float], local: Sequence[float], n: int
) -> float:
    """The P95 of a request's largest inter-token gap: the decode steps take `tpot`, and a local
    prefill on its worker makes a step of `steps[i]` (round i placed there with chance `local[i]`)
    that every running sequence sits through. Local prefills arrive as a Poisson stream, so a
    request decoding for `decode_s` sees none longer than x with chance exp(-its rate above x *
    decode_s); the least x where that reaches 0.95."""
    limit = -math.log(0.95) / (lam_d * decode_s) if lam_d * decode_s > 0 else math.inf
    above = sorted(((s, w) for s, w in zip(steps, local, strict=True) if w > 0 and s > tpot), reverse=True)
    rate, gap = 0.0, tpot
    for s, w in above:
        if rate + w / n > limit:
            return s
        rate += w / n
    return gap


def split_estimate(
    perf: PerfModel,
    load: SessionLoad,
    policy: PlannedPolicy,
    prefill: int,
    decode: int,
    ttft_slo_s: float,
    decode_slo_s: float,
    *,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    kv_tokens: int | None = None,
    prefill_slots: int | None = None,
    prefill_wait_s: float | None = None,
    placements: Sequence[Sequence[bool]] | None = None,
) -> SplitEstimate:
    """The latencies of `prefill` + `decode` workers serving `load` under `policy`: `StaticPD` ships every
    round (as its `incremental` flag says); `AMPD` and `ConditionalPD` keep on the decode worker the
    rounds they place there themselves.

    Decode: each worker's step time where Little's law and the step agree, with the local prefills' tokens
    in its steps: per unit time they take u = lambda_d * (their token cost per round), so tpot = base / (1
    - k * lambda_d * out - u), with the profile's bend in the base once the batch reaches it. AMPD's local
    share is what its rule allows at that batch, and the batch grows with the share, so the batch is the
    fixed point (bisection: a larger batch allows fewer local rounds, which make a smaller batch). The
    conditional rules are asked at each prefill queue length, weighted by the chance the least queued
    worker has it; that chance grows with the remote share, so the prefill utilisation is the fixed point
    (Dynamo's queue check keeps more rounds local as the queues grow). A local prefill's step (at most
    `max_num_batched_tokens` of it) stretches the gap every running sequence sees: the P95 of a request's
    largest gap is the fourth ratio, once past the SLO. Prefill: M/M/1 per worker on the remote rounds'
    mean prefill time; with `prefill_slots` a worker runs that many legs at a time and a leg holds its
    slot through its overhead and history pull as well, so the server's time per leg is the larger of the
    prefill and the slot time over the slots; with `prefill_wait_s` the legs whose wait in line runs out
    (M/M/1: rho e^-(mu - lambda) W; past rho = 1 the excess) prefill on their decode worker. The P95 TTFT
    is over all rounds, the local ones taken as meeting it, so with a remote share r it is the sojourn
    exceeded by 5% / r of the remote rounds, ln(20 r) / (mu - lambda), plus the mean KV transfers, the
    requests' overhead and the decode worker's first step. With `kv_tokens` (the prefill workers' pool
    too) each remote round's chance to find its session's previous prompt on its prefill worker
    (`_prefill_hits`) sets what it recomputes there or pulls. A decode batch past `max_num_seqs` counts as
    overloaded (infinite TPOT); its contexts over `kv_tokens` are the last ratio of the bottleneck (past 1
    the decode workers preempt). `placements`: `queue_placements`' answer for this load, when the caller
    has it (the same for every split)."""
    if not isinstance(policy, PlannedPolicy):
        raise ValueError(
            f"the split planner models static PD, AMPD and the conditional rules, not {policy.name!r}"
        )
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

    def decode_at(local: Sequence[float]) -> tuple[float, float, float]:
        a = k * lam_d * out + lam_d * sum(c * w for c, w in zip(local_cost, local, strict=True)) / n
        tpot = perf.busy_step_time(a, lam_d * out)
        if math.isinf(tpot):
            return math.inf, math.inf, a
        return tpot, lam_d * out * tpot, a

    def legs(hits: Sequence[float]) -> list[tuple[float, float, float]]:
        """Each round's remote leg (a hit with the chance given): its prefill time, its slot's time
        and its KV transfers."""
        out = []
        for r, hit in zip(rounds, hits, strict=True):
            mean = [0.0, 0.0, 0.0]
            for chance, case in ((hit, True), (1 - hit, False)):
                if chance:
                    new, cached, pulled, shipped = _remote_leg(load, r, policy, case)
                    compute = perf.prefill_time(new, cached)
                    pull = perf.transfer_time(pulled)
                    slot = compute + pull + perf.request_overhead_s
                    for i, v in enumerate((compute, slot, pull + perf.transfer_time(shipped))):
                        mean[i] += chance * v
            out.append((mean[0], mean[1], mean[2]))
        return out

    def prefill_at(remote: Sequence[float], costs) -> tuple[float, float, float, float]:
        """Per prefill worker: the remote legs' rate, the server's time per leg, the mean prefill
        time and the mean KV transfers."""
        share = sum(remote)
        if not share:
            return 0.0, 0.0, 0.0, 0.0
        compute, slot, transfer = (sum(w * c[i] for w, c in zip(remote, costs, strict=True)) / share
                                   for i in range(3))  # fmt: skip
        service = compute if prefill_slots is None else max(compute, slot / prefill_slots)
        return load.rate * share / n / prefill, service, compute, transfer

    if isinstance(policy, AMPD):
        lo, hi = 0.0, float(max_num_seqs)
        for _ in range(30):
            mid = (lo + hi) / 2
            placed = [
                float(_placed_local(policy, r, mid, ctx, decode_slo_s, ttft_slo_s=ttft_slo_s)) for r in rounds
            ]
            made = decode_at(placed)[1]
            lo, hi = (mid, hi) if made > mid else (lo, mid)
        local = [
            float(_placed_local(policy, r, hi, ctx, decode_slo_s, ttft_slo_s=ttft_slo_s)) for r in rounds
        ]
    else:
        table = queue_placements(policy, load, decode_slo_s) if placements is None else placements

        def local_at(rho: float) -> list[float]:
            levels = _queue_levels(rho, prefill)
            return [sum(p for p, loc in zip(levels, row, strict=True) if loc) for row in table]

        costs = legs([0.0] * n)
        lo, hi = 0.0, 1.0
        for _ in range(30):
            mid = (lo + hi) / 2
            lam_p, service, _, _ = prefill_at([1 - w for w in local_at(mid)], costs)
            lo, hi = (mid, hi) if lam_p * service > mid else (lo, mid)
        local = local_at(hi)
    tpot, batch, decode_util = decode_at(local)
    remote = [1 - w for w in local]
    util = timed = 0.0
    ttft = perf.request_overhead_s
    if sum(remote):
        lam_p = load.rate * sum(remote) / n / prefill
        hits = [0.0] * n
        if kv_tokens and math.isfinite(tpot):
            hits = _prefill_hits(perf, load, policy, remote, lam_p, prefill, tpot, kv_tokens)
        lam_p, service, compute, transfer = prefill_at(remote, legs(hits))
        util = lam_p * service
        if prefill_wait_s is not None and prefill_slots is not None:
            timed = 1 - 1 / util if util >= 1 else util * math.exp(-(1 / service - lam_p) * prefill_wait_s)
        # the P95 over all rounds: the local ones meet it, so it is a higher quantile of the remote ones
        tail = 20 * sum(remote) / n
        if util < 1:
            wait = (math.log(tail) if tail > 1 else 0.0) / (1 / service - lam_p)
        else:
            wait = math.inf if prefill_wait_s is None or prefill_slots is None else prefill_wait_s
        # the server's time per leg beyond its prefill is the leg's pull and overhead, counted below
        ttft = wait - (service - compute) + transfer + 2 * perf.request_overhead_s
        if timed:
            # a leg whose wait ran out prefills on its decode worker after all
            local = [w + timed * (1 - w) for w in local]
            tpot, batch, decode_util = decode_at(local)
            util = min(util, 1.0)
    if batch > max_num_seqs:
        tpot = math.inf
    ttft += tpot if math.isfinite(tpot) else 0.0
    gap = tpot
    if math.isfinite(tpot) and any(local):
        rows = round(batch)
        steps = [
            perf.step_time(
                StepShape.prefill(min(r.new_tokens, max_num_batched_tokens or r.new_tokens),
                                  r.prompt_tokens - r.new_tokens)
                + StepShape.decode(rows, round(rows * ctx))
            )
            for r in rounds
        ]  # fmt: skip
        gap = _gap_p95(lam_d, out * tpot, tpot, steps, local, n)
    kv = batch * ctx / kv_tokens if kv_tokens else 0.0
    # a gap within the SLO is the step a policy chose to allow (AMPD sizes its local prefills to it),
    # not a margin spent: it counts once it breaks the SLO
    broken = gap / decode_slo_s if gap > decode_slo_s else 0.0
    return SplitEstimate(prefill, decode, sum(local) / n, util, decode_util, batch, ttft, tpot, gap,
                         timed, kv, max(ttft / ttft_slo_s, tpot / decode_slo_s, broken, kv))  # fmt: skip


def pd_split(
    perf: PerfModel,
    load: SessionLoad,
    policy: PlannedPolicy,
    workers: int,
    ttft_slo_s: float,
    decode_slo_s: float,
    *,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    kv_tokens: int | None = None,
    prefill_slots: int | None = None,
    prefill_wait_s: float | None = None,
) -> SplitPlan:
    """The split of `workers` identical workers into a prefill and a decode pool with the lowest
    bottleneck (then the lower of the two pools' utilisations, so an overloaded fleet still gets the
    split nearest to serving); the keywords are `split_estimate`'s, the same for every split. One
    type at a fixed count leaves one dimension, and the policies' local shares tie the pools together
    (AMPD's depends on the decode batch, Dynamo's on the prefill queues), so every split is estimated
    rather than the two pools chosen apart as the MILP does."""
    if workers < 2:
        raise ValueError("a PD split needs at least two workers")
    # the conditional rules' and static PD's placements do not depend on the split: asked once
    placements = (
        queue_placements(policy, load, decode_slo_s) if isinstance(policy, StaticPD | ConditionalPD) else None
    )
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
            max_num_batched_tokens=max_num_batched_tokens,
            kv_tokens=kv_tokens,
            prefill_slots=prefill_slots,
            prefill_wait_s=prefill_wait_s,
            placements=placements,
        )
        for p in range(1, workers)
    )
    best = min(ests, key=lambda e: (e.bottleneck, max(e.prefill_utilisation, e.decode_utilisation)))
    return SplitPlan(policy.name, best, ests)
