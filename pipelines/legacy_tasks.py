"""The generated tasks of :mod:`pipelines.tasks` behind the recall-task interface the evaluation stage calls.

The interface (the RULER-style generators implement the same): a :class:`TaskSpec` names one cell (task, prompt
length in tokens, needle depth in [0, 1], samples, seed); :func:`generate_samples` turns it into
:class:`RecallSample` s with ``prompt_ids`` and the gold continuation ``answer_ids``; :func:`score_text` is exact
match of a greedy continuation; :func:`gold_logprob_and_rank` scores the gold continuation teacher-forced, from the
logits of ``prompt + answer`` (or only their last rows, from position ``start``) — robust for a small model that
rambles after a right answer.

Here a cell's depth is where the facts sit in the filler (``needle_depth = (depth, depth)`` of
:func:`pipelines.tasks.generate_samples`); the gold continuation is the answer as the prompt's reply prefix expects
it (``" 5242"``; arithmetic ``" 4 + 9 = 13"``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from pipelines import tasks as generated

TASKS = generated.TASKS


@dataclass(frozen=True)
class TaskSpec:
    task: str
    context: int  # prompt tokens (at least)
    depth: float  # where the facts sit, as a fraction of the filler
    samples: int
    seed: int = 0

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; known: {', '.join(TASKS)}")
        if not 0.0 <= self.depth <= 1.0:
            raise ValueError(f"task depth must be in [0, 1] (a fraction of the context), got {self.depth}")
        if self.context < 64:
            raise ValueError(f"task context must be >= 64 tokens, got {self.context}")
        if self.samples < 1:
            raise ValueError(f"task samples must be >= 1, got {self.samples}")


@dataclass(frozen=True)
class RecallSample:
    id: str
    task: str
    context: int
    depth: float
    prompt_ids: tuple[int, ...]
    answer: str
    answer_ids: tuple[int, ...]


def generate_samples(spec: TaskSpec, tokenizer, *, max_context: int | None = None) -> list[RecallSample]:
    """The cell's samples, deterministic in ``(spec, tokenizer)``; ``max_context``: the model's context (a prompt
    plus its answer must fit)."""
    if max_context is not None and spec.context >= max_context:
        raise ValueError(f"task context {spec.context} does not fit the model's context of {max_context} tokens")
    out = []
    for sample in generated.generate_samples(spec.task, spec.samples, tokenizer, context=spec.context,
                                             seed=spec.seed, needle_depth=(spec.depth, spec.depth)):
        gold = _gold_text(sample)
        out.append(RecallSample(f"{spec.task}-c{spec.context}-d{spec.depth:g}-{sample.index}", spec.task,
                                spec.context, spec.depth, tuple(generated.prompt_ids(sample, tokenizer)),
                                sample.answer, tuple(tokenizer(gold, add_special_tokens=False).input_ids)))
    return out


def _gold_text(sample: generated.TaskSample) -> str:
    if sample.task == "arithmetic":
        counts = [re.search(r"has (\d+) ", fact).group(1) for fact in sample.facts]
        return " " + " + ".join(counts) + f" = {sample.answer}"
    return f" {sample.answer}"


def score_text(sample: RecallSample, text: str) -> bool:
    return generated.extract_answer(text) == sample.answer


def gold_logprob_and_rank(logits: torch.Tensor, sample: RecallSample, *, start: int = 0) -> dict:
    """From the logits ``[S, V]`` of ``prompt + answer`` whose first row is position ``start`` (position
    ``len(prompt) - 1 + i`` predicts answer token ``i``): ``logprob`` (summed over the gold tokens),
    ``mean_logprob``, ``ranks`` (1 + the vocabulary entries with a strictly larger logit), ``first_rank``,
    ``first_token_hit`` (the first gold token is the greedy choice) and ``all_top1`` (every gold token is)."""
    first, count = len(sample.prompt_ids) - 1 - start, len(sample.answer_ids)
    if logits.dim() != 2 or first < 0 or logits.shape[0] < first + count:
        raise ValueError(f"sample {sample.id}: need the logits of positions {start + max(first, 0)} to "
                         f"{start + first + count - 1} of prompt + answer, got {tuple(logits.shape)} from {start}")
    rows = logits[first:first + count].float()
    gold = torch.tensor(sample.answer_ids, device=rows.device)[:, None]
    logprob = float(rows.log_softmax(-1).gather(-1, gold).sum())
    ranks = (1 + (rows > rows.gather(-1, gold)).sum(-1)).tolist()
    return {"logprob": logprob, "mean_logprob": logprob / count, "ranks": ranks, "first_rank": ranks[0],
            "first_token_hit": ranks[0] == 1, "all_top1": all(r == 1 for r in ranks)}
