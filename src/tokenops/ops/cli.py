"""`tokenops tenants|keys|usage`: the admin operations from the terminal, working on the configured
database directly (the same one `tokenops serve` uses; migrations run first), printed as rich
tables. Heavy imports (SQLAlchemy, the config) happen inside the commands so `tokenops --help`
stays instant. The HTTP admin API (gateway) offers the same operations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from tokenops.token_types import TOKEN_TYPE_NAMES

tenants_app = typer.Typer(no_args_is_help=True, help="Tenant tree: organisations, projects and their limits.")
keys_app = typer.Typer(no_args_is_help=True, help="API keys: create (shown once), list, revoke.")

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="YAML config (default: $TOKENOPS_CONFIG or ./tokenops.yaml).")
]
DbOpt = Annotated[str | None, typer.Option("--database-url", help="Override the configured database URL.")]
RpmOpt = Annotated[int | None, typer.Option("--rpm", help="Requests per minute.")]
TpmOpt = Annotated[
    int | None, typer.Option("--tpm", help="Tokens per minute (prompt + output, reserved at admit).")
]
ConcOpt = Annotated[int | None, typer.Option("--max-concurrent", help="Requests in flight at once.")]
BudgetOpt = Annotated[
    float | None, typer.Option("--budget", help="Budget in currency units (stored as micro-units).")
]
PeriodOpt = Annotated[
    str | None, typer.Option("--period", help="Budget period: day, month (default) or total.")
]
PrioOpt = Annotated[
    int | None, typer.Option("--priority", help="Priority class, 0 = highest (inherited when unset).")
]
ModelsOpt = Annotated[
    str | None, typer.Option("--models", help="Allowed models, comma-separated (default: all).")
]
AlertOpt = Annotated[
    str | None,
    typer.Option(
        "--alert-threshold",
        help="Soft alerts at these fractions of the budget, comma-separated, e.g. 0.8 or 0.5,0.8,1.",
    ),
]
ReasoningOpt = Annotated[
    int | None,
    typer.Option(
        "--max-reasoning-tokens",
        help="Thinking-budget cap in tokens (0 = no thinking): the default for requests that give none, "
        "and the most any request under this node may ask for.",
    ),
]
HistoryOpt = Annotated[
    int | None,
    typer.Option(
        "--max-history-tokens",
        help="Compaction budget of a /v1/responses session in tokens: past it older turns are "
        "summarised (the smallest on the path applies).",
    ),
]


def _database(config: Path | None, database_url: str | None):  # noqa: ANN202
    from tokenops.ops.db import Database

    if database_url is None:
        from tokenops.config import ConfigError, load_settings

        try:
            settings = load_settings(config)
        except ConfigError as exc:
            raise typer.BadParameter(str(exc)) from exc
        database_url = settings.resolved_database_url
        if database_url.startswith("sqlite"):
            settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = Database(database_url)
    db.migrate_sync()
    return db


def when(value: str | None, name: str):  # noqa: ANN201
    """An ISO date or time option as an aware UTC datetime (None stays None)."""
    from datetime import UTC, datetime

    if value is None:
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter(
            f"--{name} must be an ISO date or time, YYYY-MM-DD or YYYY-MM-DDTHH:MM"
        ) from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _run(config: Path | None, database_url: str | None, fn, *args: Any) -> Any:  # noqa: ANN001
    from tokenops.protocol import APIError

    db = _database(config, database_url)
    try:
        return db.run_sync(fn, *args)
    except APIError as exc:
        typer.secho(f"error: {exc.message}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    finally:
        db.dispose()


# the limit options of tenants create/update and keys create: argument name -> the limit it sets
PLAIN_LIMITS = {
    "rpm": "rpm",
    "tpm": "tpm",
    "max_concurrent": "max_concurrent",
    "period": "budget_period",
    "priority": "priority",
    "max_reasoning_tokens": "max_reasoning_tokens",
    "max_history_tokens": "max_history_tokens",
}


def _limits(args: dict[str, Any]) -> dict[str, Any]:
    """The limits a command was given, read by name from its arguments (its `locals()`): the three
    commands that set limits take the same options and state them once here."""
    out = {limit: args[name] for name, limit in PLAIN_LIMITS.items() if args[name] is not None}
    budget, models, alert = args["budget"], args["models"], args["alert_threshold"]
    if budget is not None:
        out["budget_micros"] = round(budget * 1_000_000)
    if models is not None:
        out["allowed_models"] = [m.strip() for m in models.split(",") if m.strip()]
    if alert is not None:
        try:
            levels = [float(x) for x in alert.split(",") if x.strip()]
        except ValueError:
            typer.secho(f"error: --alert-threshold takes fractions, e.g. 0.5,0.8,1; got {alert!r}", err=True)
            raise typer.Exit(1) from None
        if len(levels) == 1:
            out["alert_threshold"] = levels[0]
        else:
            out["alert_thresholds"] = levels
    return out


def _node_settings(values: dict[str, Any]) -> Any:
    """Validated `NodeSettings`; a bad value ends the command with the ops layer's message."""
    from tokenops.ops import tree
    from tokenops.protocol import APIError

    try:
        return tree.NodeSettings.from_dict(values)
    except APIError as exc:
        typer.secho(f"error: {exc.message}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def _money(micros: int | None) -> str:
    return "-" if micros is None else f"{micros / 1_000_000:,.6f}".rstrip("0").rstrip(".")


def _node_table(nodes: list[Any], title: str):  # noqa: ANN202
    from rich.table import Table

    t = Table(title=title)
    for col in (
        "path",
        "kind",
        "models",
        "rpm",
        "tpm",
        "concurrent",
        "budget",
        "period",
        "priority",
        "alert",
        "reasoning",
        "history",
    ):
        t.add_column(col)
    for n in nodes:
        s = n.settings
        t.add_row(
            n.path,
            n.kind,
            ",".join(s.allowed_models) if s.allowed_models is not None else "all",
            *(str(v) if v is not None else "-" for v in (s.rpm, s.tpm, s.max_concurrent)),
            _money(s.budget_micros),
            s.budget_period or "-",
            "-" if s.priority is None else str(s.priority),
            ",".join(f"{x:.0%}" for x in s.alert_levels()) or "-",
            "-" if s.max_reasoning_tokens is None else str(s.max_reasoning_tokens),
            "-" if s.max_history_tokens is None else str(s.max_history_tokens),
        )
    return t


def _print(obj: Any) -> None:
    from rich.console import Console

    Console().print(obj)


@tenants_app.command("create")
def tenants_create(
    path: Annotated[
        str, typer.Argument(help="Node path, e.g. 'acme' or 'acme/search' (the parent must exist).")
    ],
    rpm: RpmOpt = None,
    tpm: TpmOpt = None,
    max_concurrent: ConcOpt = None,
    budget: BudgetOpt = None,
    period: PeriodOpt = None,
    priority: PrioOpt = None,
    models: ModelsOpt = None,
    alert_threshold: AlertOpt = None,
    max_reasoning_tokens: ReasoningOpt = None,
    max_history_tokens: HistoryOpt = None,
    config: ConfigOpt = None,
    database_url: DbOpt = None,
) -> None:
    """Create an organisation, project or deeper node."""
    from tokenops.ops import tree

    parts = path.strip("/").split("/")
    s = _node_settings(_limits(locals()))
    node = _run(config, database_url, tree.create_node, parts[:-1] or None, parts[-1], s)
    _print(_node_table([node], "created"))


@tenants_app.command("list")
def tenants_list(config: ConfigOpt = None, database_url: DbOpt = None) -> None:
    """Every node of the tree with its settings."""
    from tokenops.ops import tree

    _print(_node_table(_run(config, database_url, tree.list_nodes, None), "tenant tree"))


@tenants_app.command("show")
def tenants_show(path: str, config: ConfigOpt = None, database_url: DbOpt = None) -> None:
    """One node: settings and this period's spent and reserved budget."""
    from datetime import UTC, datetime

    from tokenops.ops import budgets, tree

    def tx(conn):  # noqa: ANN001, ANN202
        node = tree.get_node(conn, path)
        period = budgets.period_key(node.settings.budget_period or "month", datetime.now(UTC))
        return node, period, budgets.node_usage(conn, node.id, period)

    node, period, (spent, reserved) = _run(config, database_url, tx)
    _print(_node_table([node], node.path))
    if node.settings.budget_micros is not None:
        left = node.settings.budget_micros - spent - reserved
        _print(f"period {period}: spent {_money(spent)}, reserved {_money(reserved)}, left {_money(left)}")


@tenants_app.command("update")
def tenants_update(
    path: str,
    rpm: RpmOpt = None,
    tpm: TpmOpt = None,
    max_concurrent: ConcOpt = None,
    budget: BudgetOpt = None,
    period: PeriodOpt = None,
    priority: PrioOpt = None,
    models: ModelsOpt = None,
    alert_threshold: AlertOpt = None,
    max_reasoning_tokens: ReasoningOpt = None,
    max_history_tokens: HistoryOpt = None,
    clear: Annotated[
        list[str] | None, typer.Option("--clear", help="Remove a setting (repeatable), e.g. --clear rpm.")
    ] = None,
    config: ConfigOpt = None,
    database_url: DbOpt = None,
) -> None:
    """Change a node's settings (unnamed ones stay as they are)."""
    from tokenops.ops import tree

    changes = _limits(locals())
    for name in clear or []:
        changes["budget_micros" if name == "budget" else name.replace("-", "_")] = None
    node = _run(config, database_url, tree.update_node, path, changes)
    _print(_node_table([node], "updated"))


@keys_app.command("create")
def keys_create(
    node: Annotated[str, typer.Argument(help="The tenant node the key belongs to, e.g. 'acme/search'.")],
    name: Annotated[str, typer.Argument(help="A name for the key, unique under its node.")],
    rpm: RpmOpt = None,
    tpm: TpmOpt = None,
    max_concurrent: ConcOpt = None,
    budget: BudgetOpt = None,
    period: PeriodOpt = None,
    priority: PrioOpt = None,
    models: ModelsOpt = None,
    alert_threshold: AlertOpt = None,
    max_reasoning_tokens: ReasoningOpt = None,
    max_history_tokens: HistoryOpt = None,
    admin_read: Annotated[
        bool,
        typer.Option("--admin-read", help="Also grant read-only admin access (the console, admin reads)."),
    ] = False,
    config: ConfigOpt = None,
    database_url: DbOpt = None,
) -> None:
    """Create a key. The key is printed once and stored only as a hash."""
    from tokenops.ops import keys

    s = _node_settings(_limits(locals()))
    scopes = [keys.ADMIN_READ] if admin_read else []
    plaintext, info = _run(config, database_url, keys.create_key, node, name, s, scopes)
    _print(f"key id {info.id} for {info.node_path}")
    typer.echo(plaintext)
    _print("[yellow]Store this key now: it is not shown again.[/yellow]")


@keys_app.command("list")
def keys_list(
    under: Annotated[str | None, typer.Option(help="Only keys under this node path.")] = None,
    config: ConfigOpt = None,
    database_url: DbOpt = None,
) -> None:
    """Keys with their node, visible prefix and state (never the key itself)."""
    from rich.table import Table

    from tokenops.ops import keys

    t = Table(title="API keys")
    for col in ("id", "node path", "prefix", "created", "state"):
        t.add_column(col)
    for k in _run(config, database_url, keys.list_keys, under):
        t.add_row(
            k.id,
            k.node_path,
            k.prefix + "...",
            f"{k.created_at:%Y-%m-%d %H:%M}",
            ("revoked" if k.revoked_at else "active") + "".join(f" {s}" for s in k.scopes),
        )
    _print(t)


@keys_app.command("revoke")
def keys_revoke(key_id: str, config: ConfigOpt = None, database_url: DbOpt = None) -> None:
    """Revoke a key by its id (gateways stop accepting it within their key-cache TTL, 2 s)."""
    from tokenops.ops import keys

    info = _run(config, database_url, keys.revoke_key, key_id)
    _print(f"revoked {info.id} ({info.node_path})")


def usage_command(
    by: Annotated[
        str, typer.Option("--by", help="Group by any of tenant,key,model,day (comma-separated).")
    ] = "tenant,model",
    since: Annotated[
        str | None, typer.Option(help="From this UTC date or time (ISO 8601), inclusive.")
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="Up to this UTC date or time (ISO 8601), exclusive.")
    ] = None,
    tenant: Annotated[str | None, typer.Option(help="Only this tenant (organisation).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON rows instead of a table.")] = False,
    config: ConfigOpt = None,
    database_url: DbOpt = None,
) -> None:
    """Token usage by type, cost and cost per million tokens, from the ledger."""
    from rich.table import Table

    from tokenops.ops.usage import check_group_by, usage_report
    from tokenops.protocol import APIError

    try:
        groups = check_group_by([g.strip() for g in by.split(",") if g.strip()])
    except APIError as exc:
        raise typer.BadParameter(exc.message) from None
    rows = _run(
        config, database_url, usage_report, groups, when(since, "since"), when(until, "until"), tenant
    )
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    t = Table(title="usage")
    cols = [*groups, "requests", *TOKEN_TYPE_NAMES, "cost", "cost / Mtok"]
    for c in cols:
        t.add_column(c, justify="left" if c in groups else "right")
    for r in rows:
        t.add_row(
            *(str(r[g]) for g in groups),
            *(f"{r[k]:,}" for k in ("requests", *TOKEN_TYPE_NAMES)),
            _money(r["cost_micros"]),
            f"{r['cost_per_million_tokens']:.4f}",
        )
    _print(t)


distill_app = typer.Typer(no_args_is_help=True, help="The distillation set of opted-in tenants.")


@distill_app.command("export")
def distill_export_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="The JSONL file to write (- for stdout).")],
    tenant: Annotated[str | None, typer.Option(help="Only this tenant (organisation).")] = None,
    model: Annotated[str | None, typer.Option(help="Only answers of this model.")] = None,
    since: Annotated[str | None, typer.Option(help="From this UTC date or time (ISO 8601).")] = None,
    until: Annotated[
        str | None, typer.Option(help="Up to this UTC date or time (ISO 8601), exclusive.")
    ] = None,
    config: ConfigOpt = None,
    database_url: DbOpt = None,
) -> None:
    """Write the recorded examples as OpenAI chat fine-tuning JSONL (one {"messages": [...]} a line)."""
    from rich.progress import Progress

    from tokenops.ops.distill import examples

    def export(conn) -> int:  # noqa: ANN001
        handle = typer.get_text_stream("stdout") if str(out) == "-" else out.open("w", encoding="utf-8")
        n = 0
        try:
            with Progress(transient=True, disable=str(out) == "-") as progress:
                task = progress.add_task("exporting", total=None)
                rows = examples(
                    conn, tenant=tenant, model=model, since=when(since, "since"), until=when(until, "until")
                )
                for row in rows:
                    handle.write(json.dumps(row, ensure_ascii=False) + "\n")
                    n += 1
                    progress.advance(task)
        finally:
            if handle is not typer.get_text_stream("stdout"):
                handle.close()
        return n

    n = _run(config, database_url, export)
    if str(out) != "-":
        typer.echo(f"{n} examples written to {out}")


def register(app: typer.Typer) -> None:
    """Add `tenants`, `keys`, `usage` and `distill` to the `tokenops` command."""
    app.add_typer(tenants_app, name="tenants")
    app.add_typer(keys_app, name="keys")
    app.command("usage")(usage_command)
    app.add_typer(distill_app, name="distill")
