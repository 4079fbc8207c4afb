"""The expert server: a stateless process holding some experts of some MoE layers, computing them
for batches of hidden states that attention clients send over the binary wire format (`wire`).

It keeps no per-request state (no KV, no sequences): any replica of the same experts answers any
request the same way, which is what lets the client fail over. Every frame is validated before
use; a bad one gets an ERROR reply (shape, dtype, an expert it does not hold) or, when the stream
itself is out of step (bad magic, truncated frame), the connection is closed. Neither stops the
server. `tokenops expert-server` (eaas/cli.py) runs one; `ExpertServer.start` runs one in a
thread, `spawn_expert_server` one in a child process, for tests and benchmarks.
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

import torch

from tokenops.engine.eaas import wire
from tokenops.engine.models.moe import Experts, QuantizedExperts, RoutedExperts, moe_blocks
from tokenops.engine.quantize import weight_bytes

log = logging.getLogger(__name__)


class ExpertShard:
    """The experts one server holds: per layer, the chosen experts (float stacked, or quantised)."""

    def __init__(self, layers: dict[int, tuple[RoutedExperts, list[int]]]) -> None:
        """layers: layer -> (the experts, as experts 0..n-1, and their global expert ids)."""
        self.layers = layers
        self.local = {layer: {e: i for i, e in enumerate(ids)} for layer, (_, ids) in layers.items()}
        first = next(iter(layers.values()))[0]
        self.hidden, self.dtype = first.hidden_size, first.dtype
        self.fingerprints = [
            (layer, e, experts.fingerprint(i))
            for layer, (experts, ids) in sorted(layers.items())
            for i, e in enumerate(ids)
        ]

    @classmethod
    def from_model(cls, model: torch.nn.Module, experts: dict[int, Iterable[int]]) -> ExpertShard:
        """Copy `experts` (layer -> expert ids) out of a loaded MoE model."""
        blocks = {b.layer_idx: b for b in moe_blocks(model)}
        num_experts = next(iter(blocks.values())).num_experts if blocks else 0
        layers = {}
        for layer, ids in experts.items():
            ids = checked_expert_ids(layer, ids, list(blocks), num_experts)
            layers[layer] = (blocks[layer].experts.subset(ids), ids)
        if not layers:
            raise ValueError("an expert server must hold at least one expert")
        return cls(layers)

    def quantized(self, mode: str, group_size: int = 32) -> ExpertShard:
        """This shard with its experts in `mode` (`models.moe.QuantizedExperts`)."""
        layers = {}
        for layer, (experts, ids) in self.layers.items():
            if not isinstance(experts, Experts):
                raise ValueError(f"layer {layer}'s experts are quantised already")
            layers[layer] = (QuantizedExperts(experts, mode, group_size), ids)
        return ExpertShard(layers)

    @property
    def nbytes(self) -> int:
        """Bytes of expert weights this shard holds."""
        return sum(weight_bytes(experts) for experts, _ in self.layers.values())

    def compute(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Unweighted expert outputs for rows sorted by expert id (as the client sends them)."""
        experts, _ = self.layers[layer]
        local = self.local[layer]
        counts = torch.zeros(len(local), dtype=torch.int64)
        for e in expert_ids.tolist():
            counts[local[e]] += 1
        with torch.no_grad():
            return experts.run(x, counts)

    def check(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor) -> tuple[int, str] | None:
        """(error code, message) when the request does not fit this shard, else None."""
        if layer not in self.layers:
            return (
                wire.E_EXPERT,
                f"this server holds no experts of layer {layer} (holds {sorted(self.layers)})",
            )
        if x.dtype != self.dtype:
            return wire.E_DTYPE, f"hidden states are {x.dtype}, layer {layer} computes in {self.dtype}"
        if x.shape[1] != self.hidden:
            return wire.E_SHAPE, f"hidden size {x.shape[1]}, layer {layer} expects {self.hidden}"
        ids = expert_ids.tolist()
        missing = sorted(set(ids) - set(self.local[layer]))
        if missing:
            return wire.E_EXPERT, f"layer {layer}: this server does not hold experts {missing[:8]}"
        if ids != sorted(ids):
            return wire.E_SHAPE, "rows must be sorted by expert id"
        return None


def _linger_close(sock: socket.socket, limit: int = 1 << 20, timeout_s: float = 1.0) -> None:
    """Half-close and drain what the peer still sends: closing with unread bytes makes the kernel
    reset the connection, and a reset can discard the error frame before the peer reads it."""
    sock.shutdown(socket.SHUT_WR)
    sock.settimeout(timeout_s)
    drained = 0
    while drained < limit and (chunk := sock.recv(65536)):
        drained += len(chunk)


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        shard = self.server.shard
        while True:
            try:
                frame = wire.read_frame(sock)
            except EOFError:
                return
            except (wire.ProtocolError, OSError) as err:
                # the stream is out of step: answer once if we can, then drop the connection
                log.warning("expert server: closing a connection: %s", err)
                try:
                    sock.sendall(wire.error_frame(0, wire.E_MALFORMED, str(err)).encode())
                    _linger_close(sock)
                except OSError:
                    pass
                return
            reply = self.server.answer(frame, shard)
            try:
                sock.sendall(reply.encode())
            except OSError:
                return


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], shard: ExpertShard) -> None:
        super().__init__(address, _Handler)
        self.shard = shard
        self.lock = threading.Lock()  # one computation at a time: torch's threads are shared
        self.rows_served = 0
        self.batches_served = 0

    def answer(self, frame: wire.Frame, shard: ExpertShard) -> wire.Frame:
        rid = frame.request_id
        if frame.kind == wire.HELLO:
            return wire.info_frame(rid, shard.hidden, shard.dtype, shard.fingerprints)
        if frame.kind != wire.COMPUTE:
            return wire.error_frame(
                rid, wire.E_MALFORMED, f"a server answers HELLO and COMPUTE, not kind {frame.kind}"
            )
        try:
            x, ids = wire.decode_compute(frame)
        except wire.ProtocolError as err:
            return wire.error_frame(rid, wire.E_SHAPE, str(err))
        problem = shard.check(frame.layer, x, ids)
        if problem is not None:
            return wire.error_frame(rid, *problem)
        try:
            with self.lock:
                y = shard.compute(frame.layer, x, ids)
                self.rows_served += x.shape[0]
                self.batches_served += 1
        except Exception as err:  # noqa: BLE001 - a failed computation is reported, never crashes the server
            log.exception("expert computation failed")
            return wire.error_frame(rid, wire.E_INTERNAL, f"computation failed: {err}")
        return wire.result_frame(rid, frame.layer, y)


class ExpertServer:
    """A listening expert server over `shard`; `start()` serves in a thread, `serve_forever()` here."""

    def __init__(self, shard: ExpertShard, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = _TCPServer((host, port), shard)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    @property
    def rows_served(self) -> int:
        return self._server.rows_served

    @property
    def batches_served(self) -> int:
        """COMPUTE frames answered (a layer call sends each server up to two: the micro-batches)."""
        return self._server.batches_served

    def start(self) -> ExpertServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="tokenops-expert-server", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def stop(self) -> None:
        """Stop accepting and close the listening socket (open connections end with their threads)."""
        self._server.shutdown()
        self._server.server_close()


def announce_once(registry: str, address: str, timeout_s: float = 10.0) -> str:
    """Register `address` with the client registry at `registry` (`ExpertClient.listen`); the
    outcome as a line: "registered with ...", "refused by ...: why" or "registry ... unreachable"."""
    host, _, port = registry.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.sendall(wire.Frame(wire.REGISTER, 1, payload=address.encode()).encode())
            reply = wire.read_frame(sock)
    except (OSError, EOFError, ValueError) as err:  # ProtocolError is a ValueError
        return f"registry {registry} unreachable: {err}"
    if reply.kind == wire.ACCEPTED:
        return f"registered with {registry}"
    return f"refused by {registry}: {reply.payload.decode('utf-8', errors='replace')}"


class Announcer:
    """Announces a server to client registries at start and every `interval_s` after: a client
    that masked this server while it kept running takes it back at the next announcement. Each
    change of outcome per registry goes to `report` (the CLI prints it)."""

    def __init__(self, registries: list[str], address: str, interval_s: float, report=print) -> None:
        self.registries, self.address, self.interval_s, self.report = registries, address, interval_s, report
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenops-expert-announcer", daemon=True)

    def start(self) -> Announcer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last: dict[str, str] = {}
        while True:
            for registry in self.registries:
                outcome = announce_once(registry, self.address)
                if outcome != last.get(registry):
                    last[registry] = outcome
                    self.report(outcome)
            if self._stop.wait(self.interval_s):
                return


def checked_expert_ids(layer: int, ids: Iterable[int], moe_layers: list[int], num_experts: int) -> list[int]:
    """`ids` sorted and deduplicated; ValueError naming the problem if `layer` is not an MoE layer or
    an id is out of range."""
    if layer not in moe_layers:
        raise ValueError(
            f"layer {layer} is not an MoE layer of this model (MoE layers: {sorted(moe_layers)})"
        )
    ids = sorted(set(ids))
    if not ids or ids[0] < 0 or ids[-1] >= num_experts:
        raise ValueError(f"layer {layer} has experts 0..{num_experts - 1}, asked for {ids}")
    return ids


def parse_expert_spec(spec: str, moe_layers: list[int], num_experts: int) -> dict[int, list[int]]:
    """ "0-3" (experts 0..3 of every MoE layer), "all", or "0:0-3;1:4,5" (per layer) -> layer -> experts."""

    def experts_of(text: str) -> list[int]:
        out: list[int] = []
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
        return out

    try:
        if ":" not in spec:
            ids = experts_of(spec) if spec.strip() not in ("", "all") else list(range(num_experts))
            return {layer: ids for layer in moe_layers}
        out = {}
        for item in spec.split(";"):
            layer, _, experts = item.partition(":")
            out[int(layer)] = experts_of(experts) if experts.strip() != "all" else list(range(num_experts))
        return out
    except ValueError:
        raise ValueError(f"bad expert spec {spec!r}: use '0-3' or '0:0-3;1:4,5'") from None


def spawn_expert_server(model: str | Path, experts: str, *args: str) -> tuple[subprocess.Popen, str]:
    """Start `tokenops expert-server` in a child process of this Python, with this checkout's
    `tokenops` first on its path, one torch thread and `args` added; (process, its address) once it
    listens. The child's stdout is a pipe (the address line, then registration outcomes)."""
    import tokenops

    src = str(Path(tokenops.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    command = ["-c", "from tokenops.cli import app; app()", "expert-server", "--model", str(model)]
    proc = subprocess.Popen(
        [sys.executable, *command, "--experts", experts, "--threads", "1", *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"expert server did not start: {line!r}")
    return proc, line.split("listening on ")[1].split()[0]
