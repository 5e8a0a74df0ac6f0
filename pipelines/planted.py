"""Planted recall for training sequences (``data.recall_mix``): facts stated early in a sequence and, at its very end, a
question about one of them with its answer. The scorer learns from the teacher's future attention, and plain
transcripts never ask for something said thousands of tokens earlier; a planted question makes that attention reach
far back.

A planted sequence of ``S`` tokens carries 1–3 facts (the count drawn uniformly) about different people and places,
all in one template, e.g. ``"By the way, Marisol's parcel was shipped to Lisbon."``, each starting at a position in
``[5 %, 50 %]`` of ``S`` (each on its own line, inserted between corpus tokens), and ends with the question about one
of them, e.g. ``"Question: Where was Marisol's parcel shipped?"`` / ``"Answer: Lisbon."``. The other facts are
distractors that only the name tells apart. The place is tokenized once, so the answer's tokens are exactly the fact's
(the answer is predictable by copying). The sequence keeps its ``S`` tokens: the corpus tokens just before the
question are dropped, so the gap between the facts and the question is long.

The format is disjoint from the evaluation's recall tasks (:mod:`pipelines.recall`): first names and cities, no
digits, no keys or words from :mod:`pipelines.recall.haystack`'s lists, no variable chains, no instruction to
remember anything (tests/test_recall_mix.py checks the vocabulary). Every draw comes from the ``random.Random`` it is
given.
"""
from __future__ import annotations

import math
import random

from pipelines.schema import ConfigError

NAMES = (
    "Marisol", "Tobias", "Ingrid", "Rafael", "Yusuf", "Leona", "Dmitri", "Priya", "Kofi", "Annika", "Mateo", "Sigrid",
    "Hamid", "Colette", "Esteban", "Fiona", "Gustav", "Halima", "Ignacio", "Imogen", "Kenji", "Lucinda", "Magnus",
    "Nadia", "Oskar", "Paloma", "Quentin", "Rosalind", "Soren", "Tamsin", "Ulrich", "Valeria", "Wendell", "Ximena",
    "Yara", "Zoltan", "Beatriz", "Cormac", "Delphine", "Emeka",
)
PLACES = (
    "Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Krakow", "Dublin", "Quito", "Seville", "Bergen", "Tbilisi", "Porto",
    "Valencia", "Helsinki", "Marseille", "Montreal", "Adelaide", "Cairo", "Istanbul", "Jakarta", "Kyoto", "Lyon",
    "Madrid", "Manila", "Munich", "Naples", "Prague", "Santiago", "Stockholm", "Tallinn", "Toronto", "Vienna", "Warsaw",
    "Zagreb", "Bogota", "Budapest", "Casablanca", "Edinburgh", "Geneva", "Havana",
)
# (the fact up to its place, the question): both name the person, the place is the answer
TEMPLATES = (
    ("By the way, {name}'s parcel was shipped to", "Where was {name}'s parcel shipped?"),
    ("Side note: {name} grew up in", "Where did {name} grow up?"),
    ("For the record, {name} moved last year to", "Where did {name} move last year?"),
)
FACT, FACT_END = "\n{fact}", ".\n"  # each fact on its own line
QUESTION, ANSWER_END = "\nQuestion: {question}\nAnswer:", "."  # the sequence's last tokens
MAX_FACTS = 3
SPAN = (0.05, 0.5)  # where a fact may start, as fractions of the sequence


class Planter:
    """Plants facts into sequences of ``seq_len`` tokens, every piece tokenized once with the data's tokenizer. Raises
    :class:`ConfigError` when ``seq_len`` is too short: ``MAX_FACTS`` of the longest facts must fit in the span and the
    longest question after it."""

    def __init__(self, tokenizer, seq_len: int):
        def encode(texts):
            return tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]

        pairs = [(t, n) for t in TEMPLATES for n in NAMES]
        self.facts = dict(zip(pairs, encode(FACT.format(fact=t[0].format(name=n)) for t, n in pairs)))
        self.questions = dict(zip(pairs, encode(QUESTION.format(question=t[1].format(name=n)) for t, n in pairs)))
        self.places = dict(zip(PLACES, encode(f" {p}" for p in PLACES)))
        self.fact_end, self.answer_end = encode([FACT_END, ANSWER_END])
        self.seq_len = seq_len
        self.first, self.last = math.ceil(SPAN[0] * seq_len), int(SPAN[1] * seq_len)
        place = max(map(len, self.places.values()))
        longest_fact = max(map(len, self.facts.values())) + place + len(self.fact_end)
        longest_question = max(map(len, self.questions.values())) + place + len(self.answer_end)
        if MAX_FACTS * longest_fact > self.last - self.first or longest_question > seq_len - self.last:
            raise ConfigError(f"data.recall_mix: data.seq_len={seq_len} is too short for {MAX_FACTS} planted facts "
                              f"of up to {longest_fact} tokens in [{SPAN[0]:.0%}, {SPAN[1]:.0%}] of the sequence and "
                              f"a question of up to {longest_question} tokens at its end: raise data.seq_len")

    def plant(self, ids: list[int], rng: random.Random) -> tuple[list[int], str]:
        """``ids`` with the facts and the question (see the module doc), and the name the question asks about."""
        template = rng.choice(TEMPLATES)
        count = rng.randint(1, MAX_FACTS)
        names, places = rng.sample(NAMES, count), rng.sample(PLACES, count)
        facts = [self.facts[template, n] + self.places[p] + self.fact_end for n, p in zip(names, places)]
        asked = rng.randrange(count)
        question = self.questions[template, names[asked]] + self.places[places[asked]] + self.answer_end
        # corpus offsets in [first, last - all facts]: with the facts before it, each fact then starts in [first, last]
        room = self.last - self.first - sum(map(len, facts))
        offsets = sorted(self.first + rng.randint(0, room) for _ in facts)
        out: list[int] = []
        taken = 0
        for offset, fact in zip(offsets, facts):
            out += ids[taken:offset] + fact
            taken = offset
        out += ids[taken:taken + self.seq_len - len(out) - len(question)]
        return out + question, names[asked]
