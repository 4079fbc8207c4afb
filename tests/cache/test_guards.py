"""The guards' signatures: numbers (digits, words, ordinals), negation counts, entity candidates."""

from __future__ import annotations

import pytest

from tokenops.cache.guards import agree, entities, negations, numbers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Convert 3 miles to km", ["3"]),
        ("convert three miles to km", ["3"]),
        ("What is 1,000.50 plus twenty-five?", ["1000.5", "25"]),
        ("two hundred and five people", ["205"]),
        ("one hundred thousand three hundred", ["100300"]),
        ("a dozen eggs", ["12"]),
        ("the 3rd of May 2024", ["2024", "3"]),
        ("the third of May", ["3"]),
        ("3.0 and 3", ["3", "3"]),
        ("What is -19 degrees Celsius?", ["-19"]),
        ("minus nineteen degrees", ["-19"]),
        ("COVID-19 and pages 3-5", ["19", "3", "5"]),
        ("no numbers here", []),
    ],
)
def test_numbers(text, expected):
    assert numbers(text) == expected


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("I like it", 0),
        ("I don't like it", 1),
        ("I do not like it", 1),
        ("I dont like it", 1),
        ("coffee without sugar", 1),
        ("no sugar and never milk", 2),
        ("It cannot be done", 1),
        ("nothing, nobody, neither nor", 4),
    ],
)
def test_negations(text, count):
    assert negations(text) == count


def test_entities():
    assert entities("What is the capital of France?") == ({"france"}, set())
    assert entities("What's Tokyo's population?") == ({"tokyo"}, set())
    assert entities("Paris: what is the weather") == (set(), {"paris"})  # a sentence starter: weak
    assert entities("Tell me about NASA and the iPhone. Then Apple stock.") == (
        {"nasa", "iphone", "apple"},
        set(),
    )
    assert entities("Lima or Quito?") == ({"quito"}, {"lima"})
    assert entities("How do I make pasta? I want it quick.") == (set(), set())


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("How far is 3 miles in km?", "How many km are three miles?"),
        ("What's the weather in Paris?", "whats the weather like in paris"),
        ("I don't want sugar in my coffee", "no sugar in my coffee please"),
        ("Explain recursion simply", "Can you explain recursion in simple terms?"),
        ("Roughly how many inhabitants does Lima have?", "How many people live in Lima?"),
        ("Compose a haiku on the moon.", "Can you write me a haiku about the moon?"),
    ],
)
def test_paraphrases_agree(a, b):
    assert agree(a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("How far is 3 miles in km?", "How far is 30 miles in km?"),
        ("Convert 2.5 kg to pounds", "Convert 25 kg to pounds"),
        ("List five fruits", "List six fruits"),
        ("Is coffee bad for you?", "Is coffee not bad for you?"),
        ("Recipes with gluten", "Recipes without gluten"),
        ("What is the capital of France?", "What is the capital of Spain?"),
        ("Summarise the history of Microsoft", "Summarise the history of Apple"),
        ("Who founded Tesla?", "who founded spacex"),
        ("Paris: weather today?", "London: weather today?"),
        ("What is -19 degrees Celsius in Fahrenheit?", "What is 19 degrees Celsius in Fahrenheit?"),
    ],
)
def test_hard_negatives_disagree(a, b):
    assert not agree(a, b)
