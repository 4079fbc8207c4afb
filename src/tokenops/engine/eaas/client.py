"""The attention client's side of Expert-as-a-Service: a routing table of expert replicas, the
dispatch that sends each MoE layer's tokens to the servers holding the chosen experts, and failover.

`ExpertClient.attach(model)` swaps every MoE block's `dispatch` for a remote one, so the engine
keeps attention, KV and sampling and nothing else changes. Per layer call the (token, k) slots are
sorted by expert as in the local block, each expert's rows go to one of its live replicas (the one
given the fewest rows so far in this call), every server's rows are split into two micro-batches
and all frames are sent before any reply is read, so a server computes one micro-batch while the
other travels. The weighted sum over experts is done here, in the same order as the monolithic
block, whichever server computed a row: replicas hold identical weights (checked by fingerprint at
`register`), so failover does not change the output. A server that fails (closed connection,
timeout, an ERROR or malformed reply) is masked and its rows are resent to other replicas; a
server that registers (again) takes traffic from the next call. Servers register themselves too:
`ExpertClient.listen` opens a registry where an expert server started with `--register` announces
its address (REGISTER), is checked exactly as `register` checks one, and is told ACCEPTED or why it
was refused; it announces again periodically, so a masked server that still runs comes back by
itself. Placement of experts onto servers is `cluster.expert_placement`'s.
"""

from __future__ import annotations

import itertools
import logging
import socket
import socketserver
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenops.engine.eaas import wire
from tokenops.engine.models.moe import moe_blocks, sort_by_expert

log = logging.getLogger(__name__)


class ExpertUnavailable(RuntimeError):
    """No live server holds an expert a token was routed to."""


class RegistrationError(ValueError):
    """A server refused at registration: unreachable, or its weights, shape or dtype do not match."""


@dataclass
class ServerState:
    address: str
    sock: socket.socket | None
    experts: set[tuple[int, int]]
    up: bool = True
    rows_sent: int = 0
    failures: int = 0
    last_error: str = ""
    # request ids sent on `sock` and not yet read, and replies read ahead of their call's collect
    # (a resend after a failover is answered after the frames of calls submitted before it)
    outstanding: set[int] = field(default_factory=set)
    early: dict[int, wire.Frame] = field(default_factory=dict)


@dataclass
class RoutingTable:
    """(layer, expert) -> the addresses of the servers holding a replica, with their liveness."""

    replicas: dict[tuple[int, int], list[str]] = field(default_factory=lambda: defaultdict(list))

    def add(self, address: str, experts: set[tuple[int, int]]) -> None:
        for key in experts:
            if address not in self.replicas[key]:
                self.replicas[key].append(address)

    def live(self, key: tuple[int, int], up: dict[str, bool]) -> list[str]:
        return [a for a in self.replicas.get(key, ()) if up.get(a)]


# the connection frames were sent on, and (request id, rows) per frame
_Sent = tuple[socket.socket, list[tuple[int, torch.Tensor]]]


@dataclass
class RemoteCall:
    """One layer call in flight: `ExpertClient.submit` sent it, `collect` finishes it."""

    layer: int
    x: torch.Tensor
    weights: torch.Tensor
    order: torch.Tensor
    token: torch.Tensor
    xs: torch.Tensor
    slot_expert: torch.Tensor
    y: torch.Tensor
    plan: dict[str, torch.Tensor] = field(default_factory=dict)
    sent: dict[str, _Sent] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)


class ExpertClient:
    """Connections to expert servers and the routing table over them, for one model's MoE layers."""

    def __init__(self, model: nn.Module, timeout_s: float = 10.0, micro_batches: int = 2) -> None:
        self.timeout_s = timeout_s
        self.micro_batches = max(1, micro_batches)
        self.blocks = {b.layer_idx: b for b in moe_blocks(model)}
        if not self.blocks:
            raise ValueError("the model has no MoE layers")
        # what every server must hold for an expert: the fingerprint of this checkpoint's weights
        # (quantised experts: of the float weights they came from, and their format)
        self.expected = {
            (layer, e): b.experts.fingerprint(e)
            for layer, b in self.blocks.items()
            for e in range(b.num_experts)
        }
        first = next(iter(self.blocks.values()))
        self.hidden, self.dtype = first.experts.hidden_size, first.experts.dtype
        self.table = RoutingTable()
        self.servers: dict[str, ServerState] = {}
        self._ids = itertools.count(1)
        self.failovers = 0
        # calls submitted while another was in flight (double batching at work), and those in flight
        self.overlapped_calls = 0
        self._in_flight = 0
        # registrations arrive on the registry's threads while the engine dispatches: a layer call
        # and the installing of a server never interleave
        self._lock = threading.Lock()
        self._registry: _Registry | None = None

    # -- registration -------------------------------------------------------------------------

    def register(self, address: str) -> ServerState:
        """Connect to `address`, read what it holds and check it; it takes traffic from the next call.
        Re-registering a masked server brings it back."""
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rid = next(self._ids)
            sock.sendall(wire.Frame(wire.HELLO, rid).encode())
            reply = wire.read_frame(sock)
            hidden, dtype, entries = wire.decode_info(reply)
        except (OSError, EOFError, wire.ProtocolError, ValueError) as err:
            raise RegistrationError(f"expert server {address}: {err}") from None
        problems = []
        if hidden != self.hidden:
            problems.append(f"hidden size {hidden}, the model's is {self.hidden}")
        if dtype != self.dtype:
            problems.append(f"computes in {dtype}, the model in {self.dtype}")
        experts = set()
        for layer, e, fp in entries:
            want = self.expected.get((layer, e))
            if want is None:
                problems.append(f"holds layer {layer} expert {e}, which the model does not have")
            elif fp != want:
                problems.append(f"layer {layer} expert {e} has different weights (fingerprint mismatch)")
            experts.add((layer, e))
        if problems:
            sock.close()
            raise RegistrationError(f"expert server {address} refused: " + "; ".join(problems[:4]))
        state = ServerState(address, sock, experts)
        with self._lock:
            old = self.servers.get(address)
            if old is not None and old.sock is not None:
                old.sock.close()
            self.servers[address] = state
            self.table.add(address, experts)
        return state

    def is_live(self, address: str) -> bool:
        state = self.servers.get(address)
        return state is not None and state.up and state.sock is not None

    def missing(self) -> list[tuple[int, int]]:
        """The (layer, expert) pairs no live server holds."""
        with self._lock:
            up = {a: self.is_live(a) for a in self.servers}
        return [key for key in self.expected if not self.table.live(key, up)]

    def wait_for_experts(self, timeout_s: float) -> None:
        """Until every expert has a live server (servers registering themselves); RegistrationError
        naming what is missing after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while missing := self.missing():
            if time.monotonic() >= deadline:
                raise RegistrationError(
                    f"no expert server holds {len(missing)} experts, e.g. layer {missing[0][0]} "
                    f"expert {missing[0][1]}"
                )
            time.sleep(0.05)

    def listen(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Open the registry where expert servers announce themselves; its address."""
        self._registry = _Registry((host, port), self)
        serve = self._registry.serve_forever
        threading.Thread(target=serve, name="tokenops-expert-registry", daemon=True).start()
        bound_host, bound_port = self._registry.server_address[:2]
        return f"{bound_host}:{bound_port}"

    def attach(self, model: nn.Module, overlap: bool = False) -> None:
        """Send `model`'s routed tokens here. `overlap`: steps of two or more sequences run as two
        micro-batches, one's attention overlapping the other's experts (`MoECausalLM`)."""
        for block in moe_blocks(model):
            block.dispatch = _LayerDispatch(self, block.layer_idx)
        if overlap:
            model.remote_experts = self

    @staticmethod
    def detach(model: nn.Module) -> None:
        for block in moe_blocks(model):
            block.dispatch = None
        if getattr(model, "remote_experts", None) is not None:
            model.remote_experts = None

    def close(self) -> None:
        if self._registry is not None:
            self._registry.shutdown()
            self._registry.server_close()
            self._registry = None
        for s in self.servers.values():
            if s.sock is not None:
                s.sock.close()
                s.sock = None

    # -- dispatch -----------------------------------------------------------------------------

    def dispatch(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.collect(self.submit(layer, x, ids, weights))

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> RemoteCall:
        """Send one layer call's rows to the servers and return without reading the replies, so the
        caller can compute meanwhile (double batching); `collect` finishes it. Calls must be
        collected in the order they were submitted (the replies share the connections)."""
        with self._lock:
            block = self.blocks[layer]
            order, _ = sort_by_expert(ids, block.num_experts)
            token = order // ids.shape[-1]
            xs = x[token].contiguous()
            slot_expert = ids.reshape(-1)[order]
            call = RemoteCall(layer, x, weights, order, token, xs, slot_expert, torch.empty_like(xs))
            call.plan = self._plan(layer, slot_expert, torch.arange(xs.shape[0]))
            call.sent, call.failed = self._send(layer, xs, slot_expert, call.plan)
            self.overlapped_calls += self._in_flight > 0
            self._in_flight += 1
            return call

    def collect(self, call: RemoteCall) -> torch.Tensor:
        """Read a submitted call's replies, resending the rows of failed servers to replicas; the
        weighted sum over experts, as the local block computes it."""
        with self._lock:
            self._in_flight -= 1
            failed = call.failed + self._receive(call.sent, call.xs, call.y)
            while failed:
                self.failovers += 1
                pending = torch.cat([call.plan[a] for a in failed])
                call.plan = self._plan(call.layer, call.slot_expert, pending)
                sent, failed = self._send(call.layer, call.xs, call.slot_expert, call.plan)
                failed += self._receive(sent, call.xs, call.y)
            y = call.y * call.weights.reshape(-1)[call.order].to(call.y.dtype)[:, None]
            return torch.zeros_like(call.x).index_add_(0, call.token, y)

    def _plan(self, layer: int, slot_expert: torch.Tensor, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Server -> the rows (indices into the sorted slots, ascending) it computes this round."""
        up = {a: s.up for a, s in self.servers.items()}
        experts = slot_expert[rows]
        assigned: dict[str, int] = defaultdict(int)
        chosen: dict[str, list[torch.Tensor]] = defaultdict(list)
        for e in torch.unique(experts).tolist():
            live = self.table.live((layer, e), up)
            if not live:
                raise ExpertUnavailable(f"no live expert server holds layer {layer} expert {e}")
            mine = rows[experts == e]
            target = min(live, key=lambda a: (assigned[a], self.servers[a].rows_sent))
            assigned[target] += mine.numel()
            chosen[target].append(mine)
        return {a: torch.cat(parts) for a, parts in chosen.items()}

    def _send(
        self, layer: int, xs: torch.Tensor, slot_expert: torch.Tensor, plan: dict[str, torch.Tensor]
    ) -> tuple[dict[str, _Sent], list[str]]:
        """Send every server its rows as micro-batches; (what was sent where, the servers that failed)."""
        sent: dict[str, _Sent] = {}
        failed: list[str] = []
        for address, rows in plan.items():
            state = self.servers[address]
            batches = [
                b for b in torch.tensor_split(rows, min(self.micro_batches, rows.numel())) if b.numel()
            ]
            try:
                if state.sock is None:
                    raise ConnectionError("not connected")
                frames = []
                for b in batches:
                    rid = next(self._ids)
                    frames.append((rid, b))
                    state.outstanding.add(rid)
                    state.sock.sendall(wire.compute_frame(rid, layer, xs[b], slot_expert[b]).encode())
                sent[address] = (state.sock, frames)
            except OSError as err:
                self._mask(state, f"send failed: {err}")
                failed.append(address)
        return sent, failed

    def _receive(self, sent: dict[str, _Sent], xs: torch.Tensor, y: torch.Tensor) -> list[str]:
        """Read the replies of `sent` into `y`; the servers that failed."""
        failed: list[str] = []
        for address, (sock, frames) in sent.items():
            state = self.servers[address]
            try:
                if state.sock is not sock:  # masked, or registered again, since the frames were sent
                    raise ConnectionError("the connection closed before the replies were read")
                for rid, b in frames:
                    reply = self._reply(state, rid)
                    if reply.kind == wire.ERROR:
                        raise wire.ProtocolError(
                            f"server error {reply.layer}: {reply.payload.decode(errors='replace')}"
                        )
                    if reply.kind != wire.RESULT or reply.request_id != rid:
                        raise wire.ProtocolError(
                            f"expected RESULT {rid}, got kind {reply.kind} id {reply.request_id}"
                        )
                    y[b] = wire.decode_result(reply, b.numel(), xs.shape[1], xs.dtype)
                state.rows_sent += sum(b.numel() for _, b in frames)
            except (OSError, EOFError, wire.ProtocolError) as err:
                if state.sock is sock:
                    self._mask(state, str(err))
                failed.append(address)
        return failed

    @staticmethod
    def _reply(state: ServerState, rid: int) -> wire.Frame:
        """The reply to `rid`, keeping replies to other outstanding requests read before it."""
        while rid not in state.early:
            reply = wire.read_frame(state.sock)
            if reply.request_id not in state.outstanding:
                return reply  # not ours: the caller reports it
            state.early[reply.request_id] = reply
        state.outstanding.discard(rid)
        return state.early.pop(rid)

    def _mask(self, state: ServerState, reason: str) -> None:
        log.warning("expert server %s masked: %s", state.address, reason)
        state.up, state.failures, state.last_error = False, state.failures + 1, reason
        state.outstanding.clear()
        state.early.clear()
        if state.sock is not None:
            state.sock.close()
            state.sock = None


def connect_expert_servers(
    model: nn.Module,
    addresses: list[str],
    timeout_s: float = 10.0,
    registry: str | None = None,
    wait_s: float = 0.0,
    overlap: bool = False,
) -> ExpertClient:
    """An `ExpertClient` over `addresses`, registered and attached to `model` (`tokenops engine
    --expert-server`, `--expert-registry`). With `registry` ("host:port") servers may also announce
    themselves there; every expert must have a server within `wait_s`. `overlap`: double batching
    (`ExpertClient.attach`). Raises ValueError
    (RegistrationError) when a server is refused or an expert has none."""
    client = ExpertClient(model, timeout_s=timeout_s)
    try:
        if registry is not None:
            host, _, port = registry.rpartition(":")
            client.listen(host or "127.0.0.1", int(port))
        for address in addresses:
            client.register(address)
        client.wait_for_experts(wait_s)
    except (ValueError, OSError) as err:
        client.close()
        raise RegistrationError(str(err)) from None
    client.attach(model, overlap=overlap)
    return client


class _RegistryHandler(socketserver.BaseRequestHandler):
    server: _Registry

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(self.server.client.timeout_s)
        try:
            frame = wire.read_frame(sock)
            if frame.kind != wire.REGISTER:
                problem = f"expected REGISTER, got kind {frame.kind}"
                reply = wire.error_frame(frame.request_id, wire.E_MALFORMED, problem)
            else:
                reply = self.server.admit(frame.request_id, frame.payload.decode("utf-8", errors="replace"))
            sock.sendall(reply.encode())
        except (OSError, EOFError, wire.ProtocolError) as err:
            log.warning("expert registry: dropped an announcement: %s", err)


class _Registry(socketserver.ThreadingTCPServer):
    """Where expert servers announce themselves: each REGISTER is checked by `ExpertClient.register`."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], client: ExpertClient) -> None:
        super().__init__(address, _RegistryHandler)
        self.client = client

    def admit(self, request_id: int, address: str) -> wire.Frame:
        if self.client.is_live(address):  # a periodic announcement of a server in use: nothing to do
            return wire.Frame(wire.ACCEPTED, request_id)
        try:
            self.client.register(address)
        except RegistrationError as err:
            return wire.error_frame(request_id, wire.E_REFUSED, str(err))
        log.info("expert server %s registered itself", address)
        return wire.Frame(wire.ACCEPTED, request_id)


class _LayerDispatch:
    """A `models.moe.ExpertDispatch` bound to one layer of an `ExpertClient`."""

    def __init__(self, client: ExpertClient, layer: int) -> None:
        self.client, self.layer = client, layer

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.client.dispatch(self.layer, x, ids, weights)
