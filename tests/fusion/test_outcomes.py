"""Learning from traffic: cascade outcomes stored per opted-in tenant (SQLite and PostgreSQL), with
no answer text unless the tenant allows it; a router retrained on them and its threshold
recalibrated; `tokenops eval retrain` end to end; the gateway's routers trained from the database."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from tokenops.fusion.outcomes import (
    CascadeOutcome,
    OutcomeLearning,
    OutcomeRecorder,
    OutcomeStore,
    cascade_outcomes,
)
from tokenops.fusion.retrain import auc, retrain
from tokenops.fusion.routers import LogisticRouter, RuleRouter, scores_for

from .test_routers import EASY, EASY_TEST, HARD, HARD_TEST


def _traffic(tenant: str = "acme") -> list[CascadeOutcome]:
    # easy questions were accepted at the cheap tier, hard ones escalated
    return [CascadeOutcome(tenant, "careful", "cheap", t, True) for t in EASY + EASY_TEST] + [
        CascadeOutcome(tenant, "careful", "cheap", t, False, "low confidence") for t in HARD + HARD_TEST
    ]


def test_only_opted_in_tenants_are_kept_and_answers_only_with_their_opt_in() -> None:
    learning = OutcomeLearning(frozenset({"acme", "beta"}), frozenset({"beta"}))
    verdicts = [("cheap", False, "low confidence", "Lyon"), ("mid", True, None, "Paris")]
    assert cascade_outcomes("r", "cheap", verdicts, "other", "q?", learning) == []
    assert cascade_outcomes("r", "cheap", verdicts, None, "q?", learning) == []
    (acme,) = cascade_outcomes("r", "cheap", verdicts, "acme", "q?", learning)
    assert (acme.model, acme.cheap_ok, acme.reason, acme.answer) == ("cheap", False, "low confidence", None)
    (beta,) = cascade_outcomes("r", "cheap", verdicts, "beta", "q?", learning)
    assert beta.answer == "Lyon"  # the distillation opt-in keeps the cheap answer
    with pytest.raises(ValueError, match="answer opt-in without the outcome opt-in"):
        OutcomeLearning(frozenset({"a"}), frozenset({"b"}))


def _round_trip(url: str) -> None:
    store = OutcomeStore(url)
    recorder = OutcomeRecorder(store)
    recorder.submit(_traffic()[:3])
    recorder.submit([CascadeOutcome("other", "elsewhere", "cheap", "hi", True)])
    recorder.flush()
    got = store.outcomes("careful")
    assert [(o.prompt, o.cheap_ok, o.answer) for o in got] == [(t, True, None) for t in EASY[:3]]
    assert [o.prompt for o in store.outcomes("careful", limit=1)] == [EASY[2]]
    assert [o.tenant for o in store.outcomes(tenant="other")] == ["other"]
    recorder.close()


def test_outcome_store_on_sqlite(tmp_path) -> None:
    _round_trip(f"sqlite:///{tmp_path / 'o.db'}")


@pytest.mark.postgres
def test_outcome_store_on_postgresql() -> None:
    schema = f"t_outcomes_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine("postgresql+psycopg://postgres@127.0.0.1:5432/test")
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    except sa.exc.OperationalError:
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432")
    try:
        _round_trip(f"postgresql://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{schema}")
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


def test_retraining_on_outcomes_learns_the_escalations_and_recalibrates(embedder) -> None:
    traffic = _traffic()
    result = retrain(traffic, target_strong_share=0.4, old=RuleRouter(), held_out=0.3, embed=embedder.embed)
    assert result.trained_on + result.held_out == len(traffic)
    assert result.new.auc is not None and result.new.auc > 0.8
    assert result.old is not None and result.old.log_loss is None  # the rule router's scores are ranks
    scores = scores_for(result.router, [o.prompt for o in traffic])
    assert np.mean(scores > result.threshold) == pytest.approx(0.4, abs=0.05)
    with pytest.raises(ValueError, match="only 3 cascade outcomes"):
        retrain(traffic[:3], target_strong_share=0.3, embed=embedder.embed)
    with pytest.raises(ValueError, match="same verdict"):
        retrain(traffic[:15], target_strong_share=0.3, embed=embedder.embed, min_outcomes=10)


def test_auc_by_hand() -> None:
    assert auc(np.array([0.9, 0.1, 0.5]), np.array([True, False, False])) == 1.0
    assert auc(np.array([0.5, 0.5]), np.array([True, False])) == 0.5
    assert auc(np.array([0.5]), np.array([True])) is None


def test_retrain_command_saves_a_router_with_its_threshold(tmp_path) -> None:
    from tokenops.cli import app

    db = f"sqlite:///{tmp_path / 'o.db'}"
    store = OutcomeStore(db)
    store.record(_traffic())
    store.close()
    out = tmp_path / "router.npz"
    runner = CliRunner()
    args = ["eval", "retrain", "--route", "careful", "--out", str(out), "--target-strong-share", "0.5"]
    r = runner.invoke(app, [*args, "--db", db])
    assert r.exit_code == 0, r.output
    assert "threshold" in r.output and out.is_file()
    router = LogisticRouter.load(out)
    assert router.threshold is not None and 0 < router.threshold < 1
    easy, hard = scores_for(router, EASY_TEST), scores_for(router, HARD_TEST)
    assert easy.mean() < hard.mean()
    again = runner.invoke(app, [*args, "--db", db])  # the saved router is now the one compared against
    assert again.exit_code == 0 and "old router log loss" in " ".join(again.output.split())
    empty = runner.invoke(app, ["eval", "retrain", "--route", "nobody", "--out", str(out), "--db", db])
    assert empty.exit_code != 0 and "only 0 cascade outcomes" in " ".join(empty.output.split())


def test_gateway_routers_train_from_the_database(tmp_path, embedder) -> None:
    from tokenops.fusion.profiles import ItemResult, ProfileStore
    from tokenops.fusion.routers import make_router
    from tokenops.fusion.stored_labels import stored_examples

    db = f"sqlite:///{tmp_path / 'p.db'}"
    profiles = ProfileStore(db)

    def results(model: str, cheap: bool) -> list[ItemResult]:
        return [
            ItemResult(model, f"i{i}", "c", 1, t, (t in EASY) if cheap else True, "", 5, 1, 0.0, 0.0)
            for i, t in enumerate(EASY + HARD)
        ]

    profiles.save("small", "chat", 0, results("small", True))
    profiles.save("big", "chat", 0, results("big", False))
    profiles.close()
    store = OutcomeStore(db)
    store.record([CascadeOutcome("acme", "auto", "small", t, False) for t in HARD_TEST])
    store.close()
    from_profiles = stored_examples(db, "auto", "small", "big", ["profiles"])
    assert len(from_profiles) == len(EASY + HARD)
    both = stored_examples(db, "auto", "small", "big", ["profiles", "outcomes"])
    assert len(both) == len(from_profiles) + len(HARD_TEST)
    router = make_router("knn", examples=both, embed=embedder.embed)
    assert scores_for(router, EASY_TEST).max() < 0.5 < scores_for(router, HARD_TEST).min()
