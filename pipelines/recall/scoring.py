"""Scoring a recall sample two ways: exact match of a generated continuation, and the gold answer's teacher-forced
log-probability and rank (robust for small models that ramble after, or around, the answer).
"""
from __future__ import annotations

import torch

from pipelines.recall.base import RecallSample


def score_text(sample: RecallSample, text: str) -> bool:
    """Whether the continuation ``text`` starts with the gold answer (leading whitespace and case ignored) and the
    answer ends there: the next character, if any, is not a letter or digit (``"4820371."`` matches ``4820371``,
    ``"48203710"`` does not)."""
    gold = sample.answer.strip().casefold()
    said = text.lstrip().casefold()
    return bool(gold) and said.startswith(gold) and (len(said) == len(gold) or not said[len(gold)].isalnum())


def gold_logprob_and_rank(logits, sample: RecallSample, *, start: int = 0) -> dict:
    """Teacher-forced scores of the gold answer from the logits ``[S, V]`` (or ``[1, S, V]``) of
    ``sample.prompt_ids + sample.answer_ids``, whose first row is position ``start`` (so that a caller can keep only
    the last rows: ``logits_to_keep``).

    Position ``len(prompt_ids) - 1 + i`` predicts answer token ``i``. Returns ``logprob`` (summed log-probability
    of the gold tokens), ``mean_logprob``, ``ranks`` (per gold token, 1 + the number of vocabulary entries with a
    strictly larger logit: a tie with the top counts as rank 1), ``first_rank``, ``first_token_hit`` (first token at
    rank 1) and ``all_top1`` (every token at rank 1: greedy decoding would produce the answer's tokens, ties aside).
    """

    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise ValueError(f"gold_logprob_and_rank scores one sample: pass logits [S, V] or [1, S, V], "
                             f"got {tuple(logits.shape)}")
        logits = logits[0]
    first, count = len(sample.prompt_ids) - 1 - start, len(sample.answer_ids)
    if logits.dim() != 2 or first < 0 or logits.shape[0] < first + count:
        raise ValueError(f"sample {sample.id}: need the logits of positions {start + max(first, 0)} to "
                         f"{start + first + count - 1} of prompt_ids + answer_ids, got {tuple(logits.shape)} from "
                         f"position {start}")
    rows = logits[first:first + count].float()
    gold = torch.tensor(sample.answer_ids, device=rows.device)[:, None]
    token_logprob = rows.log_softmax(-1).gather(-1, gold)[:, 0]
    ranks = (1 + (rows > rows.gather(-1, gold)).sum(-1)).tolist()
    total = token_logprob.sum().item()
    return {"logprob": total, "mean_logprob": total / count, "ranks": ranks, "first_rank": ranks[0],
            "first_token_hit": ranks[0] == 1, "all_top1": all(r == 1 for r in ranks)}
