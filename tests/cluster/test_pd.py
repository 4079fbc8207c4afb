"""PD placement policies as pure functions of a snapshot."""

import dataclasses

import pytest

from tokenops.cluster.pd import (
    Colocated,
    PDSnapshot,
    PrefillJob,
    SessionBindings,
    StaticPD,
    StreamProgress,
    WorkerLoad,
)


def _snap(**kw) -> PDSnapshot:
    prefill = (WorkerLoad("p0", "prefill", queued_prefill_tokens=500), WorkerLoad("p1", "prefill"))
    decode = (
        WorkerLoad("d0", "decode", kv_free_tokens=100, kv_total_tokens=1000, running=3),
        WorkerLoad("d1", "decode", kv_free_tokens=800, kv_total_tokens=1000, running=5),
    )
    return PDSnapshot(prefill=kw.get("prefill", prefill), decode=kw.get("decode", decode))


def test_static_pd_sends_every_prefill_remote_and_binds_the_session():
    policy = StaticPD()
    first = policy.place(PrefillJob("r1", 300, session_id="s"), _snap())
    assert (first.decode, first.prefill, first.transfer_tokens) == ("d1", "p1", 300)
    # the next round stays on d1 even when d0 has more headroom now
    swapped = (
        WorkerLoad("d0", "decode", kv_free_tokens=900, kv_total_tokens=1000),
        WorkerLoad("d1", "decode", kv_free_tokens=100, kv_total_tokens=1000),
    )
    again = policy.place(PrefillJob("r2", 600, session_id="s", round=1), _snap(decode=swapped))
    assert again.decode == "d1" and again.remote


def test_static_pd_ships_the_whole_prompt_back_unless_incremental():
    job = PrefillJob("r", 1000, session_id="s", round=2, cached_tokens={"d1": 800})
    shipped = StaticPD().place(job, _snap())
    # as vLLM ships it: the prefill worker recomputes the history it lacks rather than pulling it
    assert shipped.remote and shipped.transfer_tokens == 1000 and not shipped.pull_history
    incremental = StaticPD(incremental=True)
    only_new = incremental.place(job, _snap())
    assert incremental.name == "static_pd_incremental"
    assert (only_new.decode, only_new.remote, only_new.transfer_tokens) == ("d1", True, 200)
    assert only_new.pull_history


def test_static_pd_prefers_the_prefill_worker_that_caches_the_prompt():
    job = PrefillJob("r", 1000, cached_tokens={"p0": 900})
    assert StaticPD().place(job, _snap()).prefill == "p0"  # 500 + 100 queued < 0 + 1000


def test_static_pd_without_prefill_workers_prefills_locally():
    dead = (WorkerLoad("p0", "prefill", healthy=False),)
    decision = StaticPD().place(PrefillJob("r", 10), _snap(prefill=dead))
    assert decision.prefill is None and decision.reason == "no-prefill-worker"


def test_colocated_never_remote_and_rebinds_after_a_worker_dies():
    policy = Colocated()
    assert policy.place(PrefillJob("a", 50, session_id="s"), _snap()).decode == "d1"
    snap = _snap(
        decode=(
            WorkerLoad("d0", kv_free_tokens=1, kv_total_tokens=10),
            WorkerLoad("d1", kv_free_tokens=9, kv_total_tokens=10, healthy=False),
        )
    )
    decision = policy.place(PrefillJob("b", 50, session_id="s", round=1), snap)
    assert decision.decode == "d0" and not decision.remote
    policy.forget_worker("d0")
    assert policy.bindings.get("s") is None


def test_session_bindings_are_bounded():
    b = SessionBindings(limit=2)
    for s in "abc":
        b.bind(s, "w")
    assert b.get("a") is None and b.get("c") == "w"


# -- conditional rules ----------------------------------------------------------------------------------

from tokenops.cluster.pd import (  # noqa: E402
    AMPD,
    PD_POLICY_NAMES,
    ConditionalPD,
    LegPace,
    make_pd_policy,
)
from tokenops.cluster.perf_model import PerfModel, StepShape  # noqa: E402
from tokenops.cluster.prefill_queue import PrefillQueue  # noqa: E402


def test_dynamo_rule_remote_only_past_1000_uncached_tokens_and_a_short_queue():
    policy = ConditionalPD.dynamo()
    snap = _snap()
    assert not policy.place(PrefillJob("a", 1000), snap).remote  # 1000 is not > 1000
    remote = policy.place(PrefillJob("b", 1001), snap)
    assert remote.remote and remote.transfer_tokens == 1001
    # the decode worker holds most of the prompt: the uncached part is short, so it stays local
    cached = PrefillJob("c", 3000, session_id="s", cached_tokens={"d1": 2500})
    assert policy.place(cached, snap).reason == "short-uncached"
    full = tuple(WorkerLoad(p.id, "prefill", queued_requests=2) for p in snap.prefill)
    assert policy.place(PrefillJob("d", 5000), _snap(prefill=full)).reason == "prefill-queue-full"


def test_llm_d_rule_is_inclusive_and_ignores_the_queue():
    policy = ConditionalPD.llm_d(non_cached_tokens=256)
    full = tuple(WorkerLoad(p.id, "prefill", queued_requests=50) for p in _snap().prefill)
    assert policy.place(PrefillJob("a", 256), _snap(prefill=full)).remote
    assert not policy.place(PrefillJob("b", 255), _snap(prefill=full)).remote
    assert ConditionalPD.llm_d(0).place(PrefillJob("c", 1), _snap()).remote  # its default: always


# -- AMPD --------------------------------------------------------------------------------------------------

# AMPD with the faster way on every tie (no share of the TTFT SLO kept for remote): the tests of its
# ITL weighing, where local is the faster way
FASTER = {"remote_ttft_share": 0.0}

PERF = PerfModel(
    base_s=0.01,
    per_token_s=1e-4,
    decode_attention_s=1e-7,
    kv_bytes_per_token=1000,
    transfer_latency_s=0.002,
    transfer_bytes_per_s=1e9,
)


def _ampd_snap(running=8, itl=None, p_queue=0, **kw) -> PDSnapshot:
    return PDSnapshot(
        prefill=(WorkerLoad("p0", "prefill", queued_prefill_tokens=p_queue),),
        decode=(
            WorkerLoad(
                "d0",
                "decode",
                running=running,
                context_tokens=running * 2000,
                kv_free_tokens=50_000,
                kv_total_tokens=100_000,
                itl_recent_s=itl,
            ),
            WorkerLoad("d1", "decode", running=running, kv_free_tokens=10_000, kv_total_tokens=100_000),
        ),
        ttft_slo_s=kw.get("ttft_slo", 1.0),
        itl_slo_s=kw.get("itl_slo", 0.05),
    )


def test_ampd_binds_a_session_by_memory_headroom_and_keeps_it():
    policy = AMPD(PERF)
    first = policy.place(PrefillJob("r0", 2000, session_id="s", max_tokens=200), _ampd_snap())
    assert first.decode == "d0"
    # d1 looks freer now, but round 1 follows the session's history
    swapped = PDSnapshot(prefill=_ampd_snap().prefill, decode=tuple(reversed(_ampd_snap().decode)))
    assert policy.place(PrefillJob("r1", 2100, session_id="s", round=1), swapped).decode == "d0"
    # a worker without room for the session is skipped even when its ratio looks better
    tight = PDSnapshot(
        prefill=(),
        decode=(
            WorkerLoad("a", kv_free_tokens=900, kv_total_tokens=1000),
            WorkerLoad("b", kv_free_tokens=5000, kv_total_tokens=50_000),
        ),
    )
    assert AMPD(PERF).bind(PrefillJob("x", 2000, session_id="t"), tight) == "b"


def test_ampd_keeps_a_small_incremental_prefill_local_and_sends_a_big_one_remote():
    policy = AMPD(PERF, **FASTER)
    small = PrefillJob("r1", 4100, session_id="s", round=1, cached_tokens={"d0": 4000})
    decision = policy.place(small, _ampd_snap())
    assert not decision.remote and decision.reason == "local-slack"
    # 3000 new tokens inside the batch stretch its step to 0.3 s, over the 50 ms ITL SLO
    big = PrefillJob("r2", 7100, session_id="s", round=2, cached_tokens={"d0": 4100})
    decision = policy.place(big, _ampd_snap())
    assert decision.remote and decision.prefill == "p0" and decision.transfer_tokens == 3000
    # the decision carries what was weighed, so a trace can show why
    assert decision.estimate is not None and decision.estimate.local_itl_s > 0.05
    assert decision.estimate.remote_worker == "p0"


def test_ampd_prefers_local_when_the_prefill_side_is_slow_and_remote_when_itl_is_tight():
    policy = AMPD(PERF)
    job = PrefillJob("r", 2400, session_id="s", round=1, cached_tokens={"d0": 2000})
    # the prefill worker's queue makes remote miss the TTFT SLO; local's 400 tokens fit the ITL SLO
    assert not policy.place(job, _ampd_snap(p_queue=20_000, itl=0.04, itl_slo=0.08)).remote
    # observed ITL already at the SLO: no room for a local prefill in that batch
    assert policy.place(job, _ampd_snap(itl=0.06)).remote
    # an idle decode worker has no batch to disturb: local
    assert not AMPD(PERF, **FASTER).place(PrefillJob("q", 2400, session_id="u"), _ampd_snap(running=0)).remote


def test_ampd_sends_a_prefill_remote_while_the_prefill_pool_has_ttft_slack():
    # 100 new tokens fit the decode batch's ITL SLO and local is the faster way; with both ways on
    # time the prefill pool takes the round while its TTFT is within half the SLO, so the decode
    # batch keeps its time for the running streams and later rounds
    job = PrefillJob("r1", 4100, session_id="s", round=1, cached_tokens={"d0": 4000})
    idle = _ampd_snap()
    decision = AMPD(PERF).place(job, idle)
    est = decision.estimate
    assert est.local_itl_breaks == 0 and est.local_ttft_s < est.remote_ttft_s <= 0.5
    assert decision.remote and decision.reason == "remote-slack" and decision.transfer_tokens == 100
    assert not AMPD(PERF, **FASTER).place(job, idle).remote
    # without a TTFT SLO there is no slack to weigh: the faster way
    assert not AMPD(PERF).place(job, _ampd_snap(ttft_slo=float("inf"))).remote
    # 6000 tokens queued on the prefill worker: remote is still on time (0.65 s) but past the share,
    # so the faster way, local; a share of 0.75 still sends it remote
    busy = _ampd_snap(p_queue=6000)
    est = AMPD(PERF).estimate(job, busy.decode[0], busy)
    assert 0.5 < est.remote_ttft_s < 0.75
    assert AMPD(PERF).place(job, busy).reason == "local-slack"
    assert AMPD(PERF, remote_ttft_share=0.75).place(job, busy).reason == "remote-slack"
    with pytest.raises(ValueError):
        AMPD(PERF, remote_ttft_share=1.5)


def test_ampd_scales_a_prefill_workers_modelled_leg_by_its_observed_pace_never_down():
    policy = AMPD(PERF)
    job = PrefillJob("r", 3000, session_id="s")

    def estimate(pace: float | None):
        snap = PDSnapshot(
            prefill=(WorkerLoad("p0", "prefill", queued_prefill_tokens=500, leg_pace=pace),),
            decode=_ampd_snap().decode,
            ttft_slo_s=1.0,
            itl_slo_s=0.05,
        )
        return policy.estimate(job, snap.decode[0], snap), snap

    plain, snap = estimate(None)
    assert policy.place(job, snap).reason == "remote-slack"  # on time either way; local breaks streams
    # the leg as modelled: overhead, the worker's 500 queued tokens, then this prompt's 3000
    modelled = PERF.request_overhead_s + PERF.prefill_time(500) + PERF.prefill_time(3000)
    assert plain.remote_leg_s == pytest.approx(modelled)
    # after it: shipping the 3000 tokens back, the decode leg's overhead and its first step (the
    # last 8 tokens beside 8 running rows)
    d0 = _ampd_snap().decode[0]
    first = PERF.step_time(StepShape.prefill(8, 2992) + StepShape.decode(d0.running, d0.context_tokens))
    after = PERF.transfer_time(3000) + PERF.request_overhead_s + first
    assert plain.remote_ttft_s == pytest.approx(modelled + after)
    # legs there took 2.5x their modelled time of late: this one is expected to as well, and the
    # modelled figure the dispatch weighs its own time against stays the model's
    slow, _ = estimate(2.5)
    assert slow.remote_ttft_s == pytest.approx(2.5 * modelled + after)
    assert slow.remote_leg_s == pytest.approx(modelled)
    # at 4x the remote way is late too: still remote (one miss against the streams a local prefill
    # breaks), but no longer with slack
    late, snap = estimate(4.0)
    assert late.remote_ttft_s > 1.0 and policy.place(job, snap).reason == "remote-least-violation"
    # faster than modelled lowers nothing
    assert estimate(0.4)[0].remote_ttft_s == pytest.approx(plain.remote_ttft_s)


def test_leg_pace_is_observed_over_modelled_time_in_its_window():
    pace = LegPace(window_s=10.0)
    assert pace.value(0.0) is None
    pace.observe(1.0, 2.0, 1.0)  # a leg modelled at 1 s took 2 s
    pace.observe(2.0, 1.0, 3.0)  # a 3 s one took 1 s: the sums weigh each leg by its size
    assert pace.value(2.0) == pytest.approx(3.0 / 4.0)
    pace.observe(3.0, 5.0, 0.0)  # a leg no policy modelled says nothing
    assert pace.value(3.0) == pytest.approx(3.0 / 4.0)
    assert pace.value(11.5) == pytest.approx(1.0 / 3.0)  # the first leg left the window
    assert pace.value(12.5) is None


def test_ampd_without_prefill_workers_and_after_a_decode_worker_dies():
    policy = AMPD(PERF)
    snap = _ampd_snap()
    assert policy.place(PrefillJob("a", 10, session_id="s"), snap).decode == "d0"
    dead = PDSnapshot(prefill=(), decode=(WorkerLoad("d0", healthy=False), snap.decode[1]))
    decision = policy.place(PrefillJob("b", 10, session_id="s", round=1), dead)
    assert decision.decode == "d1" and decision.reason == "no-prefill-worker"
    policy.forget_worker("d1")
    assert policy.bindings.get("s") is None


# -- the prefill queue -------------------------------------------------------------------------------------


def test_prefill_queue_takes_the_most_urgent_feasible_job_within_the_lookahead():
    q = PrefillQueue(PERF, ttft_slo_s=1.0, lookahead=3)
    q.push(PrefillJob("long", 8000, arrived_at=0.9))  # 0.81 s of prefill: slack 1.0 - 0.1 - 0.81
    q.push(PrefillJob("old", 100, arrived_at=0.2))  # waited 0.8 s: slack 0.18
    q.push(PrefillJob("new", 100, arrived_at=1.0))
    q.push(PrefillJob("beyond", 100, arrived_at=0.0))  # outside the lookahead window
    assert q.pop(now=1.0).request_id == "long"  # slack 0.09: most urgent
    assert q.pop(now=1.0).request_id == "old"
    assert q.deferrals("new") == 0


def test_prefill_queue_deferral_bound_stops_starvation():
    q = PrefillQueue(PERF, ttft_slo_s=0.5, lookahead=5, max_deferrals=2)
    q.push(PrefillJob("huge", 20_000, arrived_at=0.0))  # can never meet the SLO
    order = []
    for i in range(6):
        q.push(PrefillJob(f"s{i}", 50, arrived_at=0.0))
    while len(q):
        order.append(q.pop(now=0.1).request_id)
    assert order.index("huge") == 2  # passed over twice, then taken
    # a job withdrawn (its wait ran out) is gone, and only that very job: an equal one stays
    twin = PrefillJob("twin", 50)
    q.push(twin)
    q.push(PrefillJob("twin", 50))
    q.discard(twin)
    assert len(q) == 1 and q.pop(now=0.0) is not twin
    with pytest.raises(ValueError):
        PrefillQueue(PERF, 1.0, lookahead=6)


def test_ampd_counts_the_prefills_already_queued_on_the_decode_worker_in_its_step():
    job = PrefillJob("r", 2400, session_id="s", round=1, cached_tokens={"d0": 2000})

    def snap(queued: int) -> PDSnapshot:
        d0 = WorkerLoad(
            "d0",
            "decode",
            queued_requests=1 if queued else 0,
            queued_prefill_tokens=queued,
            running=8,
            context_tokens=16_000,
            kv_free_tokens=50_000,
            kv_total_tokens=100_000,
        )
        p0 = WorkerLoad("p0", "prefill")
        return PDSnapshot(prefill=(p0,), decode=(d0,), ttft_slo_s=1.0, itl_slo_s=0.08)

    assert not AMPD(PERF, **FASTER).place(job, snap(0)).remote  # 400 tokens alone: a ~52 ms step
    # 600 queued tokens share that step (the token budget batches them): ~112 ms, over the ITL SLO
    decision = AMPD(PERF).place(job, snap(600))
    assert decision.remote and decision.reason == "remote-slack"
    est = AMPD(PERF).estimate(job, snap(600).decode[0], snap(600))
    assert est.local_step_s > 0.08


def test_ampd_does_not_break_a_running_batchs_itl_as_the_least_violation():
    # remote misses the TTFT SLO twice over (a 20,000-token queue), local's step misses the ITL SLO by
    # a few percent: one late first token is the smaller harm than a stall for all 8 running sequences
    job = PrefillJob("r", 2400, session_id="s", round=1, cached_tokens={"d0": 2000})
    decision = AMPD(PERF).place(job, _ampd_snap(p_queue=20_000, itl_slo=0.05))
    assert decision.remote and decision.reason == "remote-least-violation"
    # with no batch running there is no ITL to break: the smaller TTFT wins, locally
    idle = AMPD(PERF).place(job, _ampd_snap(running=0, p_queue=20_000, itl_slo=0.05))
    assert not idle.remote


def test_ampd_weighs_the_itl_slo_over_its_window():
    # a 400-token local prefill stretches one gap of the running batch to ~52 ms; the SLO is a 30 ms
    # mean: broken when every gap counts, kept when the mean runs over a 32-token output
    job = PrefillJob("r", 2400, session_id="s", round=1, cached_tokens={"d0": 2000})
    snap = _ampd_snap(itl=0.02, itl_slo=0.03)
    assert AMPD(PERF).place(job, snap).remote
    windowed = AMPD(PERF, itl_window_tokens=32, **FASTER)
    est = windowed.estimate(job, snap.decode[0], snap)
    assert est.local_itl_s == pytest.approx(0.02 + (est.local_step_s - 0.02) / 32)
    assert windowed.place(job, snap).reason == "local-slack"
    # the window's slack is used up when the batch already runs at the SLO
    assert windowed.place(job, _ampd_snap(itl=0.0299, itl_slo=0.03)).remote
    with pytest.raises(ValueError):
        AMPD(PERF, itl_window_tokens=0)


def test_stream_progress_gives_a_streams_mean_gap_at_its_end():
    s = StreamProgress(gaps=10, elapsed_s=0.2, remaining=5)
    assert s.mean_gap_s(0.03) == pytest.approx((0.2 + 5 * 0.03) / 15)
    # two of its gaps to come are stretched to 100 ms; more stretched steps than it has left count as many
    assert s.mean_gap_s(0.03, 2, 0.1) == pytest.approx((0.2 + 2 * 0.1 + 3 * 0.03) / 15)
    assert s.mean_gap_s(0.03, 9, 0.1) == pytest.approx((0.2 + 5 * 0.1) / 15)
    assert StreamProgress(0, 0.0, 0).mean_gap_s(0.03) == 0.0


def _with_streams(snap: PDSnapshot, *streams: StreamProgress, running: int | None = None) -> PDSnapshot:
    d0 = dataclasses.replace(snap.decode[0], streams=streams, running=running or len(streams))
    return dataclasses.replace(snap, decode=(d0, *snap.decode[1:]))


def test_ampd_weighs_a_local_prefill_against_each_running_streams_mean_gap():
    # the 400-token local prefill stretches one step to ~52 ms; the SLO is a 30 ms mean. Spread over a
    # 32-token window it looks harmless, but a stream one token from its end, its mean at 29.5 ms, takes
    # the whole stretch in one of its 31 gaps and breaks the SLO: the streams known, it goes remote
    job = PrefillJob("r", 2400, session_id="s", round=1, cached_tokens={"d0": 2000})
    policy = AMPD(PERF, itl_window_tokens=32, **FASTER)
    snap = _ampd_snap(itl=0.02, itl_slo=0.03)
    assert policy.place(job, snap).reason == "local-slack"
    fresh = [StreamProgress(0, 0.0, 32)] * 7
    ending = StreamProgress(30, 30 * 0.0295, 1)
    decision = policy.place(job, _with_streams(snap, *fresh, ending))
    assert decision.remote
    assert decision.estimate.local_itl_s == pytest.approx(
        ending.mean_gap_s(0.02, 1, decision.estimate.local_step_s)
    )
    # the batch has run at the SLO lately, so the window refuses; but these streams ran at 20 ms so
    # far and have room for the stretched step in their means
    busy = _ampd_snap(itl=0.0299, itl_slo=0.03)
    assert policy.place(job, busy).remote
    quick = [StreamProgress(10, 0.2, 22)] * 8
    assert policy.place(job, _with_streams(busy, *quick)).reason == "local-slack"
    # a stream already past the SLO is lost either way and holds nothing up
    lost = StreamProgress(20, 1.0, 5)
    assert policy.place(job, _with_streams(busy, *quick[:7], lost)).reason == "local-slack"
    # streams seen in part (other gateways stream from d0 too): the worse of the streams and the window
    assert policy.place(job, _with_streams(busy, *quick[:2], running=8)).remote


def test_ampd_counts_the_requests_each_way_would_lose_when_neither_meets_its_slo():
    # remote is late (a 20,000-token prefill queue); local is on time but its stretched step takes a
    # stream one token from its end past the 30 ms mean: one request lost either way, so the smaller
    # TTFT wins, locally; with two such streams local loses two against remote's one
    job = PrefillJob("r", 2400, session_id="s", round=1, cached_tokens={"d0": 2000})
    policy = AMPD(PERF, itl_window_tokens=32)
    late = _ampd_snap(itl=0.02, p_queue=20_000, itl_slo=0.03)
    fresh = [StreamProgress(0, 0.0, 32)] * 6
    ending = StreamProgress(30, 30 * 0.0295, 1)
    one = policy.place(job, _with_streams(late, *fresh, ending, StreamProgress(0, 0.0, 32)))
    assert one.estimate.local_itl_breaks == 1
    assert one.estimate.remote_ttft_s > 1.0 >= one.estimate.local_ttft_s
    assert not one.remote and one.reason == "local-least-violation"
    two = policy.place(job, _with_streams(late, *fresh, ending, ending))
    assert two.estimate.local_itl_breaks == 2
    assert two.remote and two.reason == "remote-least-violation"
    # with the remote leg on time, the one stream local would break sends it remote
    on_time_snap = _ampd_snap(itl=0.02, itl_slo=0.03)
    on_time = policy.place(job, _with_streams(on_time_snap, *fresh, ending, StreamProgress(0, 0.0, 32)))
    assert on_time.remote and on_time.reason == "remote-slack"
    # without the streams, a window the stretched steps overflow breaks every running sequence
    est = AMPD(PERF).estimate(job, late.decode[0], late)
    assert est.local_itl_breaks == 8
    # the batch's recent gaps ran past the SLO (earlier local prefills stretched them): its fresh
    # streams are not written off as lost, they are counted as broken at that pace
    stretched = _with_streams(_ampd_snap(itl=0.04, p_queue=20_000, itl_slo=0.03), *fresh, *fresh[:2])
    decision = policy.place(job, stretched)
    assert decision.estimate.local_itl_breaks == 8
    assert decision.remote and decision.reason == "remote-least-violation"


# -- the decode side's windowed ITL -------------------------------------------------------------------

from tokenops.cluster.pd_dispatch import ItlWindow, StreamGaps  # noqa: E402


def test_itl_window_pools_gaps_by_tokens_and_forgets_old_ones():
    w = ItlWindow(window_s=2.0)
    assert w.value(0.0) is None
    w.observe(1.0, 0.05)  # one token 50 ms after the previous
    w.observe(1.5, 0.09, tokens=3)  # three tokens read in one chunk: 30 ms each
    assert w.value(1.5) == pytest.approx(0.14 / 4)
    assert w.value(3.2) == pytest.approx(0.03)  # the first gap is older than 2 s now
    assert w.value(3.6) is None  # nothing streamed in the window: no figure rather than a stale one
    w.observe(10.0, 0.2)
    assert w.value(10.0) == pytest.approx(0.2)


def test_stream_gaps_are_the_gaps_a_client_sees_without_the_wait_for_the_first_event(monkeypatch):
    import tokenops.cluster.pd_dispatch as pd_dispatch

    clock = iter([5.0, 5.02, 5.05, 5.11])
    monkeypatch.setattr(pd_dispatch.time, "monotonic", lambda: next(clock))
    w = ItlWindow(window_s=10.0)
    gaps = StreamGaps(w)
    gaps.relayed(b'data: {"a": 1}\n\ndata: {"a": 2}\n\n')  # 5 s after the request: TTFT, no gap
    assert w.value(5.0) == pytest.approx(0.0)  # its second event came with it
    gaps.relayed(b'data: {"a": 3}\n\n')
    gaps.relayed(b": keep-alive\n\n")  # no event, no gap (and no clock read)
    gaps.relayed(b'data: {"a": 4}\n\n')
    gaps.relayed(b'data: {"a": 5}\n\ndata: [DONE]\n\n')
    assert w.value(5.11) == pytest.approx((5.11 - 5.0) / 4)  # the client's (last - first) / (n - 1)


def test_a_session_binds_to_the_worker_without_queued_prefills_when_headroom_ties():
    # four sessions arriving at once: the polled headroom has not moved yet, but the first request's
    # prefill is queued on the worker it went to, so the next one goes to the other
    def snap(queued0: int, queued1: int) -> PDSnapshot:
        return PDSnapshot(
            prefill=(),
            decode=tuple(
                WorkerLoad(w, kv_free_tokens=1000, kv_total_tokens=1000, queued_requests=q)
                for w, q in (("d0", queued0), ("d1", queued1))
            ),
        )

    for policy in (Colocated(), AMPD(PERF)):
        assert policy.place(PrefillJob("a", 50, session_id="a"), snap(0, 0)).decode == "d1"
        assert policy.place(PrefillJob("b", 50, session_id="b"), snap(0, 1)).decode == "d0"


# -- prefill legs waiting at the gateway -------------------------------------------------------------------


def _waiting_snap(waiting_tokens: int, waiting_legs: int = 2) -> PDSnapshot:
    """p0 holds the session's prefix but has legs waiting at the gateway for its slots; p1 is idle."""
    return _snap(
        prefill=(
            WorkerLoad("p0", "prefill", waiting_legs=waiting_legs, waiting_prefill_tokens=waiting_tokens),
            WorkerLoad("p1", "prefill"),
        )
    )


def test_waiting_legs_turn_static_and_conditional_pd_away_from_the_caching_worker():
    job = PrefillJob("r", 2000, cached_tokens={"p0": 1800})
    # the cache saves 1800 tokens: a 600-token wait behind the legs there is worth it...
    assert StaticPD().place(job, _waiting_snap(600)).prefill == "p0"
    assert ConditionalPD.llm_d().place(job, _waiting_snap(600)).prefill == "p0"
    # ...a 3000-token wait is not: the idle worker computes the whole prompt sooner
    assert StaticPD().place(job, _waiting_snap(3000)).prefill == "p1"
    assert ConditionalPD.llm_d().place(job, _waiting_snap(3000)).prefill == "p1"


def test_dynamos_queue_counts_the_legs_waiting_at_the_gateway():
    policy = ConditionalPD.dynamo()
    one_each = tuple(WorkerLoad(w, "prefill", queued_requests=1) for w in ("p0", "p1"))
    assert policy.place(PrefillJob("a", 5000), _snap(prefill=one_each)).remote
    # one leg on each engine and one more waiting for each worker's slot: two in Dynamo's queue
    waiting = tuple(WorkerLoad(w, "prefill", queued_requests=1, waiting_legs=1) for w in ("p0", "p1"))
    assert policy.place(PrefillJob("b", 5000), _snap(prefill=waiting)).reason == "prefill-queue-full"
    # llm-d's decider has no queue check
    assert ConditionalPD.llm_d().place(PrefillJob("c", 5000), _snap(prefill=waiting)).remote


def test_ampd_counts_the_work_waiting_ahead_of_a_leg_in_its_remote_estimate():
    job = PrefillJob("r", 2400, session_id="s", round=1, cached_tokens={"d0": 2000})
    policy = AMPD(PERF)
    snap = _ampd_snap()
    waiting = PDSnapshot(
        prefill=(WorkerLoad("p0", "prefill", waiting_legs=3, waiting_prefill_tokens=8000),),
        decode=snap.decode,
        ttft_slo_s=snap.ttft_slo_s,
        itl_slo_s=snap.itl_slo_s,
    )
    queued = _ampd_snap(p_queue=8000)
    d0 = snap.decode[0]
    idle, behind = policy.estimate(job, d0, snap), policy.estimate(job, d0, waiting)
    # legs waiting for the worker's slots are work ahead as much as prefills already on its engine
    assert behind.remote_ttft_s == pytest.approx(policy.estimate(job, d0, queued).remote_ttft_s)
    assert behind.remote_ttft_s - idle.remote_ttft_s == pytest.approx(PERF.prefill_time(8000))
    assert behind.local_ttft_s == idle.local_ttft_s


def test_ampd_picks_the_idle_prefill_worker_over_the_caching_one_with_a_long_wait():
    # round 2 of a session bound to d0 (it holds 2000 tokens); p0 holds 4000 of the 6000-token prompt
    job = PrefillJob("r", 6000, session_id="s", round=2, cached_tokens={"d0": 2000, "p0": 4000})

    def snap(waiting_tokens: int) -> PDSnapshot:
        p0 = WorkerLoad("p0", "prefill", waiting_legs=2, waiting_prefill_tokens=waiting_tokens)
        return PDSnapshot(
            prefill=(p0, WorkerLoad("p1", "prefill")),
            decode=_ampd_snap().decode,
            ttft_slo_s=1.0,
            itl_slo_s=0.05,
        )

    policy = AMPD(PERF)
    policy.bindings.bind("s", "d0")
    near = policy.place(job, snap(1000))  # p0 saves 2000 tokens' prefill and waits behind 1000
    assert near.remote and near.prefill == "p0"
    far = policy.place(job, snap(5000))  # behind 5000 the saving is smaller than the wait
    assert far.remote and far.prefill == "p1"
    assert far.estimate is not None and far.estimate.remote_worker == "p1"


def test_ampd_prefills_locally_when_the_only_prefill_worker_has_a_long_wait():
    # d0 has 3000 tokens of prefills queued: a local prefill waits behind them (~0.9 s), within the
    # TTFT SLO, and its long step spread over a 32-token window keeps the ITL SLO
    job = PrefillJob("r", 2400, session_id="s", round=1, cached_tokens={"d0": 2000})
    d0 = WorkerLoad(
        "d0",
        "decode",
        queued_requests=2,
        queued_prefill_tokens=3000,
        running=8,
        context_tokens=16_000,
        kv_free_tokens=50_000,
        kv_total_tokens=100_000,
        itl_recent_s=0.04,
    )

    def snap(waiting_tokens: int) -> PDSnapshot:
        p0 = WorkerLoad("p0", "prefill", waiting_legs=4, waiting_prefill_tokens=waiting_tokens)
        return PDSnapshot(prefill=(p0,), decode=(d0,), ttft_slo_s=1.0, itl_slo_s=0.06)

    policy = AMPD(PERF, itl_window_tokens=32)
    # nothing waits for p0: remote is the faster first token
    assert policy.place(job, snap(0)).reason == "remote-slack"
    # 20,000 tokens wait for p0's slots: remote misses the TTFT SLO, local keeps both
    decision = policy.place(job, snap(20_000))
    assert not decision.remote and decision.reason == "local-slack"


def test_every_pd_policy_name_builds_the_policy_of_that_name():
    """One name per policy: what `pd.policy`, `tokenops plan-pd --policy` and the benchmarks take is
    the built object's `name` (`static` is the gateway's short name for ours, `static_pd_incremental`)."""
    for name in PD_POLICY_NAMES:
        assert make_pd_policy(name, PERF).name == ("static_pd_incremental" if name == "static" else name)
    dynamo = make_pd_policy("conditional_dynamo", max_local_prefill_length=64, max_prefill_queue_size=1)
    assert isinstance(dynamo, ConditionalPD)
    assert (dynamo.min_remote_tokens, dynamo.max_prefill_queue) == (64, 1)
    llm_d = make_pd_policy("conditional_llm_d", non_cached_tokens=8)
    assert isinstance(llm_d, ConditionalPD) and (llm_d.min_remote_tokens, llm_d.inclusive) == (8, True)
    ampd = make_pd_policy("ampd", PERF, itl_window_tokens=4)
    assert isinstance(ampd, AMPD) and ampd.itl_window_tokens == 4
    with pytest.raises(ValueError, match="unknown PD policy 'dynamo': use one of .*conditional_dynamo"):
        make_pd_policy("dynamo")
    with pytest.raises(ValueError, match="ampd weighs modelled costs"):
        make_pd_policy("ampd")


def test_a_pd_config_left_at_its_defaults_builds_the_rules_the_simulator_runs():
    """The gateway's `pd:` defaults and `make_pd_policy`'s (the simulator's and the split planner's)
    agree: the conditional rules built either way make the same decision for the same round and
    snapshot, queue lengths included."""
    from tokenops.cluster.pd_dispatch import pd_policy
    from tokenops.config import PDSpec

    for queued in range(4):  # Dynamo's queue check: below, at and past its default size
        queue = tuple(WorkerLoad(p.id, "prefill", queued_requests=queued) for p in _snap().prefill)
        snap = _snap(prefill=queue)
        for name in ("conditional_dynamo", "conditional_llm_d"):
            live, sim = pd_policy(PDSpec(policy=name)), make_pd_policy(name)
            for uncached in (1, 255, 256, 1000, 1001, 4000):
                job = PrefillJob(f"{name}-{uncached}", uncached)
                assert live.place(job, snap) == sim.place(job, snap), (name, queued, uncached)
    snap = _snap()
    llm_d = pd_policy(PDSpec(policy="conditional_llm_d"))
    assert not llm_d.place(PrefillJob("short", 255), snap).remote  # 0 would send every round remote
