"""The `tokenops eval` commands: `run` (profile models on the task suites), `show` (stored profiles),
`routers` (cost-quality curves of the routers on a held-out split) and `retrain` (a route's learned
router retrained from its stored cascade outcomes, threshold recalibrated).

This module only turns options into calls to suites, profiles, routers and evaluate, and prints the
results with rich. Heavy imports (SQLAlchemy, torch, the embedder) happen inside the command bodies.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    no_args_is_help=True, help="Capability profiles and router evaluation (multi-model fusion)."
)


def _db_url(db: str | None) -> str:
    if db:
        return db
    from tokenops.config import load_settings

    settings = load_settings()
    if not settings.database_url:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    return settings.resolved_database_url


@app.command("run")
def run_command(
    model: Annotated[
        list[str],
        typer.Option(
            "--model",
            "-m",
            help="NAME=http://host:port/v1[,mode=completion][,served=NAME][,in=PRICE][,out=PRICE][,key=KEY] "
            "(repeatable; prices per million tokens).",
        ),
    ],
    seed: int = typer.Option(0, help="Suite seed: the same seed gives the same items."),
    per_cell: int = typer.Option(5, help="Items per category x level."),
    categories: str = typer.Option("", help="Comma-separated categories (default: all)."),
    levels: str = typer.Option("1,2,3", help="Comma-separated difficulty levels."),
    concurrency: int = typer.Option(4, help="Requests in flight per model."),
    timeout: float = typer.Option(600.0, help="Seconds one call may take before it counts as failed."),
    db: str | None = typer.Option(None, help="Database URL (default: the configured ledger database)."),
) -> None:
    """Run the task suites against each model and store its profile."""
    import asyncio

    from rich.console import Console
    from rich.progress import Progress

    from tokenops.fusion.profiles import ItemResult, ModelEndpoint, ProfileStore, aggregate, run_items
    from tokenops.fusion.suites import CATEGORIES, generate_suite

    try:
        endpoints = [ModelEndpoint.parse(s) for s in model]
        cats = [c.strip() for c in categories.split(",") if c.strip()] or list(CATEGORIES)
        lvls = [int(x) for x in levels.split(",") if x.strip()]
        items = generate_suite(seed, categories=cats, levels=lvls, per_cell=per_cell)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    console = Console()
    store = ProfileStore(_db_url(db))
    with Progress(console=console, transient=True) as progress:
        bars = [progress.add_task(f"{ep.name} ({ep.mode})", total=len(items)) for ep in endpoints]

        def advance(bar: int) -> Callable[[object], None]:
            return lambda _r: progress.advance(bar)

        async def profile_all() -> list[list[ItemResult]]:
            # models on different servers are profiled at the same time
            runs = [
                run_items(ep, items, concurrency=concurrency, on_done=advance(bar), timeout_s=timeout)
                for ep, bar in zip(endpoints, bars, strict=True)
            ]
            return list(await asyncio.gather(*runs))

        all_results = asyncio.run(profile_all())
    for ep, results in zip(endpoints, all_results, strict=True):
        run_id = store.save(ep.name, ep.mode, seed, results)
        errors = sum(r.error is not None for r in results)
        _print_profile(console, aggregate(ep.name, run_id, results))
        if errors:
            first = next(r.error for r in results if r.error)
            console.print(f"[yellow]{errors} calls failed[/] (first: {first})")
    store.close()


def _print_profile(console, profile) -> None:  # type: ignore[no-untyped-def]
    from rich.table import Table

    t = Table(title=f"{profile.model}: accuracy {profile.accuracy:.0%} (run {profile.run_id[:8]})")
    t.add_column("category", min_width=12, no_wrap=True)
    for col in ("level", "n", "accuracy", "prompt tok", "output tok", "cost", "latency s"):
        t.add_column(col, justify="right")
    for (cat, level), c in profile.cells.items():
        t.add_row(
            cat,
            str(level),
            str(c.n),
            f"{c.accuracy:.0%}",
            f"{c.mean_prompt_tokens:.0f}",
            f"{c.mean_completion_tokens:.1f}",
            f"{c.mean_cost:.2e}",
            f"{c.mean_latency_s:.2f}",
        )
    console.print(t)


@app.command("show")
def show_command(
    model: str | None = typer.Option(
        None, "--model", "-m", help="One model (default: every profiled model)."
    ),
    db: str | None = typer.Option(None, help="Database URL (default: the configured ledger database)."),
) -> None:
    """Show the latest stored profile of each model."""
    from rich.console import Console

    from tokenops.fusion.profiles import ProfileStore

    console = Console()
    store = ProfileStore(_db_url(db))
    names = [model] if model else store.models()
    if not names:
        console.print("no profiles stored yet: run `tokenops eval run` first")
    for name in names:
        profile = store.profile(name)
        if profile is None:
            console.print(f"no profile for {name!r}")
            continue
        _print_profile(console, profile)
    store.close()


def _print_spread(console, spread, title: str) -> None:  # type: ignore[no-untyped-def]
    from rich.table import Table

    def cell(x, pct: bool) -> str:  # type: ignore[no-untyped-def]
        if x.mean is None:
            return "-"
        k = 100.0 if pct else 1.0
        fmt = "{:.0f}%" if pct else "{:.3f}"
        text = f"{fmt.format(x.mean * k)} ± {fmt.format(x.std * k)}"
        return text if x.defined == len(spread.seeds) else f"{text} ({x.defined} of {len(spread.seeds)})"

    n = spread.evaluations[0].n
    t = Table(title=f"{title}: {len(spread.seeds)} splits, {n} held-out items each (mean ± std)")
    t.add_column("router", min_width=7, no_wrap=True)
    for col in ("APGR", "CPT(50%)", "CPT(80%)"):
        t.add_column(col, justify="right")
    for name, apgr in spread.apgr.items():
        t.add_row(name, cell(apgr, False), cell(spread.cpt50[name], True), cell(spread.cpt80[name], True))
    console.print(t)
    if spread.reversed_seeds:
        console.print(
            f"[yellow]left out {len(spread.reversed_seeds)} split(s) whose held-out items reverse the two "
            f"models (seeds {spread.reversed_seeds})[/]"
        )


@app.command("routers")
def routers_command(
    cheap: str = typer.Option(..., help="Profiled name of the cheap model."),
    strong: str = typer.Option(..., help="Profiled name of the strong model."),
    held_out: float = typer.Option(0.5, help="Share of items kept for evaluation."),
    seed: int = typer.Option(0, help="Split seed."),
    splits: int = typer.Option(
        1, min=1, help="Evaluate over this many seeded splits (0, 1, ...) and show each metric's spread."
    ),
    price_ratio: float = typer.Option(
        10.0, help="Strong/cheap price per token, used when the profiles recorded no prices."
    ),
    plot_path: Annotated[
        Path | None, typer.Option("--plot", help="Write the cost-quality plot (PNG) here.")
    ] = None,
    labels: Annotated[
        Path | None,
        typer.Option(help="Extra labelled JSONL ({prompt, cheap_ok}) for the kNN and learned routers."),
    ] = None,
    save_router: Annotated[
        Path | None,
        typer.Option(
            help="Also train the learned router on every profiled item and save it here (.npz) "
            "for the gateway."
        ),
    ] = None,
    export_labels: Annotated[
        Path | None,
        typer.Option(help="Also write the profile labels as JSONL ({prompt, cheap_ok}) for the kNN router."),
    ] = None,
    db: str | None = typer.Option(None, help="Database URL (default: the configured ledger database)."),
) -> None:
    """Cost-quality of the rule, kNN and learned routers vs random and oracle on a held-out split."""
    from rich.console import Console
    from rich.table import Table

    from tokenops.fusion.router_eval import evaluate_profile_splits, evaluate_profiles

    console = Console()
    if splits > 1:
        try:
            spread = evaluate_profile_splits(
                _db_url(db), cheap, strong, splits=splits, held_out=held_out, price_ratio=price_ratio,
                labels=labels,
            )  # fmt: skip
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        _print_spread(console, spread, f"{cheap} -> {strong}")
        return
    try:
        ev = evaluate_profiles(
            _db_url(db), cheap, strong, held_out=held_out, seed=seed, price_ratio=price_ratio, labels=labels
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    from tokenops.fusion.evaluate import plot, table

    t = Table(
        title=f"{cheap} -> {strong}: {ev.n} held-out items, quality {ev.q_cheap:.0%} -> {ev.q_strong:.0%}"
    )
    t.add_column("router", min_width=7, no_wrap=True)
    for col in ("APGR", "CPT(50%)", "CPT(80%)", "saved @95%", "best q"):
        t.add_column(col, justify="right")
    for row in table(ev):
        t.add_row(*row)
    console.print(t)
    console.print(
        "saved @95%: cost saved vs all-strong at 95% of the strong model's quality; best q: highest "
        "quality on the curve"
    )
    if ev.q_strong <= ev.q_cheap:
        console.print(
            "[yellow]the strong model is not better than the cheap one on these items: "
            "APGR and CPT are undefined[/]"
        )
    if plot_path is not None:
        console.print(f"plot: {plot(ev, plot_path, f'{cheap} -> {strong}')}")
    if save_router is not None or export_labels is not None:
        from tokenops.fusion import router_eval
        from tokenops.fusion.routers import LogisticRouter, load_jsonl

        examples = router_eval.profile_labels(_db_url(db), cheap, strong) + (
            load_jsonl(labels) if labels else []
        )
        if export_labels is not None:
            console.print(
                f"labels: {router_eval.export_labels(examples, export_labels)} ({len(examples)} examples)"
            )
        if save_router is not None:
            LogisticRouter.fit(examples).save(save_router)
            console.print(f"learned router: {save_router} (trained on {len(examples)} examples)")


@app.command("retrain")
def retrain_command(
    out: Annotated[
        Path, typer.Option(help="Where the retrained router goes (.npz): the route's router_model")
    ],
    route: str = typer.Option(..., help="The cascade route whose stored outcomes are the labels."),
    target_strong_share: float = typer.Option(0.3, help="Share of requests the threshold sends strong."),
    cheap: str | None = typer.Option(None, help="Also train on the stored profiles of this cheap model..."),
    strong: str | None = typer.Option(None, help="...and this strong model."),
    last: int | None = typer.Option(None, help="Use only the latest this many outcomes."),
    held_out: float = typer.Option(
        0.2, help="Share of outcomes kept to compare the new router with the old."
    ),
    seed: int = typer.Option(0, help="Split seed."),
    db: str | None = typer.Option(None, help="Database URL (default: the configured ledger database)."),
) -> None:
    """Retrain a route's learned router on its cascade outcomes and recalibrate its threshold."""
    from rich.console import Console

    from tokenops.fusion.outcomes import OutcomeStore
    from tokenops.fusion.retrain import retrain
    from tokenops.fusion.routers import LogisticRouter, labels_from_profiles

    console = Console()
    url = _db_url(db)
    store = OutcomeStore(url)
    try:
        outcomes = store.outcomes(route, limit=last)
    finally:
        store.close()
    profile_labels = None
    if (cheap is None) != (strong is None):
        raise typer.BadParameter("give both --cheap and --strong, or neither")
    if cheap is not None and strong is not None:
        from tokenops.fusion.profiles import ProfileStore

        profiles = ProfileStore(url)
        try:
            profile_labels = labels_from_profiles(profiles.results(cheap), profiles.results(strong))
        finally:
            profiles.close()
    old = LogisticRouter.load(out) if out.is_file() else None
    with console.status(f"training on {len(outcomes)} outcomes of {route!r}"):
        try:
            result = retrain(
                outcomes,
                target_strong_share=target_strong_share,
                profile_labels=profile_labels,
                old=old,
                held_out=held_out,
                seed=seed,
            )
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    result.router.save(out, threshold=result.threshold)

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    console.print(
        f"{route}: trained on {result.trained_on}, {result.held_out} held out; "
        f"new router log loss {fmt(result.new.log_loss)}, AUC {fmt(result.new.auc)}"
        + (
            f"; old router log loss {fmt(result.old.log_loss)}, AUC {fmt(result.old.auc)}"
            if result.old
            else ""
        )
    )
    console.print(
        f"threshold {result.threshold:.3f} for a strong share of {target_strong_share:g}; saved {out} "
        "(restart or reload the gateway to serve it)"
    )
