"""Expert-as-a-Service on loopback: a tiny random MoE (Qwen2-MoE: a shared expert and a dense layer,
or Mixtral) served monolithic and through 2-4 real expert servers gives identical greedy tokens;
killing an expert-server process mid-generation changes no token and raises no error; a server
added mid-generation takes traffic; bad frames, wrong shapes or dtypes and different weights get
clear errors and failover; the placement balances a skewed load within its stated bound.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from tokenops.cluster.expert_placement import place_experts
from tokenops.engine.config import EngineConfig
from tokenops.engine.eaas import wire
from tokenops.engine.eaas.client import (
    ExpertClient,
    ExpertUnavailable,
    RegistrationError,
    connect_expert_servers,
)
from tokenops.engine.eaas.server import ExpertServer, ExpertShard, parse_expert_spec, spawn_expert_server
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.models.moe import moe_blocks
from tokenops.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 42, 8, 77], [200, 31, 4], [9, 9, 120, 64, 33, 12, 250, 18, 7, 6, 5]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(make_tiny_moe):
    return make_tiny_moe("qwen2_moe", seed=21)


@pytest.fixture(scope="module")
def reference(tiny) -> list[list[int]]:
    """Monolithic greedy tokens (the block computes its experts locally)."""
    return _engine(tiny.model).generate(PROMPTS, GREEDY)


def _engine(model) -> LLMEngine:
    return LLMEngine(
        model, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=32), eos_token_ids=[2]
    )


def _servers(model, specs: list[str]) -> list[ExpertServer]:
    out = []
    for spec in specs:
        held = parse_expert_spec(spec, [0], 8)  # the tiny Qwen2-MoE: layer 0 sparse, 8 experts
        out.append(ExpertServer(ExpertShard.from_model(model, held)).start())
    return out


@pytest.fixture
def remote(tiny):
    """Attach/detach an ExpertClient to the shared tiny model around a test."""
    clients = []

    def attach(addresses: list[str], **kw) -> ExpertClient:
        client = ExpertClient(tiny.model, **kw)
        for a in addresses:
            client.register(a)
        client.attach(tiny.model)
        clients.append(client)
        return client

    yield attach
    ExpertClient.detach(tiny.model)
    for c in clients:
        c.close()


@pytest.mark.parametrize("specs", [["0-3", "4-7"], ["0,1", "2,3", "4,5", "6,7"], ["0-5", "2-7", "0,7"]])
def test_expert_servers_give_the_monolithic_tokens(tiny, reference, remote, specs) -> None:
    servers = _servers(tiny.model, specs)
    try:
        client = remote([s.address for s in servers])
        assert _engine(tiny.model).generate(PROMPTS, GREEDY) == reference
        assert all(s.rows_served > 0 for s in servers)
        assert client.failovers == 0
    finally:
        for s in servers:
            s.stop()


def _run_with(engine: LLMEngine, at_step: int, action) -> list[list[int]]:
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for rid, p in zip(ids, PROMPTS, strict=True):
        engine.add_request(rid, p, GREEDY)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    step = 0
    while engine.has_unfinished():
        if step == at_step:
            action()
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        step += 1
    return [out[rid] for rid in ids]


def test_killing_an_expert_server_process_mid_generation_changes_no_token(
    tiny, reference, remote, tmp_path
) -> None:
    """Three `tokenops expert-server` processes, every expert on two of them; one is killed after
    a few steps. The client masks it, resends to the replicas, and the tokens are the monolithic ones."""
    tiny.save(tmp_path)
    procs = [spawn_expert_server(tmp_path, spec) for spec in ("0-3", "4-7", "all")]
    try:
        client = remote([addr for _, addr in procs])
        victim = procs[2][0]
        tokens = _run_with(_engine(tiny.model), 4, lambda: (victim.kill(), victim.wait()))
        assert tokens == reference
        assert client.failovers >= 1
        assert not client.servers[procs[2][1]].up and client.servers[procs[0][1]].up
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()


def test_a_registered_server_takes_traffic(tiny, reference, remote) -> None:
    first, second = _servers(tiny.model, ["all", "all"])
    try:
        client = remote([first.address])
        tokens = _run_with(_engine(tiny.model), 5, lambda: client.register(second.address))
        assert tokens == reference
        assert client.servers[second.address].rows_sent > 0 and second.rows_served > 0
    finally:
        first.stop()
        second.stop()


def test_no_live_replica_is_a_clear_error(tiny, remote) -> None:
    (only,) = _servers(tiny.model, ["0-3"])
    try:
        remote([only.address])
        with pytest.raises(ExpertUnavailable, match="layer 0 expert"):
            _engine(tiny.model).generate(PROMPTS[:1], GREEDY)
    finally:
        only.stop()


def test_a_server_with_different_weights_is_refused(tiny, make_tiny_moe) -> None:
    other = make_tiny_moe("qwen2_moe", seed=22)  # same shapes, other weights
    (stranger,) = _servers(other.model, ["all"])
    try:
        client = ExpertClient(tiny.model)
        with pytest.raises(RegistrationError, match="fingerprint"):
            client.register(stranger.address)
        assert stranger.address not in client.servers
    finally:
        stranger.stop()


class _LyingServer:
    """A stub of a faulty remote: answers HELLO like a good server (copied fingerprints) but
    replies to COMPUTE with a RESULT of the wrong shape."""

    def __init__(self, shard: ExpertShard) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.shard = shard
        self.computes = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    while True:
                        f = wire.read_frame(conn)
                        if f.kind == wire.HELLO:
                            reply = wire.info_frame(
                                f.request_id, self.shard.hidden, self.shard.dtype, self.shard.fingerprints
                            )
                        else:
                            self.computes += 1
                            reply = wire.result_frame(f.request_id, f.layer, torch.zeros(f.rows + 1, f.cols))
                        conn.sendall(reply.encode())
                except (EOFError, OSError, wire.ProtocolError):
                    continue


def test_a_wrong_reply_fails_over_to_a_replica(tiny, reference, remote) -> None:
    (good,) = _servers(tiny.model, ["all"])
    liar = _LyingServer(ExpertShard.from_model(tiny.model, {0: list(range(8))}))
    try:
        client = remote([liar.address, good.address])
        assert _engine(tiny.model).generate(PROMPTS, GREEDY) == reference
        assert liar.computes >= 1 and not client.servers[liar.address].up
        assert "RESULT" in client.servers[liar.address].last_error
    finally:
        good.stop()
        liar.sock.close()


def _ask(address: str, data: bytes) -> wire.Frame | None:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        try:
            return wire.read_frame(s)
        except EOFError:
            return None


def test_bad_frames_get_clear_errors_and_the_server_keeps_serving(tiny) -> None:
    (server,) = _servers(tiny.model, ["0-3"])
    try:
        x = torch.zeros(2, 64)
        cases = {
            "not a frame": (b"GET / HTTP/1.1\r\n\r\n" + b"x" * 40, wire.E_MALFORMED, "bad magic"),
            "wrong hidden size": (
                wire.compute_frame(1, 0, torch.zeros(2, 32), torch.tensor([0, 1])).encode(),
                wire.E_SHAPE,
                "hidden size 32",
            ),
            "wrong dtype": (
                wire.compute_frame(2, 0, x.bfloat16(), torch.tensor([0, 1])).encode(),
                wire.E_DTYPE,
                "bfloat16",
            ),
            "expert not held": (
                wire.compute_frame(3, 0, x, torch.tensor([1, 6])).encode(),
                wire.E_EXPERT,
                "experts [6]",
            ),
            "layer not held": (
                wire.compute_frame(4, 1, x, torch.tensor([0, 1])).encode(),
                wire.E_EXPERT,
                "layer 1",
            ),
            "payload shorter than its shape": (
                wire.Frame(wire.COMPUTE, 5, 0, 3, 64, 0, bytes(2 * 64 * 4 + 8)).encode(),
                wire.E_SHAPE,
                "need",
            ),
        }
        for name, (data, code, text) in cases.items():
            reply = _ask(server.address, data)
            assert reply is not None and reply.kind == wire.ERROR, name
            assert reply.layer == code and text in reply.payload.decode(), (name, reply.payload)
        # a frame cut off mid-payload: the connection is closed, nothing is computed
        full = wire.compute_frame(6, 0, x, torch.tensor([0, 1])).encode()
        reply = _ask(server.address, full[: len(full) - 10])
        assert reply is None or (reply.kind == wire.ERROR and b"truncated" in reply.payload)
        assert server.rows_served == 0
        # and a good request is still answered, equal to the local experts
        reply = _ask(
            server.address, wire.compute_frame(7, 0, torch.ones(2, 64), torch.tensor([0, 3])).encode()
        )
        y = wire.decode_result(reply, 2, 64, torch.float32)
        experts = tiny.model.model.layers[0].mlp.experts
        for row, e in enumerate((0, 3)):
            gate, up = (torch.ones(64) @ experts.gate_up_proj[e].detach().T).chunk(2)
            torch.testing.assert_close(
                y[row], (torch.nn.functional.silu(gate) * up) @ experts.down_proj[e].detach().T
            )
    finally:
        server.stop()


def test_wire_refuses_frames_it_cannot_read() -> None:
    frame = wire.compute_frame(9, 2, torch.randn(3, 8), torch.tensor([1, 1, 4]))
    header = frame.encode()[: wire.HEADER.size]
    x, ids = wire.decode_compute(
        wire.Frame(
            *[getattr(frame, f) for f in ("kind", "request_id", "layer", "rows", "cols", "dtype", "payload")]
        )
    )
    assert x.shape == (3, 8) and ids.tolist() == [1, 1, 4]
    with pytest.raises(wire.ProtocolError, match="truncated"):
        wire.parse_header(header[:-1])
    with pytest.raises(wire.ProtocolError, match="version"):
        wire.parse_header(header[:4] + bytes([9]) + header[5:])
    huge = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.COMPUTE, 0, 0, 1, 0, 1, 1, wire.MAX_PAYLOAD + 1)
    with pytest.raises(wire.ProtocolError, match="limit"):
        wire.parse_header(huge)
    with pytest.raises(wire.ProtocolError, match="RESULT"):
        wire.decode_result(wire.result_frame(1, 0, torch.zeros(2, 8)), 3, 8, torch.float32)


def test_placement_balances_a_skewed_load_within_its_bound() -> None:
    # Zipf-like: expert 0 takes ~30% of the tokens
    load = [1000.0 / (e + 1) for e in range(16)]
    placement = place_experts(load, num_servers=4, slots_per_server=6)
    assert sorted({e for s in placement.servers for e in s}) == list(range(16))  # every expert placed
    assert all(len(set(s)) == len(s) <= 6 for s in placement.servers)  # slots, no duplicate on a server
    assert sum(placement.replicas) == 24 and placement.replicas[0] == 4  # the hottest is on every server
    assert max(placement.server_load) <= placement.bound(load) + 1e-9
    assert placement.imbalance < 1.05
    # without replication, contiguous blocks of 4 experts per server: server 0 carries 60% of the load
    naive = [sum(load[4 * s : 4 * s + 4]) for s in range(4)]
    assert max(naive) / (sum(naive) / 4) > 2.3
    assert placement.expert_spec(0, layer=3).startswith("3:0,")


def test_placement_refuses_impossible_layouts() -> None:
    with pytest.raises(ValueError, match="slots"):
        place_experts([1.0] * 10, num_servers=2, slots_per_server=4)
    with pytest.raises(ValueError, match="non-negative"):
        place_experts([1.0, -1.0], num_servers=1, slots_per_server=2)


def test_connecting_needs_every_expert_held(tiny, tiny_llama) -> None:
    """`tokenops engine --expert-server` goes through connect_expert_servers: all experts covered,
    an MoE model, or a clear error before serving starts."""
    (half,) = _servers(tiny.model, ["0-3"])
    try:
        with pytest.raises(RegistrationError, match="no expert server holds 4 experts"):
            connect_expert_servers(tiny.model, [half.address])
        assert all(b.dispatch is None for b in moe_blocks(tiny.model))
        with pytest.raises(RegistrationError, match="127.0.0.1:1"):
            connect_expert_servers(tiny.model, ["127.0.0.1:1"])
        with pytest.raises(ValueError, match="no MoE layers"):
            connect_expert_servers(tiny_llama.model, [half.address])
    finally:
        half.stop()


class _SilentServer(_LyingServer):
    """A stub of a hung remote: registers like a good server, then never answers a COMPUTE."""

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            f = wire.read_frame(conn)
            conn.sendall(
                wire.info_frame(
                    f.request_id, self.shard.hidden, self.shard.dtype, self.shard.fingerprints
                ).encode()
            )
            self.computes += 1  # the connection stays open and silent


def test_a_hung_server_times_out_fails_over_and_can_come_back(tiny, reference, remote) -> None:
    (good,) = _servers(tiny.model, ["all"])
    silent = _SilentServer(ExpertShard.from_model(tiny.model, {0: list(range(8))}))
    try:
        client = remote([silent.address, good.address], timeout_s=0.5)
        assert _engine(tiny.model).generate(PROMPTS, GREEDY) == reference
        assert (
            not client.servers[silent.address].up and "timed out" in client.servers[silent.address].last_error
        )
        # the good server drops out too (masked as a failure would), then registers again: it is
        # routed to from the next call, the silent one stays masked
        client._mask(client.servers[good.address], "simulated failure")
        with pytest.raises(ExpertUnavailable):
            _engine(tiny.model).generate(PROMPTS[:1], GREEDY)
        served = good.rows_served
        client.register(good.address)
        assert _engine(tiny.model).generate(PROMPTS[:1], GREEDY) == reference[:1]
        assert good.rows_served > served and not client.servers[silent.address].up
    finally:
        good.stop()
        silent.sock.close()


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_each_server_gets_its_rows_as_micro_batches(tiny, micro_batches) -> None:
    """Double batching: one layer call sends every server its rows in `micro_batches` frames, all
    sent before any reply is read; the result equals the local experts'."""
    servers = _servers(tiny.model, ["0-3", "4-7"])
    client = ExpertClient(tiny.model, micro_batches=micro_batches)
    try:
        for s in servers:
            client.register(s.address)
        block = tiny.model.model.layers[0].mlp
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            ids, w = block.gate.forward(x)
            got = client.dispatch(0, x, ids, w)
            torch.testing.assert_close(got, block.experts.forward(x, ids, w), rtol=1e-5, atol=1e-6)
        hit = {0: ids.lt(4).sum().item(), 1: ids.ge(4).sum().item()}
        for i, s in enumerate(servers):
            assert s.rows_served == hit[i] and s.batches_served == min(micro_batches, hit[i])
    finally:
        client.close()
        for s in servers:
            s.stop()


def test_bfloat16_experts_travel_as_bfloat16(tiny) -> None:
    """A bf16 model and bf16 servers: hidden states and results cross the wire as bf16 bits, and the
    greedy tokens equal the bf16 monolithic ones."""
    from tokenops.engine.models import build_model

    model = build_model(tiny.config, dtype=torch.bfloat16)
    model.load_weights(tiny.hf.state_dict().items())
    alone = _engine(model).generate(PROMPTS, GREEDY)
    servers = _servers(model, ["0-3", "4-7"])
    try:
        connect_expert_servers(model, [s.address for s in servers])
        assert _engine(model).generate(PROMPTS, GREEDY) == alone
        assert all(s.rows_served > 0 for s in servers)
        fp32_client = ExpertClient(tiny.model)
        with pytest.raises(RegistrationError, match="computes in torch.bfloat16"):
            fp32_client.register(servers[0].address)
    finally:
        for s in servers:
            s.stop()


def test_expert_specs_and_shards_name_what_is_wrong(tiny) -> None:
    assert parse_expert_spec("0-2,5", [0, 3], 8) == {0: [0, 1, 2, 5], 3: [0, 1, 2, 5]}
    assert parse_expert_spec("0:all;3:1", [0, 3], 4) == {0: [0, 1, 2, 3], 3: [1]}
    with pytest.raises(ValueError, match="bad expert spec"):
        parse_expert_spec("two-three", [0], 8)
    with pytest.raises(ValueError, match="experts 0..7, asked for"):
        ExpertShard.from_model(tiny.model, {0: [6, 8]})
    with pytest.raises(ValueError, match="layer 1 is not an MoE layer"):
        ExpertShard.from_model(tiny.model, {1: [0]})  # the tiny Qwen2-MoE's layer 1 is dense


def test_a_server_reads_only_its_experts_from_the_checkpoint(tiny, tmp_path) -> None:
    """The shard read from the folder equals the one copied out of the loaded model and holds only
    its experts' bytes; a folder stripped of everything but those experts' tensors still serves."""
    from safetensors.torch import load_file, save_file

    from tokenops.engine.eaas.checkpoint import read_expert_shard

    full = tmp_path / "full"
    full.mkdir()
    tiny.save(full)
    shard = read_expert_shard(full, "2,5")
    copied = ExpertShard.from_model(tiny.model, {0: [2, 5]})
    assert shard.fingerprints == copied.fingerprints
    per_expert = copied.nbytes // 2
    assert shard.nbytes == 2 * per_expert  # 2 of the 8 experts of the one sparse layer
    assert read_expert_shard(full, "all").nbytes == 8 * per_expert
    # only config.json and the two experts' tensors: nothing else is needed
    slim = tmp_path / "slim"
    slim.mkdir()
    (slim / "config.json").write_text((full / "config.json").read_text())
    (file,) = full.glob("*.safetensors")
    keep = {k: v for k, v in load_file(file).items() if ".experts.2." in k or ".experts.5." in k}
    assert len(keep) == 6
    save_file(keep, slim / "model.safetensors")
    assert read_expert_shard(slim, "2,5").fingerprints == copied.fingerprints
    with pytest.raises(ValueError, match="layer 0 expert 3 has no"):
        read_expert_shard(slim, "3")
    with pytest.raises(ValueError, match="layer 1 is not an MoE layer"):
        read_expert_shard(full, "1:0")


def test_a_fused_checkpoint_is_sliced_per_expert(tiny, tmp_path) -> None:
    """transformers 5's fused layout ([E, 2I, H] gate|up, [E, H, I] down): the held rows only."""
    from safetensors.torch import save_file

    from tokenops.engine.eaas.checkpoint import read_expert_shard

    tiny.save(tmp_path)
    experts = tiny.model.model.layers[0].mlp.experts
    (file,) = tmp_path.glob("*.safetensors")
    save_file(
        {
            "model.layers.0.mlp.experts.gate_up_proj": experts.gate_up_proj.detach().contiguous(),
            "model.layers.0.mlp.experts.down_proj": experts.down_proj.detach().contiguous(),
        },
        file,
    )
    shard = read_expert_shard(tmp_path, "1,6")
    assert shard.fingerprints == ExpertShard.from_model(tiny.model, {0: [1, 6]}).fingerprints


def _wait_until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_servers_register_themselves_and_come_back(tiny, make_tiny_moe, reference, tmp_path) -> None:
    """`tokenops expert-server --register <the client's registry>` processes: they join with no
    `register()` call, serve the monolithic tokens; one killed mid-generation is replaced by a new
    process that announces itself and takes traffic; a masked server that still runs comes back at
    its next announcement; a server with other weights is refused and told why."""
    tiny.save(tmp_path)
    client = ExpertClient(tiny.model)
    registry = client.listen()
    announce = ("--register", registry, "--announce-interval", "0.2")
    procs = [spawn_expert_server(tmp_path, spec, *announce) for spec in ("0-3", "4-7", "all")]
    try:
        client.wait_for_experts(60)
        _wait_until(lambda: all(client.is_live(addr) for _, addr in procs))
        assert set(client.servers) == {addr for _, addr in procs}
        client.attach(tiny.model)
        (victim, victim_addr) = procs[2]

        def replace_a_server() -> None:
            victim.kill()
            victim.wait()
            procs.append(spawn_expert_server(tmp_path, "all", *announce))
            _wait_until(lambda: client.is_live(procs[-1][1]))

        assert _run_with(_engine(tiny.model), 4, replace_a_server) == reference
        assert not client.servers[victim_addr].up
        assert client.servers[procs[-1][1]].rows_sent > 0
        # a server masked while it still runs (a transient fault) registers again by itself
        first = client.servers[procs[0][1]]
        client._mask(first, "simulated transient fault")
        _wait_until(lambda: client.is_live(procs[0][1]))
        sent = client.servers[procs[0][1]].rows_sent
        assert _engine(tiny.model).generate(PROMPTS, GREEDY) == reference
        assert client.servers[procs[0][1]].rows_sent > sent
        # other weights: refused at the registry, and the server is told why
        other = tmp_path / "other"
        other.mkdir()
        make_tiny_moe("qwen2_moe", seed=22).save(other)
        stranger, stranger_addr = spawn_expert_server(other, "all", *announce)
        procs.append((stranger, stranger_addr))
        line = stranger.stdout.readline()
        assert line.startswith(f"refused by {registry}") and "fingerprint" in line, line
        assert stranger_addr not in client.servers
    finally:
        ExpertClient.detach(tiny.model)
        client.close()
        for p, _ in procs:
            p.kill()
            p.wait()


def test_the_engine_starts_once_announced_servers_hold_every_expert(tiny, reference) -> None:
    """`tokenops engine --expert-registry`: servers announcing themselves (before the registry is
    even open) are enough to start, and too few is a clear error after the wait."""
    from tokenops.engine.eaas.server import Announcer

    servers = _servers(tiny.model, ["0-3", "4-7"])
    registry = "127.0.0.1:18731"  # this area's port range
    announcers = [Announcer([registry], s.address, 0.1, report=lambda line: None).start() for s in servers]
    try:
        client = connect_expert_servers(tiny.model, [], registry=registry, wait_s=60)
        try:
            assert _engine(tiny.model).generate(PROMPTS, GREEDY) == reference
            assert all(s.rows_served > 0 for s in servers)
        finally:
            ExpertClient.detach(tiny.model)
            client.close()
        announcers[1].stop()
        with pytest.raises(RegistrationError, match="no expert server holds 4 experts"):
            connect_expert_servers(tiny.model, [servers[0].address], registry="127.0.0.1:0", wait_s=0.5)
    finally:
        for a in announcers:
            a.stop()
        for s in servers:
            s.stop()


def test_int8_expert_servers_give_the_int8_engines_tokens(tiny) -> None:
    """Servers holding int8 experts (`--quantization int8`) serve a client whose experts are int8:
    the tokens of the int8 engine alone; a float server is refused by that client (the format is
    part of the fingerprint)."""
    from tokenops.engine.models import build_model
    from tokenops.engine.models.moe import quantize_experts

    model = build_model(tiny.config)
    model.load_weights(tiny.hf.state_dict().items())
    quantize_experts(model, "int8")
    alone = _engine(model).generate(PROMPTS, GREEDY)
    float_shard = ExpertShard.from_model(tiny.model, {0: list(range(8))})
    int8_shard = float_shard.quantized("int8")
    servers = [
        ExpertServer(int8_shard).start(),
        ExpertServer(ExpertShard.from_model(model, {0: [0, 1, 2, 3]})).start(),
        ExpertServer(float_shard).start(),
    ]
    try:
        client = connect_expert_servers(model, [s.address for s in servers[:2]])
        assert _engine(model).generate(PROMPTS, GREEDY) == alone
        assert all(s.rows_served > 0 for s in servers[:2]) and client.failovers == 0
        with pytest.raises(RegistrationError, match="fingerprint"):
            client.register(servers[2].address)
        assert (
            servers[1].address in client.servers and float_shard.nbytes > 3 * servers[0]._server.shard.nbytes
        )
    finally:
        for s in servers:
            s.stop()


@pytest.mark.parametrize("specs", [["0-3", "4-7"], ["0,1", "2,3", "4,5", "6,7"]])
def test_double_batching_overlaps_attention_with_remote_experts(tiny, reference, remote, specs) -> None:
    """`attach(overlap=True)`: each step's sequences run as two micro-batches, one's attention while
    the other's experts are out; the tokens are the monolithic ones."""
    servers = _servers(tiny.model, specs)
    try:
        client = remote([s.address for s in servers])
        client.attach(tiny.model, overlap=True)
        assert _engine(tiny.model).generate(PROMPTS, GREEDY) == reference
        assert client.overlapped_calls > 0 and client.failovers == 0
        assert all(s.rows_served > 0 for s in servers)
    finally:
        for s in servers:
            s.stop()


def test_double_batching_fails_over_without_changing_tokens(tiny, reference, remote) -> None:
    (good,) = _servers(tiny.model, ["all"])
    liar = _LyingServer(ExpertShard.from_model(tiny.model, {0: list(range(8))}))
    try:
        client = remote([liar.address, good.address])
        client.attach(tiny.model, overlap=True)
        assert _engine(tiny.model).generate(PROMPTS, GREEDY) == reference
        assert liar.computes >= 1 and not client.servers[liar.address].up and client.overlapped_calls > 0
    finally:
        good.stop()
        liar.sock.close()


def test_a_client_loads_only_what_it_runs(tiny, reference, tmp_path) -> None:
    """`load_model(..., routed_experts=False)` (`tokenops engine --expert-server`): embeddings,
    attention, norms, routers, the shared expert and the head, no routed-expert weights; the same
    fingerprints as the whole model's (float and int8), so its servers are checked as before, and
    the monolithic tokens through them. Run without servers, it says why it cannot."""
    from tokenops.engine.loader import load_model
    from tokenops.engine.models.moe import ExpertFingerprints, quantize_experts
    from tokenops.engine.quantize import weight_bytes

    tiny.save(tmp_path)
    client = load_model(str(tmp_path), routed_experts=False).model
    assert not [n for n, _ in client.named_parameters() if ".experts." in n]
    expert_bytes = sum(weight_bytes(b.experts) for b in moe_blocks(tiny.model))
    assert weight_bytes(client) == weight_bytes(tiny.model) - expert_bytes
    for whole, part in zip(moe_blocks(tiny.model), moe_blocks(client), strict=True):
        assert isinstance(part.experts, ExpertFingerprints)
        assert [part.experts.fingerprint(e) for e in range(8)] == [
            whole.experts.fingerprint(e) for e in range(8)
        ]
    with pytest.raises(RuntimeError, match="without its routed experts"):
        _engine(client).generate(PROMPTS[:1], GREEDY)
    servers = _servers(tiny.model, ["0-3", "4-7"])
    try:
        connect_expert_servers(client, [s.address for s in servers]).close()
        int8 = load_model(str(tmp_path), routed_experts=False).model
        quantize_experts(int8, "int8")
        int8_servers = [
            ExpertServer(ExpertShard.from_model(tiny.model, {0: list(range(8))}).quantized("int8"))
        ]
        int8_servers[0].start()
        servers += int8_servers
        connect_expert_servers(int8, [int8_servers[0].address]).close()  # int8 fingerprints match
        ExpertClient.detach(int8)
        client_engine = connect_expert_servers(client, [s.address for s in servers[:2]])
        assert _engine(client).generate(PROMPTS, GREEDY) == reference
        assert client_engine.failovers == 0
        client_engine.close()
    finally:
        for s in servers:
            s.stop()


_PEAK_GROWTH = """
import sys
from tokenops.engine.loader import load_model

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

load_model(sys.argv[1], routed_experts=False)  # imports and one-time set-up out of the way
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) restarts from the current resident size
before = status("VmRSS:")
load_model(sys.argv[1], routed_experts=sys.argv[2] == "whole")
print(status("VmHWM:") - before)
"""


def test_a_client_never_materialises_routed_experts(make_tiny_moe, tmp_path) -> None:
    """Measured in fresh processes (after one load as a client, so imports do not count) on a
    Qwen3-MoE with 100 MB of float32 routed experts: loading it whole raises the peak resident
    memory by at least their size; loading it as an expert client (the experts' bytes only
    streamed through their fingerprints, a few MB at a time) by under a tenth of it."""
    import subprocess
    import sys

    import transformers

    from .conftest import TinyMoE

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=256, moe_intermediate_size=2048, num_experts=16,
        num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    wide = TinyMoE.__new__(TinyMoE)
    wide.hf = transformers.Qwen3MoeForCausalLM(config).eval()
    wide.save(tmp_path)
    expert_bytes = 2 * 16 * 3 * 128 * 2048 * 4

    def growth(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _PEAK_GROWTH, str(tmp_path), mode],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout.split()[-1])

    assert growth("whole") >= expert_bytes
    assert growth("client") < expert_bytes / 10


def test_a_gguf_file_gives_servers_only_their_experts(tiny, tmp_path) -> None:
    """`tokenops expert-server --model x.gguf`: the held experts' slices of the 3-D
    `ffn_*_exps` tensors, equal to the experts of the whole GGUF model; a file holding nothing but
    the expert tensors serves as well. A client loaded from the GGUF file holds no experts, has the
    same fingerprints and generates the monolithic GGUF engine's tokens through such a server."""
    from tokenops.engine.eaas.checkpoint import read_expert_shard
    from tokenops.engine.loader import load_model

    from .test_moe_models import write_moe_gguf

    full, slim = tmp_path / "full.gguf", tmp_path / "slim.gguf"
    write_moe_gguf(full, tiny)
    write_moe_gguf(slim, tiny, keep=lambda name: "_exps." in name)
    whole = load_model(str(full), cache_dir=tmp_path / "cache").model
    want = ExpertShard.from_model(whole, {0: [2, 5]})
    assert read_expert_shard(full, "2,5").fingerprints == want.fingerprints
    assert read_expert_shard(slim, "2,5").fingerprints == want.fingerprints
    assert read_expert_shard(slim, "2,5").nbytes == want.nbytes
    client = load_model(str(full), cache_dir=tmp_path / "cache", routed_experts=False).model
    assert not [n for n, _ in client.named_parameters() if ".experts." in n]
    assert [moe_blocks(client)[0].experts.fingerprint(e) for e in range(8)] == [
        moe_blocks(whole)[0].experts.fingerprint(e) for e in range(8)
    ]
    monolithic = _engine(whole).generate(PROMPTS, GREEDY)
    proc, address = spawn_expert_server(slim, "all")
    try:
        remote = connect_expert_servers(client, [address])
        assert _engine(client).generate(PROMPTS, GREEDY) == monolithic
        assert remote.servers[address].rows_sent > 0
        remote.close()
    finally:
        proc.kill()
        proc.wait()
