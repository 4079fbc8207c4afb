"""Two gateways' first starts on one fresh PostgreSQL database race to create the default
organisation, project and key: exactly one creates them (and shows its key), the other finds them,
and neither fails."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest

from tokenops.gateway.serve import bootstrap_tenant
from tokenops.ops.service import Operations, OpsSettings

pytestmark = pytest.mark.postgres

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


def test_two_first_starts_create_one_default_tenant() -> None:
    schema = f"t_boot_{uuid.uuid4().hex[:10]}"

    async def main() -> list[str | None]:
        ops = [
            await Operations.open(OpsSettings(database_url=PG_URL, database_schema=schema)) for _ in range(4)
        ]
        try:
            return await asyncio.gather(*(bootstrap_tenant(o) for o in ops))
        finally:
            for o in ops:
                await o.close()

    try:
        for _ in range(3):  # the race is decided by timing: give it a few chances to show
            keys = asyncio.run(main())
            assert sum(k is not None for k in keys) == 1, keys
            with psycopg.connect(PG_URL, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
