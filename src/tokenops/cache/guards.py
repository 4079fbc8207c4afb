"""Guards that veto a semantic hit: two prompts close in embedding space must still agree on their
numbers, their negations and their named entities before one's answer is served for the other.

Sentence embeddings are nearly blind to exactly the words that flip an answer: "convert 3 miles" and
"convert 30 miles", "is X safe" and "is X not safe", "capital of France" and "capital of Spain" score
0.8-0.95 with MiniLM. Each guard extracts a cheap, deterministic signature from a prompt and the two
signatures must be equal:

- numbers: every numeric token, normalised (digits with separators, decimals, ordinals like "3rd", and
  number words up to the billions: "three" == "3", "twenty-five" == "25", "a dozen" == "12");
- negations: the multiset of negation cues (not, no, never, n't, without, none, nothing, neither, nor,
  cannot, ...): presence and count must agree;
- entities: capitalised words inside a sentence and words with inner capitals (NASA, iPhone), case-folded;
  each prompt's entities must appear among the other prompt's words, so "paris" still matches "Paris".
  A capitalised first word that is not a common starter is a weak candidate: it vetoes only when both
  prompts have one the other lacks (a substitution), not when a paraphrase adds "Roughly" or "Compose".

A guard errs towards a miss: a miss costs one backend call, a false hit a wrong answer. This module
does not embed or search; `semantic.py` calls `agree` on each candidate.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

ALL_GUARDS = ("numbers", "negations", "entities")

_UNITS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
    "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14,
    "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19,
}  # fmt: skip
_TENS = {
    "twenty": 20,
    "thirty": 30,
    "forty": 40,
    "fifty": 50,
    "sixty": 60,
    "seventy": 70,
    "eighty": 80,
    "ninety": 90,
}
_SCALES = {
    "hundred": 100,
    "thousand": 1_000,
    "million": 1_000_000,
    "billion": 1_000_000_000,
    "trillion": 10**12,
}
_ORDINALS = {
    "first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7, "eighth": 8,
    "ninth": 9, "tenth": 10, "eleventh": 11, "twelfth": 12, "twentieth": 20, "hundredth": 100,
}  # fmt: skip
_MISC = {
    "dozen": 12,
    "half": 0.5,
    "twice": 2,
    "double": 2,
    "triple": 3,
    "thrice": 3,
    "quarter": 0.25,
    "couple": 2,
}

_NEGATIONS = frozenset(
    {"not", "no", "never", "without", "none", "nothing", "nobody", "nowhere", "neither", "nor", "cannot",
     "except", "excluding", "lack", "lacks", "lacking", "non", "unless"}
)  # fmt: skip

# "dont", "isnt": contractions typed without the apostrophe
_NT_WITHOUT_APOSTROPHE = frozenset(
    (
        "dont doesnt didnt isnt arent wasnt werent cant couldnt shouldnt wouldnt wont hasnt havent "
        "hadnt aint mustnt"
    ).split()
)

# capitalised words that start sentences without naming anything (question words, pronouns, verbs of
# request); a capitalised sentence-initial word outside this list is taken for an entity
_STARTERS = frozenset(
    """what whats what's how hows how's why when where who whom whose which is are was were am be can could
    should would will shall may might must do does did done has have had please tell give explain list
    write i i'm im the a an my our your his her their its it it's this that these those there here if in
    on at for of to from by with about as and or but so then also any all some each every no not never
    translate summarize summarise describe define compare show find convert calculate compute make help
    let name suggest recommend create generate provide say share check count choose pick is isn't don't
    doesn't can't we you he she they me us them yes ok okay hi hello hey thanks thank could would
    quick short brief simple now today tomorrow yesterday again just only even still really very
    before after during while since until between into over under using use get go know need want like
    one two three four five six seven eight nine ten first second third next last other another many much
    few more most less least best worst good bad new old big small compose draft outline rewrite fix debug
    implement sort plan estimate predict improve identify classify answer solve prove derive roughly
    approximately about briefly kindly hey dear question quick""".split()
)

# a leading minus belongs to the number unless it joins a word ("-19" vs "COVID-19", "3-5")
_WORD = re.compile(
    r"[A-Za-z][A-Za-z'’\-]*|(?:(?<![A-Za-z0-9\-])-)?\d[\d,]*(?:\.\d+)?(?:st|nd|rd|th)?|[.!?;:\n]"
)
_NUM = re.compile(r"^(-?\d[\d,]*(?:\.\d+)?)(?:st|nd|rd|th)?$")
_SIGN_WORDS = frozenset({"minus", "negative"})


def _canon(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _tokens(text: str) -> list[str]:
    return _WORD.findall(text.replace("’", "'"))


def _fold(word: str) -> str:
    """Case-folded, without surrounding quotes or a possessive ("Tokyo's" -> "tokyo")."""
    w = word.lower().strip("'-")
    return w[:-2] if w.endswith("'s") else w


def numbers(text: str) -> list[str]:
    """Sorted canonical forms of every number in the text ("3", "three" and "3rd" all give "3")."""
    out: list[str] = []
    words = [w.lower() for w in _tokens(text)]
    total: float | None = None  # the number-word phrase being read ("two hundred and five")
    current = 0.0
    sign = 1  # -1 after "minus" / "negative"

    def flush() -> None:
        nonlocal total, current, sign
        if total is not None:
            out.append(_canon(sign * (total + current)))
            sign = 1
        total, current = None, 0.0

    for i, w in enumerate(words):
        m = _NUM.match(w)
        if m:
            flush()
            raw = m.group(1).replace(",", "")
            try:
                out.append(_canon(sign * float(raw)))
            except ValueError:
                out.append(raw)
            sign = 1
            continue
        if w in _SIGN_WORDS:
            flush()
            sign = -1
            continue
        parts = [p for p in w.split("-") if p]
        if parts and all(p in _UNITS or p in _TENS or p in _SCALES or p in _ORDINALS for p in parts):
            for p in parts:
                if total is None:
                    total = 0.0
                if p in _UNITS or p in _TENS or p in _ORDINALS:
                    current += _UNITS.get(p) or _TENS.get(p) or _ORDINALS.get(p) or 0
                else:  # a scale word multiplies what came before it ("three hundred", "a hundred")
                    scale = _SCALES[p]
                    current = (current or 1) * scale
                    if scale >= 1000:
                        total += current
                        current = 0.0
            continue
        if (
            w == "and"
            and total is not None
            and i + 1 < len(words)
            and (words[i + 1] in _UNITS or words[i + 1] in _TENS)
        ):
            continue  # "two hundred and five"
        if w in _MISC:
            flush()
            out.append(_canon(_MISC[w]))
            continue
        flush()
        sign = 1
    flush()
    return sorted(out)


def negations(text: str) -> int:
    """How many negation cues the text holds; all count alike ("n't", "not", "no", "without", ...), so
    "no sugar" and "without sugar" agree while "with sugar" and "without sugar" do not."""
    count = 0
    for w in _tokens(text):
        lw = w.lower()
        if lw.endswith("n't") or lw in _NT_WITHOUT_APOSTROPHE or lw in _NEGATIONS:
            count += 1
    return count


def entities(text: str) -> tuple[set[str], set[str]]:
    """Case-folded named-entity candidates as (strong, weak): strong ones are capitalised inside a
    sentence or have inner capitals (NASA, iPhone); weak ones are capitalised sentence starters that are
    not common starters ("Paris is ..." but also "Roughly how ...")."""
    strong: set[str] = set()
    weak: set[str] = set()
    sentence_start = True
    for w in _tokens(text):
        if w in ".!?;:\n":
            sentence_start = True
            continue
        if not w[0].isalpha():
            sentence_start = False
            continue
        lw = _fold(w)
        if lw and lw not in ("i", "i'm", "i've", "i'll", "i'd"):
            if any(c.isupper() for c in w[1:]) or (w[0].isupper() and not sentence_start):
                strong.add(lw)
            elif w[0].isupper() and lw not in _STARTERS:
                weak.add(lw)
        sentence_start = False
    return strong, weak - strong


@dataclass(frozen=True, slots=True)
class Signature:
    """The guard-relevant facts of one prompt, computed once and kept with its cache entry."""

    numbers: tuple[str, ...]
    negations: int
    entities: frozenset[str]  # strong candidates: each must appear among the other prompt's words
    weak_entities: frozenset[str]  # sentence starters: only a substitution on both sides vetoes
    words: frozenset[str]  # every case-folded word, for the containment tests

    @classmethod
    def of(cls, text: str) -> Signature:
        words = frozenset(_fold(w) for w in _tokens(text) if w[0].isalpha())
        strong, weak = entities(text)
        return cls(
            numbers=tuple(numbers(text)),
            negations=negations(text),
            entities=frozenset(strong),
            weak_entities=frozenset(weak),
            words=words,
        )


def disagreement(a: Signature, b: Signature, guards: Iterable[str] = ALL_GUARDS) -> str | None:
    """The first guard that vetoes serving one prompt's answer for the other, or None if all agree."""
    for g in guards:
        if g == "numbers" and a.numbers != b.numbers:
            return "numbers"
        if g == "negations" and a.negations != b.negations:
            return "negations"
        if g == "entities":
            if not (a.entities <= b.words and b.entities <= a.words):
                return "entities"
            # "Paris: weather?" vs "London: weather?": each has a starter the other lacks; "Roughly how
            # many people live in Lima?" vs "How many people live in Lima?" adds one on one side only
            if (a.weak_entities - b.words) and (b.weak_entities - a.words):
                return "entities"
    return None


def agree(a: str, b: str, guards: Iterable[str] = ALL_GUARDS) -> bool:
    """Whether two prompts agree on every guard (convenience for tests and tools)."""
    return disagreement(Signature.of(a), Signature.of(b), guards) is None
