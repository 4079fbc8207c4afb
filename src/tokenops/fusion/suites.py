"""Seeded task suites that measure what a model can do, checked automatically and offline.

This module owns the items of a capability profile: for each category (knowledge, arithmetic and
reasoning, instruction following and format, extraction, long-context retrieval, code) and each
difficulty level (1 easy .. 3 hard), a generator that turns a seed into items, and the checker that
accepts or rejects a model's output. Every item carries two prompts: `instruction` for a chat model
(one user message) and `completion_prompt` for a base model through /v1/completions (a few solved
examples, then the question, ending where the answer starts). Code is checked by running it in a
separate Python process (isolated mode, empty environment, CPU and memory limits, a wall-clock time
limit). It does not call models or store results: profiles.py does.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Category = Literal["knowledge", "arithmetic", "format", "extraction", "long_context", "code"]
CATEGORIES: tuple[Category, ...] = ("knowledge", "arithmetic", "format", "extraction", "long_context", "code")
LEVELS: tuple[int, ...] = (1, 2, 3)
Mode = Literal["chat", "completion"]

CODE_TIME_LIMIT_S = 3.0


@dataclass(frozen=True, slots=True)
class TaskItem:
    """One question with its reference answer and how to check an output against it."""

    id: str
    category: Category
    level: int
    instruction: str  # the user message for a chat model
    completion_prompt: str  # the text a base model continues
    answer: str  # the reference answer (for code: the function name)
    check: str  # checker kind: "contains", "number", "exact", "json", "list", "code"
    max_tokens: int = 32
    stop: tuple[str, ...] = ("\n",)  # stop sequences for the completion prompt
    data: dict[str, Any] = field(default_factory=dict)  # checker payload (code tests, json fields)

    def prompt(self, mode: Mode) -> str:
        return self.instruction if mode == "chat" else self.completion_prompt

    def is_correct(self, output: str, mode: Mode = "chat") -> bool:
        return check_output(self, output, mode)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TaskItem:
        return cls(**{**d, "stop": tuple(d.get("stop", ("\n",)))})


# ---------------------------------------------------------------------------------------------
# Checkers

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().strip(".!\"'`").strip()).lower()


def last_number(text: str) -> float | None:
    """The last number written in the text (commas as thousands separators)."""
    found = _NUM.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def extract_code(output: str) -> str:
    """The Python source in a model's answer: the first fenced block if any, else the whole text."""
    m = re.search(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", output, re.S)
    return m.group(1) if m else output


def run_sandboxed(source: str, time_limit_s: float = CODE_TIME_LIMIT_S) -> tuple[bool, str]:
    """Run Python source in a separate isolated process; (exited 0 within the limit, reason)."""
    with tempfile.TemporaryDirectory(prefix="tokenops-sandbox-") as tmp:
        path = os.path.join(tmp, "program.py")
        cpu = int(time_limit_s) + 1
        # the child caps itself before the program runs (soft = hard, so the program cannot raise
        # them); no preexec_fn, which is unsafe in a process with threads (profiles check in threads)
        prelude = (
            (
                "import resource as _r\n"
                f"_r.setrlimit(_r.RLIMIT_CPU, ({cpu}, {cpu}))\n"
                "_r.setrlimit(_r.RLIMIT_AS, (1 << 30, 1 << 30))\n"
                "_r.setrlimit(_r.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
                "del _r\n"
            )
            if os.name == "posix"
            else ""
        )
        # a __future__ import must open the file: it cannot follow the prelude, and changes nothing here
        source = re.sub(r"(?m)^from __future__ import .*$", "", source)
        with open(path, "w") as f:
            f.write(prelude + source)
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-S", path],
                cwd=tmp,
                env={"PATH": "/usr/bin:/bin"},
                capture_output=True,
                timeout=time_limit_s,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return False, "time limit"
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            return False, err[-1] if err else f"exit {proc.returncode}"
        return True, "ok"


def check_output(item: TaskItem, output: str, mode: Mode = "chat") -> bool:
    """Whether `output` answers `item` correctly."""
    kind = item.check
    if kind == "code":
        body = extract_code(output) if mode == "chat" else item.data["stub"] + output
        tests = "\n".join(f"assert {item.answer}({args}) == {want!r}" for args, want in item.data["tests"])
        ok, _ = run_sandboxed(body + "\n\n" + tests + "\n", item.data.get("time_limit_s", CODE_TIME_LIMIT_S))
        return ok
    line = _first_line(output)
    if kind == "number":
        got = last_number(line if mode == "completion" else output)
        return got is not None and abs(got - float(item.answer)) < 1e-6
    if kind == "contains":
        return re.search(r"\b" + re.escape(item.answer.lower()) + r"\b", line.lower()) is not None
    if kind == "exact":
        return line.strip().strip(".\"'`") == item.answer
    if kind == "list":
        parts = [_norm(p) for p in re.split(r",", line.strip().strip("."))]
        return parts == [_norm(p) for p in item.answer.split(",")]
    if kind == "json":
        m = re.search(r"\{.*\}", output, re.S)
        if not m:
            return False
        try:
            obj = json.loads(m.group(0))
        except ValueError:
            return False
        return isinstance(obj, dict) and obj == item.data["object"]
    raise ValueError(f"unknown checker {kind!r}")


# ---------------------------------------------------------------------------------------------
# Generators. Each takes (rng, level) and returns (instruction, question for a base model, answer,
# check, extra fields). Few-shot examples for base models are fixed per category.

_CAPITALS_EASY = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Germany", "Berlin"),
    ("Spain", "Madrid"),
    ("Egypt", "Cairo"),
    ("Russia", "Moscow"),
    ("China", "Beijing"),
]
_CAPITALS_HARD = [
    ("Australia", "Canberra"),
    ("Canada", "Ottawa"),
    ("Turkey", "Ankara"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Norway", "Oslo"),
    ("Vietnam", "Hanoi"),
    ("Chile", "Santiago"),
]
_ELEMENTS = [
    ("gold", "Au"),
    ("iron", "Fe"),
    ("sodium", "Na"),
    ("silver", "Ag"),
    ("potassium", "K"),
    ("lead", "Pb"),
    ("copper", "Cu"),
    ("tin", "Sn"),
]
_WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "lemon",
    "piano",
    "garden",
    "rocket",
    "candle",
    "forest",
    "mirror",
]
_NAMES = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana"]
_CITIES = ["Lyon", "Osaka", "Porto", "Quito", "Turin", "Graz", "Leeds", "Perth"]


def _knowledge(rng: random.Random, level: int) -> tuple[str, str, str, str, dict]:
    if level == 2:
        name, sym = rng.choice(_ELEMENTS)
        q = f"What is the chemical symbol of {name}?"
        return q + " Answer with the symbol only.", q, sym, "contains", {}
    country, city = rng.choice(_CAPITALS_EASY if level == 1 else _CAPITALS_HARD)
    q = f"What is the capital of {country}?"
    return q + " Answer with the city name only.", q, city, "contains", {}


def _arithmetic(rng: random.Random, level: int) -> tuple[str, str, str, str, dict]:
    if level == 1:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        q, ans = f"What is {a} + {b}?", a + b
    elif level == 2:
        a, b = rng.randint(11, 49), rng.randint(3, 9)
        q, ans = f"What is {a} * {b}?", a * b
    else:
        name = rng.choice(_NAMES)
        a, b, c = rng.randint(5, 20), rng.randint(2, 6), rng.randint(1, 4)
        q = f"{name} has {a} apples, buys {b} bags of {c} apples each, then eats 3. How many apples are left?"
        ans = a + b * c - 3
    return q + " Give the final number only.", q, str(ans), "number", {}


def _format(rng: random.Random, level: int) -> tuple[str, str, str, str, dict]:
    if level == 1:
        w = rng.choice(_WORDS)
        q = f"Write the word '{w}' in capital letters."
        return q + " Reply with that word only.", q, w.upper(), "exact", {}
    if level == 2:
        ws = rng.sample(_WORDS, 3)
        q = f"List the words {', '.join(ws)} in reverse order, separated by commas."
        return q + " Reply with the list only.", q, ",".join(reversed(ws)), "list", {}
    name, age = rng.choice(_NAMES), rng.randint(20, 70)
    q = f'Write a JSON object with the key "name" set to "{name}" and the key "age" set to {age}.'
    return (
        q + " Reply with the JSON only.",
        q,
        json.dumps({"name": name, "age": age}),
        "json",
        {"object": {"name": name, "age": age}},
    )


def _extraction(rng: random.Random, level: int) -> tuple[str, str, str, str, dict]:
    name, city = rng.choice(_NAMES), rng.choice(_CITIES)
    if level == 1:
        text = f"{name} moved to {city} last spring and now works at a bakery."
        q = f"Text: {text}\nWhich city did {name} move to?"
        return q + " Answer with the city only.", q, city, "contains", {}
    if level == 2:
        user = name.lower() + str(rng.randint(10, 99))
        email = f"{user}@example.org"
        text = f"Please contact {name} at {email} or call the office in {city} before Friday."
        q = f"Text: {text}\nWhat is the email address in the text?"
        return q + " Answer with the address only.", q, email, "contains", {}
    n1, n2 = rng.randint(2, 9), rng.randint(10, 30)
    other = rng.choice([n for n in _NAMES if n != name])
    text = (
        f"{other} ordered {n2} pencils for the school in {city}. {name} ordered {n1} notebooks and "
        f"{n2 + n1} stamps. The delivery to {city} took {n1 + 2} days."
    )
    q = f"Text: {text}\nHow many notebooks did {name} order?"
    return q + " Answer with the number only.", q, str(n1), "number", {}


_FILLER = [
    "The weather in the valley was mild that year.",
    "Farmers planted wheat along the river banks.",
    "A small library opened near the old market.",
    "Children played football in the square after school.",
    "The train to the coast left every morning at seven.",
    "Local bakers sold bread with seeds and honey.",
    "An old bridge crossed the canal near the mill.",
    "Tourists visited the castle on the hill in summer.",
]


def _long_context(rng: random.Random, level: int) -> tuple[str, str, str, str, dict]:
    sentences = {1: 8, 2: 40, 3: 120}[level]
    name = rng.choice(_NAMES)
    code = str(rng.randint(1000, 9999))
    lines = [rng.choice(_FILLER) for _ in range(sentences)]
    lines.insert(rng.randint(0, sentences), f"The secret code of {name} is {code}.")
    doc = " ".join(lines)
    q = f"Document: {doc}\nWhat is the secret code of {name}?"
    return q + " Answer with the code only.", q, code, "number", {}


# (function name, signature, docstring, tests as (args, expected), reference body)
_CODE_TASKS: dict[int, list[tuple[str, str, str, list[tuple[str, Any]]]]] = {
    1: [
        ("add_numbers", "a, b", "Return the sum of a and b.", [("2, 3", 5), ("-1, 1", 0), ("10, 5", 15)]),
        ("double", "x", "Return x multiplied by 2.", [("4", 8), ("0", 0), ("-3", -6)]),
        ("is_even", "n", "Return True if n is even, else False.", [("4", True), ("7", False), ("0", True)]),
    ],
    2: [
        (
            "reverse_string",
            "s",
            "Return the string s reversed.",
            [("'abc'", "cba"), ("''", ""), ("'xy'", "yx")],
        ),
        (
            "count_vowels",
            "s",
            "Return the number of vowels (a, e, i, o, u) in the lowercase string s.",
            [("'banana'", 3), ("'sky'", 0), ("'queue'", 4)],
        ),
        (
            "sum_even",
            "xs",
            "Return the sum of the even numbers in the list xs.",
            [("[1, 2, 3, 4]", 6), ("[]", 0), ("[5]", 0)],
        ),
    ],
    3: [
        (
            "fibonacci",
            "n",
            "Return the n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == 1.",
            [("0", 0), ("1", 1), ("10", 55), ("20", 6765)],
        ),
        (
            "is_prime",
            "n",
            "Return True if n is a prime number, else False.",
            [("2", True), ("1", False), ("15", False), ("97", True)],
        ),
        (
            "second_largest",
            "xs",
            "Return the second largest distinct value in the list xs.",
            [("[3, 1, 4, 4]", 3), ("[10, 20]", 10), ("[5, 9, 7]", 7)],
        ),
    ],
}


def _code(rng: random.Random, level: int) -> tuple[str, str, str, str, dict]:
    name, sig, doc, tests = rng.choice(_CODE_TASKS[level])
    stub = f'def {name}({sig}):\n    """{doc}"""\n'
    instruction = f"Write a Python function `{name}({sig})`. {doc} Reply with the code only."
    return instruction, stub, name, "code", {"stub": stub, "tests": tests, "time_limit_s": CODE_TIME_LIMIT_S}


_GENERATORS = {
    "knowledge": _knowledge,
    "arithmetic": _arithmetic,
    "format": _format,
    "extraction": _extraction,
    "long_context": _long_context,
    "code": _code,
}

# fixed solved examples shown to a base model before the question (never drawn from the suite)
_SHOTS: dict[str, str] = {
    "knowledge": "Question: What is the capital of Portugal?\nAnswer: Lisbon\n\n"
    "Question: What is the chemical symbol of oxygen?\nAnswer: O\n\n",
    "arithmetic": "Question: What is 3 + 4?\nAnswer: 7\n\nQuestion: What is 12 * 3?\nAnswer: 36\n\n",
    "format": "Question: Write the word 'house' in capital letters.\nAnswer: HOUSE\n\n"
    "Question: List the words red, blue in reverse order, separated by commas.\nAnswer: blue,red\n\n",
    "extraction": "Question: Text: Mia lives in Oslo and works at a school.\n"
    "Which city does Mia live in?\nAnswer: Oslo\n\n",
    "long_context": "Question: Document: The sky was grey. The secret code of Ivo is 4821. Rain fell.\n"
    "What is the secret code of Ivo?\nAnswer: 4821\n\n",
}


def generate_suite(
    seed: int = 0,
    *,
    categories: tuple[str, ...] | list[str] = CATEGORIES,
    levels: tuple[int, ...] | list[int] = LEVELS,
    per_cell: int = 5,
) -> list[TaskItem]:
    """`per_cell` items for each category x level, the same for the same seed."""
    items: list[TaskItem] = []
    for cat in categories:
        if cat not in _GENERATORS:
            raise ValueError(f"unknown category {cat!r}; choose from {', '.join(CATEGORIES)}")
        for level in levels:
            if level not in LEVELS:
                raise ValueError(f"unknown level {level}; choose from {LEVELS}")
            # one stream per cell, so adding a category never changes another category's items
            rng = random.Random(f"{seed}:{cat}:{level}")
            for i in range(per_cell):
                instruction, question, answer, check, data = _GENERATORS[cat](rng, level)
                if cat == "code":
                    completion, stop, max_tokens = (
                        question,
                        ("\ndef ", "\nclass ", "\nif __name__", "\nprint("),
                        160,
                    )
                else:
                    completion = _SHOTS[cat] + f"Question: {question}\nAnswer:"
                    stop = ("\n",)
                    max_tokens = 48 if check == "json" else 24
                items.append(
                    TaskItem(
                        id=f"{cat}-L{level}-s{seed}-{i}",
                        category=cat,
                        level=level,  # type: ignore[arg-type]
                        instruction=instruction,
                        completion_prompt=completion,
                        answer=answer,
                        check=check,
                        max_tokens=max_tokens if cat != "code" else 200,
                        stop=stop,
                        data=data,
                    )
                )
    return items


def reference_output(item: TaskItem, mode: Mode = "chat") -> str:
    """A correct output for the item (for tests and for checking the checkers)."""
    if item.check == "code":
        body = _reference_code(item.answer)
        return f"```python\n{item.data['stub']}{body}```" if mode == "chat" else body
    if item.check == "json":
        return json.dumps(item.data["object"])
    if item.check == "list":
        return ", ".join(item.answer.split(","))
    return (" " if mode == "completion" else "") + item.answer


_REFERENCE_BODIES = {
    "add_numbers": "    return a + b\n",
    "double": "    return x * 2\n",
    "is_even": "    return n % 2 == 0\n",
    "reverse_string": "    return s[::-1]\n",
    "count_vowels": "    return sum(c in 'aeiou' for c in s)\n",
    "sum_even": "    return sum(x for x in xs if x % 2 == 0)\n",
    "fibonacci": "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "is_prime": "    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))\n",
    "second_largest": "    return sorted(set(xs))[-2]\n",
}


def _reference_code(name: str) -> str:
    return _REFERENCE_BODIES[name]
