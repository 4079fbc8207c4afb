"""Profiling through a real OpenAI-compatible server (loopback), stored in SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import sqlalchemy as sa

from tokenops.fusion.profiles import ModelEndpoint, ProfileStore, aggregate, run_items
from tokenops.fusion.suites import generate_suite


def test_endpoint_spec_parsing() -> None:
    ep = ModelEndpoint.parse("gemma=http://127.0.0.1:8002/v1/,mode=completion,served=g,in=0.1,out=0.4")
    assert (ep.name, ep.base_url, ep.mode, ep.model_field) == (
        "gemma",
        "http://127.0.0.1:8002/v1",
        "completion",
        "g",
    )
    assert ep.cost(1_000_000, 1_000_000) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        ModelEndpoint.parse("nourl")
    with pytest.raises(ValueError):
        ModelEndpoint.parse("x=http://h/v1,mode=weird")


@pytest.mark.parametrize("mode", ["chat", "completion"])
def test_profile_through_loopback_server(scripted_server, suite_scripts, tmp_path, mode: str) -> None:
    items = generate_suite(5, categories=["arithmetic", "code", "format"], per_cell=2)
    url, calls = scripted_server(suite_scripts(items))
    cheap = ModelEndpoint("cheap", url, mode=mode, input_price=1.0, output_price=2.0)  # type: ignore[arg-type]
    results = asyncio.run(run_items(cheap, items, concurrency=4))
    assert len(calls) == len(items) and all(c["chat"] == (mode == "chat") for c in calls)
    assert [r.item_id for r in results] == [i.id for i in items]
    assert all(r.correct == (r.level == 1) for r in results), [
        (r.item_id, r.output) for r in results if r.correct != (r.level == 1)
    ]
    profile = aggregate("cheap", "run", results)
    assert profile.cells[("code", 1)].accuracy == 1.0 and profile.cells[("code", 3)].accuracy == 0.0
    assert profile.cells[("arithmetic", 2)].mean_cost > 0

    store = ProfileStore(f"sqlite:///{tmp_path / 'p.db'}")
    run_id = store.save("cheap", mode, 5, results)
    assert store.models() == ["cheap"] and store.latest_run("cheap") == run_id
    again = store.profile("cheap")
    assert again is not None and again.cells == profile.cells
    assert [r.correct for r in store.results("cheap")] == [r.correct for r in results]
    store.close()


def test_failed_calls_are_recorded_as_wrong(scripted_server, suite_scripts) -> None:
    items = generate_suite(0, categories=["knowledge"], levels=[1], per_cell=2)
    url, _ = scripted_server(suite_scripts(items))
    results = asyncio.run(run_items(ModelEndpoint("missing", url), items))
    assert all(not r.correct and r.error and "NotFound" in r.error for r in results)


@pytest.mark.postgres
def test_store_on_postgresql() -> None:
    schema = f"t_fusion_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine("postgresql+psycopg://postgres@127.0.0.1:5432/test")
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    except sa.exc.OperationalError:
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432")
    try:
        url = f"postgresql+psycopg://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{schema}"
        store = ProfileStore(url)
        items = generate_suite(0, categories=["knowledge"], levels=[1], per_cell=2)
        from tokenops.fusion.profiles import ItemResult

        results = [
            ItemResult("m", i.id, i.category, i.level, i.instruction, True, i.answer, 5, 1, 0.0, 0.01)
            for i in items
        ]
        store.save("m", "chat", 0, results)
        profile = store.profile("m")
        assert profile is not None and profile.cells[("knowledge", 1)].accuracy == 1.0
        store.close()
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
