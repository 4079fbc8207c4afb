"""KV transfer between engines: whole blocks as bytes, the holds that keep them for a peer, and the
binary stream that carries them over TCP.

A prefill engine that finishes a request sent with `kv_transfer_params.do_remote_decode` pins the
request's full prompt blocks in a `KVHolds` entry (a transfer id, the block ids and their chain
hashes); a decode engine pulls the blocks it lacks from that hold, block at a time, and registers them
in its own pool's prefix cache (`BlockPool.import_chain`), so its scheduler attaches them as if it had
computed them. The same stream serves pulls by chain hash, which is how a prefill engine fetches the
session history a decode engine holds (incremental transfer). A hold ends when its puller acknowledges
the last block, or when it expires (`timeout_s`, counted). The receiving side registers nothing until
every block of a pull has arrived and matched its expected hash, so a cut stream leaves no trace.

Wire format (network byte order). Request: magic `TKV1`, op (1 = by transfer id, 2 = by hash), the
puller's layout fingerprint and expected engine id (each u16 length + UTF-8), then for op 1 the
transfer id and a u32 count of block ids (u32 each), for op 2 a u32 count of hashes (u64 each).
Response: magic, status (0 = ok), the server's engine id, u32 block count, u32 bytes per block (or,
on an error, a u16-length message), then each block as u64 hash + raw bytes; the puller answers one
byte (1) once it holds them all. A block's bytes are, per layer, the keys then the values of its
slots as stored (int8: the codes, then the float16 scales), so a transfer is byte-exact per dtype.

This module owns the format and the data path; which requests use it is the server's business
(`tokenops.engine.server`), and where a prefill runs is the cluster's (`tokenops.cluster.pd`).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from tokenops.engine.kv_cache import KVTensor, QuantizedKV

if TYPE_CHECKING:
    from tokenops.engine.block_pool import BlockPool

T = TypeVar("T")

MAGIC = b"TKV1"
OP_BY_TRANSFER = 1
OP_BY_HASH = 2
OP_RELEASE = 3  # the hold will not be pulled: unpin it now, not at its timeout
OK, UNKNOWN_TRANSFER, FOREIGN_BLOCKS, LAYOUT_MISMATCH, BUSY = range(5)
STATUS_NAMES = {
    UNKNOWN_TRANSFER: "unknown_transfer",
    FOREIGN_BLOCKS: "foreign_blocks",
    LAYOUT_MISMATCH: "layout_mismatch",
    BUSY: "busy",
}
MAX_BLOCKS_PER_PULL = 1 << 16


class KVTransferError(RuntimeError):
    """A pull failed (peer gone, cut stream, stale or foreign ids, another model); `reason` is a
    short machine-readable word for metrics and the response."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# -- a block as bytes -------------------------------------------------------------------------------


def _parts(cache: KVTensor) -> tuple[torch.Tensor, ...]:
    return (cache.data, cache.scale) if isinstance(cache, QuantizedKV) else (cache,)


def block_nbytes(kv_caches: Sequence[tuple[KVTensor, KVTensor]]) -> int:
    return sum(t[0].numel() * t.element_size() for k, v in kv_caches for c in (k, v) for t in _parts(c))


def export_block(kv_caches: Sequence[tuple[KVTensor, KVTensor]], block_id: int) -> bytes:
    """One block's bytes across all layers, keys then values, as stored."""
    chunks = []
    for k, v in kv_caches:
        for cache in (k, v):
            for t in _parts(cache):
                chunks.append(t[block_id].contiguous().view(torch.uint8).numpy().tobytes())
    return b"".join(chunks)


def import_block(kv_caches: Sequence[tuple[KVTensor, KVTensor]], block_id: int, payload: bytes) -> None:
    """Write `export_block`'s bytes into `block_id` (the layouts must match: see `KVLayout`)."""
    src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    offset = 0
    for k, v in kv_caches:
        for cache in (k, v):
            for t in _parts(cache):
                dst = t[block_id].view(torch.uint8)
                n = dst.numel()
                dst.copy_(src[offset : offset + n].view(dst.shape))
                offset += n
    if offset != len(payload):
        raise ValueError(f"block payload has {len(payload)} bytes, the layout takes {offset}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What two engines must share for their blocks to be interchangeable."""

    model_id: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def fingerprint(self) -> str:
        return (
            f"{self.model_id}|{self.kv_dtype}|bs{self.block_size}|L{self.num_layers}"
            f"|H{self.num_kv_heads}|D{self.head_dim}"
        )


@dataclass(frozen=True, slots=True)
class KVImport:
    """Blocks a peer sent for one prompt: its full blocks `start_block`, `start_block + 1`, ..."""

    start_block: int
    hashes: tuple[int, ...]
    payloads: tuple[bytes, ...]


# -- holds: blocks kept for a peer --------------------------------------------------------------------


@dataclass(slots=True)
class Hold:
    transfer_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    expires_at: float
    busy: bool = False  # a pull is streaming it: it neither expires nor is released meanwhile


@dataclass(slots=True)
class TransferStats:
    """Counters behind `/metrics` (`tokenops_engine_kv_transfer_*`)."""

    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    receive_seconds: float = 0.0
    holds_created: int = 0
    holds_released: int = 0
    holds_expired: int = 0
    holds_cancelled: int = 0  # released at their puller's word, never pulled
    fallbacks: dict[str, int] = field(default_factory=dict)

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1


class KVHolds:
    """Transfer id -> pinned blocks. Holds are made, ended and expired on the engine thread (they pin
    and unpin blocks of a pool that is not thread-safe); `begin` touches no pool, so the transfer
    server calls it from its own thread: a pull of held blocks never waits for the engine's step to
    end. A lock keeps `begin`'s check-and-mark apart from `expire`, so a hold being pulled is never
    released under the puller."""

    def __init__(self, pool: BlockPool, timeout_s: float, stats: TransferStats) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.stats = stats
        self._holds: dict[str, Hold] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._holds)

    def hold(self, transfer_id: str, token_ids: Sequence[int], now: float | None = None) -> Hold | None:
        """Pin the full blocks of `token_ids` that the pool indexes (a contiguous prefix)."""
        hashes = self.pool.prefix_hashes(token_ids)
        bids = self.pool.pin_cached(hashes)
        if not bids:
            return None
        now = time.monotonic() if now is None else now
        h = Hold(transfer_id, tuple(bids), tuple(hashes[: len(bids)]), now + self.timeout_s)
        with self._lock:
            self._holds[transfer_id] = h
        self.stats.holds_created += 1
        return h

    def begin(self, transfer_id: str, block_ids: Sequence[int]) -> tuple[int, list[tuple[int, int]]]:
        """Mark a hold busy for a pull of `block_ids`; (status, [(block id, hash)]). Any thread."""
        with self._lock:
            h = self._holds.get(transfer_id)
            if h is None:
                return UNKNOWN_TRANSFER, []
            index = dict(zip(h.block_ids, h.block_hashes, strict=True))
            if h.busy:
                return BUSY, []
            if any(b not in index for b in block_ids):
                return FOREIGN_BLOCKS, []
            h.busy = True
        return OK, [(b, index[b]) for b in block_ids]

    def end(self, transfer_id: str, delivered: bool) -> None:
        """A pull finished: a delivered hold is released, a failed one may be pulled again."""
        with self._lock:
            h = self._holds.get(transfer_id)
            if h is None:
                return
            h.busy = False
        if delivered:
            self.release(transfer_id)

    def cancel(self, transfer_id: str) -> int:
        """A puller will not pull this hold: release it unless a pull of it is under way; the status
        (OK, UNKNOWN_TRANSFER: pulled or expired already, BUSY). On the engine's thread."""
        with self._lock:
            h = self._holds.get(transfer_id)
            if h is None:
                return UNKNOWN_TRANSFER
            if h.busy:
                return BUSY
            del self._holds[transfer_id]
        self.pool.unpin(h.block_ids)
        self.stats.holds_cancelled += 1
        return OK

    def release(self, transfer_id: str) -> bool:
        with self._lock:
            h = self._holds.pop(transfer_id, None)
        if h is None:
            return False
        self.pool.unpin(h.block_ids)
        self.stats.holds_released += 1
        return True

    def expire(self, now: float | None = None) -> int:
        """Release every idle hold past its deadline; return how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [t for t, h in self._holds.items() if h.expires_at <= now and not h.busy]
            held = [self._holds.pop(t) for t in gone]
        for h in held:
            self.pool.unpin(h.block_ids)
        self.stats.holds_expired += len(held)
        return len(held)


# -- the stream ----------------------------------------------------------------------------------------


def _pack_str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("!H", len(b)) + b


async def _read_str(reader: asyncio.StreamReader) -> str:
    (n,) = struct.unpack("!H", await reader.readexactly(2))
    return (await reader.readexactly(n)).decode()


@dataclass(frozen=True, slots=True)
class PulledBlocks:
    hashes: tuple[int, ...]
    payloads: tuple[bytes, ...]
    nbytes: int
    seconds: float


async def pull_blocks(
    host: str,
    port: int,
    *,
    layout: KVLayout,
    engine_id: str,
    transfer_id: str | None = None,
    block_ids: Sequence[int] = (),
    hashes: Sequence[int] = (),
    timeout_s: float = 30.0,
    block_bytes: int | None = None,
) -> PulledBlocks:
    """Pull blocks from a peer's transfer server: by `transfer_id` + `block_ids`, or by `hashes`.
    `block_bytes`: the size a block must have here (a peer announcing another size is refused
    before anything is read). Raises `KVTransferError`; returns only when every block arrived."""
    start = time.perf_counter()
    op = OP_BY_TRANSFER if transfer_id is not None else OP_BY_HASH
    head = MAGIC + bytes([op]) + _pack_str(layout.fingerprint()) + _pack_str(engine_id)
    try:
        if op == OP_BY_TRANSFER:
            body = _pack_str(transfer_id) + struct.pack(f"!I{len(block_ids)}I", len(block_ids), *block_ids)
        else:
            body = struct.pack(f"!I{len(hashes)}Q", len(hashes), *hashes)
    except struct.error as exc:  # ids no peer can hold (a handle's block id past 32 bits)
        raise KVTransferError("peer_failed", f"KV pull from {host}:{port} failed: {exc!r}") from None
    asked = len(block_ids) if op == OP_BY_TRANSFER else len(hashes)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> PulledBlocks:
        status, peer_id = await _answer_head(reader)
        if status != OK:
            message = await _read_str(reader)
            raise KVTransferError(STATUS_NAMES.get(status, "error"), f"engine {peer_id!r}: {message}")
        count, nbytes = struct.unpack("!II", await reader.readexactly(8))
        if count > asked:
            raise KVTransferError("protocol", f"engine {peer_id!r} sends {count} blocks for {asked} asked")
        if block_bytes is not None and nbytes != block_bytes:
            raise KVTransferError(
                "layout_mismatch", f"engine {peer_id!r} sends blocks of {nbytes} bytes, {block_bytes} here"
            )
        got_hashes, payloads = [], []
        for _ in range(count):
            (h,) = struct.unpack("!Q", await reader.readexactly(8))
            got_hashes.append(h)
            payloads.append(await reader.readexactly(nbytes))
        writer.write(b"\x01")
        await writer.drain()
        return PulledBlocks(tuple(got_hashes), tuple(payloads), count * nbytes, time.perf_counter() - start)

    return await _exchange(host, port, head + body, answer, timeout_s, "pull from")


async def release_hold(
    host: str, port: int, *, engine_id: str, transfer_id: str, timeout_s: float = 5.0
) -> bool:
    """Tell a peer its hold `transfer_id` will not be pulled (the puller prefills itself), so it
    unpins the blocks now rather than when the hold times out. True when the peer released it, False
    when it had no such hold (pulled or expired). Raises `KVTransferError` (busy: a pull of it is
    under way, and it stays)."""
    # a release reads no blocks: no layout to agree on
    request = MAGIC + bytes([OP_RELEASE]) + _pack_str("") + _pack_str(engine_id) + _pack_str(transfer_id)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        status, peer_id = await _answer_head(reader)
        if status in (OK, UNKNOWN_TRANSFER):
            return status == OK
        message = await _read_str(reader)
        raise KVTransferError(STATUS_NAMES.get(status, "error"), f"engine {peer_id!r}: {message}")

    return await _exchange(host, port, request, answer, timeout_s, "release at")


async def _exchange(
    host: str,
    port: int,
    request: bytes,
    answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[T]],
    timeout_s: float,
    what: str,
) -> T:
    """One exchange with a peer's transfer server: send `request`, read the reply with `answer`;
    a dead, cut or slow peer becomes a `KVTransferError`."""

    async def run() -> T:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(request)
            await writer.drain()
            return await answer(reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    try:
        return await asyncio.wait_for(run(), timeout_s)
    except KVTransferError:
        raise
    except TimeoutError:
        raise KVTransferError("timeout", f"KV {what} {host}:{port} took over {timeout_s}s") from None
    except (OSError, asyncio.IncompleteReadError, struct.error, UnicodeDecodeError) as exc:
        raise KVTransferError("peer_failed", f"KV {what} {host}:{port} failed: {exc!r}") from None


async def _answer_head(reader: asyncio.StreamReader) -> tuple[int, str]:
    """A reply's status and the answering engine's id."""
    if await reader.readexactly(4) != MAGIC:
        raise KVTransferError("protocol", "the peer is not a tokenops KV transfer server")
    status = (await reader.readexactly(1))[0]
    return status, await _read_str(reader)


class KVTransferServer:
    """Serves this engine's held (and, by hash, cached) blocks to peers on one TCP port.

    `engine` is the `AsyncEngine`: a pull of a hold begins here at once (`KVHolds.begin` is
    thread-safe) and ends on the engine's thread; blocks pinned by hash are pinned and unpinned on
    its thread; the bytes of pinned blocks are read here, on the event loop, while the engine steps
    (pinned blocks are never written)."""

    def __init__(
        self,
        engine: Any,
        layout: KVLayout,
        engine_id: str,
        stats: TransferStats,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.engine = engine
        self.layout = layout
        self.engine_id = engine_id
        self.stats = stats
        self.host, self.port = host, port
        self._server: asyncio.Server | None = None
        self._expiry: asyncio.Task | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._expiry = asyncio.create_task(self._expire_loop())

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _expire_loop(self, every_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(every_s)
            if len(self.engine.engine.kv_holds):
                try:
                    await self.engine.call(lambda e: e.kv_holds.expire())
                except Exception:  # noqa: BLE001 - the engine stopped; nothing left to expire
                    return

    async def _refuse(self, writer: asyncio.StreamWriter, status: int, message: str) -> None:
        writer.write(MAGIC + bytes([status]) + _pack_str(self.engine_id) + _pack_str(message))
        await writer.drain()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve_one(reader, writer)
        except (OSError, asyncio.IncompleteReadError, struct.error, UnicodeDecodeError):
            pass  # the puller went away or spoke nonsense: it sees its own error
        finally:
            writer.close()

    async def _release(self, writer: asyncio.StreamWriter, wanted_engine: str, transfer_id: str) -> None:
        if wanted_engine and wanted_engine != self.engine_id:
            await self._refuse(
                writer, UNKNOWN_TRANSFER, f"this is engine {self.engine_id!r}, not {wanted_engine!r}"
            )
            return
        status = await self.engine.call(lambda e: e.kv_holds.cancel(transfer_id))
        if status == OK:
            writer.write(MAGIC + bytes([OK]) + _pack_str(self.engine_id))
            await writer.drain()
        else:
            await self._refuse(writer, status, f"transfer {transfer_id!r}: {STATUS_NAMES[status]}")

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await reader.readexactly(4) != MAGIC:
            return
        op = (await reader.readexactly(1))[0]
        fingerprint, wanted_engine = await _read_str(reader), await _read_str(reader)
        transfer_id = None
        if op == OP_RELEASE:
            await self._release(writer, wanted_engine, await _read_str(reader))
            return
        if op == OP_BY_TRANSFER:
            transfer_id = await _read_str(reader)
            (n,) = struct.unpack("!I", await reader.readexactly(4))
            if n > MAX_BLOCKS_PER_PULL:
                return
            keys = list(struct.unpack(f"!{n}I", await reader.readexactly(4 * n)))
        elif op == OP_BY_HASH:
            (n,) = struct.unpack("!I", await reader.readexactly(4))
            if n > MAX_BLOCKS_PER_PULL:
                return
            keys = list(struct.unpack(f"!{n}Q", await reader.readexactly(8 * n)))
        else:
            return
        if fingerprint != self.layout.fingerprint():
            await self._refuse(
                writer,
                LAYOUT_MISMATCH,
                f"KV layout {self.layout.fingerprint()!r} here, {fingerprint!r} asked",
            )
            return
        if wanted_engine and wanted_engine != self.engine_id:
            await self._refuse(
                writer, UNKNOWN_TRANSFER, f"this is engine {self.engine_id!r}, not {wanted_engine!r}"
            )
            return
        if transfer_id is not None:
            # held blocks are pinned and never written: no need to wait for the engine's step
            status, blocks = self.engine.engine.kv_holds.begin(transfer_id, keys)
            if status != OK:
                await self._refuse(writer, status, f"transfer {transfer_id!r}: {STATUS_NAMES[status]}")
                return
        else:
            # the leading blocks of `keys` held here; the puller computes the rest itself
            bids = await self.engine.call(lambda e: e.pool.pin_cached(keys))
            blocks = list(zip(bids, keys[: len(bids)], strict=True))
        delivered = False
        try:
            caches = self.engine.engine.runner.kv_caches
            nbytes = block_nbytes(caches)
            writer.write(
                MAGIC + bytes([OK]) + _pack_str(self.engine_id) + struct.pack("!II", len(blocks), nbytes)
            )
            for bid, h in blocks:  # one block's copy while the previous one is on the wire
                writer.write(struct.pack("!Q", h) + export_block(caches, bid))
                await writer.drain()
            delivered = await reader.readexactly(1) == b"\x01"
            if delivered:
                self.stats.blocks_sent += len(blocks)
                self.stats.bytes_sent += len(blocks) * nbytes
        finally:
            if transfer_id is not None:
                await self.engine.call(lambda e: e.kv_holds.end(transfer_id, delivered))
            else:
                await self.engine.call(lambda e: e.pool.unpin([b for b, _ in blocks]))
