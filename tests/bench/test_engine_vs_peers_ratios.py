"""benchmarks/engine_vs_peers.py's paired ratios: repeat i of one peer over repeat i of the other."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def evp():
    path = ROOT / "benchmarks" / "engine_vs_peers.py"
    spec = importlib.util.spec_from_file_location("engine_vs_peers", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _runs(values: list[float]) -> list[dict[str, float]]:
    return [{"output_tokens_per_s": v} for v in values]


def test_pairs_follow_a_drifting_machine(evp) -> None:
    # the machine slows by half over the repeats; ours is 2x the peer within every repeat
    ours = _runs([300.0, 240.0, 200.0, 160.0, 150.0])
    assert evp.paired_ratios(ours, _runs([150.0, 120.0, 100.0, 80.0, 75.0]), "output_tokens_per_s") == {
        "median": 2.0,
        "min": 2.0,
        "max": 2.0,
    }
    # one slow repeat of the peer shows as the spread, not in the median
    assert evp.paired_ratios(ours, _runs([150.0, 120.0, 100.0, 80.0, 30.0]), "output_tokens_per_s") == {
        "median": 2.0,
        "min": 2.0,
        "max": 5.0,
    }


def test_pairs_differ_from_medians_when_the_pace_moves(evp) -> None:
    ours = _runs([100.0, 400.0, 200.0])
    peer = _runs([100.0, 100.0, 300.0])  # medians 200 / 100 = 2x; pairs 1x, 4x, 0.667x
    paired = evp.paired_ratios(ours, peer, "output_tokens_per_s")
    assert paired["median"] == pytest.approx(1.0)
    assert paired["min"] == pytest.approx(2 / 3)
    assert paired["max"] == pytest.approx(4.0)


def test_unpaired_or_empty_repeats_give_nothing(evp) -> None:
    assert evp.paired_ratios(_runs([1.0, 2.0]), _runs([1.0]), "output_tokens_per_s") == {}
    assert evp.paired_ratios([], [], "output_tokens_per_s") == {}
    assert evp.paired_ratios(_runs([1.0]), _runs([0.0]), "output_tokens_per_s") == {}
