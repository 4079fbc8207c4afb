"""The `tokenops` command. Each package contributes its own sub-commands from a small `cli` module
that imports heavy dependencies (torch, the database) only inside the command bodies, so that
`tokenops --help` stays instant."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="tokenops: serve LLMs as a metered service.")

# Sub-commands are registered below, one line per package.
from tokenops.bench.cli import app as bench_app  # noqa: E402, I001  (issue 3)
app.add_typer(bench_app, name="bench")
from tokenops.gateway.cli import serve as serve_command  # noqa: E402, I001  (issue 4)
app.command("serve")(serve_command)
from tokenops.engine.cli import engine_command  # noqa: E402, I001  (issue 2)
app.command("engine")(engine_command)
from tokenops.ops.cli import register as register_ops  # noqa: E402, I001  (issue 4: tenants, keys, usage)
register_ops(app)
from tokenops.fusion.cli import app as eval_app  # noqa: E402, I001  (issue 6: profiles, routers)
app.add_typer(eval_app, name="eval")
