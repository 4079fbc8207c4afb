"""PD placement policies as pure functions of a snapshot."""

from tokenops.cluster.pd import Colocated, PDSnapshot, PrefillJob, SessionBindings, StaticPD, WorkerLoad


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
    snap = _snap(decode=(WorkerLoad("d0", kv_free_tokens=1, kv_total_tokens=10),
                         WorkerLoad("d1", kv_free_tokens=9, kv_total_tokens=10, healthy=False)))
    decision = policy.place(PrefillJob("b", 50, session_id="s", round=1), snap)
    assert decision.decode == "d0" and not decision.remote
    policy.forget_worker("d0")
    assert policy.bindings.get("s") is None


def test_session_bindings_are_bounded():
    b = SessionBindings(limit=2)
    for s in "abc":
        b.bind(s, "w")
    assert b.get("a") is None and b.get("c") == "w"
