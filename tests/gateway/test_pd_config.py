"""A model's prefill/decode pools in the config: `pd: {policy, prefill, decode}` for remote engines,
`engine: {prefill: N, decode: M}` for local ones started with their `--role`; bad combinations are
refused with the field named."""

from __future__ import annotations

import pytest

from tokenops.cluster import build_cluster
from tokenops.cluster.pd import AMPD, ConditionalPD, PDSnapshot, PrefillJob, StaticPD, WorkerLoad
from tokenops.cluster.pd_dispatch import pd_policy, prefill_gate
from tokenops.cluster.perf_model import PerfModel
from tokenops.config import ConfigError, load_settings
from tokenops.gateway.serve import engine_processes


def _settings(model: dict):
    return load_settings(None, environ={}, overrides={"models": {"m": model}})


def test_local_pd_pair_starts_engines_with_their_roles() -> None:
    settings = _settings({"engine": {"port": 9200, "prefill": 1, "decode": 2}})
    specs = engine_processes(settings)
    assert [s.name for s in specs] == ["m-prefill-0", "m-decode-1", "m-decode-2"]
    assert [s.argv[s.argv.index("--port") + 1] for s in specs] == ["9200", "9201", "9202"]
    assert [s.argv[s.argv.index("--role") + 1] for s in specs] == ["prefill", "decode", "decode"]
    pd = settings.models["m"].pd
    assert pd is not None and pd.policy == "static"
    assert pd.prefill == ["http://127.0.0.1:9200/v1"]
    assert pd.decode == ["http://127.0.0.1:9201/v1", "http://127.0.0.1:9202/v1"]
    # the cluster's pool (model listing, health, admin) holds the decode engines only
    assert settings.models["m"].backend_urls() == pd.decode
    # plain replicas keep no --role (the engine's default, both)
    plain = engine_processes(_settings({"engine": {"port": 9300, "replicas": 2}}))
    assert all("--role" not in s.argv for s in plain)


def test_remote_pools_and_their_policies(tmp_path) -> None:
    pools = {"prefill": ["http://10.0.0.1:8001/v1/"], "decode": ["http://10.0.0.2:8002/v1"]}
    dynamo = {"policy": "conditional_dynamo", **pools, "max_local_prefill_length": 500}
    m = _settings({"pd": dynamo}).models["m"]
    assert m.pd.prefill == ["http://10.0.0.1:8001/v1"] and m.backends == ["http://10.0.0.2:8002/v1"]
    policy = pd_policy(m.pd)
    assert isinstance(policy, ConditionalPD) and policy.min_remote_tokens == 500
    assert policy.name == m.pd.policy
    llm_d = _settings({"pd": {"policy": "conditional_llm_d", **pools}}).models["m"].pd
    policy = pd_policy(llm_d)  # the simulator's and the planner's threshold
    assert isinstance(policy, ConditionalPD) and policy.name == "conditional_llm_d"
    assert policy.min_remote_tokens == 256
    always = _settings({"pd": {"policy": "conditional_llm_d", "non_cached_tokens": 0, **pools}})
    # llm-d's code default: every prefill remote
    assert pd_policy(always.models["m"].pd).min_remote_tokens == 0
    profile = tmp_path / "perf.json"
    PerfModel(base_s=0.01, per_token_s=1e-4).save(profile)
    ampd = (
        _settings(
            {
                "pd": {
                    "policy": "ampd",
                    "perf_model": str(profile),
                    "itl_window_tokens": 8,
                    "remote_ttft_share": 0.25,
                    "prefill": ["http://a:1/v1"],
                    "decode": ["http://b:2/v1"],
                }
            }
        )
        .models["m"]
        .pd
    )
    policy = pd_policy(ampd)
    assert isinstance(policy, AMPD) and (policy.itl_window_tokens, policy.remote_ttft_share) == (8, 0.25)
    static = _settings({"pd": {"prefill": ["http://a:1/v1"], "decode": ["http://b:2/v1"]}}).models["m"].pd
    assert isinstance(pd_policy(static), StaticPD)
    # prefill legs are served first come first served unless the prefill queue is asked for
    assert prefill_gate(static) is None and prefill_gate(ampd) is None
    queued = {**pools, "prefill_queue": True, "perf_model": str(profile), "prefill_max_deferrals": 1}
    gate = prefill_gate(_settings({"pd": {**queued, "ttft_slo_s": 2}}).models["m"].pd)
    assert gate is not None and (gate.ttft_slo_s, gate.lookahead, gate.max_deferrals) == (2, 5, 1)


@pytest.mark.parametrize(
    ("model", "where", "says"),
    [
        (
            {"pd": {"policy": "fastest", "prefill": ["http://a:1/v1"], "decode": ["http://b:2/v1"]}},
            "models.m.pd.policy",
            "'static_pd'",
        ),
        (  # the policy's own name, as its object and `tokenops plan-pd` give it
            {"pd": {"policy": "dynamo", "prefill": ["http://a:1/v1"], "decode": ["http://b:2/v1"]}},
            "models.m.pd.policy",
            "'conditional_dynamo'",
        ),
        ({"pd": {"prefill": ["http://a:1/v1"]}}, "models.m", "pd.decode"),
        ({"pd": {"decode": ["http://b:2/v1"]}}, "models.m", "pd.prefill"),
        ({"pd": {"prefill": ["a:1"], "decode": ["http://b:2/v1"]}}, "models.m.pd.prefill", "http://"),
        (
            {"pd": {"policy": "ampd", "prefill": ["http://a:1/v1"], "decode": ["http://b:2/v1"]}},
            "models.m.pd",
            "perf_model",
        ),
        (  # a share of the TTFT SLO
            {"pd": {"remote_ttft_share": 1.5, "prefill": ["http://a:1/v1"], "decode": ["http://b:2/v1"]}},
            "models.m.pd.remote_ttft_share",
            "1",
        ),
        (
            {"pd": {"prefill_queue": True, "prefill": ["http://a:1/v1"], "decode": ["http://b:2/v1"]}},
            "models.m.pd",
            "perf_model",
        ),
        (
            {
                "backends": ["http://c:3/v1"],
                "pd": {"prefill": ["http://a:1/v1"], "decode": ["http://b:2/v1"]},
            },
            "models.m",
            "backends",
        ),
        ({"engine": {"prefill": 1}}, "models.m.engine", "engine.decode"),
        ({"engine": {"prefill": 1, "decode": 1, "replicas": 2}}, "models.m.engine", "replicas"),
        ({"engine": {"prefill": 1, "decode": 1, "args": {"role": "both"}}}, "models.m.engine", "role"),
    ],
)
def test_bad_pd_config_names_the_field(model: dict, where: str, says: str) -> None:
    with pytest.raises(ConfigError, match=f"'{where}'") as err:
        _settings(model)
    assert says in str(err.value)


def test_colocated_needs_no_prefill_pool() -> None:
    m = _settings({"pd": {"policy": "colocated", "decode": ["http://b:2/v1"]}}).models["m"]
    assert m.pd.prefill == [] and m.backends == ["http://b:2/v1"]


@pytest.mark.parametrize(
    ("name", "pulls_history"),
    [("static", True), ("static_pd_incremental", True), ("static_pd", False)],
)
def test_static_pd_names(name: str, pulls_history: bool) -> None:
    """`static_pd` is vLLM's path (the prefill worker recomputes a session's history), the names as
    benchmarks/pd_policies.py and `tokenops plan-pd` use them; `static` is ours, the default."""
    spec = _settings({"pd": {"policy": name, "prefill": ["http://a:1/v1"], "decode": ["http://b:2/v1"]}})
    policy = pd_policy(spec.models["m"].pd)
    assert isinstance(policy, StaticPD) and policy.incremental is pulls_history
    snapshot = PDSnapshot(prefill=(WorkerLoad("p", "prefill"),), decode=(WorkerLoad("d", "decode"),))
    later_round = PrefillJob("r", 640, session_id="s", round=1, cached_tokens={"d": 512})
    decision = policy.place(later_round, snapshot)
    assert (decision.decode, decision.prefill, decision.pull_history) == ("d", "p", pulls_history)
    # ours ships back only what the decode worker lacks, vLLM's path the whole prompt
    assert decision.transfer_tokens == (128 if pulls_history else 640)


def test_prefill_slots_cap_the_prefill_pool_only() -> None:
    pools = {"prefill": ["http://a:1/v1"], "decode": ["http://b:2/v1"]}
    for slots, expected in ((None, 64), (1, 1)):
        models = _settings({"max_inflight": 64, "pd": {**pools, "prefill_slots": slots}}).models
        cluster = build_cluster(models)
        [prefill] = cluster.pd["m"].prefill.replicas.values()
        [decode] = cluster.pools["m"].replicas.values()
        assert prefill.limiter.config.max_limit == expected
        assert prefill.effective_limit() == min(expected, decode.effective_limit())
        assert decode.limiter.config.max_limit == 64
