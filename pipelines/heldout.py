"""In-training held-out evaluation (``train.eval_every``): a run's learning curve as metrics of its MLflow run.

Rank 0 of the train stage calls a :class:`HeldoutEvaluator` on the scorers as they are at step 0 of a fresh run,
every ``train.eval_every`` steps and at the last step (:class:`pipelines.train_worker.HeldoutRunner`). It measures,
with the evaluation stage's own code (:func:`pipelines.eval_parts.evaluate_items`, :func:`pipelines.report.summarize`):

* **items**, fixed for the run: the first ``train.eval_sequences`` (0: all ``data.eval_sequences``) sequences of the
  data stage's held-out split — documents the training split never holds — and, with ``train.eval_recall_samples``
  > 0, that many samples per recall cell (``eval.tasks`` × ``eval.task_contexts`` × ``eval.task_depths``, seeded by
  ``data.seed``: :func:`pipelines.eval_parts.recall_samples`); with ``train.eval_heldout_sources``, also the first
  ``train.eval_sequences`` sequences of each ``eval.heldout_sources`` corpus's held-out split
  (:func:`pipelines.eval_parts.heldout_corpora`: the evaluation stage's items of that corpus; text only) — how far
  the lead holds on corpora of kinds training never read;
* at the **training budget** only: kvpop at every point, ranked by the evaluation stage's rule (``eval.recency``,
  ``eval.anchor_share``, ``eval.anchor_recency``: the curve ends where the stage's number starts); dense, streaming
  and the oracle (under ``precompute``'s target definition) once per worker group and corpus, as references — they
  do not depend on the scorers. A run training at per-head budgets (``train.allocation``) measures kvpop and the
  oracle at them (the rows ``kvpop-H`` / ``oracle-H`` of the evaluation stage, logged under the same names);
* summarised over items (each corpus apart) with ``eval.resamples`` bootstrap resamples.

The references' records are kept in ``$KVPOP_HOME/heldout_references/<key>/`` (:func:`references_key`: the items'
tokens, the budget, the target definition, the ``eval`` settings, the base's weights, the card and torch; written as
:class:`pipelines.eval_parts.FinishedParts`): a resumed run, and a next phase on the same items, read them instead
of measuring them again (~150 s of an H100 for the recipe's items); ``jobs.state`` packs them.

:func:`heldout_metrics` names what is logged (:data:`METRICS` the curve's main lines; each with ``.lo`` / ``.hi``,
its 95 % interval): ``heldout.kl`` and ``heldout.top1`` (kvpop's KL(dense ‖ kvpop) and top-1 agreement over positions
``>= B``), ``heldout.gap_closed`` / ``heldout.gap_closed_top1`` (the fraction of the streaming → oracle gap kvpop
closes, a paired ratio), ``heldout.recall_exact`` (headline cells: dense's exact match there at least
``eval.task_min_dense``), and the references ``heldout.<streaming|oracle>.<kl|top1>``,
``heldout.dense.recall_exact``. Another corpus's are the same text metrics under ``heldout.<corpus>.``
(:func:`corpus_prefix`; the corpus named by :func:`pipelines.config.corpus_name`, never a reference's name), e.g.
``heldout.stdlib.gap_closed``, ``heldout.stdlib.streaming.kl``. :mod:`pipelines.curves` draws them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import numpy as np

from kvpop.evaluation import ALLOCATED_SUFFIX, settings
from kvpop.retrofit import runtime_of
from kvpop.pretrained import read_model_config
from pipelines import report
from pipelines.config import HELDOUT_REFERENCES, ConfigError, PipelineConfig
from pipelines.data import check_heldout_sources, load_sequences, load_tokenizer
from pipelines.eval_parts import FinishedParts, evaluate_items, heldout_corpora, kvpop_ranking, recall_samples

METRICS = ("heldout.kl", "heldout.top1", "heldout.gap_closed", "heldout.recall_exact")
PREFIX = "heldout."
_REPORTED = {"kl": "kl", "top1": "top1_agreement", "recall_exact": "recall_exact"}  # our name: pipelines.report's
REFERENCES_DIR = "heldout_references"  # under $KVPOP_HOME: one folder of reference records per references_key


def heldout_config(cfg: PipelineConfig) -> PipelineConfig:
    """``cfg`` as the evaluation code reads it here: ``train.eval_recall_samples`` samples per recall cell."""
    return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, task_samples=cfg.train.eval_recall_samples))


def heldout_inputs(cfg: PipelineConfig, tokenizer=None) -> dict:
    """The items (:func:`pipelines.eval_parts.evaluate_items`'s ``inputs``) at the training budget; one
    :class:`ConfigError` line where the recall cells do not fit the model."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    sequences = load_sequences(cfg, "eval", tokenizer)
    sequences = sequences[:cfg.train.eval_sequences or len(sequences)]
    context = read_model_config(cfg.model.resolved_path()).get("max_position_embeddings")
    try:
        samples = recall_samples(heldout_config(cfg), tokenizer, context)
    except ValueError as err:
        raise ConfigError(f"train.eval_recall_samples: {err}") from None
    return {"tokenizer": tokenizer, "sequences": sequences, "budgets": [cfg.budget], "samples": samples,
            "problems": [], "prompts": []}


def corpus_prefix(name: str) -> str:
    """Where corpus ``name``'s metrics are logged: ``heldout.<name>.``."""
    return f"{PREFIX}{name}."


def corpus_inputs(cfg: PipelineConfig, inputs: dict) -> dict[str, dict]:
    """With ``train.eval_heldout_sources``: ``{corpus name: items}``, ``inputs`` but for the sequences — the first
    ``train.eval_sequences`` (0: all) of each ``eval.heldout_sources`` corpus's held-out split — and no recall
    samples; else ``{}``. One :class:`ConfigError` line where a corpus cannot give them at ``data.seq_len``."""
    if not cfg.train.eval_heldout_sources:
        return {}
    try:
        check_heldout_sources(cfg)
        corpora = heldout_corpora(cfg, inputs["tokenizer"], cfg.data.seq_len)
    except ConfigError as err:
        raise ConfigError(f"train.eval_heldout_sources: {err}") from None
    count = cfg.train.eval_sequences or cfg.data.eval_sequences
    return {name: {**inputs, "sequences": corpus["sequences"][:count], "samples": []}
            for name, corpus in corpora.items()}


def check_heldout(cfg: PipelineConfig, tokenizer=None) -> None:
    """The driver's check before anything is written: the held-out items (every corpus's) can be built (one line if
    not)."""
    inputs = heldout_inputs(cfg, tokenizer)
    if not inputs["sequences"]:
        raise ConfigError("train.eval_every: the data stage's held-out split is empty (data.eval_sequences)")
    corpus_inputs(cfg, inputs)


def references_key(cfg: PipelineConfig, inputs: dict, identity: dict) -> str:
    """What the references' records of ``inputs`` depend on, as a digest: the items (tokens, recall samples), the
    budget, the oracle's target definition, the ``eval`` settings, and ``identity`` (the base's weights, the card,
    torch: whatever else changes a record)."""
    digest = hashlib.sha256(json.dumps(
        {"identity": identity, "budget": str(cfg.budget), "targets": cfg.precompute.target_options(),
         "eval": dataclasses.asdict(cfg.eval), "policies": HELDOUT_REFERENCES}, sort_keys=True, default=str).encode())
    for sequence in inputs["sequences"]:
        digest.update(np.asarray(sequence["input_ids"], dtype=np.int64).tobytes())
    for sample in inputs["samples"]:
        digest.update(json.dumps(dataclasses.asdict(sample), sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


class HeldoutEvaluator:
    """``evaluator(model) -> {metric name: value}`` for a retrofitted model under training (in eval mode, any
    device): kvpop at the training budget on the run's fixed items of each corpus, beside that corpus's references
    measured at the first call — or read from ``home``'s :data:`REFERENCES_DIR` where ``identity`` (see
    :func:`references_key`) is given and they were measured before."""

    def __init__(self, cfg: PipelineConfig, identity: dict | None = None, home: Path | None = None):
        self.cfg = heldout_config(cfg)
        self.identity, self.home = identity, home if home is not None else cfg.home_dir()
        main = heldout_inputs(cfg)
        # metric prefix -> items: the training source's under heldout.*, another corpus's under heldout.<corpus>.*
        self.items = {PREFIX: main, **{corpus_prefix(name): items for name, items in corpus_inputs(cfg, main).items()}}
        total = cfg.budget.total
        self.budgets = [{"B": total, "CR": 1 - total / cfg.data.seq_len, "budget": str(cfg.budget)}]
        self.references: dict[str, list[dict]] = {}  # metric prefix -> the references' records

    def records(self, model, policies: list[str], inputs: dict,
                finished: FinishedParts = FinishedParts(None)) -> list[dict]:
        allocation = runtime_of(model).allocation  # training at per-head budgets: measured at them
        allocated = [p for p in policies if allocation is not None and p in ("kvpop", "oracle")]
        # kvpop ranks as the evaluation stage ranks it: the curve predicts the stage's number
        runs = settings([p for p in policies if p not in allocated], [self.cfg.budget],
                        **kvpop_ranking(self.cfg.eval), allocated=allocated,
                        allocations={self.cfg.budget.total: allocation})
        found, _ = evaluate_items(self.cfg, inputs, model, progress=False, runs=runs, finished=finished)
        return [{**r, "policy": r["policy"].removesuffix(ALLOCATED_SUFFIX)} for r in found]

    def __call__(self, model) -> dict[str, float]:
        out = {}
        for prefix, inputs in self.items.items():
            if prefix not in self.references:
                kept = FinishedParts(None if self.identity is None else
                                     self.home / REFERENCES_DIR / references_key(self.cfg, inputs, self.identity))
                self.references[prefix] = self.records(model, list(HELDOUT_REFERENCES), inputs, kept)
            found = [r for r in self.records(model, ["kvpop"], inputs) if r["policy"] == "kvpop"]  # dense: the refs'
            summary = report.summarize(self.references[prefix] + found, self.budgets,
                                       resamples=self.cfg.eval.resamples)
            out.update(heldout_metrics(summary, self.cfg.budget.total, prefix))
        return out


def heldout_metrics(summary: dict, total: int, prefix: str = PREFIX) -> dict[str, float]:
    """The logged names (module docstring) of a :func:`pipelines.report.summarize` at budget ``total``, under
    ``prefix`` (a corpus's: :func:`corpus_prefix`); finite values only."""
    out = {}

    def put(name: str, entry: dict | None) -> None:
        if entry is not None:
            out.update({name: entry["estimate"], f"{name}.lo": entry["lo"], f"{name}.hi": entry["hi"]})

    def find(entries: list[dict], policy: str, metric: str) -> dict | None:
        return next((e for e in entries if e["policy"] == policy and e["metric"] == metric and e["B"] == total), None)

    for name, metric in _REPORTED.items():
        put(f"{prefix}{name}", find(summary["metrics"], "kvpop", metric))
        for policy in HELDOUT_REFERENCES:
            if (policy == "dense") == (name == "recall_exact"):  # dense: its text metrics are 0 / 1 by definition
                put(f"{prefix}{policy}.{name}", find(summary["metrics"], policy, metric))
    put(f"{prefix}gap_closed", find(summary["gap_closed"], "kvpop", "kl"))
    put(f"{prefix}gap_closed_top1", find(summary["gap_closed"], "kvpop", "top1_agreement"))
    return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(v)}


def logged_corpora(names) -> list[str]:
    """The other corpora among logged metric ``names`` (those of some ``heldout.<corpus>.<kl|top1|gap_closed>``),
    sorted."""
    found = set()
    for name in names:
        parts = name.split(".")  # corpus names hold no dot (pipelines.config: eval.heldout_sources)
        if len(parts) == 3 and f"{parts[0]}." == PREFIX and parts[1] not in HELDOUT_REFERENCES \
                and parts[2] in ("kl", "top1", "gap_closed"):
            found.add(parts[1])
    return sorted(found)
