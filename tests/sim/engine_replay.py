"""The engine's own scheduler and block pool, driven through what the replica model did: the tests
hold the model to the engine by replaying a simulated run, replica by replica, on the engine's
objects and comparing steps, prompt tokens computed, preemptions, cached tokens and answers.

A replica's run is logged as the engine would see it: each planning pass (one `schedule()` call,
empty or not), the requests that reached its queue before each pass, and the pool operations that
reach an engine from other threads (KV imports, the unpins of a hold or of a peer's pull), stamped
with the pass they came before."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tokenops.bench.traces import TraceRecord
from tokenops.cluster.perf_model import PerfModel
from tokenops.engine.block_pool import BlockPool
from tokenops.engine.config import EngineConfig
from tokenops.engine.sampling_params import SamplingParams
from tokenops.engine.scheduler import Scheduler
from tokenops.engine.sequence import Sequence
from tokenops.sim.engine_model import EngineShape, ReplicaEngine
from tokenops.sim.workload import SimSession, to_sim_session

# the hand-made model the replays and the engine model's tests run on
PERF = PerfModel(
    name="hand", base_s=0.010, per_token_s=0.001, prefill_attention_s=1e-7, decode_attention_s=1e-6,
    kv_bytes_per_token=1000, transfer_latency_s=0.002, transfer_bytes_per_s=1e8,
)  # fmt: skip


def engine_scheduler(shape: EngineShape) -> Scheduler:
    """The engine's own scheduler and block pool with `shape`'s limits, 16-token blocks."""
    cfg = EngineConfig(
        block_size=16,
        num_kv_blocks=shape.num_kv_blocks,
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        max_chunk_tokens=shape.max_chunk_tokens,
        max_prefill_step_tokens=shape.max_prefill_step_tokens or shape.max_num_batched_tokens,
    )
    return Scheduler(cfg, BlockPool(shape.num_kv_blocks, 16), 8192, (0,))


def engine_seq(i: int, tokens: list[int], max_tokens: int) -> Sequence:
    return Sequence(f"r{i}", tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def block_tokens(blocks: list[int]) -> list[int]:
    return [1 + 16 * b + k for b in blocks for k in range(16)]  # each block id as 16 token ids


def engine_step(sched: Scheduler, prefilling: set[int]) -> tuple[int, int] | None:
    """One step of the engine's scheduler, every sampling row given token 7; returns the prompt
    tokens it computed (a sequence's tokens from its admission, or re-admission after a preemption,
    to its first sample: `prefilling` holds the sequences in between) and its decode rows, None for
    an empty step."""
    running = {id(s) for s in sched.running}
    out = sched.schedule()
    if not out.scheduled:
        return None
    prefill = rows = 0
    for e in out.scheduled:
        if id(e.seq) not in running:
            prefilling.add(id(e.seq))
        if id(e.seq) in prefilling:
            prefill += e.num_new_tokens
        else:
            rows += 1
    sampled = [id(e.seq) for e in out.scheduled if e.samples]
    sched.update(out, [7 if e.samples else None for e in out.scheduled])
    prefilling.difference_update(sampled)
    return prefill, rows


def step_to_end(sched: Scheduler) -> tuple[int, int]:
    """Run the engine's scheduler until every request ends: its steps and prompt tokens computed."""
    steps = prefill = 0
    prefilling: set[int] = set()
    while sched.has_unfinished():
        prefill += (engine_step(sched, prefilling) or (0, 0))[0]
        steps += 1
    return steps, prefill


@dataclass
class Case:
    """A random small workload: sessions of 1 to `max_rounds` rounds on small pools, budgets and
    chunks. A session: `shared` leading blocks common to all, `own` of its own, then per round the
    tokens its prompt adds after the last answer, the answer's length and the delay before it (ms);
    and its start."""

    shape: EngineShape
    sessions: list[tuple[int, int, list[tuple[int, int, float]], float]]

    @classmethod
    def draw(cls, seed: int, max_rounds: int, spread_s: float) -> Case:
        rng = random.Random(seed)
        shape = EngineShape(
            num_kv_blocks=rng.randint(12, 40),
            max_num_batched_tokens=16 * rng.randint(2, 12),
            max_chunk_tokens=16 * rng.randint(1, 6),
            max_num_seqs=rng.randint(2, 6),
            # drawn apart, so the other draws stay those of the cases before the rule
            max_prefill_step_tokens=16 * random.Random(~seed).randint(1, 24),
        )
        sessions = []
        for _ in range(rng.randint(2, 8)):
            shared, own = rng.choice([0, 0, 4, 8]), rng.randint(1, 10)
            rounds = [
                (rng.randint(1, 40) if k else rng.randint(0, 15), rng.randint(1, 30), rng.uniform(0, 400))
                for k in range(rng.randint(1, max_rounds))
            ]
            if (shared + own) * 16 + sum(e + o for e, o, _ in rounds) <= shape.num_kv_blocks * 16:
                sessions.append((shared, own, rounds, rng.uniform(0, spread_s)))
        return cls(shape, sessions)

    def simulated(self) -> list[SimSession]:
        out = []
        for i, (shared, own, rounds, start) in enumerate(self.sessions):
            records, length = [], (shared + own) * 16
            for k, (extra, answer, delay) in enumerate(rounds):
                length += extra
                records.append(TraceRecord(0, length, answer, list(range(shared)), f"s{i}", k, delay))
                length += answer
            out.append(to_sim_session(records, start, 16, 16, i))
        return out

    def tokens(self, i: int) -> list[int]:
        """Session i's whole sequence as the engine sees it: its blocks, then per round the tokens its
        prompt adds and the answer (every answer token is 7, as `engine_step` samples)."""
        shared, own, rounds, _ = self.sessions[i]
        out = block_tokens(list(range(shared)) + [10_000 * (i + 1) + b for b in range(own)])
        for k, (extra, answer, _) in enumerate(rounds):
            first = 1 + 16 * (10_000 * (i + 1) + 1000 * k)
            out += list(range(first, first + extra)) + [7] * answer
        return out


@dataclass
class ReplicaLog:
    """What each simulated replica did, as its engine would have seen it (see the module's doc)."""

    plans: dict[str, int] = field(default_factory=dict)
    ops: dict[str, list[tuple[int, str, object]]] = field(default_factory=dict)
    steps: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)  # (pass, prompt tokens, rows)
    keys: dict[int, tuple[str, int]] = field(default_factory=dict)  # request id -> (session, round)

    def install(self, monkeypatch) -> None:
        log = self
        plan, add, pin = ReplicaEngine._plan, ReplicaEngine.add, ReplicaEngine.pin_for_peer

        def watched_plan(self, arg):
            n = log.plans[self.id] = log.plans.get(self.id, 0) + 1
            was = self.steps + self._stepping
            plan(self, arg)
            if self.steps + self._stepping > was:  # a step was launched
                prefill = sum(m for _, m in self._batch)
                log.steps.setdefault(self.id, []).append((n, prefill, self.n_decode))

        def watched_add(self, r, kv=()):
            log.keys[r.id] = (r.session_id, r.round)
            add(self, r, kv)

        def watched_pin(self, r, hashes):
            log.keys[r.id] = (r.session_id, r.round)
            pin(self, r, hashes)

        monkeypatch.setattr(ReplicaEngine, "_plan", watched_plan)
        monkeypatch.setattr(ReplicaEngine, "add", watched_add)
        monkeypatch.setattr(ReplicaEngine, "pin_for_peer", watched_pin)
        for name in ("_add", "_import_prefix", "_pin_for_peer", "_unpin_for_peer"):
            op = getattr(ReplicaEngine, name)

            def watched_op(self, arg, op=op, name=name):
                op(self, arg)  # an add logs after the import it makes
                if name == "_add":
                    r = arg[0]
                    what: object = (log.keys[r.id], r.prefill_only, r.max_tokens)
                elif name == "_pin_for_peer":
                    what = (log.keys[arg[0]], list(arg[1]))
                elif name == "_unpin_for_peer":
                    what = log.keys[arg]
                else:
                    what = list(arg)
                log.ops.setdefault(self.id, []).append((log.plans.get(self.id, 0) + 1, name, what))

            monkeypatch.setattr(ReplicaEngine, name, watched_op)

    def clear(self) -> None:
        self.plans.clear()
        self.ops.clear()
        self.keys.clear()
        self.steps.clear()


def replay(case: Case, sims: list[SimSession], log: ReplicaLog, replica: str):
    """Replica `replica`'s logged run on the engine's scheduler and pool: before each planning pass
    the operations logged before it, in their order (requests added, KV imports, blocks pinned for
    a peer and released), then `schedule()`, whose prompt tokens and decode rows must be the model's
    for that pass; a prefill leg's prompt blocks are pinned from its end
    until its hold's release, as the engine's KV hold keeps them. Returns the steps, prompt tokens
    computed and preemptions, and per request by (session, round) its cached tokens and answer
    length."""
    sched = engine_scheduler(case.shape)
    pool = sched.pool
    tokens = [case.tokens(i) for i in range(len(case.sessions))]
    where: dict[int, tuple[int, int]] = {}  # the model's block hash -> (session, block)
    for i, s in enumerate(sims):
        for j, h in enumerate(s.rounds[-1].cache_hashes):
            where.setdefault(h, (i, j))

    def engine_hashes(hashes: list[int]) -> tuple[list[int], list[int]]:
        """The model's hashes of one session's chain as the engine's: the tokens up to them, and
        their hashes."""
        i, last = where[hashes[-1]]
        head = tokens[i][: (last + 1) * 16]
        return head, pool.prefix_hashes(head)[where[hashes[0]][1] :]

    ops = list(log.ops.get(replica, []))  # in the order they ran, so in pass order
    seqs: dict[tuple[str, int], tuple[Sequence, bool]] = {}
    pinned: dict[tuple[str, int], list[int]] = {}

    def before(n: int) -> None:
        while ops and ops[0][0] <= n:
            _, name, what = ops.pop(0)
            if name == "_add":
                key, prefill_only, max_tokens = what
                i, k = int(key[0][1:]), key[1]
                prompt = tokens[i][: sims[i].rounds[k].prompt_tokens]
                seq = engine_seq(len(seqs), prompt, 1 if prefill_only else max_tokens)
                seqs[key] = (seq, prefill_only)
                sched.add(seq)
            elif name == "_unpin_for_peer":
                pool.unpin(pinned.pop(what))
            elif name == "_pin_for_peer":
                key, hashes = what
                pinned[key] = pool.pin_cached(engine_hashes(hashes)[1]) if hashes else []
            elif what:
                head, expected = engine_hashes(what)
                have = pool.cached_blocks(expected)
                pool.import_chain(head, have, expected[have:])

    steps = prefill = 0
    prefilling: set[int] = set()
    shapes: list[tuple[int, int, int]] = []
    for n in range(1, log.plans.get(replica, 0) + 1):
        before(n)
        ended = {key for key, (s, _) in seqs.items() if s.finish_reason is not None}
        step = engine_step(sched, prefilling)
        if step is None:
            continue
        shapes.append((n, *step))
        prefill += step[0]
        steps += 1
        for key, (s, prefill_only) in seqs.items():
            if prefill_only and s.finish_reason is not None and key not in ended:
                pinned[key] = pool.pin_cached(pool.prefix_hashes(s.token_ids[: s.num_prompt_tokens]))
    before(1 << 62)
    assert not sched.has_unfinished() and not pinned
    modelled = log.steps.get(replica, [])
    if modelled != shapes:  # (pass, prompt tokens, decode rows) of each step, from the first that differs
        pairs = zip([*modelled, None], [*shapes, None], strict=False)
        i = next(i for i, (a, b) in enumerate(pairs) if a != b)
        raise AssertionError(f"{replica}: modelled {modelled[i : i + 3]}, engine {shapes[i : i + 3]}")
    pool.check_invariants()
    answers = {
        key: (s.num_cached_tokens, len(s.output_token_ids)) for key, (s, leg) in seqs.items() if not leg
    }
    return steps, prefill, sched.num_preemptions, answers
