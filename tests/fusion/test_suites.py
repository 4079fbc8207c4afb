"""Suites are deterministic for a seed, and their checkers accept right answers and reject wrong ones."""

from __future__ import annotations

import pytest

from tokenops.fusion.suites import (
    CATEGORIES,
    LEVELS,
    TaskItem,
    generate_suite,
    reference_output,
    run_sandboxed,
)


def test_same_seed_same_items_and_other_seed_differs() -> None:
    a = generate_suite(7, per_cell=3)
    b = generate_suite(7, per_cell=3)
    assert [i.to_dict() for i in a] == [i.to_dict() for i in b]
    assert len(a) == len(CATEGORIES) * len(LEVELS) * 3
    c = generate_suite(8, per_cell=3)
    assert [i.instruction for i in a] != [i.instruction for i in c]
    # a category's items do not depend on which other categories are generated
    only = generate_suite(7, categories=["extraction"], per_cell=3)
    assert [i.to_dict() for i in only] == [i.to_dict() for i in a if i.category == "extraction"]


def test_items_round_trip_through_dicts() -> None:
    for item in generate_suite(1, per_cell=1):
        assert TaskItem.from_dict(item.to_dict()) == item


def test_long_context_grows_with_level() -> None:
    items = generate_suite(0, categories=["long_context"], per_cell=1)
    lengths = [len(i.instruction) for i in sorted(items, key=lambda i: i.level)]
    assert lengths == sorted(lengths) and lengths[-1] > 5 * lengths[0]


@pytest.mark.parametrize("mode", ["chat", "completion"])
def test_reference_answers_pass_and_wrong_answers_fail(mode: str) -> None:
    items = generate_suite(3, per_cell=2)
    non_code = [i for i in items if i.check != "code"]
    for item in non_code:
        assert item.is_correct(reference_output(item, mode), mode), (item.id, reference_output(item, mode))
        assert not item.is_correct("I do not know.", mode), item.id
        assert not item.is_correct("", mode), item.id
    # a code item of each level, right and wrong
    for level in LEVELS:
        item = next(i for i in items if i.check == "code" and i.level == level)
        assert item.is_correct(reference_output(item, mode), mode), item.id
        wrong = "    return None\n"
        assert not item.is_correct(
            f"```python\n{item.data['stub']}{wrong}```" if mode == "chat" else wrong, mode
        )


def test_checkers_on_typical_model_phrasings() -> None:
    item = next(i for i in generate_suite(0, categories=["arithmetic"], levels=[2], per_cell=1))
    assert item.is_correct(f"The answer is {item.answer}.")
    assert not item.is_correct(f"The answer is {int(item.answer) + 1}.")
    cap = next(i for i in generate_suite(0, categories=["knowledge"], levels=[1], per_cell=1))
    assert cap.is_correct(f"The capital is {cap.answer}.")
    assert not cap.is_correct(f"{cap.answer}ville")
    fmt = next(i for i in generate_suite(0, categories=["format"], levels=[3], per_cell=1))
    assert fmt.is_correct("Here it is:\n```json\n" + reference_output(fmt) + "\n```")
    assert not fmt.is_correct('{"name": "Nobody", "age": 1}')
    upper = next(i for i in generate_suite(0, categories=["format"], levels=[1], per_cell=1))
    assert not upper.is_correct(upper.answer.lower())


def test_code_sandbox_time_limit_and_isolation() -> None:
    ok, why = run_sandboxed("while True:\n    pass\n", time_limit_s=1.0)
    assert not ok and why == "time limit"
    ok, why = run_sandboxed("raise SystemExit(3)\n")
    assert not ok
    ok, why = run_sandboxed("import os\nassert 'HOME' not in os.environ\n")
    assert ok, why
    assert run_sandboxed("from __future__ import annotations\nx: int = 1\n")[0]
    # the memory cap holds: a 2 GiB allocation fails inside the sandbox
    ok, why = run_sandboxed("x = bytearray(2 << 30)\n")
    assert not ok and "MemoryError" in why
    # a model's infinite loop is a wrong answer, not a hung profile
    item = next(i for i in generate_suite(0, categories=["code"], levels=[1], per_cell=1))
    looping = item.data["stub"] + "    while True:\n        pass\n"
    assert not item.is_correct(f"```python\n{looping}```")
