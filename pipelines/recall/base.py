"""What every recall task shares: the sample, what a task family draws, and how a prompt of the requested length is
built around it.

A family (one file each) draws a :class:`Draft` from a seeded ``random.Random``: an instruction, the *inserts* (the
needle — the fact the answer depends on — and its distractors, each with the fraction of the haystack before it), a
question naming the key (never the value), the start of the assistant's reply and the gold answer.
:func:`build_sample` then hides the inserts in filler units (sentences) and sizes the filler so that the prompt —
the chat template of the user message (instruction, filler, question) followed by the reply's start, or the plain
text where the tokenizer has no template — is at most ``context`` tokens and short of it by less than one filler word
under the evaluated model's own tokenizer.

Placement rule: with ``n`` whole filler units, an insert at fraction ``f`` goes before unit ``round(f * n)``
(inserts at the same place keep the family's order), so the needle's token position inside the filler is the
requested depth up to one unit and the distractors placed before it; the filler is then topped up word by word from
unit ``n + 1`` at its end.

Determinism: the facts, the filler stream and the distractor places depend only on ``(task, seed, index)`` through
:func:`stable_seed` (sha256, never ``hash()``), so one sample index holds the same facts at every context and depth —
the cells of a context × depth grid are paired — and the same prompt ids on every machine.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import ClassVar, Iterator

from pipelines.recall.haystack import Haystack


@dataclass(frozen=True)
class Insert:
    at: float  # fraction of the filler units before it, in [0, 1]
    text: str
    needle: bool = False  # part of the fact asked about: the sample's needle span covers every needle insert


@dataclass(frozen=True)
class Draft:
    instruction: str
    inserts: tuple[Insert, ...]
    question: str
    answer_prefix: str  # the start of the assistant's reply, part of the prompt
    answer: str  # the gold continuation of ``answer_prefix``


@dataclass(frozen=True)
class RecallSample:
    """One prompt and its gold continuation. Token positions index ``prompt_ids``; spans are half-open."""

    id: str
    task: str
    context: int
    depth: float
    seed: int
    index: int
    prompt_ids: list[int]
    answer: str
    answer_ids: list[int]  # the gold continuation's tokens: prompt_ids + answer_ids tokenizes prompt + answer
    needle_token_start: int
    needle_token_end: int
    haystack_token_start: int
    haystack_token_end: int


@dataclass(frozen=True)
class Family:
    """A task family: draws one sample's facts. ``positional``: the needle sits at the spec's depth (False for
    tasks whose facts are spread by rule, e.g. aggregation over a region)."""

    name: str
    haystack: Haystack
    positional: ClassVar[bool] = True

    def draft(self, rng: random.Random, spec) -> Draft:
        raise NotImplementedError

    def filler(self, rng: random.Random, draft: Draft) -> Iterator[str]:
        return self.haystack.units(rng)


def stable_seed(*parts) -> int:
    """A 64-bit seed from the parts' text (the same on every machine and Python version)."""
    return int(hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:16], 16)


def uses_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_text(tokenizer, user: str, answer_prefix: str) -> str:
    """The instruct model's chat template with the reply started (plain text when the tokenizer has no template)."""
    if uses_chat_template(tokenizer):
        head = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                             tokenize=False)
        return head + answer_prefix
    return user + "\n\n" + answer_prefix


def encode(tokenizer, text: str, *, offsets: bool = False) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Token ids of a whole prompt text (special tokens come from the template, or from the tokenizer when there is
    none) and, with ``offsets`` and a fast tokenizer, their character offsets (else None)."""
    special = not uses_chat_template(tokenizer)
    if offsets and getattr(tokenizer, "is_fast", False):
        out = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        return list(out["input_ids"]), [tuple(o) for o in out["offset_mapping"]]
    return list(tokenizer(text, add_special_tokens=special)["input_ids"]), None


def _token_span(tokenizer, text: str, offsets, start: int, end: int) -> tuple[int, int]:
    """Tokens covering characters ``[start, end)`` of ``text``."""
    if offsets is not None:
        first = next(i for i, (_, e) in enumerate(offsets) if e > start)
        last = max(i for i, (s, e) in enumerate(offsets) if s < end and e > s)
        return first, last + 1
    before = len(encode(tokenizer, text[:start])[0])
    return before, before + len(encode(tokenizer, text[start:end])[0])


class _Layout:
    """The prompt text of one draft for a given amount of filler, and where the filler and the needle landed."""

    def __init__(self, tokenizer, draft: Draft, units: list[str], sep: str, n: int, words: int):
        pieces: list[tuple[str, bool | None]] = [(u, None) for u in units[:n]]  # (text, needle flag; None = filler)
        placed = sorted(enumerate(draft.inserts), key=lambda item: (round(item[1].at * n), item[0]))
        for shift, (_, ins) in enumerate(placed):
            pieces.insert(round(ins.at * n) + shift, (ins.text, ins.needle))
        if words:
            pieces.append((" ".join(units[n].split(" ")[:words]), None))
        body, needle = "", []
        for text, flag in pieces:
            if body:
                body += sep
            if flag:
                needle.append((len(body), len(body) + len(text)))
            body += text
        user = f"{draft.instruction}\n\n{body}\n\n{draft.question}"
        self.text = prompt_text(tokenizer, user, draft.answer_prefix)
        base = self.text.find(user) + len(draft.instruction) + 2
        self.body = (base, base + len(body))
        self.needle = (base + needle[0][0], base + needle[-1][1]) if needle else None


def build_sample(family: Family, spec, index: int, tokenizer) -> RecallSample:
    """Sample ``index`` of ``spec`` (a :class:`pipelines.recall.TaskSpec`): the longest prompt of at most
    ``spec.context`` tokens (see the module docstring for placement and determinism)."""
    rng = random.Random(stable_seed(spec.task, spec.seed, index, "facts"))
    draft = family.draft(rng, spec)
    stream = family.filler(random.Random(stable_seed(spec.task, spec.seed, index, "filler")), draft)
    units: list[str] = []
    sep = family.haystack.sep
    lengths: dict[tuple[int, int], int] = {}

    def layout(n: int, words: int = 0) -> _Layout:
        while len(units) <= max(n, 63):
            units.append(next(stream))
        return _Layout(tokenizer, draft, units, sep, n, words)

    def length(n: int, words: int = 0) -> int:  # the prompt's token count with n units and some words of the next
        if (n, words) not in lengths:
            lengths[n, words] = len(encode(tokenizer, layout(n, words).text)[0])
        return lengths[n, words]

    if length(0) > spec.context:
        raise ValueError(f"recall task {spec.task!r}: context {spec.context} is too short, its prompt without filler "
                         f"already takes {length(0)} tokens")
    per_unit = max(1.0, len(encode(tokenizer, sep.join(units[:64]))[0]) / 64)
    n = 0
    for _ in range(8):  # secant steps towards the length, then exact single steps
        step = int((spec.context - length(n)) / per_unit)
        if step == 0:
            break
        n = max(0, n + step)
    while n > 0 and length(n) > spec.context:
        n -= 1
    while length(n + 1) <= spec.context:
        n += 1
    low, high = 0, len(units[n].split(" ")) - 1  # the most words of unit n + 1 that still fit (bisection)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if length(n, mid) <= spec.context else (low, mid - 1)
    best = layout(n, low)
    ids, offsets = encode(tokenizer, best.text, offsets=True)
    full = encode(tokenizer, best.text + draft.answer)[0]
    if full[:len(ids)] != ids:
        raise RuntimeError(f"recall task {spec.task!r}: the answer {draft.answer!r} changes how the prompt's end "
                           f"tokenizes; end the reply prefix where a token ends")
    needle = _token_span(tokenizer, best.text, offsets, *best.needle) if best.needle else (0, 0)
    body = _token_span(tokenizer, best.text, offsets, *best.body)
    return RecallSample(
        id=f"{spec.task}/c{spec.context}/d{spec.depth:g}/s{spec.seed}/{index}", task=spec.task, context=spec.context,
        depth=spec.depth, seed=spec.seed, index=index, prompt_ids=ids, answer=draft.answer,
        answer_ids=full[len(ids):], needle_token_start=needle[0], needle_token_end=needle[1],
        haystack_token_start=body[0], haystack_token_end=body[1])
