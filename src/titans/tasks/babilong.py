"""BABILong-style reasoning (Kuratov et al. 2024) with our own bAbI-like generator (Weston et al. 2015).

qa1 (single supporting fact): people move between rooms; "Where is Mary?" → the room of her last move.
qa2 (two supporting facts): people also pick up and drop objects; "Where is the apple?" → the room of
whoever holds it now, or the room where it was dropped.

Byte-level (vocabulary 256, no special tokens). The story's facts keep their order and are spread at
random sentence starts through generated distractor text (the tail of a longer text) so that the
whole sequence `context + question + answer` is exactly `length` bytes; only the answer is scored.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import Task, TaskOptions, TokenBatch, answer_targets, register
from .text import generated_text, pick, tail, to_tokens

PEOPLE = ["Mary", "John", "Sandra", "Daniel"]
ROOMS = ["kitchen", "garden", "office", "bathroom", "hallway", "bedroom"]
OBJECTS = ["apple", "football", "milk"]
MOVE_VERBS = ["went to", "moved to", "journeyed to", "travelled to", "went back to"]
TAKE_VERBS = ["picked up", "grabbed", "got", "took"]
DROP_VERBS = ["dropped", "put down", "discarded", "left"]
ANSWER_PROMPT = "Answer: "


def longest(items: list[str]) -> str:
    return max(items, key=len)


@dataclasses.dataclass
class BabilongOptions(TaskOptions):
    qa: int = 1  # 1: single supporting fact, 2: two supporting facts
    num_facts: int = 6  # facts in the story (qa2 adds one opening move per person)

    def validate(self) -> None:
        if self.qa not in (1, 2):
            raise ValueError(f"qa must be 1 or 2, got {self.qa}")
        if self.num_facts < 1:
            raise ValueError(f"num_facts must be >= 1, got {self.num_facts}")


def move(person: str, room: str, g: torch.Generator) -> str:
    return f"{person} {pick(MOVE_VERBS, g)} the {room}. "


def story_qa1(num_facts: int, g: torch.Generator) -> tuple[list[str], str, str]:
    """(facts, question, answer): moves only; ask for someone who moved."""
    where: dict[str, str] = {}
    facts = []
    for _ in range(num_facts):
        person, room = pick(PEOPLE, g), pick(ROOMS, g)
        where[person] = room
        facts.append(move(person, room, g))
    person = pick(sorted(where), g)
    return facts, f"Where is {person}? {ANSWER_PROMPT}", where[person]


def story_qa2(num_facts: int, g: torch.Generator) -> tuple[list[str], str, str]:
    """(facts, question, answer): everyone first goes somewhere, then num_facts random feasible
    actions (move, take a free object, drop a held one); ask for an object someone has touched."""
    where = {p: pick(ROOMS, g) for p in PEOPLE}
    facts = [move(p, where[p], g) for p in PEOPLE]
    holder: dict[str, str] = {}  # object -> person holding it
    dropped_in: dict[str, str] = {}  # object -> room it lies in
    for _ in range(num_facts):
        person = pick(PEOPLE, g)
        free = [o for o in OBJECTS if o not in holder]
        held = [o for o, h in holder.items() if h == person]
        actions = ["move"] + ["take"] * bool(free) + ["drop"] * bool(held)
        action = pick(actions, g)
        if action == "move":
            where[person] = pick(ROOMS, g)
            facts.append(move(person, where[person], g))
        elif action == "take":
            thing = pick(free, g)
            holder[thing] = person  # a held object's place is its holder's, whatever dropped_in says
            facts.append(f"{person} {pick(TAKE_VERBS, g)} the {thing}. ")
        else:
            thing = pick(held, g)
            del holder[thing]
            dropped_in[thing] = where[person]
            facts.append(f"{person} {pick(DROP_VERBS, g)} the {thing}. ")
    touched = sorted(set(holder) | set(dropped_in))
    if not touched:  # nobody took anything: end with a take so there is something to ask about
        person, thing = pick(PEOPLE, g), pick(OBJECTS, g)
        holder[thing] = person
        facts.append(f"{person} {pick(TAKE_VERBS, g)} the {thing}. ")
        touched = [thing]
    thing = pick(touched, g)
    answer = where[holder[thing]] if thing in holder else dropped_in[thing]
    return facts, f"Where is the {thing}? {ANSWER_PROMPT}", answer


@register
class Babilong(Task):
    name = "babilong"
    Options = BabilongOptions
    vocab_size = 256
    byte_level = True

    def min_length(self) -> int:
        """The longest possible story, question and answer, with no distractor text."""
        person, room, thing = longest(PEOPLE), longest(ROOMS), longest(OBJECTS)
        if self.options.qa == 1:
            most_facts, question = self.options.num_facts, f"Where is {person}? {ANSWER_PROMPT}"
        else:
            # the opening moves, the actions, and a closing take when nothing was touched
            most_facts, question = len(PEOPLE) + self.options.num_facts + 1, f"Where is the {thing}? {ANSWER_PROMPT}"
        fact = max(f"{person} {longest(MOVE_VERBS)} the {room}. ",
                   f"{person} {longest(TAKE_VERBS + DROP_VERBS)} the {thing}. ", key=len)
        return most_facts * len(fact) + len(question) + len(room)

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        story = story_qa1 if self.options.qa == 1 else story_qa2
        rows, targets = [], []
        for _ in range(batch_size):
            facts, question, answer = story(self.options.num_facts, generator)
            room = length - sum(map(len, facts)) - len(question) - len(answer)
            distractor = tail(generated_text(room, generator), room)
            # each fact goes to the last sentence start at or before its random cut, keeping the order
            cuts = torch.randint(0, room + 1, (len(facts),), generator=generator).sort().values.tolist()
            pieces, last = [], 0
            for cut, fact in zip(cuts, facts):
                boundary = distractor.rfind(". ", last, cut)
                cut = boundary + 2 if boundary >= 0 else last
                pieces += [distractor[last:cut], fact]
                last = cut
            rows.append(to_tokens("".join(pieces) + distractor[last:] + question + answer))
            targets.append(answer_targets(rows[-1], len(answer)))
        return TokenBatch(torch.stack(rows), torch.stack(targets))
