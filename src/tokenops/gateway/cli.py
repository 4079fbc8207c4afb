"""The `tokenops serve` command: options only; the start-up sequence lives in serve.py.

Heavy imports (uvicorn, the database) happen inside the command body so that `tokenops --help`
stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def serve(
    config: Annotated[
        Path | None, typer.Option(help="YAML config file (default: $TOKENOPS_CONFIG or ./tokenops.yaml).")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind (overrides the config).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind (overrides the config).")] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="Where the SQLite ledger and the admin key hash live.")
    ] = None,
    probes: Annotated[
        bool,
        typer.Option(
            "--probes",
            help="Diagnostic probes on /metrics: event-loop lag and the upstream call's steps "
            "(docs/gateway.md).",
        ),
    ] = False,
) -> None:
    """Run the gateway on port 8000 in front of the embedded engine, with a SQLite ledger."""
    from tokenops.config import ConfigError, load_settings
    from tokenops.gateway.serve import serve as run_serve

    try:
        settings = load_settings(config, overrides={"host": host, "port": port, "data_dir": data_dir})
    except ConfigError as exc:
        typer.echo(f"tokenops serve: {exc}", err=True)
        raise typer.Exit(2) from None
    run_serve(settings, probes=probes)
