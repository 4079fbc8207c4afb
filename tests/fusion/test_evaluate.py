"""APGR, CPT and cost saved on constructed curves whose values are worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from tokenops.fusion.evaluate import (
    ModelOutcomes,
    QualityGapError,
    apgr,
    cost_saved_at,
    cpt,
    curve_from_scores,
    evaluate_routers,
    plot,
    split_indices,
    table,
)

QC = np.array([1.0, 0.0, 0.0, 1.0])
QS = np.array([1.0, 1.0, 1.0, 1.0])
CC = np.ones(4)
CS = np.full(4, 10.0)


def _ev(scores: dict[str, np.ndarray], qc=QC, qs=QS, cc=CC, cs=CS):
    return evaluate_routers(scores, cheap=ModelOutcomes("c", qc, cc), strong=ModelOutcomes("s", qs, cs))


def test_perfect_router_by_hand() -> None:
    c = curve_from_scores("perfect", np.array([0.0, 1.0, 1.0, 0.0]), QC, QS, CC, CS)
    np.testing.assert_allclose(c.share, [0, 0.25, 0.5, 0.75, 1])
    np.testing.assert_allclose(c.quality, [0.5, 0.75, 1, 1, 1])
    np.testing.assert_allclose(c.cost, [4, 13, 22, 31, 40])
    # PGR 0, .5, 1, 1, 1 -> trapezoids .0625 + .1875 + .25 + .25
    assert apgr(c, 0.5, 1.0) == pytest.approx(0.75)
    assert cpt(c, 0.5, 1.0, 0.5) == 0.25 and cpt(c, 0.5, 1.0, 0.8) == 0.5
    assert cost_saved_at(c, 1.0, 40.0, 0.95) == pytest.approx(1 - 22 / 40)


def test_reversed_router_random_and_oracle() -> None:
    ev = _ev({"backwards": np.array([1.0, 0.0, 0.0, 1.0])})
    s = {x.name: x for x in ev.summaries}
    assert s["backwards"].apgr == pytest.approx(0.25)
    assert s["random"].apgr == pytest.approx(0.5)
    assert s["random"].cpt50 == 0.5 and s["random"].cpt80 == 1.0
    assert s["oracle"].apgr == pytest.approx(0.75) and s["oracle"].cpt80 == 0.5
    assert s["oracle"].cost_saved_at_95 == pytest.approx(0.45)
    assert s["backwards"].cost_saved_at_95 == pytest.approx(0.0)
    rows = table(ev)
    assert rows[0] == ["backwards", "0.250", "75%", "100%", "0%", "100%"]


def test_no_quality_gap_leaves_pgr_undefined() -> None:
    qc, qs = np.array([1.0, 1.0, 0.0, 0.0]), np.array([1.0, 0.0, 1.0, 0.0])
    ev = _ev({"r": np.zeros(4)}, qc, qs, np.ones(4), np.full(4, 2.0))
    oracle = next(s for s in ev.summaries if s.name == "oracle")
    assert oracle.apgr is None and oracle.cpt50 is None
    assert oracle.best_quality == pytest.approx(0.75)  # the two models complement each other
    assert oracle.cost_saved_at_95 == pytest.approx(0.5)  # all-cheap already matches the strong model


def test_no_gap_and_unreachable_quality() -> None:
    same = np.ones(3)
    c = curve_from_scores("r", np.zeros(3), same, same, np.ones(3), np.ones(3) * 2)
    assert apgr(c, 1.0, 1.0) == pytest.approx(1.0)
    worse = curve_from_scores("r", np.zeros(2), np.zeros(2), np.zeros(2), np.ones(2), np.ones(2))
    assert cost_saved_at(worse, 1.0, 2.0) is None


def test_split_is_seeded_and_disjoint() -> None:
    tr, te = split_indices(10, 0.3, seed=4)
    assert len(te) == 3 and set(tr).isdisjoint(te) and set(tr) | set(te) == set(range(10))
    assert np.array_equal(te, split_indices(10, 0.3, seed=4)[1])


def test_plot_writes_png(tmp_path) -> None:
    ev = _ev({"r": np.array([0.0, 1.0, 1.0, 0.0])})
    path = plot(ev, tmp_path / "c.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_negative_quality_gap_is_refused_by_name() -> None:
    worse = np.array([0.0, 0.0, 1.0, 0.0])
    msg = r"strong model 's' \(quality 0.250\) is worse than the cheap model 'c'"
    with pytest.raises(QualityGapError, match=msg):
        _ev({"r": np.zeros(4)}, QC, worse)
    with pytest.raises(TypeError):  # the models are named by role, never by position
        evaluate_routers({"r": np.zeros(4)}, QC, QS, CC, CS)  # type: ignore[misc]


@pytest.mark.parametrize("name", ["random", "oracle"])
def test_user_router_cannot_take_a_builtin_curve_name(name: str) -> None:
    with pytest.raises(ValueError, match="collide with the built-in curves"):
        _ev({name: np.zeros(4)})


def test_scores_must_match_the_items() -> None:
    with pytest.raises(ValueError, match="scored 3 items, expected 4"):
        _ev({"r": np.zeros(3)})


def test_oracle_apgr_exceeds_one_when_the_models_complement() -> None:
    # the cheap model is right where the strong one is wrong: picking per item beats the strong model
    qc, qs = np.array([1.0, 0.0, 0.0, 0.0]), np.array([0.0, 1.0, 1.0, 0.0])
    ev = _ev({"r": np.zeros(4)}, qc, qs)
    oracle = next(s for s in ev.summaries if s.name == "oracle")
    assert oracle.apgr is not None and oracle.apgr > 1.0
