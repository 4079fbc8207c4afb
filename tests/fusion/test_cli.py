"""`tokenops eval run|show|routers` end to end against loopback models and a SQLite file."""

from __future__ import annotations

from typer.testing import CliRunner

from tokenops.cli import app
from tokenops.fusion.suites import generate_suite


def words(output: str) -> str:
    """The CLI's output as plain words (the error box's borders and line breaks gone)."""
    return " ".join(output.replace("│", " ").split())


def test_eval_run_show_routers(scripted_server, suite_scripts, tmp_path) -> None:
    items = generate_suite(0, categories=["arithmetic", "extraction", "code"], per_cell=3)
    url, _ = scripted_server(suite_scripts(items))
    db = f"sqlite:///{tmp_path / 'eval.db'}"
    runner = CliRunner()
    common = ["--db", db, "--seed", "0", "--per-cell", "3", "--categories", "arithmetic,extraction,code"]
    r = runner.invoke(
        app,
        [
            "eval",
            "run",
            "-m",
            f"cheap={url},in=0.1,out=0.2",
            "-m",
            f"strong={url},mode=completion,in=1,out=2",
            *common,
        ],
    )
    assert r.exit_code == 0, r.output
    assert "cheap: accuracy 33%" in r.output and "strong: accuracy 100%" in r.output

    r = runner.invoke(app, ["eval", "show", "--db", db])
    assert r.exit_code == 0 and "arithmetic" in r.output and "strong" in r.output

    png = tmp_path / "curve.png"
    r = runner.invoke(
        app,
        [
            "eval",
            "routers",
            "--cheap",
            "cheap",
            "--strong",
            "strong",
            "--db",
            db,
            "--plot",
            str(png),
            "--save-router",
            str(tmp_path / "router.npz"),
            "--export-labels",
            str(tmp_path / "l.jsonl"),
        ],
    )
    assert r.exit_code == 0, r.output
    from tokenops.fusion.routers import load_jsonl, make_router

    labels = load_jsonl(tmp_path / "l.jsonl")
    assert (
        len(labels) == len(items) and sum(not e.cheap_ok for e in labels) == 18
    )  # levels 2 and 3 fail on cheap
    router = make_router("learned", model_path=tmp_path / "router.npz")
    assert router.name == "learned"
    for name in ("rules", "knn", "learned", "random", "oracle"):
        assert name in r.output
    assert png.read_bytes()[:4] == b"\x89PNG"

    r = runner.invoke(app, ["eval", "routers", "--cheap", "nobody", "--strong", "strong", "--db", db])
    assert r.exit_code != 0 and "no stored profile" in r.output

    # over seeded splits: each metric's mean and spread, random and oracle beside the routers
    spread = ["eval", "routers", "--db", db, "--splits", "3"]
    r = runner.invoke(app, [*spread, "--cheap", "cheap", "--strong", "strong"], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "3 splits" in r.output and "0.500 ± 0.000" in r.output  # random's APGR on every split
    for name in ("rules", "knn", "learned", "oracle"):
        assert name in r.output
    # the pair the wrong way round is refused with a message naming both, not empty metrics
    r = runner.invoke(app, [*spread, "--cheap", "strong", "--strong", "cheap"], terminal_width=200)
    assert r.exit_code != 0 and "worse than the cheap model 'strong'" in words(r.output)
    r = runner.invoke(app, ["eval", "routers", "--db", db, "--cheap", "strong", "--strong", "cheap"])
    assert r.exit_code != 0 and "Swap cheap and strong" in words(r.output)

    r = runner.invoke(app, ["eval", "run", "-m", "bad-spec", "--db", db])
    assert r.exit_code != 0
