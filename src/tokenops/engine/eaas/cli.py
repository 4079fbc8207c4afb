"""The `tokenops expert-server` command: load an MoE model's experts and serve them (eaas.server).

Only option parsing and startup live here; torch and the loader are imported inside the command
body so that `tokenops --help` stays instant.
"""

from __future__ import annotations

import typer


def expert_server_command(
    model: str = typer.Option(
        ..., "--model", "-m", help="The MoE model: a local HF folder (or any loader spec)."
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
) -> None:
    """Serve experts of an MoE model to attention clients over the binary expert wire format."""
    import torch

    from tokenops.engine.eaas.server import ExpertServer, ExpertShard, parse_expert_spec
    from tokenops.engine.loader import load_model
    from tokenops.engine.models.moe import moe_blocks

    if threads:
        torch.set_num_threads(threads)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise typer.BadParameter(f"dtype must be float32 or bfloat16, not {dtype!r}", param_hint="--dtype")
    loaded = load_model(model, dtype=torch_dtype)
    blocks = moe_blocks(loaded.model)
    if not blocks:
        raise typer.BadParameter(f"{model} has no MoE layers", param_hint="--model")
    try:
        held = parse_expert_spec(experts, [b.layer_idx for b in blocks], blocks[0].num_experts)
        shard = ExpertShard.from_model(loaded.model, held)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--experts") from None
    del loaded  # only the shard's copies stay
    server = ExpertServer(shard, host, port)
    count = sum(len(ids) for ids in held.values())
    # flushed: a supervisor (or a test) reads the address from a pipe
    print(f"expert server listening on {server.address} ({count} experts of {len(held)} layers)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
