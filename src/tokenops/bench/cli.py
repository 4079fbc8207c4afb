"""The `tokenops bench` sub-commands: run, sweep, compare, stub, trace.

This module only parses options and calls into the bench package; heavy imports (aiohttp, numpy,
matplotlib, uvicorn) happen inside the command bodies so that `tokenops --help` stays instant.
"""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="Load generator and SLO metrics for OpenAI-compatible endpoints.")


@app.command()
def stub(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8001,
    tokens: Annotated[int, typer.Option(help="Output tokens per answer when the request gives no max_tokens.")] = 16,
    ttft_ms: Annotated[float, typer.Option(help="Delay before the first token, in ms.")] = 0.0,
    itl_ms: Annotated[float, typer.Option(help="Delay between tokens, in ms.")] = 0.0,
    model: Annotated[list[str] | None, typer.Option(help="Model name listed by /v1/models (repeatable).")] = None,
    fail_status: Annotated[int | None, typer.Option(help="Answer every request with this HTTP status.")] = None,
    drop_after: Annotated[int | None, typer.Option(help="Cut every stream after this many tokens.")] = None,
) -> None:
    """Serve a fast OpenAI-compatible stub upstream that streams N tokens at a set pace."""
    from tokenops.bench.stub import StubConfig, serve_stub

    cfg = StubConfig(
        models=model or ["stub"],
        output_tokens=tokens,
        ttft_s=ttft_ms / 1000,
        itl_s=itl_ms / 1000,
        fail_status=fail_status,
        drop_after=drop_after,
    )
    serve_stub(host, port, cfg)
