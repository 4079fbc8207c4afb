"""An engine server's side of prefill/decode disaggregation: the KV transfer server its peers pull
from, and each request's `kv_transfer_params` leg. A leg is checked against this engine's role; the
prompt blocks this engine lacks are pulled from the leg's peer before the request is queued (a
prefill leg: a session's earlier prompt on another engine; a decode leg: the prefill engine's hold);
a peer's hold is released as soon as this engine prefills after all; and a prefill leg answers with
the handle its decode leg pulls by. The wire protocol is `kv_transfer`'s, the request field's form
`kv_transfer_params`'.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tokenops.engine import kv_transfer_params
from tokenops.engine.async_engine import AsyncEngine
from tokenops.engine.generation import Choice, Generation
from tokenops.engine.kv_transfer import (
    KVImport,
    KVTransferError,
    KVTransferServer,
    block_nbytes,
    pull_blocks,
    release_hold,
)
from tokenops.engine.kv_transfer_params import DecodeLeg, PrefillLeg
from tokenops.protocol import invalid_request

log = logging.getLogger(__name__)


class KVLegs:
    """The KV transfer server of one engine (started and closed with its HTTP server) and the
    prefill and decode legs of the requests that name one."""

    def __init__(
        self, engine: AsyncEngine, *, engine_id: str, host: str, port: int, pull_timeout_s: float
    ) -> None:
        inner = engine.engine
        self.engine = engine
        self.engine_id = engine_id
        self.pull_timeout_s = pull_timeout_s
        self.server = KVTransferServer(engine, inner.kv_layout, engine_id, inner.transfer_stats, host, port)
        self._releases: set[asyncio.Future] = set()  # holds of peers being released (`release`)

    async def start(self) -> None:
        await self.server.start()

    async def close(self) -> None:
        await self.server.close()
        for task in list(self._releases):  # a peer's hold still being released: it expires there
            task.cancel()

    def address(self) -> dict[str, Any]:
        """Where peers reach this engine's blocks (`/v1/load`'s `kv_transfer`)."""
        return {"engine_id": self.engine_id, "host": self.server.host, "port": self.server.port}

    @staticmethod
    def check(leg: PrefillLeg | DecodeLeg, role: str, choices: int, stream: bool) -> None:
        """A leg an engine of `role` takes, on one prompt with n=1; a prefill leg is answered whole."""
        if (err := kv_transfer_params.role_error(role, leg)) is not None:
            raise err
        if choices != 1:
            raise invalid_request("A request with kv_transfer_params takes one prompt and n=1.", param="n")
        if isinstance(leg, PrefillLeg) and stream:
            raise invalid_request(
                "The prefill leg (do_remote_decode) is answered whole: send stream=false.", param="stream"
            )

    async def pull_for(self, leg: PrefillLeg | DecodeLeg, ids: list[int], gen: Generation) -> KVImport | None:
        """Pull the blocks of `ids` this engine lacks from the leg's peer; None (prefill here) when
        there is nothing to pull or the pull failed (the reason goes into the response and metrics)."""
        engine = self.engine.engine
        pool, stats = engine.pool, engine.transfer_stats
        expected = pool.prefix_hashes(ids)
        have = pool.cached_blocks(expected)
        report: dict[str, Any] = {
            "leg": "prefill" if isinstance(leg, PrefillLeg) else "decode",
            "blocks": 0,
            "bytes": 0,
            "seconds": 0.0,
            "fallback": None,
        }
        gen.kv_fields["leg"] = report["leg"]
        gen.kv_fields["kv_transfer"] = report
        if isinstance(leg, PrefillLeg):
            if leg.history is None or have >= len(expected):
                return None
            source, kw = leg.history, {"hashes": expected[have:]}
        else:
            if not leg.block_ids:  # the prefill engine held nothing (a prompt shorter than a block)
                return None
            source = leg.source
            # the hold covers the prompt's leading full blocks; ask only for those not cached here
            kw = {"transfer_id": leg.transfer_id, "block_ids": leg.block_ids[have:]}
        if not pool.enable_prefix_caching:  # pulled blocks land in the prefix cache: nowhere to put them
            stats.fallback("no_prefix_cache")
            report["fallback"] = "no_prefix_cache"
            self.release(leg)
            return None
        try:
            pulled = await pull_blocks(
                source.host,
                source.port,
                layout=engine.kv_layout,
                engine_id=source.engine_id,
                timeout_s=self.pull_timeout_s,
                block_bytes=block_nbytes(engine.runner.kv_caches),
                **kw,
            )
        except KVTransferError as exc:
            log.warning("KV pull failed, prefilling locally: %s", exc)
            stats.fallback(exc.reason)
            report["fallback"] = exc.reason
            self.release(leg)
            return None
        stats.bytes_received += pulled.nbytes
        stats.receive_seconds += pulled.seconds
        report.update(blocks=len(pulled.hashes), bytes=pulled.nbytes, seconds=round(pulled.seconds, 6))
        if tuple(expected[have : have + len(pulled.hashes)]) != pulled.hashes:
            stats.fallback("hash_mismatch")  # another prompt's or another model's blocks
            report["fallback"] = "hash_mismatch"
            return None
        return KVImport(have, pulled.hashes, pulled.payloads) if pulled.hashes else None

    def release(self, leg: PrefillLeg | DecodeLeg | None) -> None:
        """A decode leg that prefills here instead tells the prefill engine to drop its hold now
        rather than at its timeout; in the background (the answer does not wait), best effort (the
        timeout stays the backstop). A prefill leg's pull by hash holds nothing."""
        if not isinstance(leg, DecodeLeg):
            return
        task = asyncio.ensure_future(self._release_hold(leg))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release_hold(self, leg: DecodeLeg) -> None:
        source = leg.source
        try:
            await release_hold(
                source.host, source.port, engine_id=source.engine_id, transfer_id=leg.transfer_id
            )
        except KVTransferError as exc:
            log.info("KV hold %s not released at %s:%s: %s", leg.transfer_id, source.host, source.port, exc)

    def decode_handle(self, choice: Choice) -> dict[str, Any]:
        """What a prefill leg answers with: where its decode leg pulls the held blocks from."""
        hold = choice.kv_hold
        return kv_transfer_params.decode_handle(
            self.engine_id,
            self.server.host,
            self.server.port,
            hold.transfer_id if hold is not None else choice.request_id,
            hold.block_ids if hold is not None else (),
        )
