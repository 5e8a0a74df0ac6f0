"""Common-word extraction (RULER cwe, aggregation): a long list of words in which one word is the most common, and
its occurrences are packed into a region around the spec's depth; asked for the most common word.

The filler is the list itself (:data:`~pipelines.recall.haystack.WORD_LIST`) without the answer. The answer occurs
``2e + 4·sqrt(e) + 6`` times, where ``e`` is the expected count of any other word at this length — far more than
any of them reaches — all within ``spread`` of the depth, so the count that decides the answer can only be made
where the region is still in the cache (a recent window sees ordinary words only).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterator

from pipelines.recall.base import Draft, Family, Insert
from pipelines.recall.haystack import WORDS

TOKENS_PER_WORD = 2  # " apple" + ","


@dataclass(frozen=True)
class CommonWords(Family):
    spread: float = 0.05  # the answer's occurrences lie within depth ± spread (fractions of the list)

    def draft(self, rng: random.Random, spec) -> Draft:
        word = rng.choice(WORDS)
        expected = max(1.0, spec.context / TOKENS_PER_WORD / (len(WORDS) - 1))
        count = math.ceil(2 * expected + 4 * math.sqrt(expected) + 6)
        low, high = max(0.0, spec.depth - self.spread), min(1.0, spec.depth + self.spread)
        places = sorted(rng.random() for _ in range(count))
        return Draft(
            instruction="Below is a list of words. One word appears more often than any other word in the list.",
            inserts=tuple(Insert(low + (high - low) * p, word, needle=True) for p in places),
            question="Which word appears most often in the list?",
            answer_prefix="The word that appears most often is:",
            answer=f" {word}")

    def filler(self, rng: random.Random, draft: Draft) -> Iterator[str]:
        others = [w for w in WORDS if w != draft.answer.strip()]
        while True:
            yield rng.choice(others)
