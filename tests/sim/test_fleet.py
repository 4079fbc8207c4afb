"""The fleet: runs repeat exactly for a seed, and the simulator's policy decisions are the live pool's
(the same snapshots, built the same way, give the same decisions to the same policy class), its PD
prefill queue's picks the live prefill gate's."""

import asyncio

import pytest

from tokenops.bench.metrics import SLO
from tokenops.bench.workloads import make_workload
from tokenops.cluster.concurrency import AIMDConfig
from tokenops.cluster.pd import PrefillJob, StaticPD
from tokenops.cluster.pd_dispatch import PrefillGate
from tokenops.cluster.perf_model import PerfModel
from tokenops.cluster.policies import make_policy
from tokenops.cluster.pool import ReplicaPool, ReplicaSpec
from tokenops.cluster.prefill_queue import PrefillQueue
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.fleet import Fleet, FleetConfig
from tokenops.sim.workload import sim_sessions

PERF = PerfModel(name="t", base_s=0.012, per_token_s=0.0004, prefill_attention_s=2e-8,
                 decode_attention_s=3e-7)  # fmt: skip


def _sessions(seed: int, n: int = 400, rate: float = 40.0):
    wl = make_workload(
        "multi-turn",
        seed=seed,
        block_size=16,
        prefix_len=256,
        groups=4,
        input_len="uniform:32,200",
        output_len="uniform:8,64",
        think_s="exp:0.5",
    )
    return sim_sessions(wl, num_requests=n, rate=rate, seed=seed, block_size=16, trace_block=16)


def _run(seed: int, policy: str = "power_of_two", **cfg):
    opts = {"seed": seed} if policy == "power_of_two" else {}
    fleet = Fleet(
        FleetConfig(PERF, EngineShape(num_kv_blocks=1024), replicas=4, **cfg),
        make_policy(policy, **opts),
        record_decisions=True,
    )
    return fleet.run(_sessions(seed))


def _trace(res):
    return [(r.session_id, r.round, r.start, tuple(r.chunk_times), r.end) for r in res.records]


def test_a_seeded_run_repeats_event_for_event_and_another_seed_differs():
    a, b, c = _run(7), _run(7), _run(8)
    assert _trace(a) == _trace(b)
    assert [d[2] for d in a.decisions] == [d[2] for d in b.decisions]
    assert a.events == b.events
    assert _trace(a) != _trace(c)
    assert len(a.records) == 400 and all(r.success for r in a.records)


def test_the_summary_is_the_bench_summary_with_replica_stats():
    s = _run(3, "round_robin").summary(SLO(ttft=1.0, tpot=0.2))
    for key in (
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_tpot_ms",
        "p99_itl_ms",
        "request_goodput",
        "slo_attainment",
        "output_throughput",
    ):
        assert key in s
    assert s["completed"] == 400 and 0 < s["slo_attainment"] <= 1
    assert set(s["replica_stats"]) == {"r0", "r1", "r2", "r3"}
    assert all(0 < v["utilisation"] <= 1 for v in s["replica_stats"].values())


def _live_decisions(policy_name: str, recorded, limit: int, replica_ids):
    """Replay the simulator's snapshots through a live `ReplicaPool` holding a fresh policy."""
    now = [0.0]
    pool = ReplicaPool(
        "sim", [ReplicaSpec(url=rid, id=rid) for rid in replica_ids], make_policy(policy_name),
        concurrency=AIMDConfig(initial=limit, max_limit=limit), clock=lambda: now[0],
    )  # fmt: skip
    out = []

    async def go():
        for info, snap, _ in recorded:
            now[0] = snap.now
            states = snap.by_id
            for rid, rep in pool.replicas.items():
                st = states.get(rid)
                rep.limiter.in_flight = st.in_flight if st else limit  # absent: no free slot
                rep.in_flight_prompt_tokens = st.in_flight_prompt_tokens if st else 0
                rep.in_flight_output_tokens = st.in_flight_output_tokens if st else 0
                rep.reported = st.reported if st else None
                rep.polled = True
            assert pool.snapshot() == snap  # the live pool builds the very snapshot the sim built
            async with pool.acquire(info) as lease:
                out.append(lease.decision)

    asyncio.run(go())
    return out


@pytest.mark.parametrize("policy", ["prefix_aware", "kv_aware", "session_affinity", "round_robin"])
def test_the_same_snapshots_give_the_same_decisions_in_the_simulator_and_the_live_pool(policy):
    fleet = Fleet(
        FleetConfig(PERF, EngineShape(num_kv_blocks=1024), replicas=4, concurrency_limit=8),
        make_policy(policy),
        record_decisions=True,
    )
    res = fleet.run(_sessions(5, n=300, rate=60.0))
    sim = [d for _, _, d in res.decisions]
    assert len(sim) == 300
    assert len({d.replica for d in sim}) == 4
    live = _live_decisions(policy, res.decisions, 8, [w.id for w in fleet.workers])
    assert live == sim


def test_the_simulated_prefill_queue_picks_the_legs_the_live_prefill_gate_picks():
    # one prefill worker with one slot: the simulator's PD path hands waiting legs to a PrefillQueue;
    # replayed through the live PrefillGate (the same jobs, the same clock), every freed slot goes to
    # the same leg
    cfg = FleetConfig(
        PERF, EngineShape(num_kv_blocks=1024), replicas=2, prefill_replicas=1, ttft_slo_s=1.0,
        prefill_slots=1, prefill_queue=True, prefill_lookahead=4, prefill_max_deferrals=2,
    )  # fmt: skip
    fleet = Fleet(cfg, pd_policy=StaticPD(PERF))
    queue = fleet.prefill_queues["p0"]
    assert isinstance(queue, PrefillQueue) and queue.perf is PERF and queue.worker == "p0"
    ops = []  # ("push", job) or ("pop", now, the job taken)
    push, pop = queue.push, queue.pop
    queue.push = lambda job: (ops.append(("push", job)), push(job))[1]
    queue.pop = lambda now: (job := pop(now), ops.append(("pop", now, job)))[0]
    res = fleet.run(_sessions(5, n=300, rate=60.0))
    assert len(res.records) == 300 and all(r.success for r in res.records)
    pops = [op for op in ops if op[0] == "pop"]
    pushed = [op[1] for op in ops if op[0] == "push"]
    assert len(pops) == len(pushed) > 50
    assert [op[2] for op in pops] != pushed  # the queue reordered some legs: not first come first served
    assert [t for t, _, _ in fleet.leg_releases] == [now for _, now, _ in pops]
    assert live_gate_picks(ops, queue) == [op[2] for op in pops]


def live_gate_picks(ops, queue):
    """Drive a live `PrefillGate` through the simulator's queue operations: a leg holds the one slot
    while others are pushed; each pop is the holder leaving at that time. Returns whom it let in."""
    now = [0.0]
    gate = PrefillGate(queue.perf, queue.ttft_slo_s, lookahead=queue.lookahead,
                       max_deferrals=queue.max_deferrals, clock=lambda: now[0])  # fmt: skip
    let_in = []

    async def go():
        done: dict[int, asyncio.Event] = {}
        entered: asyncio.Queue = asyncio.Queue()

        async def leg(job):
            done[id(job)] = asyncio.Event()
            async with gate.turn("p0", job, lambda: 1, max_wait=1e9):
                await entered.put(job)
                await done[id(job)].wait()

        tasks = [asyncio.create_task(leg(PrefillJob("holder", 1)))]
        holder = await entered.get()
        for op in ops:
            if op[0] == "push":
                tasks.append(asyncio.create_task(leg(op[1])))
                await asyncio.sleep(0)  # it reaches the gate and waits
                assert gate.waiting("p0") > 0
            else:
                now[0] = op[1]
                done[id(holder)].set()
                holder = await entered.get()
                let_in.append(holder)
        done[id(holder)].set()
        await asyncio.gather(*tasks)

    asyncio.run(go())
    return let_in


def _sim_run(*extra: str):
    import json

    from typer.testing import CliRunner

    from tokenops.cli import app

    args = ["sim", "run", "--profile", "opt-13b-a100-80g-tp1", "--num-requests", "60", "--rate", "0.5",
            "--input-len", "uniform:1500,2000", *extra]  # fmt: skip
    res = CliRunner().invoke(app, args, terminal_width=200)
    return res.exit_code, (json.loads(res.output) if res.exit_code == 0 else res.output)


def test_sim_run_takes_the_engines_prefill_chunk_and_step_limits():
    # long prompts arriving alone: a 2,048-token prefill step takes each in one step instead of four
    # of the 512-token budget, and 256-token chunks take eight, so TTFT falls and rises in that order
    code, base = _sim_run()
    assert code == 0 and base["completed"] == 60
    _, step = _sim_run("--max-prefill-step-tokens", "2048")
    _, chunk = _sim_run("--max-chunk-tokens", "256")
    assert step["median_ttft_ms"] < base["median_ttft_ms"] < chunk["median_ttft_ms"]
    for bad, said in [
        (("--max-prefill-step-tokens", "0"), "max_prefill_step_tokens must be >= 1"),
        (("--max-chunk-tokens", "0"), "max_chunk_tokens must be >= 1"),
        (("--max-num-seqs", "600"), "max_num_batched_tokens must be >= max_num_seqs"),
    ]:
        code, out = _sim_run(*bad)
        assert code == 2 and said in out  # a usage error, not a traceback


def test_plan_pd_checks_the_engines_limits_before_planning():
    from typer.testing import CliRunner

    from tokenops.cli import app

    args = ["plan-pd", "--profile", "opt-13b-a100-80g-tp1", "--workers", "4", "--sessions-per-s", "1",
            "--max-num-seqs", "4000"]  # fmt: skip
    res = CliRunner().invoke(app, args, terminal_width=200)
    assert res.exit_code == 2 and "max_num_batched_tokens must be >= max_num_seqs" in res.output
