"""The evaluation stage: every policy × budget on held-out text, recall tasks and long generation, with intervals.

:func:`run` resolves the inputs (the trained model, the held-out sequences, the recall cells, the held-out problems,
the budgets), runs them through :mod:`kvpop.evaluation`, bootstraps the per-item records (:mod:`pipelines.report`,
:mod:`pipelines.stats`), and writes one self-describing directory per hash of its inputs:

    $KVPOP_HOME/eval/<key>/config.json       what was evaluated: model identity, data digests, policies, budgets, specs;
                                             the folders' paths (``paths``: information, not keyed)
                          predictions.jsonl  one line per (part, policy, budget, item): its metrics and generated text
                          metrics.json       means, 95 % intervals, paired differences, gap closed, recall cells
                          report.txt         the printed report; figures *.png
                          complete.json      written last (atomically): the directory is complete; the MLflow run id
    $KVPOP_HOME/eval/<key>.parts/<part>.json     each part (text, recall, generation; a baseline's as <name>.<part>)
                                                 as it finishes: a re-run of an unfinished key skips those parts

``<key>`` hashes the model's identity (a digest of every file of the checkpoint folder), the held-out token ids (and
each ``eval.heldout_sources`` corpus's, when there are any), the policies, the budgets, the recall samples' token ids
and the generation prompts and length. A re-run with the same inputs finds ``complete.json``, prints the report and
reuses the MLflow run ``evaluate-<key>`` (one run per key: a run left unfinished by a crash is resumed, not
duplicated). The stage's hand-over record (:mod:`pipelines.records`,
``evaluate``: the directory and the MLflow run id) is written last. Budgets: ``eval.budgets`` totals and
``eval.compression_ratios`` (CR = 1 - B / S) with the training budget's sink and window, topk swept; a CR whose B is
below sink + window is reported as unreachable. Free generation: the oracle ranks by the teacher's targets of the
prompt followed by dense's continuation.

**More held-out corpora** (``eval.heldout_sources``: ``data.source`` values): each corpus's held-out split
(:func:`pipelines.data.heldout_source_config`: ``data.eval_sequences`` sequences of documents training never reads)
is teacher-forced under the same policies and budgets (the ``text`` part only; the recall and generation parts and the
trained baselines run once, on the main items). ``metrics.json`` ``summary.corpora.<corpus>`` holds its summary, the
report a section per corpus, MLflow its metrics as ``<corpus>.<policy>.B<total>.<metric>``
(:func:`pipelines.report.mlflow_metrics`); the main corpus's names are unprefixed.

**Trained baselines** (``eval.baselines``: row name → saved model folder, hashed into ``<key>``): each runs on the
same items under its own policy (:func:`pipelines.eval_parts.baseline_items`) against the same dense reference, as
rows of its own in the tables, paired differences and figures. DMS keeps a ragged number of tokens per head: its row
sits at the budget ``B`` of its mean retained tokens on the held-out sequences (:func:`kvpop.evaluation.dms_occupancy`,
added to the budgets, so that every policy has a paired row there); ``metrics.json`` ``summary.occupancy`` holds its
per (layer, head) mean and max and its peak. ``eval.capped``: DMS again at that ``B``, capped at the largest peak of
the fixed-budget rows there (``<name>-cap``: at most that many tokens per (layer, KV head); its occupancy in
``summary.capped``), so that it is also compared at the same reservation.

**Per-head budgets** (``eval.allocated``, METHOD §7): those static policies again at every budget under the allocate
stage's allocation at that mean (``<policy>-H``), beside their uniform rows. Every row's memory is reported two ways
(``summary.memory``, the memory table): the mean tokens per (layer, KV head) over the counted queries (what "matched
at B" matches) and the peak (what a serving engine reserves per head).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpop import Budget
from kvpop import evaluation as runner
from kvpop.retrofit import runtime_of
from kvpop.files import atomic_write_text
from kvpop.retrofit import CONFIG_FILE, SCORERS_FILE, rewindow_scorer_folder, saved_model_config
from pipelines import allocate as allocation_stage
from pipelines import eval_parts, records, report, stats, tracking
from pipelines import problems as long_prompts
from pipelines.config import ConfigError, PipelineConfig, config_path, fingerprint
from pipelines.data import check_heldout_sources, load_tokenizer
from pipelines.identity import base_folder, file_digest, folder_digest
from pipelines.train import model_dir

FORMAT_VERSION = 1


@dataclass
class EvalResult:
    output_dir: Path
    summary: dict
    text: str
    run_id: str | None
    seconds: dict
    reused: bool


def trained_model_path(cfg: PipelineConfig) -> Path:
    """``eval.checkpoint``, or the train stage's final model for this config."""
    if cfg.eval.checkpoint:
        path = config_path(cfg.eval.checkpoint).resolve()
    else:  # the train stage's committed record: no tokenizer, no weight hashing
        path = model_dir(cfg)
    if not (path / "kvpop.json").is_file():
        raise ConfigError(f"no trained retrofitted model at {path}: run the train stage first, or set "
                          f"eval.checkpoint to a folder written by kvpop.save_retrofitted")
    return path


ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads")


def check_checkpoint_base(cfg: PipelineConfig, path: Path) -> None:
    """``eval.checkpoint``, a folder with its own weights (distilled, or saved whole), must have ``model.path``'s
    architecture (:data:`ARCHITECTURE_KEYS`), else one :class:`ConfigError` naming both: otherwise another model would
    be evaluated against its own dense reference while the config names this one. (A scorer-only folder's base is
    held to its tensors digest by :func:`pipelines.identity.base_folder`.)"""
    model = cfg.model.resolved_path()
    try:
        theirs, ours = (json.loads((folder / "config.json").read_text()) for folder in (path, model))
    except (OSError, ValueError) as err:
        raise ConfigError(f"eval.checkpoint {path} against model.path {model}: {err}") from None
    differs = {k: (theirs.get(k), ours.get(k)) for k in ARCHITECTURE_KEYS if theirs.get(k) != ours.get(k)}
    if differs:
        raise ConfigError(f"eval.checkpoint {path} is another model than model.path {model} ("
                          + ", ".join(f"{k} {a} vs {b}" for k, (a, b) in differs.items())
                          + "): set model.path to the checkpoint's base model")


def resolve_budgets(base: Budget, seq_len: int, totals=(), ratios=()) -> tuple[list[Budget], list[dict]]:
    """``(budgets, unreachable)``: ``base``'s sink and window with ``topk`` from each total or CR, largest first;
    a CR whose total is below sink + window goes to ``unreachable``. Neither given: ``[base]``."""
    floor = base.sink + base.window
    for total in totals:
        if total < floor:
            raise ConfigError(f"eval.budgets: {total} is smaller than sink + window = {floor} (they stay fixed "
                              f"when the budget is swept): use a larger total")
    wanted = {int(t): None for t in totals}
    unreachable = []
    for ratio in ratios:
        total = int(round((1.0 - float(ratio)) * seq_len))
        if total < floor:
            unreachable.append({"CR": float(ratio), "B": total, "reason": f"B < sink + window = {floor}"})
        else:
            wanted.setdefault(total, ratio)
    if not wanted and not unreachable:
        wanted[base.total] = None
    budgets = [Budget.from_total(t, sink=base.sink, window=base.window) for t in sorted(wanted, reverse=True)]
    return budgets, unreachable


def matched_budgets(base: Budget, budgets: list[Budget], totals, seq_len: int) -> tuple[list[Budget], list[dict]]:
    """``budgets`` plus a budget at each ragged baseline's matched total (its mean retained tokens), so that every
    policy has a paired row there; largest first. A total below ``base``'s sink + window goes to ``unreachable``
    (every CR asked for may be unreachable too: ``base`` is the checkpoint's, not ``budgets[0]``)."""
    floor = base.sink + base.window
    extra = sorted(set(int(t) for t in totals) - {b.total for b in budgets})
    unreachable = [{"CR": 1 - t / seq_len, "B": t, "reason": f"a ragged baseline's mean retained B < sink + "
                    f"window = {floor}"} for t in extra if t < floor]
    added = [Budget.from_total(t, sink=base.sink, window=base.window) for t in extra if t >= floor]
    return sorted([*budgets, *added], key=lambda b: -b.total), unreachable


def _digest(rows) -> str:
    return fingerprint([list(map(int, r)) for r in rows], length=32)


def plan(cfg: PipelineConfig) -> dict:
    """Everything the evaluation depends on, resolved without loading the model, and the directory key."""
    check_heldout_sources(cfg)
    path = trained_model_path(cfg)
    weights = base_folder(cfg, path)  # a scorer-only checkpoint's base: model.path, refused unless its tensors match
    if cfg.eval.checkpoint and weights == path:  # a folder with its own weights: it must be of model.path's kind
        check_checkpoint_base(cfg, path)
    tokenizer = eval_parts.checkpoint_tokenizer(path) or load_tokenizer(cfg)
    sequences = eval_parts.heldout_sequences(cfg, tokenizer)
    if not sequences:
        raise ConfigError("no held-out sequences: set data.eval_sequences >= 1")
    seq_len = len(sequences[0]["input_ids"])
    kv = json.loads((path / "kvpop.json").read_text())
    base = Budget(**kv["budget"]) if kv.get("budget") else cfg.budget
    budgets, unreachable = resolve_budgets(base, seq_len, cfg.eval.budgets, cfg.eval.compression_ratios)
    context = saved_model_config(path, weights).get("max_position_embeddings")
    try:
        samples = eval_parts.recall_samples(cfg, tokenizer, context)
        problems = long_prompts.load_problems(cfg.eval.generation_prompts, seed=cfg.data.seed, training_docs=
                                              eval_parts.training_documents(cfg, tokenizer)) if cfg.eval.generation_prompts else []
    except ValueError as err:
        raise ConfigError(str(err)) from None
    prompts = [long_prompts.prompt_ids(p, tokenizer) for p in problems]
    # a folder is keyed by its files, not its path: a moved or imported KVPOP_HOME keeps the key (and the parts an
    # unfinished evaluation finished); the paths go beside the identity into config.json
    paths = {"model": str(path)}
    identity = {"model": {"files_sha256": folder_digest(path, cfg.home_dir()),
                          "dtype": cfg.model.dtype, "reference": cfg.train.mode == "distill"},
                "heldout": {"count": len(sequences), "seq_len": seq_len,
                            "sha256": _digest(s["input_ids"] for s in sequences)},
                "policies": list(cfg.eval.policies), "budgets": [str(b) for b in budgets], "unreachable": unreachable,
                "recall": {"samples": len(samples), "sha256": _digest(s.prompt_ids + s.answer_ids for s in samples),
                           "max_new_tokens": cfg.eval.max_new_tokens, "min_dense": cfg.eval.task_min_dense},
                "generation": {"problems": [p.id for p in problems], "sha256": _digest(prompts),
                               "tokens": cfg.eval.generation_tokens},
                "dynamic_sequences": cfg.eval.dynamic_sequences, "resamples": cfg.eval.resamples}
    for name in ("recency", "anchor_share", "anchor_recency"):  # only when set: the keys of evaluations without
        if getattr(cfg.eval, name) is not None:                # them stay as they were
            identity[f"kvpop_{name}"] = getattr(cfg.eval, name)
    corpora = eval_parts.heldout_corpora(cfg, tokenizer, seq_len)
    if corpora:  # likewise
        identity["heldout_sources"] = [{"source": c["source"], "corpus": name, "count": len(c["sequences"]),
                                        "sha256": _digest(s["input_ids"] for s in c["sequences"])}
                                       for name, c in corpora.items()]
    if cfg.eval.allocated:  # likewise
        identity["allocated"] = {"policies": list(cfg.eval.allocated), "mode": cfg.allocate.mode,
                                 "gains_sha256": allocation_stage.gains_digest(cfg)}
    if cfg.eval.capped:  # likewise
        identity["capped"] = True
    if cfg.eval.baselines:  # likewise
        identity["baselines"] = {}
        for name, folder in cfg.eval.baselines.items():
            where = eval_parts.baseline_path(name, folder)
            identity["baselines"][name] = {"files_sha256": folder_digest(where, cfg.home_dir())}
            paths.setdefault("baselines", {})[name] = str(where)
    key = fingerprint("kvpop.eval", FORMAT_VERSION, identity, length=16)
    return {"key": key, "identity": identity, "paths": paths, "path": path, "tokenizer": tokenizer, "sequences": sequences,
            "base": base, "budgets": budgets, "samples": samples, "problems": problems, "prompts": prompts,
            "seq_len": seq_len, "corpora": corpora}


def run(cfg: PipelineConfig, *, progress: bool = True) -> EvalResult:
    """Evaluate (or find the complete result of) this config; print the report; log it to MLflow once."""
    t0 = time.perf_counter()
    p = plan(cfg)
    out = cfg.home_dir() / "eval" / p["key"]
    marker = out / "complete.json"
    if marker.is_file():
        done = json.loads(marker.read_text())
        text = (out / "report.txt").read_text()
        print(text + f"\n(complete result reused from {out})", flush=True)
        summary = json.loads((out / "metrics.json").read_text())["summary"]
        run_id = _log(cfg, out, p, summary, done.get("run_id"), done.get("seconds"))
        if run_id != done.get("run_id"):
            atomic_write_text(marker, json.dumps({**done, "run_id": run_id}, indent=1))
        records.commit(cfg, "evaluate", {"output_dir": str(out), "mlflow_run_id": run_id})
        return EvalResult(out, summary, text, run_id, done["seconds"], True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # one process, one device
    model, reference = eval_parts.load_models(cfg, p["path"], device)
    baselines = eval_parts.load_baselines(cfg, device)
    own = runtime_of(model).policy
    p["own_recency"], p["own_anchors"] = own.recency, (own.anchor_share, own.anchor_recency)
    p["occupancy"] = {name: runner.dms_occupancy(m, [torch.tensor(s["input_ids"]) for s in p["sequences"]],
                                                 batch_size=cfg.eval.batch_size)
                      for name, m in baselines.items() if runtime_of(m).policy.ragged}
    p["budgets"], matched_unreachable = matched_budgets(p["base"], p["budgets"], [o["B"] for o in
                                                                                p["occupancy"].values()], p["seq_len"])
    unreachable = [*p["identity"]["unreachable"], *matched_unreachable]
    p["allocations"] = (allocation_stage.allocations_at(cfg, [b.total for b in p["budgets"]])
                        if cfg.eval.allocated else {})
    p["capped"] = capped_occupancy(cfg, p, baselines)
    p["evicting"] = {b.total: runner.evicting_share([len(ids) for ids in p["prompts"]], cfg.eval.generation_tokens,
                                                    b.total) for b in p["budgets"]} if p["prompts"] else {}
    finished = eval_parts.FinishedParts(parts_dir(out))
    with _memory_limit(cfg, device):
        items, seconds = eval_parts.evaluate_items(cfg, p, model, reference, progress=progress, finished=finished)
        for name, corpus in p["corpora"].items():
            found, spent = eval_parts.corpus_items(cfg, p, name, corpus["sequences"], model, reference,
                                                   progress=progress, finished=finished)
            items += found
            seconds.update(spent)
        for name, baseline in baselines.items():
            found, spent = eval_parts.baseline_items(cfg, p, name, baseline, reference or model,
                                                     p["occupancy"].get(name), progress=progress, finished=finished)
            items += found
            seconds.update(spent)
            if name in p["capped"]:
                found, spent = eval_parts.baseline_items(cfg, p, name, baseline, reference or model,
                                                         p["capped"][name], progress=progress, finished=finished)
                items += found
                seconds.update(spent)
    budgets = [{"B": b.total, "CR": 1 - b.total / p["seq_len"], "budget": str(b)} for b in p["budgets"]]
    summary = report.summarize([r for r in items if "corpus" not in r], budgets, resamples=cfg.eval.resamples,
                               seed=cfg.data.seed)
    if p["corpora"]:
        summary["corpora"] = {name: {"source": c["source"], **report.summarize(
            [r for r in items if r.get("corpus") == name], budgets, resamples=cfg.eval.resamples, seed=cfg.data.seed)}
            for name, c in p["corpora"].items()}
    summary["occupancy"] = p["occupancy"]
    if p["capped"]:
        summary["capped"] = p["capped"]
    summary["memory"] = memory_rows(cfg, p, baselines)
    labels = {(r["policy"], r["B"]): r["budget"] for r in items if r["part"] == "text" and "corpus" not in r}
    text = eval_parts.describe(cfg, p) + "\n" + report.format_report(summary, budgets, labels=labels,
                                                         unreachable=unreachable, evicting=p["evicting"]) \
        + "\n" + report.format_memory(summary["memory"])
    print(text, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.json", json.dumps({**p["identity"], "paths": p["paths"], "config": cfg.to_dict()},
                                                      indent=1))
    atomic_write_text(out / "predictions.jsonl", "".join(json.dumps(r) + "\n" for r in items))
    atomic_write_text(out / "metrics.json", json.dumps({
        "budgets": budgets, "unreachable": unreachable, "summary": summary, "generation_evicting": p["evicting"],
        "labels": [{"policy": k[0], "B": k[1], "budget": v} for k, v in labels.items()]}, indent=1))
    atomic_write_text(out / "report.txt", text + "\n")
    report.save_figures(summary, budgets, out)
    seconds["total"] = time.perf_counter() - t0
    run_id = _log(cfg, out, p, summary, None, seconds)
    records.crash_point("evaluate.logged")
    atomic_write_text(marker, json.dumps({"key": p["key"], "run_id": run_id, "seconds": seconds}, indent=1))
    records.crash_point("evaluate.complete")
    shutil.rmtree(parts_dir(out), ignore_errors=True)  # predictions.jsonl holds every record now
    records.commit(cfg, "evaluate", {"output_dir": str(out), "mlflow_run_id": run_id})  # the hand-over, last
    return EvalResult(out, summary, text, run_id, seconds, False)


def memory_rows(cfg: PipelineConfig, p: dict, baselines: dict) -> list[dict]:
    """Every row's memory two ways (issue 43): ``{"policy", "B", "mean", "peak"}`` tokens per (layer, KV head) at the
    queries its text metrics count (``d >= B``) — a fixed budget holds ``min(d + 1, b)`` per head
    (:meth:`kvpop.evaluation.Setting.memory`: the mean and the largest head's), a ragged baseline (DMS) what it was
    measured to hold (its occupancy), dense everything."""
    seq_len, out = p["seq_len"], []
    runs = runner.settings(cfg.eval.policies, p["budgets"], allocated=cfg.eval.allocated,
                           allocations=p.get("allocations"))
    for setting in runs:
        for b in (p["budgets"] if setting.policy == "dense" else [setting.budget]):
            out.append({"policy": setting.name, "B": b.total, **setting.memory(seq_len, b.total)})
    for name, model in baselines.items():
        policy = runtime_of(model).policy
        if policy.ragged:
            for row, o in ((name, p["occupancy"][name]), (name + runner.CAPPED_SUFFIX, p["capped"].get(name))):
                if o is not None:
                    out.append({"policy": row, "B": o["B"], "mean": o["mean"], "peak": o["peak"]})
        else:
            out += [{"policy": name, "B": b.total, **runner.Setting(policy.name, b).memory(seq_len, b.total)}
                    for b in p["budgets"]]
    return out


def capped_occupancy(cfg: PipelineConfig, p: dict, baselines: dict) -> dict:
    """``eval.capped``: ``{baseline name: {"cap", "B", "mean", "peak", …}}`` for each ragged baseline — its cap the
    largest peak of the fixed-budget rows at its budget ``B`` (the allocation's at that mean when ``eval.allocated``,
    else ``B``), its occupancy under the cap over the queries ``d >= B`` (:func:`kvpop.evaluation.dms_occupancy`)."""
    if not cfg.eval.capped:
        return {}
    out = {}
    for name, model in baselines.items():
        policy = runtime_of(model).policy
        if not policy.ragged:
            continue
        total = p["occupancy"][name]["B"]
        allocation = p["allocations"].get(total)
        cap = max(total, allocation.peak_budget if allocation is not None else total)
        with runner.applied(model, runner.Setting(policy.name, policy.budget, cap=cap)):
            out[name] = {"cap": cap, **runner.dms_occupancy(model, [torch.tensor(s["input_ids"]) for s in
                                                                    p["sequences"]],
                                                            batch_size=cfg.eval.batch_size, start=total)}
    if not out:
        raise ConfigError("eval.capped caps a ragged trained baseline (DMS), and eval.baselines holds none: drop "
                          "eval.capped or add the DMS model")
    return out


@contextlib.contextmanager
def _memory_limit(cfg: PipelineConfig, device: torch.device):
    """Out of device memory is one :class:`ConfigError` line saying which settings to lower. The batches are the
    config's, not sized to the free memory (a documented limit: several evaluations sharing a GPU must split it by
    their batch sizes); the parts finished before it are kept, and a re-run resumes after them."""
    try:
        yield
    except torch.OutOfMemoryError:
        free = ""
        if device.type == "cuda":
            torch.cuda.empty_cache()
            free = f" ({torch.cuda.mem_get_info(device)[0] / 2**30:.1f} GiB free now)"
        raise ConfigError(f"out of {device.type} memory{free} at eval.batch_size={cfg.eval.batch_size}, "
                          f"eval.generation_batch_size={cfg.eval.generation_batch_size}: the evaluation does not size "
                          f"its batches to the free memory; lower them (finished parts are kept: a re-run resumes)") \
            from None


def parts_summary(folder: Path, seq_len: int, *, resamples: int = stats.RESAMPLES,
                  markdown: bool = False) -> tuple[dict, str]:
    """The summary and report of what an *unfinished* evaluation finished: the records of every part in its
    ``<key>.parts`` folder (``<part>.json``; a trained baseline's ``<name>.<part>.json``, renamed to its row ``name``
    as :func:`pipelines.eval_parts.baseline_items` does), at the budgets its text records hold. A session cut short
    keeps these; this says what they show without the models (the intervals are the complete run's, over fewer parts:
    a part that did not finish has no rows). A ragged baseline's (DMS's) rows stay at its policy's budget: the
    occupancy that places them is measured with the model."""
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise ConfigError(f"{folder}: no finished evaluation parts (<part>.json) there")
    items = []
    for path in files:
        if path.stem.startswith(eval_parts.CORPUS_PART):  # another corpus's text: not this table's items
            continue
        name = path.stem.rpartition(".")[0]  # "<name>.<part>" for a trained baseline, "<part>" for the main model
        found = json.loads(path.read_text())["records"]
        items += eval_parts.baseline_rows(found, name) if name else found
    totals = sorted({r["B"] for r in items if r["part"] == "text" and r["B"] is not None}, reverse=True)
    budgets = [{"B": b, "CR": 1 - b / seq_len} for b in totals]
    summary = report.summarize(items, budgets, resamples=resamples)
    text = (f"Unfinished evaluation {folder}: finished parts {', '.join(f.stem for f in files)}\n"
            + report.format_report(summary, budgets, markdown=markdown))
    return summary, text


def parts_dir(out: Path) -> Path:
    """``<key>.parts`` beside the result directory: the parts an unfinished evaluation of that key has finished
    (:class:`pipelines.eval_parts.FinishedParts`); removed once the directory is complete."""
    return out.with_name(out.name + ".parts")


def _log(cfg: PipelineConfig, out: Path, p: dict, summary: dict, run_id: str | None, seconds: dict | None = None):
    """The MLflow run ``evaluate-<key>``: reuse a finished one, resume an unfinished one, else start it (with the
    ``seconds.*`` of the evaluation that made ``out``, also when a reused directory's run is logged afresh)."""
    import mlflow
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource

    name = f"evaluate-{p['key']}"
    tracking.setup(cfg)  # the config's store: asked before it is set, MLflow answers from ./mlflow.db
    client = mlflow.MlflowClient(cfg.tracking_uri())
    if run_id is not None:
        try:
            if client.get_run(run_id).info.status == "FINISHED":
                return run_id
        except mlflow.exceptions.MlflowException:  # gone from this store: the run by name, else log it afresh
            run_id = None
    run_id = run_id or tracking.find_run(cfg, name, "evaluate")
    if run_id is not None and client.get_run(run_id).info.status == "FINISHED":
        return run_id
    with tracking.run(cfg, name, stage="evaluate", run_id=run_id, tags={"kvpop.checkpoint": str(p["path"])}) as active:
        items = list(report.mlflow_metrics(summary).items()) + [(f"seconds.{k}", v) for k, v in (seconds or {}).items()]
        for start in range(0, len(items), 500):
            mlflow.log_metrics(dict(items[start:start + 500]))
        source = LocalArtifactDatasetSource(str(out / "predictions.jsonl"))
        parts = [("heldout", p["identity"]["heldout"]), ("recall", p["identity"]["recall"]),
                 ("generation", p["identity"]["generation"])]
        parts += [(f"heldout-{c['corpus']}", c) for c in p["identity"].get("heldout_sources", [])]
        for part, info in parts:
            mlflow.log_input(MetaDataset(source, name=f"eval-{part}", digest=info["sha256"][:32]), context="evaluation")
        mlflow.log_artifacts(str(out), "eval")
        return active.info.run_id


# ------------------------------------------------------------------------------------------------ read windows
def readings(cfg: PipelineConfig) -> list[PipelineConfig]:
    """The evaluations ``eval.read_windows`` adds: the CRs this config's trained budget cannot reach (B < sink +
    window), each at the largest read window that leaves long-range slots (sink + w < B), grouped by window: per
    window, this config evaluating a copy of the trained scorers at that window
    (:func:`kvpop.retrofit.rewindow_scorer_folder`: the same weights, read when a token leaves the shorter window; a
    policy of its own, not the trained one) at those CRs only. Empty without ``eval.read_windows``."""
    if not cfg.eval.read_windows:
        return []
    path = trained_model_path(cfg)
    kv = json.loads((path / CONFIG_FILE).read_text())
    if not kv.get("budget") or not kv.get("scorer"):
        raise ConfigError(f"eval.read_windows: {path} holds no trained scorers with a budget to read at other windows")
    trained = Budget(**kv["budget"])
    _, unreachable = resolve_budgets(trained, cfg.data.seq_len, (), cfg.eval.compression_ratios)
    by_window: dict[int, list[float]] = {}
    for cell in unreachable:
        fits = [w for w in cfg.eval.read_windows if trained.sink + w < cell["B"]]
        if fits:
            by_window.setdefault(max(fits), []).append(cell["CR"])
    found = []
    scorers = file_digest(path / SCORERS_FILE, cfg.home_dir())[:16]
    for window, ratios in sorted(by_window.items(), reverse=True):
        folder = cfg.home_dir() / "eval" / "read_windows" / f"{scorers}-s{trained.sink}-w{window}"
        if not (folder / CONFIG_FILE).is_file():  # written aside, then renamed: a kill leaves no half folder
            aside = folder.with_name(f".{folder.name}.tmp")
            shutil.rmtree(aside, ignore_errors=True)
            rewindow_scorer_folder(path, aside, Budget(trained.sink, window, 0))
            aside.rename(folder)
        found.append(dataclasses.replace(cfg, eval=dataclasses.replace(  # allocations are made at the trained window
            cfg.eval, checkpoint=str(folder), compression_ratios=tuple(ratios), budgets=(), read_windows=(),
            allocated=())))
    return found


def run_readings(cfg: PipelineConfig, *, progress: bool = True) -> list[EvalResult]:
    """:func:`run` for this config, then for each of its :func:`readings`."""
    results = [run(cfg, progress=progress)]
    for reading in readings(cfg):
        print(f"[kvpop.evaluate] CR {', '.join(f'{r:g}' for r in reading.eval.compression_ratios)}: the scorers read "
              f"at {reading.eval.checkpoint}", flush=True)
        results.append(run(reading, progress=progress))
    return results
