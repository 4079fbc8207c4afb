import asyncio

import pytest
from ops_helpers import open_ops, outcome, request
from sqlalchemy import MetaData, select

from tokenops.protocol import APIError


def run(coro):
    return asyncio.run(coro)


def test_tree_keys_and_auth(db_target):
    async def main():
        ops = await open_ops(db_target)
        try:
            await ops.create_node(None, "acme", {"priority": 0})
            await ops.create_node("acme", "search", {"rpm": 100})
            plaintext, info = await ops.create_key("acme/search", "ci", {})
            assert plaintext.startswith("tok-") and len(plaintext) > 40
            assert info.prefix == plaintext[:10] and info.node_path == "acme/search/ci"

            p = await ops.authenticate(plaintext)
            assert p.key_id == info.id and p.node_path == ("acme", "search", "ci")
            assert p.tenant == "acme" and p.priority == 0  # inherited from the organisation

            with pytest.raises(APIError) as e:
                await ops.create_node("acme", "search", {})
            assert e.value.status == 409
            with pytest.raises(APIError) as e:
                await ops.create_node("nope", "x", {})
            assert e.value.status == 404
            with pytest.raises(APIError) as e:
                await ops.create_node(None, "bad/name", {})
            assert e.value.status == 400
            with pytest.raises(APIError) as e:
                await ops.create_node(None, "x", {"rpm": -1})
            assert e.value.status == 400 and e.value.param == "rpm"

            for bad in (None, "", "tok-nope", plaintext + "x"):
                with pytest.raises(APIError) as e:
                    await ops.authenticate(bad)
                assert e.value.status == 401 and e.value.code == "invalid_api_key"
                if bad:
                    assert bad not in e.value.message

            keys = await ops.list_keys()
            assert [k.id for k in keys] == [info.id]
            await ops.revoke_key(info.id)
            with pytest.raises(APIError) as e:
                await ops.authenticate(plaintext)
            assert e.value.status == 401 and plaintext not in e.value.message
            assert (await ops.list_keys())[0].revoked_at is not None
            with pytest.raises(APIError) as e:
                await ops.revoke_key("key_missing")
            assert e.value.status == 404

            # the plaintext cannot be found in any column of any table
            with ops.db.engine.connect() as conn:
                meta = MetaData()
                meta.reflect(conn)
                for table in meta.sorted_tables:
                    for row in conn.execute(select(table)).all():
                        for value in row:
                            assert plaintext not in str(value)
                            assert plaintext[10:30] not in str(value)
        finally:
            await ops.close()

    run(main())


def test_priority_nearest_node_wins_and_default(db_target):
    async def main():
        ops = await open_ops(db_target)
        try:
            await ops.create_node(None, "org", {"priority": 3})
            await ops.create_node("org", "p", {})
            k1, _ = await ops.create_key("org/p", "a", {"priority": 0})
            k2, _ = await ops.create_key("org/p", "b", {})
            await ops.create_node(None, "plain", {})
            k3, _ = await ops.create_key("plain", "c", {})
            assert (await ops.authenticate(k1)).priority == 0
            assert (await ops.authenticate(k2)).priority == 3
            assert (await ops.authenticate(k3)).priority == 1
            adm = await ops.admit(await ops.authenticate(k2), request())
            assert adm.priority == 3
            await ops.settle(adm, outcome())
        finally:
            await ops.close()

    run(main())


def test_allowed_models_on_any_node(db_target):
    async def main():
        ops = await open_ops(db_target)
        try:
            await ops.create_node(None, "org", {"allowed_models": ["m1", "free"]})
            await ops.create_node("org", "p", {"allowed_models": ["free"]})
            k, _ = await ops.create_key("org/p", "k", {})
            p = await ops.authenticate(k)
            with pytest.raises(APIError) as e:
                await ops.admit(p, request(model="m1"))
            assert (
                e.value.status == 403 and e.value.code == "model_not_allowed" and "org/p" in e.value.message
            )
            adm = await ops.admit(p, request(model="free"))
            await ops.release(adm)
        finally:
            await ops.close()

    run(main())


def test_a_key_with_the_read_only_admin_scope(db_target):
    async def main():
        ops = await open_ops(db_target)
        try:
            await ops.create_node(None, "acme", {})
            plain, _ = await ops.create_key("acme", "user", {})
            reader, info = await ops.create_key("acme", "auditor", {}, ["admin:read"])
            assert info.scopes == ("admin:read",)
            assert (await ops.get_key(info.id)).scopes == ("admin:read",)
            assert (await ops.admin_reader(reader)).id == info.id
            assert await ops.admin_reader(plain) is None  # a plain key is no admin
            assert await ops.admin_reader("tok-unknown") is None
            assert (await ops.authenticate(reader)).key_id == info.id  # still calls the models
            await ops.revoke_key(info.id)
            assert await ops.admin_reader(reader) is None
            with pytest.raises(APIError) as e:
                await ops.create_key("acme", "root", {}, ["admin:write"])
            assert e.value.status == 400 and e.value.param == "scopes"
        finally:
            await ops.close()

    run(main())
