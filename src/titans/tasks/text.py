"""Generated English-like text for haystacks and distractors (nothing downloaded), and byte helpers.

All text here is ASCII, so one character is one byte and string lengths are token counts.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import torch

T = TypeVar("T")

SUBJECTS = ["The old farmer", "A young student", "The tired doctor", "My neighbour", "The quiet painter",
            "A travelling merchant", "The city council", "Our teacher", "The small child", "A careful engineer",
            "The baker", "An elderly sailor"]
VERBS = ["carried", "painted", "repaired", "discovered", "borrowed", "described", "measured", "sold", "found",
         "cleaned", "admired", "forgot"]
OBJECTS = ["a wooden chair", "the blue bicycle", "an ancient map", "the broken clock", "a basket of pears",
           "the heavy door", "a silver spoon", "the garden fence", "a paper kite", "the stone bridge",
           "a woollen scarf", "the copper kettle"]
SETTINGS = ["near the river", "before dawn", "in the village", "after the storm", "on a quiet street",
            "during the festival", "behind the market", "at the harbour", "under the old tree", "by the station",
            "late at night", "in early spring"]
SENTENCE_PARTS = (SUBJECTS, VERBS, OBJECTS, SETTINGS)
# RULER's "noise" haystack for the passkey task: the same few sentences over and over.
REPEATED_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
# Keys and values of the word-keyed needles: none of them occurs in the generated sentences.
WORDS = ["apple", "ribbon", "candle", "falcon", "marble", "violet", "harbor", "pepper", "saddle", "tunnel",
         "walnut", "zephyr", "lantern", "meadow", "quartz", "orchid", "pebble", "thistle", "velvet", "anchor",
         "beacon", "cactus", "dolphin", "ember", "fennel", "glacier", "hazel", "igloo", "jasmine", "kiwi",
         "lagoon", "mango", "nectar", "oyster", "parsley", "quiver", "raven", "sorrel", "tulip", "umber",
         "walrus", "yarrow", "badger", "cobalt", "dune", "ferret", "garnet", "heron", "indigo", "juniper"]


def pick(items: Sequence[T], generator: torch.Generator) -> T:
    """One item drawn uniformly."""
    return items[int(torch.randint(len(items), (1,), generator=generator))]


def generated_text(n_bytes: int, generator: torch.Generator) -> str:
    """At least n_bytes of varied generated sentences, ending at a sentence end (". ")."""
    shortest = sum(min(map(len, part)) for part in SENTENCE_PARTS) + len(SENTENCE_PARTS) + 1
    count = n_bytes // shortest + 1  # enough sentences even if every one is the shortest
    choice = torch.rand(count, len(SENTENCE_PARTS), generator=generator)
    sentences = []
    for row in choice.tolist():
        words = [part[int(u * len(part))] for u, part in zip(row, SENTENCE_PARTS)]
        sentences.append(" ".join(words) + ". ")
    return "".join(sentences)


def repeated_text(n_bytes: int) -> str:
    """At least n_bytes of RULER's repeated noise sentences, ending at a sentence end."""
    return REPEATED_NOISE * (n_bytes // len(REPEATED_NOISE) + 1)


def tail(text: str, n_bytes: int) -> str:
    """The last n_bytes of `text`: a window that may start mid-sentence but ends where `text` ends."""
    return text[len(text) - n_bytes :]


def insert_at_sentence(text: str, insert: str, depth: float) -> str:
    """Insert `insert` at the last sentence start at or before fraction `depth` of `text` (0 = front)."""
    cut = int(len(text) * depth)
    boundary = text.rfind(". ", 0, cut)
    cut = boundary + 2 if boundary >= 0 else 0
    return text[:cut] + insert + text[cut:]


def to_tokens(text: str) -> torch.Tensor:
    """[len(text)] long tensor of the text's bytes."""
    return torch.tensor(list(text.encode("ascii")), dtype=torch.long)
