"""The typed config: YAML file, TOKENOPS_* environment overrides, clear errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenops.config import ConfigError, load_settings
from tokenops.ops.pricing import price_table

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tokenops.yaml"


def test_example_config_loads_with_env_overrides() -> None:
    s = load_settings(
        EXAMPLE,
        environ={
            "TOKENOPS_PORT": "9001",
            "TOKENOPS_REDIS_URL": "redis://x:6379/0",
            "TOKENOPS_QUEUE__RETRY_AFTER_S": "3",
        },
    )
    assert s.port == 9001 and s.redis_url == "redis://x:6379/0" and s.queue.retry_after_s == 3
    model = s.models["smollm2-135m-instruct"]
    assert model.backend_urls() == ["http://127.0.0.1:8001/v1"]
    price = price_table(s.pricing())["smollm2-135m-instruct"]
    assert (price.input, price.cached_input, price.output) == (0.05, 0.025, 0.10)


def test_defaults_serve_the_bundled_model_on_sqlite(tmp_path: Path) -> None:
    s = load_settings(None, environ={}, overrides={"data_dir": tmp_path})
    assert s.port == 8000 and s.resolved_database_url.startswith("sqlite:///")
    assert str(tmp_path) in s.resolved_database_url
    assert s.models["smollm2-135m-instruct"].engine is not None


def test_override_beats_env_beats_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("port: 7000\nmodels: {m: {backends: ['http://h:1/v1/']}}\n")
    assert load_settings(f, environ={}).port == 7000
    assert load_settings(f, environ={"TOKENOPS_PORT": "7001"}).port == 7001
    assert load_settings(f, environ={"TOKENOPS_PORT": "7001"}, overrides={"port": 7002}).port == 7002
    assert load_settings(f, environ={}).models["m"].backends == ["http://h:1/v1"]


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("prot: 1\n", "prot"),
        ("port: many\n", "port"),
        ("models: {m: {}}\n", "models.m"),
        ("models: {m: {backends: ['ftp://x']}}\n", "models.m.backends"),
        ("models: {m: {backends: ['http://x/v1'], pricing: {input: -1}}}\n", "models.m.pricing.input"),
    ],
)
def test_bad_values_name_the_field(tmp_path: Path, text: str, where: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=f"'{where}"):
        load_settings(f, environ={})


def test_cluster_and_cache_sections() -> None:
    s = load_settings(None, environ={}, overrides={"models": {"m": {"backends": ["http://a/v1"]}}})
    assert s.cluster.models == {} and s.cache.enabled and s.cache.index == "memory"
    shared = load_settings(
        None,
        environ={"TOKENOPS_REDIS_URL": "redis://127.0.0.1:6379/0"},
        overrides={"models": {"m": {"backends": ["http://a/v1"]}}},
    )
    assert shared.cache.index == "redis"  # gateways that share Redis share the cache index
    kept = load_settings(
        None,
        environ={"TOKENOPS_REDIS_URL": "redis://x", "TOKENOPS_CACHE__INDEX": "memory"},
        overrides={"models": {"m": {"backends": ["http://a/v1"]}}},
    )
    assert kept.cache.index == "memory"
    with pytest.raises(ConfigError, match="cluster"):
        load_settings(
            None,
            environ={},
            overrides={"models": {"m": {"backends": ["http://a/v1"]}}, "cluster": {"models": {"typo": {}}}},
        )
    with pytest.raises(ConfigError, match="policy"):
        load_settings(
            None,
            environ={},
            overrides={
                "models": {"m": {"backends": ["http://a/v1"]}},
                "cluster": {"models": {"m": {"policy": "nope"}}},
            },
        )
