"""The evaluation stage: every policy × every budget on held-out text (teacher-forced) and on generated tasks.

For a trained retrofitted model and each policy in ``cfg.eval.policies`` (dense, streaming, tova, h2o, random,
oracle, kvpop) at each budget (``cfg.eval.budgets`` totals, ``cfg.eval.compression_ratios`` of the held-out sequence
length, or the training budget), swept **without retraining** — sink and window stay those of the training budget,
only ``topk`` changes; streaming gets the same total as window (:func:`kvpop.build_policy`):

* teacher-forced, on the held-out sequences, against the dense reference (:mod:`kvpop.metrics`, positions ``>= B``):
  top-1 agreement, KL(dense ‖ policy), token accuracy of the policy and of dense on the same positions;
* free generation through the fixed cache on the generated tasks (:mod:`pipelines.tasks`), exact match.

How each policy runs. Static policies (streaming, random, oracle, kvpop) in one masked forward
(``model(ids, use_cache=False)``), which the fixed cache reproduces exactly (METHOD §5). Dynamic ones (TOVA, H2O)
only through the cache: ``kvpop.teacher_forced_logits(model, ids, prefill=S)`` — one forward whose attention layers
step token by token inside (the same computation as decoding, MLPs batched), ~10 ms/token for SmolLM2 on 2 cores
against ~50 ms/token for one-token forwards; on CUDA one decoding step is captured once and replayed as a CUDA graph
(``graphed=True``), since launching every layer's small kernels from Python costs ~1 ms per layer-token. The oracle
reads the teacher's future-attention targets (:func:`kvpop.targets.teacher_pass`, for the budget's window) of the
evaluated sequence. In free generation
there are no targets for generated tokens: the oracle uses the targets of the prompt alone (tokens without a target,
the prompt's last ``window`` tokens and the generated ones, rank lowest), so its row shows what the ideal static
choice *of the prompt's tokens* gives.

The dense reference is the evaluated model with the dense policy; pass ``reference=`` (the original teacher, for a
model fine-tuned by distillation) to compare against another model — then the ``dense`` row is the student's own
dense mode against the teacher.

:func:`evaluate_model` is the pure part (no Ray, no MLflow); :func:`run` is the stage.
"""
from __future__ import annotations

import csv
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

import kvpop
from kvpop import Budget
from kvpop.metrics import compare_logits, summarize
from pipelines.config import ConfigError, PipelineConfig, fingerprint

STATIC = ("streaming", "random", "oracle", "kvpop")
DYNAMIC = ("tova", "h2o")
POLICY_ORDER = ("dense", "streaming", "tova", "h2o", "random", "oracle", "kvpop")
METRICS = ("top1_agreement", "kl", "token_acc", "token_acc_dense")
HIST_BINS = 32


# ---------------------------------------------------------------------------------------------------- budgets
def resolve_budgets(base: Budget, seq_len: int, totals: Iterable[int] = (),
                    ratios: Iterable[float] = ()) -> list[Budget]:
    """The budgets to sweep: ``base``'s sink and window, ``topk`` from each total (or ``CR = 1 - B / seq_len``).

    Neither given: ``[base]``. Sorted by total, largest first (least compression); duplicates dropped.
    """
    wanted = [int(t) for t in totals] + [int(round((1.0 - float(r)) * seq_len)) for r in ratios]
    if not wanted:
        wanted = [base.total]
    out = []
    for total in sorted(set(wanted), reverse=True):
        if total < base.sink + base.window:
            raise ConfigError(f"budget total {total} is smaller than the training budget's sink + window = "
                              f"{base.sink + base.window} (they stay fixed when the budget is swept): use a larger "
                              f"total or a smaller compression ratio")
        out.append(Budget.from_total(total, sink=base.sink, window=base.window))
    return out


# ---------------------------------------------------------------------------------------------------- helpers
def _as_tensor(seq) -> torch.Tensor:
    if isinstance(seq, dict):
        seq = seq["input_ids"]
    t = torch.as_tensor(seq, dtype=torch.long)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise ValueError(f"each sequence must be a 1-D list of token ids, got shape {tuple(t.shape)}")
    return t


def _batches(seqs: list[torch.Tensor], batch_size: int, device=None):
    """Consecutive sequences of equal length, ``batch_size`` at a time: ``(first index, [b, S] ids)``."""
    i = 0
    while i < len(seqs):
        j = i + 1
        while j < len(seqs) and j - i < batch_size and seqs[j].shape[0] == seqs[i].shape[0]:
            j += 1
        yield i, torch.stack(seqs[i:j]).to(device)
        i = j


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _runtime(model):
    runtime = getattr(model, "kvpop_runtime", None)
    if runtime is None:
        raise ValueError("evaluate_model needs a retrofitted model (kvpop.retrofit or kvpop.load_retrofitted)")
    return runtime


def _has_scorers(model) -> bool:
    return _runtime(model).scorer_spec is not None


@torch.no_grad()
def _dense_logits(model, ids: torch.Tensor) -> torch.Tensor:
    if getattr(model, "kvpop_runtime", None) is not None:
        kvpop.set_policy(model, "dense")
        return model(ids, use_cache=False).logits
    return model(input_ids=ids, use_cache=False).logits


@torch.no_grad()
def teacher_targets(model, ids: torch.Tensor, window: int | Sequence[int]):
    """Oracle priorities ``[layers, B, Hkv, S]``: the dense teacher's future-attention targets for ``window``
    (a list of windows: ``{window: targets}`` from one pass).

    Works on a plain model and on a retrofitted one whatever its policy: :func:`kvpop.targets.teacher_pass` swaps
    the attention implementation for its own dense one for the duration of the call (and restores it).
    """
    from kvpop.targets import teacher_pass

    windows = [window] if isinstance(window, int) else list(window)
    targets = teacher_pass(model, ids, windows=windows, top_k=1)["targets"]
    return targets[window] if isinstance(window, int) else targets


@torch.no_grad()
def policy_logits(model, name: str, budget: Budget, ids: torch.Tensor, targets: torch.Tensor | None = None,
                  collect: dict | None = None) -> torch.Tensor:
    """Teacher-forced logits ``[B, S, V]`` of ``model`` under policy ``name`` at ``budget``."""
    if name == "dense":
        return _dense_logits(model, ids)
    kvpop.set_policy(model, name, budget)
    if name in DYNAMIC:
        if ids.is_cuda:
            return kvpop.teacher_forced_logits(model, ids, graphed=True)
        return kvpop.teacher_forced_logits(model, ids, prefill=ids.shape[1])
    if name == "oracle":
        if targets is None:
            raise ValueError("the oracle policy needs teacher targets")
        with kvpop.oracle_priorities(model, targets):
            return _static_forward(model, ids, collect)
    return _static_forward(model, ids, collect)


def _static_forward(model, ids, collect):
    if collect is None:
        return model(ids, use_cache=False).logits
    with kvpop.collect_priorities(model) as store:
        logits = model(ids, use_cache=False).logits
    collect.update(store)
    return logits


def _kept_long_range(collected: dict, budget: Budget, size: int) -> torch.Tensor:
    """``[layers, B, Hkv, S]`` bool: the tokens held in the long-range slots at the last query position."""
    from kvpop.retention import eviction_positions

    last = size - 1
    pos = torch.arange(size)
    kept = []
    for layer in sorted(collected):
        ranked = collected[layer].detach().float().cpu()
        evict = eviction_positions(ranked, budget)
        eligible = (pos >= budget.sink) & (pos <= last - budget.window)
        kept.append(eligible & (last < evict))
    return torch.stack(kept)


class _Retention:
    """Accumulates, per (policy, budget), what the long-range slots hold at the last position."""

    def __init__(self):
        self.data: dict[tuple[str, int], dict[str, Any]] = {}

    def add(self, name: str, budget: Budget, kept: torch.Tensor, oracle: torch.Tensor | None):
        layers, _, hkv, size = kept.shape
        entry = self.data.setdefault((name, budget.total), {
            "policy": name, "budget": str(budget), "total": budget.total, "topk": budget.topk, "seq_len": size,
            "age_sum": torch.zeros(layers, hkv, dtype=torch.float64), "count": torch.zeros(layers, hkv),
            "overlap_sum": torch.zeros(layers, hkv, dtype=torch.float64), "overlap_rows": 0,
            "hist": torch.zeros(HIST_BINS, dtype=torch.float64), "rows": 0})
        age = (size - 1 - torch.arange(size)).double()
        entry["age_sum"] += (kept.double() * age).sum(-1).sum(1)
        entry["count"] += kept.sum(-1).sum(1).float()
        bins = (torch.arange(size) * HIST_BINS // size).clamp(max=HIST_BINS - 1)
        per_pos = kept.double().sum((0, 1, 2))
        entry["hist"] += torch.zeros(HIST_BINS, dtype=torch.float64).index_add_(0, bins, per_pos)
        entry["rows"] += kept.shape[1]
        if oracle is not None and budget.topk > 0:
            both = (kept & oracle).sum(-1).double()  # [L, B, Hkv]
            entry["overlap_sum"] += (both / max(1, budget.topk)).sum(1)
            entry["overlap_rows"] += kept.shape[1]

    def summary(self) -> list[dict]:
        out = []
        for entry in self.data.values():
            count = entry["count"].clamp(min=1)
            item = {k: entry[k] for k in ("policy", "budget", "total", "topk", "seq_len", "rows")}
            item["mean_age"] = (entry["age_sum"] / count).tolist()  # [layers][Hkv]
            item["kept_histogram"] = entry["hist"].tolist()
            if entry["overlap_rows"]:
                item["oracle_overlap"] = (entry["overlap_sum"] / entry["overlap_rows"]).tolist()
            out.append(item)
        return out


# ---------------------------------------------------------------------------------------------------- generation
def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, batch_size: int,
             oracle_targets: list[torch.Tensor] | None = None, progress=None) -> list[str]:
    """Greedy continuations (decoded text) of ``prompts`` through the model's current policy, left-padded batches.

    ``oracle_targets`` (one ``[layers, Hkv, n_i]`` per prompt) feed the oracle policy: right-padded with ``-inf``
    so that a row's targets are indexed by its real token positions.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_id = tokenizer.eos_token_id
    texts = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids, mask = _left_pad(chunk, pad_id if pad_id is not None else 0)
        ids, mask = ids.to(_device(model)), mask.to(_device(model))
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                      pad_token_id=pad_id, eos_token_id=eos_id)
        if oracle_targets is not None:
            width = ids.shape[1] + max_new_tokens
            table = torch.full((oracle_targets[0].shape[0], len(chunk), oracle_targets[0].shape[1], width),
                               float("-inf"))
            for i, t in enumerate(oracle_targets[start:start + batch_size]):
                table[:, i, :, :t.shape[-1]] = t
            with kvpop.oracle_priorities(model, table.to(_device(model))):
                out = model.generate(**kwargs)
        else:
            out = model.generate(**kwargs)
        texts += tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        if progress is not None:
            progress.update(len(chunk))
    return texts


# ---------------------------------------------------------------------------------------------------- evaluation
@dataclass
class _Row:
    policy: str
    budget: Budget
    stats: list = field(default_factory=list)
    sequences: int = 0
    tasks: dict = field(default_factory=dict)  # task -> (correct, total)


def evaluate_model(model, tokenizer, sequences: Sequence, *, policies: Sequence[str] = POLICY_ORDER,
                   budgets: Sequence[Budget | int] | None = None, base_budget: Budget | None = None,
                   tasks: dict[str, list] | None = None, max_new_tokens: int = 12, batch_size: int = 4,
                   generation_batch_size: int = 12, dynamic_sequences: int = 0, metric_start: int | None = None,
                   reference=None, chat: bool = True, progress: bool = True,
                   details: dict | None = None) -> list[dict]:
    """Evaluate every policy × budget; returns one row (a dict) per (policy, budget), dense included.

    ``sequences``: held-out token sequences (lists / 1-D tensors / ``{"input_ids": ...}`` dicts), teacher-forced.
    ``budgets``: :class:`Budget` s or totals (totals keep ``base_budget``'s sink and window; ``base_budget``
    defaults to the model's current policy's budget — the training budget of a loaded checkpoint).
    ``tasks``: ``{task name: [pipelines.tasks.TaskSample]}`` for free generation (None / empty: skip).
    ``dynamic_sequences``: evaluate TOVA/H2O teacher-forced on the first N sequences only (0: all); the row's
    ``n_seq`` says how many it saw, and its ``token_acc_dense`` is dense on those same sequences.
    ``metric_start``: first query position that counts (default: each budget's total B).
    ``details``: if a dict, receives ``{"retention": [...], "seconds": {...}, "seq_len": S}`` for the figures.

    Leaves the model with the policy and budget it came with.
    """
    runtime = _runtime(model)
    original_policy = runtime.policy
    base_budget = base_budget or original_policy.budget
    budgets = list(budgets) if budgets else ([base_budget] if base_budget is not None else [])
    if any(not isinstance(b, Budget) for b in budgets):
        if base_budget is None:
            raise ValueError("budget totals need a base budget (sink, window): pass base_budget=Budget(...)")
        budgets = [b if isinstance(b, Budget) else Budget.from_total(int(b), sink=base_budget.sink,
                                                                     window=base_budget.window) for b in budgets]
    if not budgets:
        raise ValueError("no budget to evaluate: pass budgets=[...] or a model retrofitted with a budget")
    budgets = list(dict.fromkeys(budgets))
    if len({b.total for b in budgets}) != len(budgets):
        raise ValueError(f"budgets {[str(b) for b in budgets]}: two budgets with the same total (rows are keyed by "
                         f"policy and total)")
    unknown = [p for p in policies if p not in POLICY_ORDER]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {list(POLICY_ORDER)}")
    if "kvpop" in policies and not _has_scorers(model):
        raise ValueError("policy 'kvpop' needs a model retrofitted with scorers (this one has none)")
    policies = [p for p in POLICY_ORDER if p in policies or p == "dense"]
    windows = sorted({b.window for b in budgets})  # the oracle's targets depend on the window (METHOD §2)
    seqs = [_as_tensor(s) for s in sequences]
    seq_len = max((s.shape[0] for s in seqs), default=0)
    reference = reference if reference is not None else model
    seconds: dict[str, float] = {}
    retention = _Retention()

    if tasks and tokenizer is None:
        raise ValueError("free generation on tasks needs the tokenizer")
    rows = {(p, b.total): _Row(p, b if p != "streaming" else kvpop.build_policy("streaming", b).budget)
            for b in budgets for p in policies}
    if reference is not model:
        reference.eval()
    model.eval()

    def timed(key, fn):
        t0 = time.perf_counter()
        out = fn()
        seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0
        return out

    prompts_len = None
    try:
        _teacher_forced(model, reference, seqs, rows, policies, budgets, windows, batch_size, dynamic_sequences,
                        metric_start, retention, timed, progress)
        if tasks:
            prompts_len = _free_generation(model, reference, tokenizer, tasks, rows, policies, budgets, windows,
                                           max_new_tokens, generation_batch_size, chat, timed, progress, details)
    finally:
        runtime.policy = original_policy
    table = _rows_to_table(rows, budgets, policies, seq_len, tasks, prompts_len)
    if details is not None:
        details.update({"retention": retention.summary(), "seconds": seconds, "seq_len": seq_len})
    return table


def _teacher_forced(model, reference, seqs, rows, policies, budgets, windows, batch_size, dynamic_sequences,
                    metric_start, retention, timed, progress) -> None:
    from tqdm.auto import tqdm

    combos = [(p, b) for p in policies if p != "dense" for b in budgets]
    dyn_limit = dynamic_sequences if dynamic_sequences > 0 else len(seqs)
    units = len(seqs) * (1 + len(combos))
    bar = tqdm(total=units, desc="teacher-forced", unit="seq×policy", disable=not progress or not units)
    try:
        for first, ids in _batches(seqs, batch_size, _device(model)):
            size = ids.shape[1]
            dense = timed("dense", lambda: _dense_logits(reference, ids))
            own = dense if reference is model else timed("dense", lambda: policy_logits(model, "dense", None, ids))
            bar.update(len(ids))
            for b in budgets:
                start = b.total if metric_start is None else metric_start
                rows[("dense", b.total)].stats.append(compare_logits(own, dense, ids, start=start))
                rows[("dense", b.total)].sequences += len(ids)
            targets = timed("oracle_targets", lambda: teacher_targets(reference, ids, windows)) \
                if "oracle" in policies else {}
            for b in budgets:
                start = b.total if metric_start is None else metric_start
                kept_by = {}
                for p in policies:
                    if p == "dense":
                        continue
                    row = rows[(p, b.total)]
                    use = ids[:max(0, dyn_limit - first)] if p in DYNAMIC else ids
                    if len(use):
                        collect = {} if (p in ("random", "oracle", "kvpop") and b.topk > 0) else None
                        logits = timed(p, lambda: policy_logits(model, p, b, use, targets.get(b.window), collect))
                        row.stats.append(compare_logits(logits, dense[:len(use)], use, start=start))
                        row.sequences += len(use)
                        del logits
                        if collect:
                            kept_by[p] = _kept_long_range(collect, row.budget, size)
                    bar.update(len(ids))
                for p, kept in kept_by.items():
                    retention.add(p, rows[(p, b.total)].budget, kept, kept_by.get("oracle") if p != "oracle" else None)
            del dense, own
    finally:
        bar.close()


def _free_generation(model, reference, tokenizer, tasks, rows, policies, budgets, windows, max_new_tokens,
                     generation_batch_size, chat, timed, progress, details) -> float:
    """Exact match per task for every (policy, budget) (dense once); returns the mean prompt length."""
    from tqdm.auto import tqdm

    from pipelines.tasks import is_correct, prompt_ids

    names = list(tasks)
    samples = [s for name in names for s in tasks[name]]
    prompts = [prompt_ids(s, tokenizer, chat) for s in samples]
    oracle_prompt_targets = {}  # window -> one [layers, Hkv, n] per prompt
    if "oracle" in policies:  # the prompt's own targets: there are none for tokens not generated yet
        device = _device(reference)
        per_prompt = timed("oracle_targets", lambda: [teacher_targets(reference, torch.tensor([p], device=device),
                                                                      windows) for p in prompts])
        oracle_prompt_targets = {w: [t[w][:, 0] for t in per_prompt] for w in windows}
    combos = [("dense", budgets[0])] + [(p, b) for p in policies if p != "dense" for b in budgets]
    bar = tqdm(total=len(samples) * len(combos), desc="generation", unit="prompt", disable=not progress)
    try:
        for p, b in combos:
            if p == "dense":
                kvpop.set_policy(model, "dense")
            else:
                kvpop.set_policy(model, p, b)
            texts = timed(f"generate.{p}", lambda: generate(
                model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=generation_batch_size,
                oracle_targets=oracle_prompt_targets.get(b.window) if p == "oracle" else None, progress=bar))
            counts: dict[str, list[int]] = {n: [0, 0] for n in names}
            for sample, text in zip(samples, texts):
                counts[sample.task][0] += int(is_correct(sample, text))
                counts[sample.task][1] += 1
            for row in ([rows[(p, x.total)] for x in budgets] if p == "dense" else [rows[(p, b.total)]]):
                row.tasks = {n: tuple(c) for n, c in counts.items()}
            if details is not None:
                details.setdefault("generations", {})["dense" if p == "dense" else f"{p}.B{b.total}"] = [
                    {"task": s.task, "index": s.index, "answer": s.answer, "output": t}
                    for s, t in zip(samples, texts)]
    finally:
        bar.close()
    return sum(len(p) for p in prompts) / len(prompts)


def _rows_to_table(rows, budgets, policies, seq_len, tasks, prompts_len) -> list[dict]:
    out = []
    task_names = list(tasks or {})
    for b in budgets:
        dense_row = rows[("dense", b.total)]
        dense_tasks = {n: (c / t if t else math.nan) for n, (c, t) in dense_row.tasks.items()}
        for p in policies:
            row = rows[(p, b.total)]
            means = summarize(row.stats) if row.stats else {**{k: math.nan for k in METRICS}, "positions": 0}
            item = {"policy": p, "budget": "full" if p == "dense" else str(row.budget), "B": b.total,
                    "CR": 1.0 - b.total / seq_len if seq_len else math.nan,
                    "n_seq": row.sequences, "positions": int(means["positions"])}
            for key in METRICS:
                item[key] = means[key]
            if tasks:
                item["CR_tasks"] = 1.0 - b.total / prompts_len
            for n in task_names:
                correct, total = row.tasks.get(n, (0, 0))
                item[n] = correct / total if total else math.nan
            item["token_acc_rel"] = _ratio(item["token_acc"], item["token_acc_dense"])
            for n in task_names:
                item[f"{n}_rel"] = _ratio(item[n], dense_tasks.get(n, math.nan))
            out.append(item)
    return out


def _ratio(a: float, b: float) -> float:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


# ---------------------------------------------------------------------------------------------------- output
SHORT = {"top1_agreement": "top1", "token_acc": "acc", "token_acc_dense": "acc_dense", "token_acc_rel": "acc_rel",
         "kv_retrieval": "kv", "variable_tracking": "vars", "arithmetic": "arith"}
WIDE_ONLY = ("positions", "CR_tasks")  # in the CSV / JSON, not in the printed table


def format_table(rows: list[dict], *, compact: bool = True) -> str:
    """A plain text table, one line per row, a blank line between budgets; KL with 4 decimals, other floats
    with 3, ``-`` for NaN. ``compact``: short headers and without the ``positions`` / ``CR_tasks`` columns."""
    if not rows:
        return "(no rows)"
    columns = [c for c in rows[0] if not (compact and c in WIDE_ONLY)]
    headers = [_short(c) if compact else c for c in columns]
    cells = [[_cell(c, r.get(c)) for c in columns] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(headers, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    previous = None
    for r, row in zip(rows, cells):
        if previous is not None and r["B"] != previous:
            lines.append("")
        previous = r["B"]
        lines.append("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def _short(column: str) -> str:
    if column.endswith("_rel") and column[:-4] in SHORT:
        return SHORT[column[:-4]] + "_rel"
    return SHORT.get(column, column)


def _cell(column: str, value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.4f}" if column == "kl" else f"{value:.3f}"
    return str(value)


def table_csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]) if rows else [])
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def row_metrics(rows: list[dict]) -> dict[str, float]:
    """``{"<policy>.B<total>.<metric>": value}`` for every finite numeric column (MLflow metric names)."""
    out = {}
    for row in rows:
        for key, value in row.items():
            if key in ("policy", "budget", "B") or isinstance(value, (str, bool)) or value is None:
                continue
            value = float(value)
            if math.isfinite(value):
                out[f"{row['policy']}.B{row['B']}.{key}"] = value
    return out


def plot_metrics_vs_cr(rows: list[dict], task_names: Sequence[str] = ()):
    """(a) top-1 agreement, KL and (if tasks ran) mean task exact match against the compression ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("top1_agreement", "top-1 agreement with dense"), ("kl", "KL(dense ‖ policy) [nats/token]")]
    if task_names:
        panels.append(("task_mean", "task exact match (mean over tasks)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    policies = [p for p in POLICY_ORDER if any(r["policy"] == p for r in rows)]
    colors = {p: f"C{i}" for i, p in enumerate(POLICY_ORDER)}
    markers = {"dense": "", "streaming": "s", "tova": "^", "h2o": "v", "random": "x", "oracle": "*", "kvpop": "o"}
    for ax, (key, title) in zip(axes[0], panels):
        for p in policies:
            pts = sorted((r["CR"], _task_mean(r, task_names) if key == "task_mean" else r[key])
                         for r in rows if r["policy"] == p)
            pts = [(x, y) for x, y in pts if y is not None and not math.isnan(y)]
            if not pts:
                continue
            if p == "dense":
                if key != "task_mean":
                    continue
                ax.axhline(pts[0][1], color="k", ls="--", lw=1, label="dense")
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker=markers[p], color=colors[p], label=p, lw=1.5, ms=7 if p != "oracle" else 10)
        ax.set_xlabel("compression ratio CR = 1 − B/S")
        ax.set_title(title, fontsize=11)
        ax.grid(alpha=0.3)
        if key == "kl":
            ax.set_yscale("log")
        if key in ("top1_agreement", "task_mean"):
            ax.set_ylim(top=1.02)
    handles, labels = {}, []
    for ax in axes[0]:
        for h, l in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(l, h)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), frameon=False)
    fig.suptitle("Policies vs compression (teacher-forced on held-out text; positions ≥ B)", fontsize=12)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    return fig


def _task_mean(row: dict, task_names: Sequence[str]) -> float:
    values = [row.get(n, math.nan) for n in task_names]
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def plot_retention(retention: list[dict], policy: str = "kvpop", total: int | None = None):
    """(b) What the long-range slots hold at the last position, per (layer, KV head): mean age ``d − t`` for
    ``policy``, its overlap with the oracle's choice, and where the kept tokens sit in the sequence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [r for r in retention if r["policy"] == policy and (total is None or r["total"] == total)]
    if not chosen:
        return None
    main = max(chosen, key=lambda r: r["total"]) if total is None else chosen[0]
    others = [r for r in retention if r["total"] == main["total"]]
    age = torch.tensor(main["mean_age"])
    has_overlap = "oracle_overlap" in main
    ncols = 3 if has_overlap else 2
    fig, axes = plt.subplots(1, ncols, figsize=(5.0 * ncols, 5.0), gridspec_kw={"width_ratios": [1] * ncols})
    layers, heads = age.shape
    im = axes[0].imshow(age.numpy(), aspect="auto", cmap="viridis", origin="lower")
    axes[0].set_title(f"{policy}: mean age d−t of long-range tokens\n(last position, {main['budget']})", fontsize=10)
    axes[0].set_xlabel("KV head")
    axes[0].set_ylabel("layer")
    axes[0].set_xticks(range(heads))
    axes[0].set_yticks(_layer_ticks(layers))
    fig.colorbar(im, ax=axes[0], label="tokens back")
    col = 1
    if has_overlap:
        overlap = torch.tensor(main["oracle_overlap"])
        im = axes[1].imshow(overlap.numpy(), aspect="auto", cmap="magma", vmin=0, vmax=1, origin="lower")
        baseline = next((r for r in others if r["policy"] == "random" and "oracle_overlap" in r), None)
        note = f"mean {overlap.mean():.2f}"
        if baseline is not None and policy != "random":
            note += f"; random priorities: {torch.tensor(baseline['oracle_overlap']).mean():.2f}"
        axes[1].set_title(f"{policy}: share of long-range slots also chosen\nby the oracle ({note})", fontsize=10)
        axes[1].set_xlabel("KV head")
        axes[1].set_ylabel("layer")
        axes[1].set_xticks(range(heads))
        axes[1].set_yticks(_layer_ticks(layers))
        fig.colorbar(im, ax=axes[1], label="|kept ∩ oracle| / k")
        col = 2
    ax = axes[col]
    size = main["seq_len"]
    edges = [i * size / HIST_BINS for i in range(HIST_BINS + 1)]
    centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    for i, r in enumerate(sorted(others, key=lambda r: POLICY_ORDER.index(r["policy"]))):
        hist = torch.tensor(r["kept_histogram"])
        share = hist / hist.sum().clamp(min=1)
        ax.step(centers, share.numpy(), where="mid", label=r["policy"], lw=2 if r["policy"] == policy else 1.3,
                color=f"C{POLICY_ORDER.index(r['policy'])}")
    ax.set_title("where the kept long-range tokens sit\n(all layers and heads, last position)", fontsize=10)
    ax.set_xlabel("token position t")
    ax.set_ylabel("share of long-range slots")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def _layer_ticks(layers: int) -> list[int]:
    step = max(1, math.ceil(layers / 16))
    return list(range(0, layers, step))


# ---------------------------------------------------------------------------------------------------- the stage
@dataclass
class EvalResult:
    rows: list[dict]
    text: str
    output_dir: Path
    run_id: str | None
    figures: list[Path]
    seconds: dict


def checkpoint_path(cfg: PipelineConfig) -> Path:
    """``cfg.eval.checkpoint`` or the train stage's output for this config."""
    if cfg.eval.checkpoint:
        path = Path(cfg.eval.checkpoint).expanduser().resolve()
    else:
        from pipelines.train import model_dir

        path = model_dir(cfg)
    if not (path / "kvpop.json").is_file():
        raise ConfigError(f"no trained retrofitted model at {path}: run the train stage first, or set "
                          f"eval.checkpoint to a folder written by kvpop.save_retrofitted")
    return path


def load_eval_sequences(cfg: PipelineConfig, tokenizer=None) -> list[dict]:
    """The held-out sequences (the data stage's ``eval`` split); replaced in tests."""
    from pipelines.data import load_sequences

    return load_sequences(cfg, split="eval", tokenizer=tokenizer)


def load_model(cfg: PipelineConfig, path: Path):
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.model.dtype]
    model, tokenizer = kvpop.load_retrofitted(path, dtype=dtype)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.resolved_path(), local_files_only=True)
    return model, tokenizer


def load_reference(cfg: PipelineConfig):
    """The dense teacher when the base model was fine-tuned (distill); None: the evaluated model's dense mode."""
    if cfg.train.mode != "distill":
        return None
    from kvpop.pretrained import load_pretrained

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.model.dtype]
    model, _ = load_pretrained(cfg.model.resolved_path(), dtype=dtype)
    return model


def output_dir(cfg: PipelineConfig, checkpoint: Path) -> Path:
    key = fingerprint(cfg.model, cfg.data, cfg.budget, cfg.eval, str(checkpoint))
    return cfg.home_dir() / "eval" / key


def run(cfg: PipelineConfig, *, progress: bool = True) -> EvalResult:
    """Load the trained model, evaluate every policy × budget, write + log the table and figures."""
    import mlflow

    from pipelines import tracking
    from pipelines.tasks import generate_samples

    t0 = time.perf_counter()
    path = checkpoint_path(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # evaluation is one process, one device
    model, tokenizer = load_model(cfg, path)
    model.to(device)
    reference = load_reference(cfg)
    if reference is not None:
        reference.to(device)
    sequences = load_eval_sequences(cfg, tokenizer)
    if not sequences:
        raise ConfigError("no held-out sequences: set data.eval_sequences >= 1")
    seq_len = max(len(s["input_ids"]) for s in sequences)
    base = model.kvpop_runtime.policy.budget or cfg.budget
    budgets = resolve_budgets(base, seq_len, cfg.eval.budgets, cfg.eval.compression_ratios)
    tasks = {name: generate_samples(name, cfg.eval.task_samples, tokenizer, context=cfg.eval.task_context,
                                    seed=cfg.data.seed) for name in cfg.eval.tasks} if cfg.eval.task_samples else {}
    details: dict = {}
    rows = evaluate_model(model, tokenizer, sequences, policies=cfg.eval.policies, budgets=budgets,
                          base_budget=base, tasks=tasks, max_new_tokens=cfg.eval.max_new_tokens,
                          batch_size=cfg.eval.batch_size, generation_batch_size=cfg.eval.generation_batch_size,
                          dynamic_sequences=cfg.eval.dynamic_sequences, reference=reference, progress=progress,
                          details=details)
    text = format_table(rows)
    header = (f"KVpop evaluation of {path}\n{len(sequences)} held-out sequences of {seq_len} tokens (metrics over "
              f"positions >= B; CR = 1 - B/{seq_len}); tasks: {cfg.eval.task_samples} samples each, "
              f"~{cfg.eval.task_context}-token prompts, greedy, {cfg.eval.max_new_tokens} new tokens; "
              f"sink {base.sink} and window {base.window} fixed, topk swept\n"
              f"top1 = top-1 agreement with dense, kl = KL(dense || policy) in nats/token, acc / acc_dense = token "
              f"accuracy of the policy / of dense on the same positions, kv / vars / arith = task exact match, "
              f"*_rel = relative to dense")
    if 0 < cfg.eval.dynamic_sequences < len(sequences) and {"tova", "h2o"} & set(cfg.eval.policies):
        header += (f"\ntova / h2o teacher-forced on the first {cfg.eval.dynamic_sequences} sequence(s) (n_seq); "
                   f"their acc_dense is dense on the same ones")
    if "oracle" in cfg.eval.policies and tasks:
        header += "\noracle in free generation: the prompt's own teacher targets (none exist for generated tokens)"
    print(header)
    print(text)

    out = output_dir(cfg, path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.txt").write_text(header + "\n\n" + text + "\n")
    (out / "table.csv").write_text(table_csv(rows))
    (out / "table.json").write_text(json.dumps(rows, indent=2, default=float))
    (out / "details.json").write_text(json.dumps(details, indent=2, default=float))
    figures = {"metrics_vs_cr.png": plot_metrics_vs_cr(rows, list(tasks))}
    retention_policy = "kvpop" if any(r["policy"] == "kvpop" for r in details["retention"]) else (
        details["retention"][0]["policy"] if details["retention"] else None)
    if retention_policy:
        figures["retention.png"] = plot_retention(details["retention"], retention_policy, base.total
                                                  if any(r["total"] == base.total for r in details["retention"])
                                                  else None)
    saved = []
    for name, fig in figures.items():
        if fig is None:
            continue
        fig.savefig(out / name, dpi=110)
        saved.append(out / name)

    run_name = f"evaluate-{out.name[:10]}"
    seconds = {**details.get("seconds", {}), "total": time.perf_counter() - t0}
    with tracking.run(cfg, run_name, stage="evaluate", tags={"kvpop.checkpoint": str(path)}) as active:
        metrics = row_metrics(rows)
        items = list(metrics.items())
        for start in range(0, len(items), 500):
            mlflow.log_metrics(dict(items[start:start + 500]))
        mlflow.log_metrics({f"seconds.{k}": v for k, v in seconds.items()})
        mlflow.log_dict(rows, "eval/table.json")
        mlflow.log_text(table_csv(rows), "eval/table.csv")
        mlflow.log_text(header + "\n\n" + text + "\n", "eval/table.txt")
        mlflow.log_dict(details, "eval/details.json")
        for name, fig in figures.items():
            if fig is not None:
                mlflow.log_figure(fig, f"eval/{name}")
        run_id = active.info.run_id
    import matplotlib.pyplot as plt

    for fig in figures.values():
        if fig is not None:
            plt.close(fig)
    return EvalResult(rows, text, out, run_id, saved, seconds)


def _main() -> None:  # pragma: no cover - jobs/ hold the real CLI
    import argparse

    from pipelines.config import load_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?")
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    run(load_config(args.config, args.set))


if __name__ == "__main__":  # pragma: no cover
    _main()
