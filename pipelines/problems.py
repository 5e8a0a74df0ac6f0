"""Held-out math problems for long free generation: the competition problems of the packaged champ corpus.

Each :class:`Problem` is one champ problem with its reference answer. The prompt is the instruct model's chat
template around "Solve the following problem … put the final answer in \\boxed{}." and the problem text. Problems
whose solution transcripts are in the training split come last (``seen_in_training``): the scorer was trained on
those transcripts, though never on the evaluated model's own continuation. Among the rest, problems with a plain
numeric answer come first (their final answer can be checked), in an order fixed by ``seed``.

Answer extraction (:func:`extract_answer`): the content of the last ``\\boxed{…}`` (braces balanced), else the last
number in the text, else nothing. Two answers are the same (:func:`same_answer`) when both parse as numbers that are
equal to 1e-6 relative, else when their normalised text (no spaces, ``$``, trailing ``.``, thousands separators)
is equal.
"""
from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import champ_dataset

INSTRUCTION = "Solve the following problem. Put the final answer in \\boxed{}.\n\n"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@dataclass(frozen=True)
class Problem:
    id: str
    text: str
    answer: str
    seen_in_training: bool = False

    @property
    def numeric(self) -> bool:
        return _as_number(self.answer) is not None


def load_problems(count: int, *, training_docs=(), seed: int = 0) -> list[Problem]:
    """``count`` champ problems: unseen numeric ones first, then unseen others, then those whose transcripts
    (document ids ``"<problem>/<transcript>"``) are among ``training_docs``; a clear error if champ has fewer."""
    seen = {str(doc).split("/", 1)[0] for doc in training_docs}
    problems = [Problem(pid, text, answer, pid in seen) for pid, text, answer in _champ_problems()]
    random.Random(seed).shuffle(problems)
    problems.sort(key=lambda p: (p.seen_in_training, not p.numeric))  # stable: the shuffle orders each group
    if count > len(problems):
        raise ValueError(f"eval.generation_prompts={count}, but champ has only {len(problems)} problems")
    return problems[:count]


@functools.lru_cache(maxsize=1)
def _champ_problems() -> tuple[tuple[str, str, str], ...]:
    """``(id, text, answer)`` of every champ problem, sorted by id; read from the file ``champ_dataset.load("v0")``
    reads, without parsing the 19k solution transcripts (what makes ``load`` take seconds)."""
    raw = json.loads((Path(champ_dataset.BASE_FOLDER) / "dataset_files" / "v0.json").read_text())["problems"]
    problems = {pid: champ_dataset.Problem.from_dict({**entry, "conversations": None}) for pid, entry in raw.items()}
    return tuple((pid, p.text, str(p.answer)) for pid, p in sorted(problems.items()))


def prompt_ids(problem: Problem, tokenizer) -> list[int]:
    """Token ids of the chat prompt (with the generation prompt), or of the plain text without a chat template."""
    text = INSTRUCTION + problem.text
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer(text + "\n\n", add_special_tokens=False).input_ids


def extract_answer(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normal(text: str) -> str:
    return re.sub(r"[\s$]", "", text).rstrip(".")


def _as_number(text: str | None) -> float | None:
    if text is None:
        return None
    plain = _normal(text)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", plain):
        plain = plain.replace(",", "")
    try:
        return float(plain)
    except ValueError:
        return None


def same_answer(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    x, y = _as_number(a), _as_number(b)
    if x is not None and y is not None:
        return abs(x - y) <= 1e-6 * max(1.0, abs(x), abs(y))
    return _normal(a) == _normal(b)
