"""The key cache in front of the database: concurrent misses share one lookup, a key in use is
renewed ahead of expiry without a request waiting, and a revocation is never undone by a lookup
that was already in flight. Real databases; lookups are counted by wrapping the real function."""

import asyncio
import time

import pytest
from ops_helpers import open_ops

from tokenops.ops import keys
from tokenops.protocol import APIError


@pytest.fixture
def lookups(monkeypatch):
    calls = []
    real = keys.lookup_key

    def counting(conn, plaintext):
        calls.append(time.monotonic())
        return real(conn, plaintext)

    monkeypatch.setattr(keys, "lookup_key", counting)
    return calls


async def _key(ops):
    await ops.create_node(None, "acme", {})
    plaintext, info = await ops.create_key("acme", "ci", {})
    return plaintext, info


def test_concurrent_misses_share_one_lookup(db_target, lookups):
    async def main():
        ops = await open_ops(db_target, key_cache_ttl_s=0.3)
        try:
            plaintext, info = await _key(ops)
            principals = await asyncio.gather(*(ops.authenticate(plaintext) for _ in range(50)))
            assert {p.key_id for p in principals} == {info.id}
            assert len(lookups) == 1
            await asyncio.sleep(0.35)  # expired: the next burst again costs one lookup
            await asyncio.gather(*(ops.authenticate(plaintext) for _ in range(50)))
            assert len(lookups) == 2
            # an unknown key: one lookup for the burst, and every caller gets the 401
            results = await asyncio.gather(
                *(ops.authenticate("tok-unknown") for _ in range(10)), return_exceptions=True
            )
            assert all(isinstance(r, APIError) and r.status == 401 for r in results)
            assert len(lookups) == 3
        finally:
            await ops.close()

    asyncio.run(main())


def test_key_in_use_is_renewed_ahead_of_expiry(db_target, lookups):
    async def main():
        ttl = 0.4
        ops = await open_ops(db_target, key_cache_ttl_s=ttl)
        try:
            plaintext, _ = await _key(ops)
            await ops.authenticate(plaintext)
            assert len(lookups) == 1
            # a steady stream of requests for 3 TTLs: past half its life the entry is renewed in the
            # background, so no request ever finds it expired (each would wait for the database)
            waited = 0
            end = time.monotonic() + 3 * ttl
            while time.monotonic() < end:
                cached = ops._by_hash[keys.hash_key(plaintext)]
                if cached.expires <= time.monotonic():
                    waited += 1
                await ops.authenticate(plaintext)
                await asyncio.sleep(0.02)
            assert waited == 0
            assert 3 <= len(lookups) <= 8  # about one renewal per half TTL, not one per request
        finally:
            await ops.close()

    asyncio.run(main())


def test_revocation_is_not_undone_by_a_lookup_in_flight(db_target, monkeypatch):
    real = keys.lookup_key

    def slow(conn, plaintext):  # the live key is read, then its answer is slow to come back
        row = real(conn, plaintext)
        time.sleep(0.3)
        return row

    async def main():
        ops = await open_ops(db_target, key_cache_ttl_s=60)
        try:
            plaintext, info = await _key(ops)
            monkeypatch.setattr(keys, "lookup_key", slow)
            pending = asyncio.ensure_future(ops.authenticate(plaintext))
            for _ in range(5):
                await asyncio.sleep(0)  # the lookup is on its way to the database
            await ops.revoke_key(info.id)  # PostgreSQL: commits while the lookup still sleeps
            await asyncio.gather(pending, return_exceptions=True)  # either side of the revocation
            with pytest.raises(APIError) as e:
                await ops.authenticate(plaintext)
            assert e.value.status == 401
        finally:
            await ops.close()

    asyncio.run(main())
