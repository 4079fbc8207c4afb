"""PD in the simulated fleet: what a PD snapshot reports (legs waiting at the gateway included), where a
remote prefill's history comes from, a leg whose wait for a slot runs out, and AMPD against static PD on
multi-round agentic sessions."""

import dataclasses
import json
import random
from collections import Counter

import pytest
from typer.testing import CliRunner

from tokenops.bench.metrics import SLO
from tokenops.bench.workloads import make_workload
from tokenops.cli import app
from tokenops.cluster.pd import AMPD, PDDecision, PDSnapshot, PrefillEstimate, PrefillJob, StaticPD
from tokenops.cluster.perf_model import PerfModel
from tokenops.sim.cli import PROFILES
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.fleet import Fleet, FleetConfig
from tokenops.sim.workload import sim_sessions

OPT13B = dataclasses.replace(PerfModel.load(PROFILES / "opt-13b-a100-80g-tp1.json"),
                             transfer_latency_s=0.001, transfer_bytes_per_s=25e9)  # fmt: skip
SHAPE = EngineShape(max_num_seqs=128, max_num_batched_tokens=2048, num_kv_blocks=3000)


def _agentic(n: int):
    wl = make_workload("agentic", seed=1, block_size=16)
    return sim_sessions(wl, num_requests=n, rate=1.0, seed=1, block_size=16, trace_block=16)


class _Alternating:
    """Every prefill remote, on p0 and p1 by turns, so the prefill worker lacks the last round's history;
    `new_only` ships back only what the decode worker lacks (AMPD's way), else the whole prompt."""

    name = "alternating"

    def __init__(self, new_only: bool) -> None:
        self.new_only = new_only

    def place(self, job: PrefillJob, snapshot: PDSnapshot) -> PDDecision:
        back = job.prompt_tokens - job.cached_on("d0") if self.new_only else job.prompt_tokens
        return PDDecision("d0", f"p{job.round % 2}", "test", transfer_tokens=back)

    def forget_worker(self, worker: str) -> None:
        pass


def _fleet(policy, n: int = 200, **kw):
    cfg = FleetConfig(
        OPT13B,
        SHAPE,
        replicas=kw.get("replicas", 1),
        prefill_replicas=kw.get("prefill", 1),
        ttft_slo_s=1.0,
        itl_slo_s=0.1,
    )
    fleet = Fleet(cfg, pd_policy=policy, record_decisions=True)
    return fleet, fleet.run(_agentic(n))


class _RemoteModelled:
    """Every prefill remote on p0 with an estimate whose modelled leg is `leg_s` (None: no estimate,
    as a rule-based policy); keeps each placing's time and the prefill worker's pace it saw."""

    name = "remote-modelled"

    def __init__(self, leg_s: float | None) -> None:
        self.leg_s = leg_s
        self.placed: dict[str, float] = {}
        self.paces: list[tuple[float, float | None]] = []

    def place(self, job: PrefillJob, snapshot: PDSnapshot) -> PDDecision:
        self.placed[job.request_id] = snapshot.now
        self.paces.append((snapshot.now, snapshot.prefill[0].leg_pace))
        est = None if self.leg_s is None else PrefillEstimate(0.0, 0.0, 0.0, 0.0, "p0", 0, self.leg_s)
        return PDDecision("d0", "p0", "test", job.prompt_tokens - job.cached_on("d0"), est)

    def forget_worker(self, worker: str) -> None:
        pass


class _LegsAnswered(Fleet):
    """A fleet that notes when each remote leg's KV is ready (the live leg's answer)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.answered: list[tuple[float, str]] = []

    def _prefilled(self, r) -> None:
        if r.prefill_replica is not None:
            self.answered.append((self.loop.now, str(r.id)))
        super()._prefilled(r)


@pytest.mark.parametrize("leg_s", [None, 0.05])
def test_a_pd_snapshot_shows_a_prefill_workers_legs_observed_over_modelled_time(leg_s):
    # as the live gateway: a leg's time from its placing (its wait for a slot at the gateway
    # included) to its KV ready, over the time the policy modelled for it, summed over the legs that
    # answered in the last 10 s; legs no policy modelled leave it unknown
    policy = _RemoteModelled(leg_s)
    cfg = FleetConfig(OPT13B, SHAPE, replicas=1, prefill_replicas=1, ttft_slo_s=1.0, itl_slo_s=0.1,
                      prefill_slots=1)  # fmt: skip
    fleet = _LegsAnswered(cfg, pd_policy=policy)
    res = fleet.run(_agentic(150))
    assert all(r.success for r in res.records)
    if leg_s is None:
        assert all(p is None for _, p in policy.paces)
        return
    legs = [(at, at - policy.placed[rid]) for at, rid in fleet.answered]
    assert sum(took > 0.5 for _, took in legs) >= 10, "legs should wait for the one slot"
    checked = 0
    for now, pace in policy.paces:
        window = [took for at, took in legs if now - 10.0 <= at <= now]
        if not window:
            assert pace is None
            continue
        assert pace == pytest.approx(sum(window) / (leg_s * len(window)))
        checked += 1
    assert checked >= 100


def test_a_remote_prefill_that_ships_back_only_new_tokens_gets_the_history_instead_of_recomputing_it():
    _, shipped = _fleet(_Alternating(new_only=True), n=100, prefill=2)
    _, recomputed = _fleet(_Alternating(new_only=False), n=100, prefill=2)
    assert all(r.success for r in shipped.records) and len(shipped.records) == 100

    def computed(res):
        return res.replicas["p0"]["prefill_tokens"] + res.replicas["p1"]["prefill_tokens"]

    # the prefill workers compute only what neither side holds (a block's remainder at most besides)
    new = sum(
        job.prompt_tokens - max(job.cached_on("d0"), job.cached_on(d.prefill))
        for job, _, d in shipped.decisions
    )
    assert computed(shipped) <= new + 16 * len(shipped.records)
    # shipping the whole prompt back means the other round's history is recomputed there
    assert computed(shipped) < 0.5 * computed(recomputed)


def test_a_pd_snapshot_counts_prompt_tokens_still_to_compute_without_the_cached_history():
    _, res = _fleet(StaticPD(OPT13B), n=300, replicas=2, prefill=1)
    loads = [w for _, snap, _ in res.decisions for w in snap.prefill]
    assert any(w.queued_requests for w in loads), "the run never queued a prefill"
    # rounds past the first hold thousands of history tokens; what is left to compute is far less
    for w in loads:
        assert w.queued_prefill_tokens <= (w.queued_requests + w.running) * 8192


class _LocalOnD0:
    """Every prefill local on d0; keeps each snapshot's d0 beside d0's own state at that moment."""

    name = "local-on-d0"

    def __init__(self) -> None:
        self.fleet: Fleet | None = None
        self.seen: list[tuple] = []

    def place(self, job: PrefillJob, snapshot: PDSnapshot) -> PDDecision:
        w = self.fleet.by_id["d0"]
        self.seen.append((snapshot.decode[0], w.queued, w.prefill_backlog(), w.running))
        return PDDecision("d0", None, "test")

    def forget_worker(self, worker: str) -> None:
        pass


def test_a_pd_snapshot_counts_the_requests_placed_before_their_engine_takes_them():
    # as the live gateway's counts: a request on its way to its worker, or in its engine's inbox until
    # the step under way ends, is in no engine's state yet; the snapshot has it, so two prefills placed
    # within one step do not each see an idle worker
    policy = _LocalOnD0()
    cfg = FleetConfig(OPT13B, SHAPE, replicas=1, prefill_replicas=1, ttft_slo_s=1.0, itl_slo_s=0.1)
    fleet = policy.fleet = Fleet(cfg, pd_policy=policy)
    res = fleet.run(_agentic(300))
    assert all(r.success for r in res.records) and len(res.records) == 300
    # placements the engine has not taken yet: more requests and prompt tokens in the snapshot than
    # in d0's own queue (the snapshot takes the larger of the two, so never fewer)
    ahead = [
        (load, queued, backlog) for load, queued, backlog, _ in policy.seen if load.queued_requests > queued
    ]
    assert len(ahead) >= 10
    assert sum(load.queued_prefill_tokens > backlog for load, _, backlog in ahead) >= 10


def test_ampd_holds_its_own_against_static_pd_on_agentic_sessions():
    slo = SLO(ttft=1.0, itl=0.1)
    runs = {}
    for name, policy in (
        ("static", StaticPD(OPT13B)),
        ("ampd", AMPD(OPT13B)),
        ("faster", AMPD(OPT13B, remote_ttft_share=0.0)),
    ):
        _, res = _fleet(policy, n=1000, replicas=4, prefill=4)
        runs[name] = res.summary(slo)["slo_attainment"]
        reasons = Counter(d.reason for _, _, d in res.decisions)
        # slack decides nearly every placement; a local prefill that misses both SLOs is rare
        assert reasons["local-least-violation"] <= 10
        if name == "ampd":
            # four prefill workers for four decode workers have TTFT slack: nearly every round goes there
            assert reasons["remote-slack"] > 900
        if name == "faster":
            # the faster way on every tie keeps the rounds that fit the decode batch local
            assert reasons["local-slack"] > 100 and reasons["remote-slack"] > 100
    # a local prefill inside the batch does not stall the running sequences past the ITL SLO
    assert runs["ampd"] >= 0.95 * runs["static"] and runs["faster"] >= 0.9 * runs["static"]


def test_incremental_static_pd_pulls_the_history_that_vllms_static_pd_recomputes():
    computed, bound = {}, {}
    for policy in (StaticPD(OPT13B), StaticPD(OPT13B, incremental=True)):
        _, res = _fleet(policy, n=300, replicas=2, prefill=2)
        assert all(r.success for r in res.records) and len(res.records) == 300
        assert {d.reason for _, _, d in res.decisions} == {"static-remote"}
        pool = [v["prefill_tokens"] for v in res.replicas.values() if v["role"] == "prefill"]
        computed[policy.name] = sum(pool)
        # what neither the decode worker nor the chosen prefill worker held (a block's remainder besides)
        bound[policy.name] = sum(
            job.prompt_tokens - max(job.cached_on(d.decode), job.cached_on(d.prefill)) + 16
            for job, _, d in res.decisions
        )
    assert computed["static_pd_incremental"] <= bound["static_pd_incremental"]
    # as vLLM ships it, the prefill worker recomputes the history its own cache lost
    assert computed["static_pd"] > bound["static_pd"]
    assert computed["static_pd_incremental"] < 0.85 * computed["static_pd"]


def test_ampd_keeps_prefills_local_when_the_prefill_pool_is_the_bottleneck():
    slo = SLO(ttft=1.0, itl=0.1)
    runs, local = {}, {}
    for policy, prefill in ((StaticPD(OPT13B, incremental=True), 1), (AMPD(OPT13B), 1), (AMPD(OPT13B), 3)):
        _, res = _fleet(policy, n=1000, replicas=3, prefill=prefill)
        runs[policy.name, prefill] = res.summary(slo)["slo_attainment"]
        local[policy.name, prefill] = sum(d.reason.startswith("local") for _, _, d in res.decisions)
    # one prefill worker for three decode workers: every prefill there queues, a local one does not
    assert runs["ampd", 1] > 1.05 * runs["static_pd_incremental", 1]
    # the rounds it keeps local are where the prefill side lacks TTFT slack: with three prefill
    # workers it has slack for nearly every round
    assert local["ampd", 1] > 5 * local["ampd", 3] and local["ampd", 1] >= 50


def test_a_kv_pull_of_held_blocks_does_not_wait_for_the_prefill_workers_step():
    # as the live KV server, which begins a pull of held blocks at once while its engine steps
    from tokenops.sim.workload import SimRound, SimSession

    perf = PerfModel(base_s=0.01, per_token_s=0.001, kv_bytes_per_token=1000, transfer_latency_s=0.002,
                     transfer_bytes_per_s=1e8)  # fmt: skip
    shape = EngineShape(max_num_seqs=8, max_num_batched_tokens=2048, num_kv_blocks=1000)

    def first_token_of_a(with_b: bool) -> float:
        sessions = [SimSession("a", 0.0, (SimRound(64, 4, 0.0, (), ()),))]
        if with_b:  # arrives during a's prefill step, so its own long step runs when a's pull begins
            sessions.append(SimSession("b", 0.001, (SimRound(1024, 4, 0.0, (), ()),)))
        cfg = FleetConfig(perf, shape, replicas=1, prefill_replicas=1, poll_interval_s=None)
        res = Fleet(cfg, pd_policy=StaticPD(perf)).run(sessions)
        return next(r for r in res.records if r.session_id == "a").ttft

    a_prefill, b_prefill = perf.prefill_time(64), perf.prefill_time(1024)
    alone, behind_b = first_token_of_a(False), first_token_of_a(True)
    assert alone < a_prefill + perf.transfer_time(64) + 0.1
    assert b_prefill > 0.5 and behind_b - alone < 0.5 * b_prefill


def _legs_on_one_slot(wait_s, prompts):
    """Sessions one millisecond apart, each with one round of `prompts` (tokens, block hashes), every
    prefill remote on one prefill worker with one slot: the first leg takes it, the others wait."""
    from tokenops.sim.workload import SimRound, SimSession

    perf = PerfModel(base_s=0.01, per_token_s=0.001, kv_bytes_per_token=1000, transfer_latency_s=0.002,
                     transfer_bytes_per_s=1e8)  # fmt: skip
    shape = EngineShape(max_num_seqs=8, max_num_batched_tokens=2048, num_kv_blocks=1000)
    sessions = [
        SimSession(name, i * 0.001, (SimRound(n, 4, 0.0, hashes, ()),))
        for i, (name, (n, hashes)) in enumerate(prompts.items())
    ]
    cfg = FleetConfig(perf, shape, replicas=1, prefill_replicas=1, poll_interval_s=None, prefill_slots=1,
                      prefill_wait_s=wait_s)  # fmt: skip
    fleet = Fleet(cfg, pd_policy=StaticPD(perf), record_decisions=True)
    res = fleet.run(sessions)
    return fleet, res, {r.session_id: r for r in res.records}


def _three_legs_on_one_slot(wait_s):
    """a's 1024-token leg takes the slot for about a second, b's and c's wait at the gateway."""
    return _legs_on_one_slot(wait_s, {"a": (1024, ()), "b": (512, ()), "c": (256, ())})


def test_legs_waiting_with_a_shared_prefix_count_it_once():
    # b, c and d share a 512-token system prompt (32 blocks) and add 64 tokens each: the leg that goes
    # first leaves it cached, so those behind it compute their own 64
    system = tuple(range(1, 33))
    own = {name: tuple(range(k * 100, k * 100 + 4)) for k, name in enumerate("bcd", 1)}
    prompts = {"a": (1024, tuple(range(1000, 1064)))} | {n: (576, system + h) for n, h in own.items()}
    fleet, res, _ = _legs_on_one_slot(None, prompts)
    waiting = [
        (snap.prefill[0].waiting_legs, snap.prefill[0].waiting_prefill_tokens) for _, snap, _ in res.decisions
    ]
    assert waiting == [(0, 0), (0, 0), (1, 576), (2, 576 + 64)]
    assert (fleet._backlog["p0"].legs, fleet._backlog["p0"].tokens) == (0, 0)


def test_a_pd_snapshot_shows_the_legs_waiting_at_the_gateway_for_a_prefill_workers_slot():
    fleet, res, _ = _three_legs_on_one_slot(None)
    waiting = [
        (snap.prefill[0].waiting_legs, snap.prefill[0].waiting_prefill_tokens) for _, snap, _ in res.decisions
    ]
    # a found the slot free; b found it taken; c found b waiting for it with its 512 uncached tokens
    assert waiting == [(0, 0), (0, 0), (1, 512)]
    assert [job for _, _, job in fleet.leg_releases] == ["2", "3"] and not fleet.leg_timeouts
    assert (fleet._backlog["p0"].legs, fleet._backlog["p0"].tokens) == (0, 0)


def test_a_leg_whose_wait_runs_out_is_prefilled_on_its_decode_worker():
    fleet, res, by_session = _three_legs_on_one_slot(0.05)
    # b and c gave up on the slot 50 ms after their placing, as the live dispatch's wait ends
    assert [(round(t, 3), w, job) for t, w, job in fleet.leg_timeouts] == [
        (0.051, "p0", "2"),
        (0.052, "p0", "3"),
    ]
    assert not fleet.leg_releases and (fleet._backlog["p0"].legs, fleet._backlog["p0"].tokens) == (0, 0)
    assert all(r.success for r in res.records) and len(res.records) == 3
    # the decode worker computed their prompts itself; the prefill worker only a's
    assert res.replicas["p0"]["prefill_tokens"] == 1024
    assert res.replicas["d0"]["prefill_tokens"] >= 512 + 256
    # their first tokens came after the wait, well before a's leg would have freed the slot
    waited = _three_legs_on_one_slot(None)[2]["b"]
    assert 0.05 < by_session["b"].ttft < by_session["a"].ttft < waited.ttft


def test_sim_run_takes_a_pd_policy_by_its_one_name():
    runner = CliRunner()
    args = ["sim", "run", "--profile", "opt-13b-a100-80g-tp1", "--workload", "multi-turn", "--rate", "1",
            "--num-requests", "40", "--prefill-replicas", "1"]  # fmt: skip
    for name in ("conditional_dynamo", "ampd"):
        res = runner.invoke(app, [*args, "--pd", name], terminal_width=200)
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["completed"] == 40
    res = runner.invoke(app, [*args, "--pd", "dynamo"], terminal_width=200)
    said = " ".join(res.output.replace("│", " ").split())  # the error box wraps at 80 columns
    assert res.exit_code == 2 and "unknown PD policy 'dynamo': use one of static," in said


class _RandomPD:
    """Random placements: a decode worker, a prefill worker or none (local), and the whole prompt
    shipped back or only what the decode worker lacks (the prefill worker then pulls the history)."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def place(self, job: PrefillJob, snapshot: PDSnapshot) -> PDDecision:
        decode = f"d{self.rng.randrange(2)}"
        prefill = self.rng.choice([None, "p0", "p1"])
        back = job.prompt_tokens if self.rng.random() < 0.5 else job.prompt_tokens - job.cached_on(decode)
        return PDDecision(decode, prefill, "random", transfer_tokens=back)

    def forget_worker(self, worker: str) -> None:
        pass


@pytest.mark.parametrize(("seeds", "slots"), [(range(0, 150), None), ((*range(150, 300), 1638, 2076), 1)])
def test_random_pd_runs_replay_replica_by_replica_on_the_engine(seeds, slots, monkeypatch):
    # two prefill and two decode workers with small pools, random placements, multi-round sessions:
    # each worker's steps, prompt tokens computed and preemptions, and each answer, equal the engine's
    # scheduler and block pool put through the same requests, KV imports, holds and pulls. Seeds 1638
    # and 2076 are where a peer's pull refreshing the blocks it read decides what is evicted later
    from .engine_replay import Case, ReplicaLog

    log = ReplicaLog()
    log.install(monkeypatch)
    for seed in seeds:
        log.clear()
        _replay_random_pd(Case.draw(seed, 3, 2.0), seed, slots, log)


@pytest.mark.parametrize("slots", [None, 1])
def test_decode_rows_ahead_of_a_preemption_take_what_is_free_first_as_in_the_engine(slots, monkeypatch):
    # the engine grants decode rows their blocks one by one, so the rows ahead of the one that finds
    # the pool empty evict every cached block before the last-added sequence is preempted; a
    # simulator that preempted first gave them the victim's freed blocks and kept an old cached one,
    # which a later request then found (decode worker d1, 1 prompt token computed against 17)
    from .engine_replay import Case, ReplicaLog

    case = Case(
        EngineShape(max_num_seqs=5, max_num_batched_tokens=128, num_kv_blocks=20, max_chunk_tokens=80,
                    max_prefill_step_tokens=272),
        [(8, 6, [(12, 30, 88.0)], 1.236), (8, 4, [(0, 5, 180.6)], 0.261),
         (0, 4, [(11, 19, 69.2), (14, 9, 103.4)], 0.158),
         (0, 1, [(0, 5, 211.0), (20, 30, 147.1), (38, 1, 125.9)], 1.483),
         (0, 8, [(11, 17, 296.3), (29, 7, 111.1), (31, 25, 267.8)], 1.375), (0, 9, [(12, 7, 49.8)], 0.217)],
    )  # fmt: skip
    log = ReplicaLog()
    log.install(monkeypatch)
    _replay_random_pd(case, 80, slots, log)


def _replay_random_pd(case, seed: int, slots: int | None, log) -> None:
    """Run `case` on two prefill and two decode workers under `_RandomPD(seed)`, watched by `log`, then
    replay each worker on the engine's scheduler and block pool: steps, prompt tokens, preemptions
    and answers."""
    from .engine_replay import PERF, replay

    sims = case.simulated()
    cfg = FleetConfig(
        PERF, case.shape, replicas=2, prefill_replicas=2, poll_interval_s=None, prefill_slots=slots
    )
    fleet = Fleet(cfg, pd_policy=_RandomPD(seed))
    res = fleet.run(sims)
    answers = {(r.session_id, r.round): r.output_tokens for r in res.records}
    replayed = {}
    for w in fleet.workers + fleet.prefill_workers:
        *engine, done = replay(case, sims, log, w.id)
        assert [w.steps, w.prefill_tokens, w.preemptions] == engine, (seed, w.id, case)
        replayed.update({key: n for key, (_, n) in done.items()})
        assert not w._pinned and not w.in_use and w.used_private == 0  # every block given back
    assert answers == replayed, (seed, case)
