"""Generated English-like text for haystacks and distractors (no downloads), byte-level helpers."""

from __future__ import annotations

import torch

SUBJECTS = ["The old farmer", "A young student", "The tired doctor", "My neighbour", "The quiet painter",
            "A travelling merchant", "The city council", "Our teacher", "The small child", "A careful engineer"]
VERBS = ["carried", "painted", "repaired", "discovered", "borrowed", "described", "measured", "sold", "found",
         "cleaned"]
OBJECTS = ["a wooden chair", "the blue bicycle", "an ancient map", "the broken clock", "a basket of pears",
           "the heavy door", "a silver spoon", "the garden fence", "a paper kite", "the stone bridge"]
PLACES_TEXT = ["near the river", "before dawn", "in the village", "after the storm", "on a quiet street",
               "during the festival", "behind the market", "at the harbour", "under the old tree", "by the station"]
REPEATED_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
WORDS = ["apple", "river", "candle", "falcon", "marble", "violet", "harbor", "pepper", "saddle", "tunnel",
         "walnut", "zephyr", "lantern", "meadow", "copper", "orchid", "pebble", "quartz", "thistle", "velvet"]


def pick(items, generator: torch.Generator):
    return items[int(torch.randint(len(items), (1,), generator=generator))]


def sentence(generator: torch.Generator) -> str:
    return f"{pick(SUBJECTS, generator)} {pick(VERBS, generator)} {pick(OBJECTS, generator)} {pick(PLACES_TEXT, generator)}. "


def generated_text(n_bytes: int, generator: torch.Generator) -> str:
    """At least n_bytes of varied generated sentences."""
    parts, size = [], 0
    while size < n_bytes:
        parts.append(sentence(generator))
        size += len(parts[-1])
    return "".join(parts)


def repeated_text(n_bytes: int) -> str:
    return REPEATED_NOISE * (n_bytes // len(REPEATED_NOISE) + 1)


def to_bytes(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def insert_at_sentence(haystack: str, needle: str, depth: float) -> str:
    """Insert `needle` at a sentence boundary near fraction `depth` of the haystack."""
    cut = int(len(haystack) * depth)
    boundary = haystack.rfind(". ", 0, cut)
    cut = boundary + 2 if boundary >= 0 else 0
    return haystack[:cut] + needle + haystack[cut:]
