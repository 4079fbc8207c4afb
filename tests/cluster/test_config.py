"""Building a cluster from the platform's model table and the cluster config section."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tokenops.cluster.config import ClusterConfig, build_cluster
from tokenops.cluster.policies import PrefixAware, SessionAffinity
from tokenops.config import EngineSpec, ServedModel


def test_build_cluster_from_settings_models() -> None:
    models = {
        "big": ServedModel(
            backends=["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"],
            engine=EngineSpec(port=8101),
            served_name="org/big",
            max_inflight=8,
        ),
        "light": ServedModel(backends=["http://10.0.0.3:8000/v1"]),
    }
    cfg = ClusterConfig.model_validate(
        {
            "models": {
                "big": {
                    "policy": "session_affinity",
                    "policy_options": {"epsilon": 0.5},
                    "weights": {"http://10.0.0.2:8000/v1": 2.0},
                    "kinds": {"http://10.0.0.1:8000/v1": "vllm"},
                    "fallback": ["light"],
                    "degrade_to": "light",
                    "shed_at": {2: 0.95},
                }
            },
            "concurrency": {"initial": 32},
        }
    )
    cluster = build_cluster(models, cfg)
    big = cluster.pools["big"]
    assert isinstance(big.policy, SessionAffinity) and big.policy.epsilon == 0.5
    assert isinstance(cluster.pools["light"].policy, PrefixAware)  # the default policy
    specs = {r.url: r.spec for r in big.replicas.values()}
    assert specs["http://10.0.0.1:8000/v1"].kind == "vllm"
    assert (
        specs["http://10.0.0.2:8000/v1"].weight == 2.0 and specs["http://10.0.0.2:8000/v1"].kind == "openai"
    )
    assert specs["http://127.0.0.1:8101/v1"].kind == "tokenops"  # the local engine reports /v1/load
    assert {s.served_model for s in specs.values()} == {"org/big"}
    assert all(r.limiter.limit == 8 for r in big.replicas.values())  # capped by max_inflight
    assert cluster.fallbacks == {"big": ["light"]}
    assert cluster.degrade.rules["big"].degrade_to == "light"
    status = cluster.status()
    assert status["big"]["policy"] == "session_affinity" and len(status["big"]["replicas"]) == 3


def test_config_errors_name_the_problem() -> None:
    with pytest.raises(ValidationError, match="unknown policy 'fastest'"):
        ClusterConfig.model_validate({"models": {"m": {"policy": "fastest"}}})
    with pytest.raises(ValidationError, match="extra"):
        ClusterConfig.model_validate({"modles": {}})
    models = {"m": ServedModel(backends=["http://h:1/v1"])}
    with pytest.raises(ValueError, match="not configured: ghost"):
        build_cluster(models, ClusterConfig.model_validate({"models": {"m": {"fallback": ["ghost"]}}}))


def test_vllm_replicas_with_kv_events_make_the_prefix_index_exact() -> None:
    urls = ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"]
    models = {"m": ServedModel(backends=urls, tokenizer="smollm2-135m-instruct")}
    events = {u: {"endpoint": f"tcp://10.0.0.{i + 1}:5557"} for i, u in enumerate(urls)}
    pool_cfg = {"kinds": dict.fromkeys(urls, "vllm"), "kv_events": events, "block_size": 32}
    pool = build_cluster(models, ClusterConfig.model_validate({"models": {"m": pool_cfg}})).pools["m"]
    assert isinstance(pool.policy, PrefixAware) and pool.policy.learn is False
    spec = pool.replicas["m#1"].spec
    assert spec.kv_events is not None and spec.kv_events.endpoint == "tcp://10.0.0.2:5557"
    assert spec.kv_events.replay_endpoint is None and pool.prompt_tokenizer.block_size == 32
    # one replica that reports nothing: the index must learn from decisions
    del events[urls[1]]
    pool = build_cluster(models, ClusterConfig.model_validate({"models": {"m": pool_cfg}})).pools["m"]
    assert pool.policy.learn is True
