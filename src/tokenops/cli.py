"""The `tokenops` command. Each package contributes its own sub-commands from a small `cli` module
that imports heavy dependencies (torch, the database) only inside the command bodies, so that
`tokenops --help` stays instant."""

from __future__ import annotations

import typer

from tokenops.bench.cli import app as bench_app
from tokenops.engine.cli import engine_command
from tokenops.engine.eaas.cli import expert_server_command
from tokenops.fusion.cli import app as eval_app
from tokenops.gateway.cli import serve as serve_command
from tokenops.ops.cli import register as register_ops
from tokenops.sim.cli import register as register_sim

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="tokenops: serve LLMs as a metered service."
)

app.command("serve")(serve_command)  # gateway + embedded engine
app.command("engine")(engine_command)  # the inference engine server
app.command("expert-server")(expert_server_command)  # MoE experts as a service
register_ops(app)  # tenants, keys, usage
app.add_typer(bench_app, name="bench")  # load generator and SLO metrics
app.add_typer(eval_app, name="eval")  # capability profiles and routers
register_sim(app)  # fleet simulator, calibration and capacity planning


if __name__ == "__main__":
    app()
