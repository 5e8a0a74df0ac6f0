"""Calibration: how often the dense model solves each task × context × depth cell.

Only cells the dense model solves (exact match >= ``threshold``, 0.9 by default) can show what an eviction policy
loses; the others are reported, not used for the headline. Generation is passed in (``generate_fn(model, prompts)
-> texts``) so that the evaluation's own runner can drive it; :func:`greedy_generate_fn` is a plain
``model.generate`` loop for use without it. :func:`run` keeps one result per (model, tokenizer, grid) under
``$KVPOP_HOME/calibration/<hash>/``: ``calibration.json`` (written last; its presence means complete) and
``table.txt``.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from transformers import AutoTokenizer

import kvpop
from kvpop.pretrained import load_pretrained
from pipelines.config import fingerprint
from pipelines.identity import atomic_write_text, teacher_identity, tokenizer_digest
from pipelines.recall.scoring import gold_logprob_and_rank, score_text
from pipelines.recall.spec import TaskSpec, generate_samples

CONTEXTS = (1024, 2048, 4096, 8192)
RESULT = "calibration.json"
DEPTHS = (0.1, 0.5, 0.9)
THRESHOLD = 0.9


def grid(tasks: Iterable[str], contexts: Iterable[int] = CONTEXTS, depths: Iterable[float] = DEPTHS, *,
         samples: int = 16, seed: int = 0) -> list[TaskSpec]:
    """Every task × context × depth cell as a :class:`TaskSpec`."""
    return [TaskSpec(t, c, d, samples, seed) for t in tasks for c in contexts for d in depths]


def greedy_generate_fn(tokenizer, max_new_tokens: int = 16, batch_size: int = 1) -> Callable:
    """``generate_fn(model, prompts) -> texts``: greedy ``model.generate`` over left-padded batches."""

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    fill = pad if pad is not None else 0

    def generate(model, prompts: Sequence[Sequence[int]]) -> list[str]:
        device = next(model.parameters()).device
        texts = []
        for at in range(0, len(prompts), batch_size):
            chunk = [list(p) for p in prompts[at:at + batch_size]]
            width = max(map(len, chunk))
            ids = torch.tensor([[fill] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad)
            texts += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        return texts

    return generate


def teacher_forced(model, samples: Sequence, batch_size: int = 1) -> list[dict]:
    """:func:`gold_logprob_and_rank` of each sample under ``model`` (right-padded batches; only the rows that
    predict answer tokens are projected to the vocabulary)."""

    device = next(model.parameters()).device
    out = []
    for at in range(0, len(samples), batch_size):
        chunk = samples[at:at + batch_size]
        seqs = [s.prompt_ids + s.answer_ids for s in chunk]
        width, first = max(map(len, seqs)), min(len(s.prompt_ids) for s in chunk) - 1
        ids = torch.tensor([q + [0] * (width - len(q)) for q in seqs], device=device)  # causal: padding after is inert
        logits = model(input_ids=ids, logits_to_keep=width - first).logits
        out += [gold_logprob_and_rank(logits[i], s, start=first) for i, s in enumerate(chunk)]
    return out


@contextlib.contextmanager
def _dense(model):
    """A retrofitted model runs dense inside the block (its policy is restored after); a plain model is dense."""
    runtime = getattr(model, "kvpop_runtime", None)
    if runtime is None:
        yield
        return

    previous = runtime.policy
    kvpop.set_policy(model, "dense")
    try:
        yield
    finally:
        kvpop.set_policy(model, previous)


def calibrate(model, tokenizer, specs: Sequence[TaskSpec], *, generate_fn: Callable, gold: bool = True,
              batch_size: int = 1, threshold: float = THRESHOLD,
              progress: Callable[[str], None] | None = None) -> list[dict]:
    """One row per spec: the dense model's exact-match accuracy (``exact``) of ``generate_fn``'s continuations,
    ``usable`` (``exact >= threshold``), and with ``gold`` the teacher-forced rate of first gold tokens at rank 1
    (``first_token_hit``), of whole answers at rank 1 (``all_top1``) and the mean summed gold log-probability
    (``batch_size`` sequences per forward). ``items`` holds each sample's id, continuation and scores."""

    max_context = getattr(model.config, "max_position_embeddings", None)
    for spec in specs:
        spec.check_fits(max_context)
    rows = []
    with _dense(model), torch.no_grad():
        for spec in specs:
            samples = generate_samples(spec, tokenizer, max_context=max_context)
            texts = generate_fn(model, [s.prompt_ids for s in samples])
            items = [{"id": s.id, "answer": s.answer, "output": t, "exact": score_text(s, t)}
                     for s, t in zip(samples, texts)]
            if gold:
                for item, scores in zip(items, teacher_forced(model, samples, batch_size)):
                    item.update({k: scores[k] for k in ("logprob", "first_rank", "first_token_hit", "all_top1")})
            row = {"task": spec.task, "context": spec.context, "depth": spec.depth, "samples": spec.samples,
                   "seed": spec.seed, "prompt_tokens": sum(len(s.prompt_ids) for s in samples) / len(samples),
                   "exact": sum(i["exact"] for i in items) / len(items)}
            if gold:
                row.update({key: sum(i[key] for i in items) / len(items)
                            for key in ("first_token_hit", "all_top1", "logprob")})
            row["usable"] = row["exact"] >= threshold
            row["items"] = items
            rows.append(row)
            if progress is not None:
                progress(format_row(row))
    return rows


COLUMNS = (("task", "{}"), ("context", "{}"), ("depth", "{:g}"), ("samples", "{}"), ("exact", "{:.3f}"),
           ("first_token_hit", "{:.3f}"), ("all_top1", "{:.3f}"), ("logprob", "{:.2f}"), ("usable", "{}"))


def format_row(row: dict) -> str:
    return "  ".join(f"{key}={fmt.format(row[key])}" for key, fmt in COLUMNS if key in row)


def format_table(rows: Sequence[dict]) -> str:
    """A fixed-width table of the rows (``items`` left out)."""
    keys = [(k, f) for k, f in COLUMNS if any(k in r for r in rows)]
    cells = [[k for k, _ in keys]] + [[f.format(r[k]) if k in r else "-" for k, f in keys] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(keys))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in cells)


def run(cfg, specs: Sequence[TaskSpec], *, max_new_tokens: int = 12, batch_size: int = 1,
        progress: Callable[[str], None] | None = None) -> tuple[list[dict], Path, bool]:
    """Calibrate ``cfg.model`` (dense, greedy) on ``specs`` unless that was done before: ``(rows, directory,
    reused)``."""



    path = cfg.model.resolved_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    identity = {"model": teacher_identity(cfg), "tokenizer_sha256": tokenizer_digest(tokenizer),
                "max_new_tokens": max_new_tokens, "threshold": THRESHOLD}
    out = cfg.home_dir() / "calibration" / fingerprint(identity, list(specs))
    if (out / RESULT).is_file():
        return json.loads((out / RESULT).read_text())["rows"], out, True
    model, _ = load_pretrained(path, dtype=getattr(torch, cfg.model.dtype),
                               device="cuda" if torch.cuda.is_available() else "cpu")
    rows = calibrate(model, tokenizer, specs, generate_fn=greedy_generate_fn(tokenizer, max_new_tokens, batch_size),
                     batch_size=batch_size, progress=progress)
    atomic_write_text(out / "table.txt", format_table(rows) + "\n")
    atomic_write_text(out / RESULT, json.dumps({**identity, "rows": rows}, indent=1))
    return rows, out, False
