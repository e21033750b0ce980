"""BABILong-style reasoning (Kuratov et al. 2024) with our own bAbI-like generator (Weston et al. 2015).

qa1 (single supporting fact): "Mary went to the kitchen." … "Where is Mary?" → the person's last place.
qa2 (two supporting facts): people pick up and drop objects and move; "Where is the apple?" → where the
object is now (with its holder, or where it was dropped). The facts are spread at random positions
through generated distractor sentences filling `length` bytes; only the answer is scored.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import Config
from .base import Task, TokenBatch, register
from .needle import answer_targets
from .text import generated_text, pick, to_bytes

PEOPLE = ["Mary", "John", "Sandra", "Daniel"]
ROOMS = ["kitchen", "garden", "office", "bathroom", "hallway", "bedroom"]
THINGS = ["apple", "football", "milk"]


@dataclasses.dataclass
class BabilongOptions(Config):
    qa: int = 1  # 1: single supporting fact, 2: two supporting facts
    num_facts: int = 6

    def validate(self) -> None:
        if self.qa not in (1, 2):
            raise ValueError(f"qa must be 1 or 2, got {self.qa}")
        if self.num_facts < 1:
            raise ValueError(f"num_facts must be >= 1, got {self.num_facts}")


def story_qa1(n: int, g: torch.Generator) -> tuple[list[str], str, str]:
    where: dict[str, str] = {}
    facts = []
    for _ in range(n):
        person, room = pick(PEOPLE, g), pick(ROOMS, g)
        where[person] = room
        facts.append(f"{person} went to the {room}. ")
    person = pick(sorted(where), g)
    return facts, f"Where is {person}? Answer: ", where[person]


def story_qa2(n: int, g: torch.Generator) -> tuple[list[str], str, str]:
    where = {p: pick(ROOMS, g) for p in PEOPLE}
    facts = [f"{p} went to the {where[p]}. " for p in PEOPLE]
    holder: dict[str, str] = {}
    place: dict[str, str] = {}
    for _ in range(n):
        person = pick(PEOPLE, g)
        action = int(torch.randint(3, (1,), generator=g))
        held = [t for t, h in holder.items() if h == person]
        if action == 0:  # move
            where[person] = pick(ROOMS, g)
            facts.append(f"{person} went to the {where[person]}. ")
        elif action == 1 or not held:  # pick up something nobody holds
            free = [t for t in THINGS if t not in holder]
            if not free:
                continue
            thing = pick(free, g)
            holder[thing] = person
            facts.append(f"{person} picked up the {thing}. ")
        else:  # drop
            thing = pick(held, g)
            del holder[thing]
            place[thing] = where[person]
            facts.append(f"{person} dropped the {thing}. ")
    known = sorted(set(holder) | set(place))
    if not known:  # guarantee a question: someone picks something up
        person, thing = pick(PEOPLE, g), pick(THINGS, g)
        holder[thing] = person
        facts.append(f"{person} picked up the {thing}. ")
        known = [thing]
    thing = pick(known, g)
    answer = where[holder[thing]] if thing in holder else place[thing]
    return facts, f"Where is the {thing}? Answer: ", answer


@register
class Babilong(Task):
    name = "babilong"
    Options = BabilongOptions
    vocab_size = 256

    def min_length(self) -> int:
        return 60 * (self.options.num_facts + 4)

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        self.check_length(length)
        story = story_qa1 if self.options.qa == 1 else story_qa2
        rows, targets = [], []
        for _ in range(batch_size):
            facts, question, answer = story(self.options.num_facts, generator)
            room = length - sum(map(len, facts)) - len(question) - len(answer)
            if room < 0:
                raise ValueError(f"length {length} is too short for {len(facts)} facts; raise length")
            filler = generated_text(room, generator)[:room]
            # spread the facts, in order, at sentence boundaries of the distractor text
            cuts = sorted(int(c) for c in torch.randint(0, room + 1, (len(facts),), generator=generator))
            pieces, last = [], 0
            for cut, fact in zip(cuts, facts):
                boundary = filler.rfind(". ", last, cut)
                cut = boundary + 2 if boundary >= last else last
                pieces += [filler[last:cut], fact]
                last = cut
            text = "".join(pieces) + filler[last:] + question + answer
            rows.append(to_bytes(text))
            targets.append(answer_targets(rows[-1], len(answer)))
        return TokenBatch(torch.stack(rows), torch.stack(targets))
