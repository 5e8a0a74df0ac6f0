"""What the facts hide in, and the words they are made of: fixed lists in this file, so that every sample is the same
on every machine and Python version (drawn only through a seeded ``random.Random``, never ``hash()`` or set order).

* ``REPEAT`` — RULER's noise haystack: five plain sentences repeated ("The grass is green. …").
* ``ESSAY`` — essay-like filler: plain English sentences drawn at random (no digits, no names, no colons).
* ``WORD_LIST`` — a comma-separated list of words drawn uniformly from ``WORDS`` (for aggregation tasks).
* ``WORDS`` — single-token English nouns for keys and word lists; ``ADJECTIVES`` for keys.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")

ESSAY_SENTENCES = (
    "The morning train was quiet, and most passengers read or looked out of the window.",
    "A small bakery on the corner sells bread that is still warm at dawn.",
    "Rivers shape valleys slowly, carrying sand and stones towards the sea.",
    "The library keeps old maps in a cool room on the top floor.",
    "Gardeners often plant beans next to corn because the two help each other grow.",
    "The committee met again and agreed to postpone the decision until spring.",
    "On clear nights the sky above the hills is full of faint stars.",
    "A good kettle boils water quickly and keeps the handle cool.",
    "The old bridge was repaired last summer with stone from a nearby quarry.",
    "Many birds fly south when the days grow short and the air turns cold.",
    "The museum added a new hall for paintings of ships and harbours.",
    "Fresh snow muffles sound, so a winter forest can feel very still.",
    "The cook tasted the soup, added a pinch of salt, and stirred it again.",
    "Farmers watch the clouds closely during the weeks before the harvest.",
    "The village square has a fountain where children play in the afternoon.",
    "Most of the letters in the box were written in careful, slanted handwriting.",
    "A lighthouse guides ships away from the rocks along the northern coast.",
    "The teacher drew a large circle on the board and asked a simple question.",
    "Wooden floors creak more in dry weather than in damp weather.",
    "The market opens early, and the best fruit is usually gone by noon.",
    "A gentle wind moved the curtains while the house slowly grew warm.",
    "Bees visit many flowers in a single trip before returning to the hive.",
    "The path through the woods is marked with small painted stones.",
    "Some people prefer tea in the morning and coffee later in the day.",
    "The orchestra tuned their instruments while the audience found their seats.",
    "Rain on a tin roof makes a steady sound that many find relaxing.",
    "The shop on the hill repairs bicycles, clocks and old radios.",
    "In autumn the leaves of the maple trees turn a deep shade of red.",
    "The ferry crosses the lake slowly, stopping at each small pier.",
    "A well written manual explains not only what to do but also why.",
    "The cat slept on the warm windowsill for most of the afternoon.",
    "Mountain roads wind back and forth to keep the slope gentle.",
    "The town council planted new trees along the main street.",
    "Old photographs fade when they are left in bright sunlight.",
    "The students worked in pairs and compared their notes at the end.",
    "A thick fog rolled in from the sea and covered the harbour.",
    "The farmer repaired the fence before moving the sheep to the upper field.",
    "Good bread needs time, patience and a warm place to rise.",
    "The hikers stopped at the ridge to admire the view of the valley.",
    "A quiet reading room is hard to find in a busy city.",
    "The carpenter measured the board twice before making a single cut.",
    "Streetlights flickered on one by one as the evening grew dark.",
    "The garden behind the house has roses, herbs and a small pond.",
    "Travellers often remember the food of a place more than its buildings.",
    "The river was high after the storm, and the fields near it were flooded.",
    "A new bookshop opened near the station and quickly became popular.",
    "The clock in the hall chimed softly every quarter of an hour.",
    "Children collected shells on the beach and sorted them by colour.",
)

# Nouns that SmolLM2's tokenizer keeps as one token after a space (checked in tests/test_recall.py).
WORDS = (
    "apple", "arrow", "basket", "bell", "blanket", "boat", "bottle", "bread", "bridge", "brush", "bucket", "butter",
    "button", "cabin", "camera", "candle", "canoe", "carpet", "castle", "chair", "cheese", "cherry", "chimney",
    "circle", "cloud", "coat", "coin", "collar", "copper", "cotton", "cup", "curtain", "desk", "diamond", "dinner",
    "dragon", "drum", "eagle", "engine", "feather", "fence", "finger", "flag", "flower", "forest", "fork", "fountain",
    "garden", "glass", "glove", "hammer", "harbor", "helmet", "honey", "horse", "island", "jacket", "jungle", "kettle",
    "ladder", "lamp", "lemon", "letter", "lion", "machine", "magnet", "marble", "meadow", "mirror", "monkey", "needle",
    "ocean", "orange", "oven", "paper", "parrot", "pencil", "pepper", "piano", "pillow", "planet", "pocket", "potato",
    "rabbit", "ribbon", "river", "rocket", "saddle", "salmon", "shadow", "shelf", "shield", "silver", "spider", "spoon",
    "square", "statue", "stone", "sugar", "table", "tiger", "tomato", "tower", "train", "trumpet", "tunnel", "turtle",
    "valley", "violin", "wagon", "wallet", "window", "winter", "lantern", "wolf", "zebra",
)
ADJECTIVES = (
    "ancient", "bitter", "brave", "bright", "calm", "clever", "cold", "crimson", "curious", "dark", "eager", "empty",
    "faint", "fierce", "gentle", "golden", "grumpy", "hidden", "hollow", "humble", "icy", "lazy", "little", "lonely",
    "loud", "lucky", "mighty", "narrow", "noble", "old", "pale", "proud", "quiet", "rapid", "rough", "rusty", "silent",
    "sleepy", "small", "smooth", "soft", "steady", "strange", "sweet", "swift", "tall", "tiny", "wild", "wise",
    "wooden",
)


@dataclass(frozen=True)
class Haystack:
    """A stream of filler units (sentences) joined by ``sep``; the prompt builder takes as many as the length needs."""

    name: str
    sep: str = " "

    def __post_init__(self):
        if self.name not in ("repeat", "essay", "words"):
            raise ValueError(f"unknown haystack {self.name!r}; known: repeat, essay, words")

    def units(self, rng: random.Random) -> Iterator[str]:
        if self.name == "repeat":
            while True:
                yield from NOISE
        if self.name == "essay":
            last = None
            while True:  # every sentence equally likely, never the same one twice in a row
                pick = rng.randrange(len(ESSAY_SENTENCES) - (last is not None))
                if last is not None and pick >= last:
                    pick += 1
                last = pick
                yield ESSAY_SENTENCES[pick]
        while True:
            yield rng.choice(WORDS)


REPEAT = Haystack("repeat")
ESSAY = Haystack("essay")
WORD_LIST = Haystack("words", sep=", ")


def magic_number(rng: random.Random, digits: int) -> str:
    """A number of exactly ``digits`` digits (no leading zero)."""
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def key_phrase(rng: random.Random) -> str:
    """A RULER-style key, e.g. ``"hollow-candle"``."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(WORDS)}"
