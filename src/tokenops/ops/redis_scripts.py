"""Lua script calls to Redis, pipelined: the calls the event loop issues while a batch is on the wire
go out together as the next one, on one connection, in one write and one read. Under load a gateway
pays one connection checkout and one round trip for many requests' scripts rather than one each
(redis-py's per-call pool, timeout and parsing work was most of the budget store's CPU); an idle
gateway sends a lone call at once.

Scripts are called by their SHA1 (EVALSHA) and loaded on a NOSCRIPT answer (a restarted or flushed
Redis), then called again. A script may run twice if its batch is sent again after a lost
connection, so every script given here must be safe to repeat. `PackingConnection` is the
connection class to give the pool."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import hiredis
from redis.asyncio import Connection
from redis.exceptions import NoScriptError


class PackingConnection(Connection):
    """A connection that packs commands with hiredis (C) rather than redis-py's Python packer, which
    encodes every argument on its own: with a script's dozen arguments that was the largest single
    cost of a call."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if isinstance(args[0], str) and " " in args[0]:  # "SCRIPT LOAD": the server wants two words
            args = (*args[0].split(), *args[1:])
        return [hiredis.pack_command(args)]


class ScriptPipeline:
    def __init__(self, redis: Any, scripts: dict[str, str]) -> None:
        self._redis = redis
        self._scripts = scripts
        self._sha = {name: hashlib.sha1(body.encode()).hexdigest() for name, body in scripts.items()}
        self._queue: list[tuple[str, list, list, asyncio.Future]] = []
        self._sending = False

    async def call(self, name: str, keys: list, args: list) -> Any:
        """Run script `name`; its reply, or its error raised here."""
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((name, keys, args, fut))
        if not self._sending:
            self._sending = True
            asyncio.get_running_loop().create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                await self._send(batch)
        finally:
            self._sending = False

    async def _send(self, batch: list[tuple[str, list, list, asyncio.Future]]) -> None:
        try:
            results = await self._pipeline(batch)
            missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
            if missing:
                for name in {batch[i][0] for i in missing}:
                    await self._redis.script_load(self._scripts[name])
                for i, r in zip(missing, await self._pipeline([batch[i] for i in missing]), strict=True):
                    results[i] = r
        except BaseException as exc:  # the connection failed: every caller of the batch hears it
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for (*_, fut), r in zip(batch, results, strict=True):
            if fut.done():  # its caller was cancelled; the script ran regardless
                continue
            if isinstance(r, Exception):
                fut.set_exception(r)
            else:
                fut.set_result(r)

    async def _pipeline(self, batch: list[tuple[str, list, list, asyncio.Future]]) -> list[Any]:
        pipe = self._redis.pipeline(transaction=False)
        for name, keys, args, _ in batch:
            pipe.execute_command("EVALSHA", self._sha[name], len(keys), *keys, *args)
        return await pipe.execute(raise_on_error=False)
