"""vLLM's KV event wire format against a real ZeroMQ publisher on loopback (PUB + replay ROUTER, as
vLLM's ZmqEventPublisher runs them): both event encodings, gaps filled by replay, a replay buffer that
no longer holds what was missed, and a publisher restart. The real vLLM is in tests/vllm."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from tokenops.cluster.kv_event_stream import (
    KVEventsEndpoint,
    VLLMKVEventSubscriber,
    decode_batch,
)
from tokenops.cluster.prefix_index import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventApplier,
    PrefixIndex,
    block_hashes_from_tokens,
)

pytestmark = pytest.mark.anyio

TOKS = list(range(100, 148))  # three blocks of 16


def stored_map(hashes: list[bytes], parent: bytes | None, toks: list[int], **extra: object) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": toks,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def batch(*events: object) -> bytes:
    return msgpack.packb([1.0, list(events), 0], use_bin_type=True)


def test_both_encodings_decode_to_the_same_events() -> None:
    h = [b"\x01" * 32, b"\x02" * 32]
    as_map = batch(
        stored_map(h, None, TOKS[:32]),
        {"type": "BlockRemoved", "block_hashes": [h[1]], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    )
    as_array = batch(
        ["BlockStored", h, None, TOKS[:32], 16, None, "GPU"],
        ["BlockRemoved", [h[1]], "GPU"],
        ["AllBlocksCleared"],
    )
    as_int_hashes = batch(["BlockStored", [1, 2], None, TOKS[:32], 16, None, None])
    key = [int.from_bytes(x, "big") for x in h]
    expected = [
        BlockStored(tuple(key), None, tuple(TOKS[:32]), 16),
        BlockRemoved((key[1],)),
        AllBlocksCleared(),
    ]
    assert decode_batch(as_map) == expected
    plain_blocks = batch(stored_map(h, None, TOKS[:32], extra_keys=[None, None]))  # no extra keys per block
    assert decode_batch(plain_blocks) == expected[:1]
    assert decode_batch(as_array) == expected
    assert decode_batch(as_int_hashes) == [BlockStored((1, 2), None, tuple(TOKS[:32]), 16)]
    # a map batch too, and blocks a plain prompt cannot hit are left out
    skipped = msgpack.packb(
        {
            "ts": 1.0,
            "events": [
                stored_map(h[:1], None, TOKS[:16], lora_name="adapter"),
                stored_map(h[:1], None, TOKS[:16], extra_keys=[["salt"]]),
                stored_map(h[:1], None, TOKS[:16], medium="CPU"),
            ],
        }
    )
    assert decode_batch(skipped) == []


class Publisher:
    """vLLM's publisher protocol on loopback: PUB (topic, seq, payload), ROUTER replay of a buffer."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.source = KVEventsEndpoint(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.lock = threading.Lock()
        self.replays: list[int] = []
        self.running = True
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def publish(self, payload: bytes, *, send: bool = True) -> None:
        """Buffer a batch; `send=False` loses it on the wire (only a replay can bring it)."""
        with self.lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, payload))
            if send:
                self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def restart(self) -> None:
        with self.lock:
            self.seq, self.buffer = 0, []

    def _serve_replay(self) -> None:
        while self.running:
            if not self.router.poll(50):
                continue
            with self.lock:
                client, _, start = self.router.recv_multipart()
                first = int.from_bytes(start, "big")
                self.replays.append(first)
                for seq, buf in self.buffer:
                    if seq >= first:
                        self.router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), buf])
                self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.ctx.destroy(linger=0)


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    p = Publisher()
    yield p
    p.close()


def block(i: int) -> bytes:
    return i.to_bytes(32, "big")


def chain_event(i: int) -> dict:
    """Block i of TOKS (0..2), chained on block i-1."""
    return stored_map([block(i)], block(i - 1) if i else None, TOKS[16 * i : 16 * (i + 1)])


async def until(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_history_gaps_and_restarts_keep_the_index_exact(publisher: Publisher) -> None:
    ours = block_hashes_from_tokens(TOKS)
    index = PrefixIndex()
    sub = VLLMKVEventSubscriber(KVEventApplier(index, "v0"), publisher.source)
    publisher.publish(batch(chain_event(0)))  # before we subscribed: only the replay has it
    sub.start()
    try:
        await until(lambda: index.match(ours) == {"v0": 1})
        assert publisher.replays == [0]
        # batch 1 is lost on the wire; batch 2 shows the gap and the replay brings 1 back
        publisher.publish(batch(chain_event(1)), send=False)
        publisher.publish(batch(chain_event(2)))
        await until(lambda: index.match(ours) == {"v0": 3})
        assert publisher.replays == [0, 1] and sub.next_seq == 3
        publisher.publish(batch({"type": "BlockRemoved", "block_hashes": [block(2)], "medium": "GPU"}))
        await until(lambda: index.match(ours) == {"v0": 2})
        # the publisher restarts (empty cache, numbering from 0): what we held is dropped
        publisher.restart()
        await asyncio.sleep(0.1)
        publisher.publish(batch(chain_event(0)))
        await until(lambda: sub.next_seq == 1)
        assert index.match(ours) == {"v0": 1}
        # a gap the buffer no longer covers: the replica's entries go, new chains refill it
        publisher.publish(batch(chain_event(1)), send=False)
        publisher.buffer.clear()
        publisher.publish(batch(chain_event(2)), send=False)
        publisher.publish(batch(stored_map([block(9)], None, TOKS[:16])))
        await until(lambda: sub.next_seq == 4)
        assert index.match(ours) == {"v0": 1}  # block(9) re-indexes the first block only
        assert index.match(block_hashes_from_tokens(TOKS[:32])) == {"v0": 1}
    finally:
        await sub.stop()
