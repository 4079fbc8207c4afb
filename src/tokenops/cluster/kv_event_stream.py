"""vLLM's KV event stream (ZeroMQ, msgpack) decoded into our KV events and applied to a replica's index.

Wire format of vLLM's `ZmqEventPublisher` (`--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`):
- PUB socket: multipart (topic, seq as 8-byte big-endian, payload); seq counts batches from 0 per
  engine start.
- payload: msgpack of `EventBatch` = [ts, events, data_parallel_rank?] (an array; a map
  {"ts", "events"} is read too). Each event is a tagged struct: recent versions send a map with its tag
  under "type" ({"type": "BlockStored", "block_hashes": ..., ...}), earlier ones an array whose first
  item is the tag (["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium]). Block hashes are bytes (vLLM's sha256 digests) or 64-bit ints
  (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`); either is only a key here.
- replay: a DEALER sends (b"", start seq) to the ROUTER, which answers (b"", topic, seq, payload) for
  every batch it still buffers from `start` on, then (b"", b"", -1, b"").

The applier re-hashes each stored block from its token ids into our hash space, so the index matches
the gateway's own hashing of a prompt exactly. Blocks whose vLLM hash covers more than the tokens
(a LoRA adapter, a cache salt, multimodal inputs: `lora_id`, `lora_name`, `extra_keys`) and blocks of
an offload tier (`medium` other than the primary "GPU") are skipped: a plain prompt would not hit them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from tokenops.cluster.prefix_index import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventApplier

log = logging.getLogger("tokenops.cluster.kv_events")

END_SEQ = -1
PRIMARY_MEDIA = (None, "GPU")  # vLLM names its main KV pool "GPU" on every device, the CPU build too

# field order of the array encoding, after the tag
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


@dataclass(frozen=True, slots=True)
class KVEventsEndpoint:
    """Where one vLLM replica publishes its KV events."""

    endpoint: str  # the PUB socket, e.g. tcp://10.0.0.5:5557
    replay_endpoint: str | None = None  # the ROUTER socket, e.g. tcp://10.0.0.5:5558
    topic: str = ""


def hash_key(value: bytes | int) -> int:
    """A vLLM block hash as the int our applier keys on."""
    return int.from_bytes(value, "big") if isinstance(value, bytes | bytearray) else int(value)


def _fields(raw: Any) -> tuple[str, Mapping[str, Any]] | None:
    if isinstance(raw, Mapping):
        return str(raw.get("type", "")), raw
    if isinstance(raw, Sequence) and raw and isinstance(raw[0], str):
        names = _ARRAY_FIELDS.get(raw[0])
        if names is None:
            return raw[0], {}
        return raw[0], dict(zip(names, raw[1:], strict=False))
    return None


def decode_event(raw: Any) -> KVEvent | None:
    """One event of a batch, in either encoding; None for events we do not index (see module doc)."""
    parsed = _fields(raw)
    if parsed is None:
        return None
    tag, f = parsed
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if f.get("medium") not in PRIMARY_MEDIA:
        return None
    if tag == "BlockRemoved":
        return BlockRemoved(tuple(hash_key(h) for h in f.get("block_hashes") or ()))
    if tag == "BlockStored":
        extra = f.get("extra_keys") or ()  # one entry per block, None where the block has none
        if f.get("lora_id") is not None or f.get("lora_name") is not None or any(k for k in extra):
            return None
        parent = f.get("parent_block_hash")
        return BlockStored(
            tuple(hash_key(h) for h in f.get("block_hashes") or ()),
            None if parent is None else hash_key(parent),
            tuple(int(t) for t in f.get("token_ids") or ()),
            int(f.get("block_size") or 16),
        )
    return None


def decode_batch(payload: bytes) -> list[KVEvent]:
    """A published payload (one `EventBatch`) as our events, in order."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    events = batch.get("events", ()) if isinstance(batch, Mapping) else batch[1]
    return [e for e in (decode_event(raw) for raw in events or ()) if e is not None]


class VLLMKVEventSubscriber:
    """Follows one vLLM replica's KV event stream into its `KVEventApplier`.

    On start and after every gap in the sequence numbers it asks the replay socket for what it missed;
    what the replay buffer no longer holds is lost, so the replica's entries are dropped (`resync`) and
    the index refills from new events. A seq that falls back to 0 means vLLM restarted (empty cache).
    A parent hash we never saw stored is always a lost event for vLLM (a chain's first block has
    parent None), so the applier never learns roots here.
    """

    def __init__(
        self,
        applier: KVEventApplier,
        source: KVEventsEndpoint,
        *,
        replay_timeout: float = 2.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.applier = applier
        self.applier.complete = False
        self.source = source
        self.replay_timeout = replay_timeout
        self._ctx = context or zmq.asyncio.Context.instance()
        self.next_seq: int | None = None  # the seq we expect next; None before the first batch
        self.batches = 0  # batches applied (tests and diagnostics)
        self._task: asyncio.Task[None] | None = None

    def reset(self) -> None:
        """The replica restarted or was unreachable: forget its blocks and where its stream was."""
        self.applier.resync()
        self.next_seq = None

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            events = decode_batch(payload)
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            log.warning("undecodable KV event batch %d from %s: %s", seq, self.source.endpoint, exc)
            events = []
        for event in events:
            self.applier.apply(event)
        self.next_seq = seq + 1
        self.batches += 1

    async def replay(self, start: int) -> bool | None:
        """Apply the buffered batches from `start` on. True: nothing was lost; False: the buffer no
        longer held `start` (the replica's entries were dropped, later batches applied); None: no
        replay (no socket configured, or no answer)."""
        if self.source.replay_endpoint is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.source.replay_endpoint)
        complete = False
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            first = True
            while True:
                if not await sock.poll(int(self.replay_timeout * 1000)):
                    log.warning("KV event replay from %s timed out", self.source.replay_endpoint)
                    return None
                frames = await sock.recv_multipart()
                if len(frames) < 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    # an empty buffer answered a request from its very start: nothing was missed
                    return complete or (first and start == 0)
                if first:
                    complete = seq <= start
                    if not complete:
                        self.applier.resync()  # the batches before `seq` are gone
                    first = False
                if self.next_seq is None or seq >= self.next_seq:
                    self._apply(seq, frames[3])
        finally:
            sock.close()

    async def on_batch(self, seq: int, payload: bytes) -> None:
        """One live batch: apply it, replaying first what a gap says we missed."""
        if self.next_seq is not None and seq < self.next_seq:
            if seq != 0:
                return  # already applied (it came with a replay)
            self.reset()  # vLLM restarted: its numbering starts again
        if self.next_seq is not None and seq > self.next_seq:
            if await self.replay(self.next_seq) is None:
                self.reset()
        if self.next_seq is None or seq >= self.next_seq:
            self._apply(seq, payload)

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(self.source.endpoint)
        try:
            # what was published before we connected: the replay buffer has it (from seq 0 if it
            # still holds the engine's whole history)
            await asyncio.sleep(0.1)  # let the SUB connect so nothing falls between replay and live
            if self.source.replay_endpoint is not None and await self.replay(0) is False:
                log.info("KV events of %s: the oldest batches are gone", self.source.endpoint)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                await self.on_batch(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close()

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name="vllm-kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
