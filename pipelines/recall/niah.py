"""Needle in a haystack (RULER niah): "The special magic number for <key> is: <value>." hidden at the spec's depth.

``keys = 1`` is RULER's niah_single; with ``keys > 1`` (multi-key) the other needles name other keys with other
values at seeded places anywhere in the haystack, so a policy that kept the wrong needle answers a wrong number. The
question and the reply's start name the key only; the gold continuation is the value's digits.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from pipelines.recall.base import Draft, Family, Insert
from pipelines.recall.haystack import key_phrase, magic_number


def distinct(draw, count: int) -> list:
    """``count`` different values of ``draw()``, in the order first drawn."""
    out: list = []
    while len(out) < count:
        value = draw()
        if value not in out:
            out.append(value)
    return out


@dataclass(frozen=True)
class Needles(Family):
    keys: int = 1
    digits: int = 7

    def draft(self, rng: random.Random, spec) -> Draft:
        keys = distinct(lambda: key_phrase(rng), self.keys)
        values = distinct(lambda: magic_number(rng, self.digits), self.keys)
        needles = [f"The special magic number for {k} is: {v}." for k, v in zip(keys, values)]
        inserts = [Insert(spec.depth, needles[0], needle=True)]
        inserts += [Insert(rng.random(), text) for text in needles[1:]]
        hidden = "A special magic number is" if self.keys == 1 else "Some special magic numbers are"
        return Draft(
            instruction=(f"{hidden} hidden within the following text. Make sure to memorize "
                         f"{'it' if self.keys == 1 else 'them'}. I will quiz you about it afterwards."),
            inserts=tuple(inserts),
            question=f"What is the special magic number for {keys[0]} mentioned in the provided text?",
            answer_prefix=f"The special magic number for {keys[0]} is: ",
            answer=values[0])
