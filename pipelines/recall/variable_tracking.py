"""Variable tracking (RULER vt): a chain ``VAR AB = 12345. VAR CD = VAR AB. …`` of ``hops`` assignments after the
value, asked for the value of the chain's last variable.

The chain sits together at the spec's depth (its first assignment is the needle's start); a distractor chain of the
same length, other names and another value, sits at a seeded place anywhere, so a policy that kept only recent tokens
(or only the distractor) answers wrong. Needs every link of the chain: ``hops`` + 1 facts.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass

from pipelines.recall.base import Draft, Family, Insert
from pipelines.recall.haystack import magic_number
from pipelines.recall.niah import distinct


def chain(names: list[str], value: str) -> str:
    return " ".join([f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])])


@dataclass(frozen=True)
class VariableTracking(Family):
    hops: int = 1
    digits: int = 5

    def draft(self, rng: random.Random, spec) -> Draft:
        names = distinct(lambda: "".join(rng.choice(string.ascii_uppercase) for _ in range(2)), 2 * (self.hops + 1))
        values = distinct(lambda: magic_number(rng, self.digits), 2)
        asked, other = names[:self.hops + 1], names[self.hops + 1:]
        return Draft(
            instruction="Memorize and track the chain of variable assignments hidden in the following text.",
            inserts=(Insert(spec.depth, chain(asked, values[0]), needle=True),
                     Insert(rng.random(), chain(other, values[1]))),
            question=f"What is the value of VAR {asked[-1]}?",
            answer_prefix=f"The value of VAR {asked[-1]} is: ",
            answer=values[0])
