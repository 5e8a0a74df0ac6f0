"""The first generated tasks (fixed seeds, exact match) — superseded by :mod:`pipelines.recall`.

Retired because at ~2k-token prompts SmolLM2-135M fails them even with full attention, their facts sit at one early
depth only, and ``arithmetic`` tests adding as much as recall. Kept only while the pre-issue-11 evaluation stage
(``pipelines/evaluate.py``) and the ``eval.tasks`` defaults of ``pipelines/config.py`` still name them: delete this
module and ``tests/test_tasks.py`` once those use :mod:`pipelines.recall`. Calibration lives in
:mod:`pipelines.recall.calibration` (``python -m jobs.calibrate``).

Each sample is a chat prompt whose *facts* — everything the answer depends on — sit together far back in the
context, behind filler text (:data:`pipelines.recall.haystack.ESSAY_SENTENCES`), then a question, then the start of
the assistant's reply (``prefix``), which the model continues greedily for a few tokens. The answer is a number; a
sample is solved when :func:`extract_answer` of the continuation (the number after the first ``=``, else the first
number) equals it.

* ``kv_retrieval`` — "The secret code of <name> is <4 digits>." early; two distractor codes of other people later;
  "What is the secret code of <name>?" → "The secret code of <name> is" ``5242``.
* ``variable_tracking`` — "Remember that QX = 28. Remember that TB = QX." early (``hops`` links; one by default),
  a distractor assignment later; "What is the value of TB?" → "The value of TB is" ``28``: needs both assignments.
* ``arithmetic`` — "Alice has 4 shells. Daniel has 9 shells." early (``terms`` people, two by default); "How many
  shells do Alice and Daniel have together?" → "Adding their shells:" ``4 + 9 = 13``: both numbers, then a sum.

The filler is drawn with the sample's own seed, so samples are identical on every machine and Python version; the
prompt grows sentence by sentence until its templated token count reaches ``context`` tokens. The facts sit after
the first 5–15% of the filler. ``python -m pipelines.tasks`` prints a sample of each task.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from pipelines.recall.haystack import ESSAY_SENTENCES

TASKS = ("kv_retrieval", "variable_tracking", "arithmetic")

FILLER = ESSAY_SENTENCES

NAMES = ("Alice", "Bruno", "Clara", "Daniel", "Elena", "Felix", "Grace", "Hugo", "Irene", "Jonas", "Karla", "Leon",
         "Maria", "Nadia", "Oscar", "Paula", "Rafael", "Sofia", "Tomas", "Vera", "Walter", "Yara", "Zoe", "Miguel")
VARIABLES = ("QX", "BR", "KV", "ZT", "MP", "LW", "HN", "DF", "GS", "JC", "PY", "RV", "TB", "WK", "XN", "YL")
ITEMS = ("apples", "books", "coins", "stamps", "marbles", "pencils", "shells", "cards", "buttons", "tickets")


@dataclass(frozen=True)
class TaskSample:
    """One prompt and its expected answer. ``needle`` is the text of the fact placed far back (in ``user``)."""

    task: str
    index: int
    seed: int
    user: str  # the user message
    prefix: str  # the start of the assistant's reply, given to the model (it continues with the answer)
    answer: str
    needle: str
    facts: tuple[str, ...] = field(default=())  # every fact the answer depends on, in order (needle first)

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.user}]


# ---------------------------------------------------------------------------------------------------- building
def _facts(task: str, rng: random.Random, hops: int,
           terms: int) -> tuple[list[str], list[tuple[str, bool]], str, str, str]:
    """``(facts, distractors, question, prefix, answer)`` of one sample; facts[0] is the needle, distractors are
    ``(text, before)`` — placed before the facts (``True``) or after them."""
    if task == "kv_retrieval":
        names = rng.sample(NAMES, 3)
        codes = rng.sample(range(1000, 10000), 3)
        facts = [f"The secret code of {names[0]} is {codes[0]}."]
        distractors = [(f"The secret code of {n} is {c}.", False) for n, c in zip(names[1:], codes[1:])]
        question = f"What is the secret code of {names[0]}? Answer with the number only."
        return facts, distractors, question, f"The secret code of {names[0]} is", str(codes[0])
    if task == "variable_tracking":
        names = rng.sample(VARIABLES, hops + 1)
        value = rng.randrange(10, 100)
        facts = [f"Remember that {names[0]} = {value}."]
        facts += [f"Remember that {names[i]} = {names[i - 1]}." for i in range(1, hops + 1)]
        other = rng.sample([v for v in VARIABLES if v not in names], 1)[0]
        other_value = rng.choice([v for v in range(10, 100) if v != value])
        # before the chain: after it, SmolLM2-135M answers with the latest number it saw (dense accuracy 0.04 at
        # 256 tokens); before it, a policy that drops the chain but keeps the distractor still answers wrong
        distractors = [(f"Remember that {other} = {other_value}.", True)]
        question = f"What is the value of {names[-1]}? Answer with the number only."
        return facts, distractors, question, f"The value of {names[-1]} is", str(value)
    if task == "arithmetic":
        people = rng.sample(NAMES, terms)
        item = rng.choice(ITEMS)
        counts = [rng.randrange(2, 10) for _ in people]
        facts = [f"{p} has {c} {item}." for p, c in zip(people, counts)]
        question = f"How many {item} do {_join(people)} have together?"
        return facts, [], question, f"Adding their {item}:", str(sum(counts))
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _user_text(sentences: list[str], question: str) -> str:
    return ("Read the following notes carefully. You will be asked about them at the end.\n\n"
            + " ".join(sentences) + f"\n\nQuestion: {question}")


def prompt_ids(sample: TaskSample, tokenizer, chat: bool = True) -> list[int]:
    """Token ids of the whole prompt: the chat template with the generation prompt, then the reply prefix."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(sample.messages(), add_generation_prompt=True, tokenize=False)
    else:
        text = sample.user + "\n\n"
    return tokenizer(text + sample.prefix, add_special_tokens=False).input_ids


def generate_samples(task: str, count: int, tokenizer, *, context: int = 384, seed: int = 0, hops: int = 1,
                     terms: int = 2, needle_depth: tuple[float, float] = (0.05, 0.15),
                     chat: bool = True) -> list[TaskSample]:
    """``count`` samples of ``task`` with prompts of about ``context`` tokens (never fewer), deterministic in
    ``(task, index, seed, context, tokenizer)``.

    The facts go together after a fraction of the filler drawn from ``needle_depth``; distractors before them
    (variable tracking) or anywhere after them (key-value retrieval). The question comes last; ``hops`` is the
    number of links of the variable chain, ``terms`` the number of quantities to add.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    if context < 64:
        raise ValueError(f"context must be >= 64 tokens, got {context}")
    sentence_tokens = [len(tokenizer(" " + s, add_special_tokens=False).input_ids) for s in FILLER]
    samples = []
    for index in range(count):
        sample_seed = _sample_seed(task, index, seed)
        rng = random.Random(sample_seed)
        facts, distractors, question, prefix, answer = _facts(task, rng, hops, terms)
        draw = random.Random(rng.random())
        filler: list[str] = []

        def build(n_filler: int) -> TaskSample:
            while len(filler) < n_filler:
                filler.append(FILLER[draw.randrange(len(FILLER))])
            sentences = _place(filler[:n_filler], facts, distractors, needle_depth, random.Random(sample_seed + 1))
            return TaskSample(task, index, seed, _user_text(sentences, question), prefix, answer, facts[0],
                              tuple(facts))

        bare = len(prompt_ids(build(0), tokenizer, chat))
        mean = sum(sentence_tokens) / len(sentence_tokens)
        n = max(1, int((context - bare) / mean))
        while len(prompt_ids(build(n), tokenizer, chat)) < context:
            n += 1
        while n > 1 and len(prompt_ids(build(n - 1), tokenizer, chat)) >= context:
            n -= 1
        samples.append(build(n))
    return samples


def _sample_seed(task: str, index: int, seed: int) -> int:
    """A seed per (task, index, seed) that does not depend on Python's string hashing."""
    return (seed * 1_000_003 + TASKS.index(task) * 10_007 + index) & 0x7FFFFFFF


def _place(filler: list[str], facts: list[str], distractors: list[tuple[str, bool]], depth: tuple[float, float],
           rng: random.Random) -> list[str]:
    """Filler with every fact, in order and together, at a drawn early depth; each distractor at a random place
    before or after the facts."""
    n = len(filler)
    first = min(n, max(1, round(n * rng.uniform(*depth))))
    head, tail = list(filler[:first]), list(filler[first:])
    for text, before in distractors:
        part = head if before else tail
        part.insert(rng.randint(0, len(part)), text)
    return head + list(facts) + tail


# ---------------------------------------------------------------------------------------------------- scoring
_NUMBER = re.compile(r"-?\d+")
_RESULT = re.compile(r"=\s*(-?\d+)")


def extract_answer(text: str) -> str | None:
    """The model's answer in a continuation: the number right after the first ``=`` if it wrote an equation
    (``" 6 + 5 = 11 apples."`` → ``"11"``), else the first number (``" 5242."``), else the first word."""
    result = _RESULT.search(text)
    if result:
        return result.group(1)
    match = _NUMBER.search(text)
    if match:
        return match.group(0)
    words = re.findall(r"\w+", text)
    return words[0] if words else None


def is_correct(sample: TaskSample, continuation: str) -> bool:
    return extract_answer(continuation) == sample.answer


def needle_distance(sample: TaskSample, tokenizer, chat: bool = True, fact: str | None = None) -> int:
    """Tokens from the first token of the needle (or of ``fact``) to the end of the prompt: how far back the last
    prompt position (the first query that must use it) has to look."""
    ids = prompt_ids(sample, tokenizer, chat)
    text = (tokenizer.apply_chat_template(sample.messages(), add_generation_prompt=True, tokenize=False)
            if chat and getattr(tokenizer, "chat_template", None) else sample.user + "\n\n")
    cut = text.index(fact if fact is not None else sample.needle)
    before = len(tokenizer(text[:cut], add_special_tokens=False).input_ids)
    return len(ids) - before


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - a look at the prompts
    from transformers import AutoTokenizer

    from pipelines.models import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True)
    for task in TASKS:
        sample = generate_samples(task, 1, tokenizer)[0]
        print(f"== {task}: answer {sample.answer}, {len(prompt_ids(sample, tokenizer))} tokens, needle "
              f"{needle_distance(sample, tokenizer)} tokens back\n{sample.user}\n[assistant] {sample.prefix}\n")


if __name__ == "__main__":  # pragma: no cover
    main()
