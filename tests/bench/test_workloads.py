"""Workload generators and the Mooncake trace format: seeded, round-tripped, prefixes really shared."""

from __future__ import annotations

import itertools
import random

import pytest

from tokenops.bench.traces import (
    TraceRecord,
    block_words,
    group_sessions,
    prompt_from_hash_ids,
    read_trace,
    write_trace,
)
from tokenops.bench.workloads import Dist, make_workload, to_session


def take(gen, n):
    return list(itertools.islice(gen, n))


def test_trace_round_trip(tmp_path):
    recs = [
        TraceRecord(0, 655, 52, [0, 1], None),
        TraceRecord(105, 1200, 26, [0, 2, 3], "a", 0),
        TraceRecord(2500.5, 1400, 30, [0, 2, 3, 4], "a", 1, delay=1500.0, extra={"role": "tool", "x": [1]}),
    ]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, recs) == 3
    back = read_trace(path)
    assert back == recs
    # Mooncake lines without our extensions read too
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [7]}\n')
    assert read_trace(path) == [TraceRecord(0.0, 10, 2, [7])]
    path.write_text('{"timestamp": 0, "output_length": 2}\n')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        read_trace(path)


def test_prompt_from_hash_ids_is_deterministic_and_shares_prefixes():
    a = prompt_from_hash_ids([1, 2, 3], 40, block_size=16)
    b = prompt_from_hash_ids([1, 2, 9], 40, block_size=16)
    assert len(a.split()) == 40 and a == prompt_from_hash_ids([1, 2, 3], 40, block_size=16)
    assert a.split()[:32] == b.split()[:32] and a.split()[32:] != b.split()[32:]
    assert block_words(5, 16) != block_words(6, 16)
    assert len(prompt_from_hash_ids([], 7, block_size=16).split()) == 7


def test_dist_parse_and_sample():
    rng = random.Random(0)
    assert Dist.parse("128").length(rng) == 128
    assert all(10 <= Dist.parse("uniform:10,20").length(rng) <= 20 for _ in range(100))
    xs = [Dist.parse("exp:300").sample(rng) for _ in range(5000)]
    assert sum(xs) / len(xs) == pytest.approx(300, rel=0.08)
    for bad in ("uniform:5", "zipf:1,2", "abc", "uniform:5,1"):
        with pytest.raises(ValueError):
            Dist.parse(bad)


def test_random_workload_is_seeded():
    a = take(make_workload("random", seed=3, input_len="uniform:10,100", output_len="5"), 20)
    b = take(make_workload("random", seed=3, input_len="uniform:10,100", output_len="5"), 20)
    c = take(make_workload("random", seed=4, input_len="uniform:10,100", output_len="5"), 20)
    assert a == b and a != c
    assert all(len(s) == 1 and 10 <= s[0].input_length <= 100 and s[0].output_length == 5 for s in a)
    ids = [h for s in a for h in s[0].hash_ids]
    assert len(ids) == len(set(ids))  # no accidental sharing


def test_shared_prefix_groups_share_real_text():
    sessions = take(
        make_workload("shared-prefix", seed=1, groups=3, prefix_len=32, input_len="8", block_size=16), 30
    )
    groups = {s[0].extra["group"] for s in sessions}
    assert groups == {0, 1, 2}
    by_group = {}
    for s in sessions:
        text = to_session(s, block_size=16).turns[0].text.split()
        assert len(text) == 40
        by_group.setdefault(s[0].extra["group"], []).append(text)
    for texts in by_group.values():
        assert all(t[:32] == texts[0][:32] for t in texts)
    firsts = [texts[0][:32] for texts in by_group.values()]
    assert len({tuple(f) for f in firsts}) == 3


def test_multi_turn_and_agentic_sessions_grow():
    s = take(
        make_workload("multi-turn", seed=2, turns="4", input_len="20", output_len="10", think_s="0.5"), 1
    )[0]
    assert [r.round for r in s] == [0, 1, 2, 3]
    assert all(b.input_length == a.input_length + a.output_length + 20 for a, b in itertools.pairwise(s))
    assert all(set(a.hash_ids) <= set(b.hash_ids) for a, b in itertools.pairwise(s))
    session = to_session(s, block_size=16)
    assert [len(t.text.split()) for t in session.turns] == [20, 20, 20, 20]
    assert session.turns[1].delay_s == 0.5
    ag = take(make_workload("agentic", seed=2, rounds="3", system_len=64, task_len=16, block_size=16), 2)
    assert all(len(x) == 3 for x in ag)
    assert ag[0][0].hash_ids[:4] == ag[1][0].hash_ids[:4]  # the agent's system prompt is shared
    assert ag[0][1].extra["role"] == "tool" and ag[0][1].delay >= 0
    assert to_session(ag[0], block_size=16).turns[1].role == "tool"


def test_multi_turn_sessions_open_with_one_of_several_system_prompts():
    sessions = take(make_workload("multi-turn", seed=3, turns="2", prefix_len=32, groups=3, block_size=16), 6)
    prefixes = [tuple(s[0].hash_ids[:2]) for s in sessions]
    assert prefixes[:3] == prefixes[3:] and len(set(prefixes)) == 3  # session i uses prompt i % 3
    texts = [to_session(s, block_size=16).turns[0].text.split()[:32] for s in sessions]
    assert texts[0] == texts[3] and texts[0] != texts[1]


def test_trace_workload_groups_sessions(tmp_path):
    recs = [
        TraceRecord(100, 10, 2, [1], "b", 1),
        TraceRecord(0, 10, 2, [1], "b", 0),
        TraceRecord(50, 10, 2, [2]),
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, recs)
    sessions = list(make_workload("trace", path=str(path)))
    assert [[r.round for r in s] for s in sessions] == [[0, 1], [0]]
    assert group_sessions(recs)[0][0].session_id == "b"
    with pytest.raises(ValueError):
        make_workload("trace")
    with pytest.raises(ValueError):
        make_workload("nope")


def test_trace_without_hash_ids_shares_nothing():
    recs = [
        TraceRecord(0, 30, 2),
        TraceRecord(10, 30, 2),
        TraceRecord(20, 30, 2, [], "s", 0),
        TraceRecord(30, 50, 2, [], "s", 1),
    ]
    sessions = [to_session(s, 16, i) for i, s in enumerate(group_sessions(recs))]
    texts = [t.text for s in sessions for t in s.turns]
    assert len(set(texts)) == len(texts) == 4
    assert [len(t.split()) for t in texts] == [30, 30, 30, 18]
