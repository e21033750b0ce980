"""BABILong-style reasoning (Kuratov et al. 2024) with our own bAbI-like generator (Weston et al. 2015).

qa1 (single supporting fact): people move between rooms; "Where is Mary?" → the room of her last move.
qa2 (two supporting facts): people also pick up and drop objects; "Where is the apple?" → the room of
whoever holds it now, or the room where it was dropped.
qa3 (three supporting facts): the same world; "Where was the apple before the office?" → the room the object was in
before it last arrived where it is now (the take, the move that carried it there and the move before it).

Byte-level (vocabulary 256, no special tokens). The story's facts keep their order and are spread at
random sentence starts through generated distractor text (the tail of a longer text) so that the
whole sequence `context + question + answer` is exactly `length` bytes; only the answer is scored.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

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


class BabilongOptions(TaskOptions):
    qa: Literal[1, 2, 3] = 1  # single, two, three supporting facts
    # facts in the story (qa2 and qa3 add one opening move per person, and up to two closing facts)
    num_facts: int = Field(6, ge=1)


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


class World:
    """People moving between rooms and carrying objects (qa2, qa3): where everyone and everything is, and the rooms
    each object has been in, in order (a room is added when the object arrives somewhere new)."""

    def __init__(self, g: torch.Generator):
        self.g = g
        self.where = {p: pick(ROOMS, g) for p in PEOPLE}
        self.facts = [move(p, self.where[p], g) for p in PEOPLE]
        self.holder: dict[str, str] = {}  # object -> person holding it
        self.dropped_in: dict[str, str] = {}  # object -> room it lies in
        self.trail: dict[str, list[str]] = {}  # object -> rooms it has been in, once touched

    def arrive(self, thing: str, room: str) -> None:
        trail = self.trail.setdefault(thing, [])
        if not trail or trail[-1] != room:
            trail.append(room)

    def move(self, person: str, room: str) -> None:
        self.where[person] = room
        self.facts.append(move(person, room, self.g))
        for thing, holder in self.holder.items():
            if holder == person:
                self.arrive(thing, room)

    def take(self, person: str, thing: str) -> None:
        self.holder[thing] = person  # a held object's place is its holder's, whatever dropped_in says
        self.arrive(thing, self.where[person])
        self.facts.append(f"{person} {pick(TAKE_VERBS, self.g)} the {thing}. ")

    def drop(self, person: str, thing: str) -> None:
        del self.holder[thing]
        self.dropped_in[thing] = self.where[person]
        self.facts.append(f"{person} {pick(DROP_VERBS, self.g)} the {thing}. ")

    def act(self) -> None:
        """One random feasible action of a random person: move, take a free object, drop a held one."""
        person = pick(PEOPLE, self.g)
        free = [o for o in OBJECTS if o not in self.holder]
        held = [o for o, h in self.holder.items() if h == person]
        action = pick(["move"] + ["take"] * bool(free) + ["drop"] * bool(held), self.g)
        if action == "move":
            self.move(person, pick(ROOMS, self.g))
        elif action == "take":
            self.take(person, pick(free, self.g))
        else:
            self.drop(person, pick(held, self.g))

    def place(self, thing: str) -> str:
        return self.where[self.holder[thing]] if thing in self.holder else self.dropped_in[thing]


def story_qa2(num_facts: int, g: torch.Generator) -> tuple[list[str], str, str]:
    """(facts, question, answer): everyone first goes somewhere, then num_facts random actions; ask where an object
    someone has touched is now."""
    world = World(g)
    for _ in range(num_facts):
        world.act()
    if not world.trail:  # nobody took anything: end with a take so there is something to ask about
        world.take(pick(PEOPLE, g), pick(OBJECTS, g))
    thing = pick(sorted(world.trail), g)
    return world.facts, f"Where is the {thing}? {ANSWER_PROMPT}", world.place(thing)


def story_qa3(num_facts: int, g: torch.Generator) -> tuple[list[str], str, str]:
    """(facts, question, answer): qa2's world; ask where an object was before the room it last arrived in. When no
    object has been in two rooms, the story ends with someone taking one and carrying it to another room."""
    world = World(g)
    for _ in range(num_facts):
        world.act()
    moved = sorted(t for t, trail in world.trail.items() if len(trail) >= 2)
    if not moved:
        held = sorted(world.holder)
        if held:
            thing = pick(held, g)
        else:
            thing = pick(OBJECTS, g)
            world.take(pick(PEOPLE, g), thing)
        here = world.where[world.holder[thing]]
        world.move(world.holder[thing], pick([r for r in ROOMS if r != here], g))
        moved = [thing]
    thing = pick(moved, g)
    before, last = world.trail[thing][-2:]
    return world.facts, f"Where was the {thing} before the {last}? {ANSWER_PROMPT}", before


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
        elif self.options.qa == 2:
            # the opening moves, the actions, and a closing take when nothing was touched
            most_facts, question = len(PEOPLE) + self.options.num_facts + 1, f"Where is the {thing}? {ANSWER_PROMPT}"
        else:  # the opening moves, the actions, and a closing take and move when no object has been in two rooms
            most_facts = len(PEOPLE) + self.options.num_facts + 2
            question = f"Where was the {thing} before the {room}? {ANSWER_PROMPT}"
        fact = max(f"{person} {longest(MOVE_VERBS)} the {room}. ",
                   f"{person} {longest(TAKE_VERBS + DROP_VERBS)} the {thing}. ", key=len)
        return most_facts * len(fact) + len(question) + len(room)

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        story = (story_qa1, story_qa2, story_qa3)[self.options.qa - 1]
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
