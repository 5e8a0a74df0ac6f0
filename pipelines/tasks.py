"""Generated long-range tasks for the free-generation check (fixed seeds, exact match).

Each sample is a chat prompt (the instruct model's chat template) whose *facts* — everything the answer depends on —
sit together far back in the context, behind filler text, then a question, then the start of the assistant's reply
(``prefix``), which the model continues greedily for a few tokens. The answer is a number; a sample is solved when
:func:`extract_answer` of the continuation (the number after the first ``=``, else the first number) equals it.

Tasks (:data:`TASKS`), each sized so that SmolLM2-135M-Instruct with full attention solves it often (see
:func:`calibrate`; a 135M model cannot add from memory, chain more than one hop, or add three numbers):

* ``kv_retrieval`` — "The secret code of <name> is <4 digits>." early; two distractor codes of other people later;
  "What is the secret code of <name>?" → "The secret code of <name> is" ``5242``.
* ``variable_tracking`` — "Remember that QX = 28. Remember that TB = QX." early (``hops`` links; one by default),
  a distractor assignment later; "What is the value of TB?" → "The value of TB is" ``28``: needs both assignments.
* ``arithmetic`` — "Alice has 4 shells. Daniel has 9 shells." early (``terms`` people, two by default); "How many
  shells do Alice and Daniel have together?" → "Adding their shells:" ``4 + 9 = 13``: both numbers, then a sum.

The filler is a fixed list of plain English sentences in this file (no digits, none of the task's names), drawn with
the sample's own seed, so samples are identical on every machine and Python version; the prompt grows sentence by
sentence until its templated token count reaches ``context`` tokens. The facts sit after the first 5–15% of the
filler: at ``context`` = 384 they are 295–340 tokens before the last prompt position, beyond any window or
streaming budget below that.

``python -m pipelines.tasks`` prints a sample of each task; ``python -m pipelines.tasks calibrate`` measures the
dense model's accuracy per task and context length.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

TASKS = ("kv_retrieval", "variable_tracking", "arithmetic")

FILLER = (
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


def calibrate(model, tokenizer, *, samples: int = 24, contexts=(256, 384, 512), max_new_tokens: int = 12,
              batch_size: int = 12, seed: int = 0) -> dict[int, dict[str, float]]:
    """Dense exact-match accuracy per task and context length (the check that the tasks are solvable at all)."""
    import kvpop
    from pipelines.evaluate import evaluate_model

    if getattr(model, "kvpop_runtime", None) is None:
        kvpop.retrofit(model, None, scorer=None, policy="dense")
    out = {}
    for context in contexts:
        tasks = {name: generate_samples(name, samples, tokenizer, context=context, seed=seed) for name in TASKS}
        row = evaluate_model(model, tokenizer, [], policies=["dense"], budgets=[kvpop.Budget(0, 1, 0)], tasks=tasks,
                             max_new_tokens=max_new_tokens, generation_batch_size=batch_size, progress=False)[0]
        out[context] = {name: row[name] for name in TASKS}
    return out


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - a look at the prompts, or a calibration
    import argparse

    from transformers import AutoTokenizer

    from kvpop.pretrained import load_pretrained
    from pipelines.models import smollm2_dir

    parser = argparse.ArgumentParser(description="print one sample per task, or calibrate on SmolLM2 (dense)")
    parser.add_argument("command", nargs="?", choices=("show", "calibrate"), default="show")
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--contexts", default="256,384,512")
    args = parser.parse_args(argv)
    if args.command == "calibrate":
        model, tokenizer = load_pretrained(smollm2_dir())
        for context, accs in calibrate(model, tokenizer, samples=args.samples,
                                       contexts=[int(c) for c in args.contexts.split(",")]).items():
            print(f"context {context}: " + ", ".join(f"{k} {v:.2f}" for k, v in accs.items()), flush=True)
        return
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True)
    for task in TASKS:
        sample = generate_samples(task, 1, tokenizer)[0]
        print(f"== {task}: answer {sample.answer}, {len(prompt_ids(sample, tokenizer))} tokens, needle "
              f"{needle_distance(sample, tokenizer)} tokens back\n{sample.user}\n[assistant] {sample.prefix}\n")


if __name__ == "__main__":  # pragma: no cover
    main()
