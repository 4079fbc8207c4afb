"""Stored responses and the distillation set on each database: a response is found only by its own
tenant, refused once expired and purged later; distillation examples come back by tenant, model and
date."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tokenops.ops.db import Database
from tokenops.ops.distill import examples, record_example
from tokenops.ops.responses_store import (
    StoredResponse,
    delete_response,
    find_response,
    purge_expired,
    save_response,
)


def _response(rid: str, tenant: str, expires_in: float) -> StoredResponse:
    now = datetime.now(UTC)
    return StoredResponse(
        id=rid,
        tenant=tenant,
        key_id="key_1",
        model="m",
        session_id=rid,
        previous_response_id=None,
        body={"id": rid, "object": "response", "output": []},
        history=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        history_tokens=12,
        created_at=now,
        expires_at=now + timedelta(seconds=expires_in),
    )


def test_responses_are_scoped_expire_and_purge(db_target) -> None:
    url, schema = db_target
    db = Database(url, schema=schema)
    try:
        db.migrate_sync()
        db.run_sync(save_response, _response("resp_a", "acme", 3600))
        db.run_sync(save_response, _response("resp_old", "acme", -1))
        found, expired = db.run_sync(find_response, "resp_a", "acme")
        assert found is not None and not expired
        assert found.history[1] == {"role": "assistant", "content": "hello"} and found.history_tokens == 12
        assert found.expires_at > datetime.now(UTC)
        assert db.run_sync(find_response, "resp_a", "other") == (None, False)  # reads like an unknown id
        assert db.run_sync(find_response, "resp_nope", "acme") == (None, False)
        assert db.run_sync(find_response, "resp_old", "acme") == (None, True)
        assert db.run_sync(purge_expired) == 1
        assert db.run_sync(find_response, "resp_old", "acme") == (None, False)
        assert not db.run_sync(delete_response, "resp_a", "other")
        assert db.run_sync(delete_response, "resp_a", "acme")
        assert db.run_sync(find_response, "resp_a", "acme") == (None, False)
    finally:
        db.dispose()


def test_distillation_examples_filter(db_target) -> None:
    url, schema = db_target
    db = Database(url, schema=schema)
    try:
        db.migrate_sync()
        q = [{"role": "user", "content": "q"}]
        db.run_sync(
            record_example, "acme", "strong", "auto", "escalated", [*q, {"role": "assistant", "content": "a"}]
        )
        db.run_sync(
            record_example, "beta", "mid", "vote", "agreed", [*q, {"role": "assistant", "content": "b"}]
        )

        def export(**kw):  # noqa: ANN003, ANN202
            return db.run_sync(lambda conn: list(examples(conn, **kw)))

        assert [e["messages"][-1]["content"] for e in export()] == ["a", "b"]
        assert [e["messages"][-1]["content"] for e in export(tenant="beta")] == ["b"]
        assert [e["messages"][-1]["content"] for e in export(model="strong")] == ["a"]
        assert export(since=datetime.now(UTC) + timedelta(hours=1)) == []
        assert len(export(until=datetime.now(UTC) + timedelta(hours=1))) == 2
    finally:
        db.dispose()
