"""The `tokenops expert-server` command: load an MoE model's experts and serve them (eaas.server).

Only option parsing and startup live here; torch and the loader are imported inside the command
body so that `tokenops --help` stays instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    import torch

    from tokenops.engine.eaas.server import ExpertShard


def expert_server_command(
    model: str = typer.Option(
        ..., "--model", "-m", help="The MoE model: a local HF folder, a .gguf file or a bundled name."
    ),
    experts: str = typer.Option(
        "all", help="Experts to hold: 'all', '0-3' (those of every MoE layer) or '0:0-3;1:4,5' (per layer)."
    ),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(0, help="Port to listen on (0: any free port; the address is printed)."),
    dtype: str = typer.Option(
        "float32", help="Compute dtype: float32 or bfloat16 (the client's must match)."
    ),
    threads: int | None = typer.Option(None, help="torch intra-op threads (default: torch's)."),
    register: Annotated[
        list[str] | None,
        typer.Option(
            help="A client's expert registry HOST:PORT (`tokenops engine --expert-registry`) to announce "
            "this server to, at start and every --announce-interval seconds (repeatable)."
        ),
    ] = None,
    announce_interval: float = typer.Option(5.0, help="Seconds between announcements to --register."),
    quantization: str | None = typer.Option(
        None,
        help="The experts' format: int8, int8_dynamic, int4 or bf16 (as `tokenops engine --quantization`; "
        "the engine's must be the same: the fingerprints include it).",
    ),
    advertise: str | None = typer.Option(
        None, help="The HOST:PORT clients should connect to (default: the listening address)."
    ),
) -> None:
    """Serve experts of an MoE model to attention clients over the binary expert wire format."""
    import torch

    from tokenops.engine.eaas.server import Announcer, ExpertServer

    if threads:
        torch.set_num_threads(threads)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise typer.BadParameter(f"dtype must be float32 or bfloat16, not {dtype!r}", param_hint="--dtype")
    try:
        shard = _load_shard(model, experts, torch_dtype)
        if quantization:
            shard = shard.quantized(quantization)
    except ValueError as err:
        hint = "--model" if "no MoE layers" in str(err) else "--experts"
        hint = "--quantization" if "quantization" in str(err) else hint
        raise typer.BadParameter(str(err), param_hint=hint) from None
    held = shard.layers
    server = ExpertServer(shard, host, port)
    count = sum(len(ids) for _, ids in held.values())
    # flushed: a supervisor (or a test) reads the address from a pipe
    print(f"expert server listening on {server.address} ({count} experts of {len(held)} layers)", flush=True)
    announcer = None
    if register:
        address = advertise or server.address
        announcer = Announcer(register, address, announce_interval, lambda line: print(line, flush=True))
    try:
        if announcer is not None:
            announcer.start()
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if announcer is not None:
            announcer.stop()
        server.stop()


def _load_shard(model: str, experts: str, dtype: torch.dtype) -> ExpertShard:
    """Only the held experts' tensors are read, from an HF folder or a GGUF file (bundled names
    are GGUF files)."""
    from tokenops.engine.eaas.checkpoint import read_expert_shard
    from tokenops.modelfiles.files import default_cache_dir, resolve_model

    return read_expert_shard(resolve_model(model, default_cache_dir()).path, experts, dtype)
