"""The evaluation's three parts on one model, as tagged per-item records (the stage bootstraps them).

* ``text``: the held-out sequences teacher-forced under every setting (:func:`kvpop.evaluation.teacher_forced_items`);
* ``recall``: the recall-task samples — greedy exact match of the answer, and the gold answer teacher-forced
  (log-probability, rank of its first token, all tokens greedy); a cell (task, context, depth) is a *headline* cell
  when dense's exact match there reaches ``eval.task_min_dense``;
* ``generation``: the held-out problems (:mod:`pipelines.problems`) — tokens until the first divergence from dense,
  KL and top-1 agreement on dense's continuation teacher-forced, the final answer, whether it equals dense's
  (``answer_agrees``, where dense gave one) and the reference answer (``solved``, on the problems dense solves).

Each record gets ``part``, the item's string id, and its generated text (decoded; the token ids are dropped). The
inputs come from here too: the held-out sequences, the training documents, the checkpoint's model and tokenizer. The
recall tasks (:mod:`pipelines.recall`: ``TaskSpec``, ``generate_samples``, ``score_text``,
``gold_logprob_and_rank``) are used here and nowhere else in the stage.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

import kvpop
from kvpop import evaluation as runner
from kvpop.files import atomic_write_text
from kvpop.pretrained import load_pretrained
from kvpop.retrofit import runtime_of
from pipelines import recall
from pipelines import problems as long_prompts
from pipelines.config import ConfigError, PipelineConfig, config_path, corpus_name
from pipelines.data import heldout_source_config, load_sequences
from pipelines.identity import base_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def heldout_sequences(cfg: PipelineConfig, tokenizer) -> list[dict]:
    """The data stage's ``eval`` split: ``[{"id", "input_ids", "docs"}]``."""
    return load_sequences(cfg, split="eval", tokenizer=tokenizer)


CORPUS_PART = "corpus-"  # FinishedParts names of another corpus's text part: corpus-<name>.text


def heldout_corpora(cfg: PipelineConfig, tokenizer, seq_len: int) -> dict[str, dict]:
    """``eval.heldout_sources`` as ``{corpus name: {"source", "sequences"}}``: each corpus's held-out split
    (:func:`pipelines.data.heldout_source_config`), refused in one line if it is empty or cut at another length."""
    corpora = {}
    for source in cfg.eval.heldout_sources:
        name = corpus_name(source)
        try:
            sequences = load_sequences(heldout_source_config(cfg, source), split="eval", tokenizer=tokenizer)
        except ConfigError as err:
            raise ConfigError(f"eval.heldout_sources {source!r}: {err}") from None
        if not sequences or any(len(s["input_ids"]) != seq_len for s in sequences):
            raise ConfigError(f"eval.heldout_sources {source!r}: no held-out sequences of {seq_len} tokens")
        corpora[name] = {"source": source, "sequences": sequences}
    return corpora


def corpus_items(cfg: PipelineConfig, inputs: dict, name: str, sequences: list[dict], model, reference, *,
                 progress: bool = True, finished: FinishedParts | None = None) -> tuple[list[dict], dict]:
    """Another corpus's held-out ``sequences`` teacher-forced under every policy and budget of ``inputs``: its
    ``text`` records, each tagged ``corpus: name`` (the item ids are its own split's), and the seconds it took."""
    found, seconds = evaluate_items(cfg, {**inputs, "sequences": sequences, "samples": [], "problems": [],
                                          "prompts": []}, model, reference, progress=progress,
                                    finished=finished or FinishedParts(None),
                                    prefix=f"{CORPUS_PART}{name}.")
    return [{**r, "corpus": name} for r in found], {f"{CORPUS_PART}{name}.{k}": v for k, v in seconds.items()}


def training_documents(cfg: PipelineConfig, tokenizer) -> list[str]:
    """Ids of the documents the training split was cut from."""
    return [doc for s in load_sequences(cfg, split="train", tokenizer=tokenizer) for doc in s["docs"]]


def checkpoint_tokenizer(path: Path):
    """The tokenizer saved with the checkpoint (``kvpop.save_retrofitted(..., tokenizer)``), if any."""
    if not (path / "tokenizer_config.json").is_file():
        return None
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_models(cfg: PipelineConfig, path: Path, device):
    """The retrofitted model, and the dense reference when the base model was fine-tuned (distill) else None."""
    model, _ = kvpop.load_retrofitted(path, dtype=DTYPES[cfg.model.dtype], base=base_folder(cfg, path),
                                      verify_base=False)  # base_folder checked it (digests cached)
    reference = None
    if cfg.train.mode == "distill":
        reference, _ = load_pretrained(cfg.model.resolved_path(), dtype=DTYPES[cfg.model.dtype])
        reference.to(device).eval()
    return model.to(device).eval(), reference


def recall_samples(cfg: PipelineConfig, tokenizer, max_context: int | None) -> list:
    """Every cell's samples: tasks × contexts × depths, ``eval.task_samples`` each, seeded by ``data.seed``."""
    if not cfg.eval.task_samples:
        return []
    specs = [recall.TaskSpec(t, c, d, cfg.eval.task_samples, cfg.data.seed) for t in cfg.eval.tasks
             for c in cfg.eval.task_contexts for d in cfg.eval.task_depths]
    return [s for spec in specs for s in recall.generate_samples(spec, tokenizer, max_context=max_context)]


def describe(cfg: PipelineConfig, p: dict) -> str:
    """The report's head: what was evaluated, how, and what the column names mean."""
    base = p["base"]
    lines = [f"KVpop evaluation of {p['path']}",
             f"{len(p['sequences'])} held-out sequences of {p['seq_len']} tokens; CR = 1 - B/{p['seq_len']}; sink "
             f"{base.sink} and window {base.window} fixed, topk swept; streaming gets the same total as window",
             "top1 = top-1 agreement with dense, kl = KL(dense || policy) in nats/token, acc = token accuracy; "
             "intervals: 95% percentile bootstrap over items, paired for differences"]
    if cfg.eval.recency is not None:
        lines.append(f"kvpop ranks by its scorer + {cfg.eval.recency:g} * t (eval.recency, METHOD §3; trained with "
                     f"{p.get('own_recency', 0.0):g}); the other rows keep the model's own term")
    if cfg.eval.anchor_share is not None or cfg.eval.anchor_recency is not None:
        share, recency = p.get("own_anchors", (0.0, 0.0))
        share = share if cfg.eval.anchor_share is None else cfg.eval.anchor_share
        recency = recency if cfg.eval.anchor_recency is None else cfg.eval.anchor_recency
        lines.append(f"kvpop's anchor slots (eval.anchor_share, METHOD §1): {share:g} of the topk slots keep the best "
                     f"by its scorer + {recency:g} * t, beside the rest")
    if cfg.eval.allocated:
        lines.append(f"{', '.join(p + runner.ALLOCATED_SUFFIX for p in cfg.eval.allocated)}: the same policies under "
                     f"per-head budgets (METHOD §7), allocated ({cfg.allocate.mode}) from the allocate stage's slot "
                     f"gains at each B's mean: the same total memory, a larger peak per head (memory table)")
    if cfg.eval.dynamic_sequences and {"tova", "h2o"} & set(cfg.eval.policies):
        lines.append(f"tova / h2o teacher-forced on the first {cfg.eval.dynamic_sequences} sequences (paired on those)")
    if p["samples"]:
        lines.append(f"recall: {len(p['samples'])} samples in {len(p['samples']) // cfg.eval.task_samples} cells "
                     f"(tasks {', '.join(cfg.eval.tasks)}; contexts {list(cfg.eval.task_contexts)}; depths "
                     f"{list(cfg.eval.task_depths)}), greedy {cfg.eval.max_new_tokens} tokens; headline cells: dense "
                     f">= {cfg.eval.task_min_dense}")
    if p["problems"]:
        lines.append(f"generation: {len(p['problems'])} champ problems ({sum(q.seen_in_training for q in p['problems'])}"
                     f" seen in training), greedy {cfg.eval.generation_tokens} tokens; diverge_at = tokens until the "
                     f"first divergence from dense; answer = last \\boxed{{}} or last number")
    for name in cfg.eval.baselines:
        o = p.get("occupancy", {}).get(name)
        lines.append(f"{name}: trained baseline {cfg.eval.baselines[name]}" + ("" if o is None else (
            f"; ragged: mean {o['mean']:.1f} retained tokens per (layer, head) over the queries d >= {o['B']}, so "
            f"its row is at B = {o['B']}; peak {o['peak']}; per (layer, head) means "
            f"{min(min(r) for r in o['mean_per_head']):.1f}-{max(max(r) for r in o['mean_per_head']):.1f}")))
        c = p.get("capped", {}).get(name)
        if c is not None:
            lines.append(f"{name}{runner.CAPPED_SUFFIX}: {name} capped at {c['cap']} tokens per (layer, head) (the "
                         f"largest peak of the fixed-budget rows at B = {c['B']}; a full head drops its kept token of "
                         f"the highest eviction logit first): mean {c['mean']:.1f}, peak {c['peak']}")
    if "oracle" in cfg.eval.policies and (p["samples"] or p["problems"]):
        lines.append("oracle in generation: the teacher targets of the prompt + dense's continuation, by position")
    return "\n".join(lines)


class FinishedParts:
    """The parts an unfinished evaluation has finished: ``<folder>/<part>.json`` (its records and seconds), each written
    atomically when the part ends. The folder belongs to one evaluation key (the same inputs), so a re-run takes a
    finished part from here instead of running it again: a run cut off — a GPU session's end, a crash — keeps every
    part it finished. ``folder=None``: nothing is kept."""

    def __init__(self, folder: Path | None):
        self.folder = folder

    def get(self, part: str) -> dict | None:
        path = None if self.folder is None else self.folder / f"{part}.json"
        return json.loads(path.read_text()) if path is not None and path.is_file() else None

    def put(self, part: str, records: list[dict], seconds: float) -> None:
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.folder / f"{part}.json", json.dumps({"seconds": seconds, "records": records}))


def kvpop_ranking(ev) -> dict:
    """How the kvpop rows rank at evaluation (``eval.recency``, ``eval.anchor_share``, ``eval.anchor_recency``), as
    keywords of :func:`kvpop.evaluation.settings`: the stage's rows and the learning curve's points alike."""
    return {"kvpop_recency": ev.recency, "kvpop_anchor_share": ev.anchor_share,
            "kvpop_anchor_recency": ev.anchor_recency}


def evaluate_items(cfg: PipelineConfig, inputs: dict, model, reference=None, *, progress: bool = True,
                   runs: list | None = None, metric_start: int | None = None,
                   finished: FinishedParts = FinishedParts(None), prefix: str = "") -> tuple[list[dict], dict]:
    """All per-item records of the three parts and the seconds each part took. ``inputs``: ``tokenizer``,
    ``sequences``, ``budgets``, ``samples``, ``problems``, ``prompts`` (pipelines.evaluate.plan). ``runs``: the
    settings (default every ``eval.policies`` × budget); ``metric_start``: count the text metrics from there.
    ``finished``: parts already run are taken from there (as ``prefix + part``), each part run is put there."""
    tok, ev = inputs["tokenizer"], cfg.eval
    runs = runner.settings(ev.policies, inputs["budgets"], **kvpop_ranking(ev), allocated=ev.allocated,
                           allocations=inputs.get("allocations")) if runs is None else runs
    others = len([s for s in runs if s.policy != "dense"])
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    oracle = cfg.precompute.target_options()  # the target definition the scorer was trained on
    generation = dict(eos_id=tok.eos_token_id, pad_id=pad, batch_size=ev.generation_batch_size, reference=reference,
                      target_options=oracle)
    records, seconds = [], {}

    def part(name, total, fn):
        done = finished.get(prefix + name)
        if done is not None:
            seconds[name] = done["seconds"]
            return done["records"]
        t0 = time.perf_counter()
        with tqdm(total=total, desc=prefix + name, unit="item", disable=not progress) as bar:
            out = fn(bar.update)
        seconds[name] = time.perf_counter() - t0
        finished.put(prefix + name, out, seconds[name])
        return out

    sequences = inputs["sequences"]
    ids = [torch.tensor(s["input_ids"]) for s in sequences]
    records += part("text", len(ids) * len(runs), lambda tick: [
        {"part": "text", **r, "item": sequences[r["item"]]["id"]} for r in runner.teacher_forced_items(
            model, ids, runs, reference=reference, batch_size=ev.batch_size, dynamic_limit=ev.dynamic_sequences,
            metric_start=metric_start, target_options=oracle, progress=tick)])
    samples = inputs["samples"]
    if samples:
        records += part("recall", len(samples) * others, lambda tick: recall_records(runner.generation_items(
            model, [s.prompt_ids for s in samples], runs, max_new_tokens=ev.max_new_tokens,
            forced=[s.answer_ids for s in samples], progress=tick, **generation,
            score=lambda logits, i: recall.gold_logprob_and_rank(  # the rows that predict the answer
                logits, samples[i], start=len(samples[i].prompt_ids) - 1)), samples, tok, ev.task_min_dense))
    if inputs["problems"]:
        records += part("generation", len(inputs["prompts"]) * others, lambda tick: generation_records(
            runner.generation_items(model, inputs["prompts"], runs, max_new_tokens=ev.generation_tokens,
                                    forced="dense", progress=tick, **generation), inputs["problems"], tok))
    return records, seconds


def load_baselines(cfg: PipelineConfig, device) -> dict:
    """``eval.baselines``: ``{row name: model}``, each a saved retrofitted model under the policy it was saved with
    (StreamingLLM+: ``streaming``, DMS: the hard ``dms``, a separately trained KVpop: ``kvpop``)."""
    out = {}
    for name, folder in cfg.eval.baselines.items():
        where = baseline_path(name, folder)
        model, _ = kvpop.load_retrofitted(where, dtype=DTYPES[cfg.model.dtype], base=base_folder(cfg, where),
                                          verify_base=False)
        out[name] = model.to(device).eval()
    return out


def baseline_path(name: str, folder: str) -> Path:
    path = config_path(folder).resolve()
    if not (path / "kvpop.json").is_file():
        raise ConfigError(f"eval.baselines.{name}: {path} is not a folder written by kvpop.save_retrofitted (the train "
                          f"stage's final_model of a train.policy=streaming / dms run)")
    return path


def baseline_items(cfg: PipelineConfig, inputs: dict, name: str, model, reference, occupancy: dict | None = None, *,
                   progress: bool = True, finished: FinishedParts = FinishedParts(None)) -> tuple[list[dict], dict]:
    """A trained baseline's records on the same items as the main model, as rows named ``name``: under its own
    policy at every budget, or — DMS, ragged — once at the budget of its mean memory (``occupancy`` from
    :func:`kvpop.evaluation.dms_occupancy`, whose ``B`` also sets where the text metrics start). Dense is the main
    model's reference (the original teacher), whose own records the main evaluation already holds. An ``occupancy``
    with a ``cap`` (:func:`pipelines.evaluate.capped_occupancy`): DMS under that cap, as rows ``<name>-cap``."""
    policy = runtime_of(model).policy
    cap = (occupancy or {}).get("cap", 0)
    if policy.ragged:
        runs, start = [runner.Setting(policy.name, policy.budget, cap=cap)], occupancy["B"]
    else:
        runs, start = [runner.Setting(policy.name, b) for b in inputs["budgets"]], None
    row = name + runner.CAPPED_SUFFIX if cap else name
    found, seconds = evaluate_items(cfg, inputs, model, reference, progress=progress, runs=runs, metric_start=start,
                                    finished=finished, prefix=f"{row}.")
    records = baseline_rows(found, row)
    if policy.ragged:
        for r in records:
            r.update(B=occupancy["B"], budget=f"{runs[0].label} mean {occupancy['mean']:.1f} peak {occupancy['peak']}")
    return records, {f"{row}.{part}": s for part, s in seconds.items()}


def baseline_rows(found: list[dict], name: str) -> list[dict]:
    """A trained baseline's own records as rows named ``name`` (new dicts); its dense records are dropped: dense is
    the main model's reference, whose records the main evaluation holds."""
    return [{**r, "policy": name} for r in found if r["policy"] != "dense"]


def recall_records(found: list[dict], samples: list, tokenizer, min_dense: float) -> list[dict]:
    out = []
    for r in found:
        sample, text = samples[r.pop("item")], tokenizer.decode(r.pop("tokens"), skip_special_tokens=True)
        out.append({"part": "recall", **r, "item": sample.id, "task": sample.task, "context": sample.context,
                    "depth": sample.depth, "exact": float(recall.score_text(sample, text)), "text": text})
    cells: dict[tuple, list[float]] = {}
    for r in out:
        if r["policy"] == "dense":
            cells.setdefault((r["task"], r["context"], r["depth"]), []).append(r["exact"])
    good = {cell for cell, hits in cells.items() if sum(hits) / len(hits) >= min_dense}
    for r in out:
        r["headline"] = (r["task"], r["context"], r["depth"]) in good
    return out


def generation_records(found: list[dict], problems: list, tokenizer) -> list[dict]:
    out = []
    for r in found:
        problem, text = problems[r.pop("item")], tokenizer.decode(r.pop("tokens"), skip_special_tokens=True)
        answer = long_prompts.extract_answer(text)
        out.append({"part": "generation", **r, "item": problem.id, "answer": answer, "text": text,
                    "correct": float(long_prompts.same_answer(answer, problem.answer)),
                    "seen_in_training": problem.seen_in_training})
    dense = {r["item"]: r for r in out if r["policy"] == "dense"}
    for r in out:
        ref = dense.get(r["item"])
        r["answer_agrees"] = None if ref is None or ref["answer"] is None else float(
            long_prompts.same_answer(r["answer"], ref["answer"]))
        r["solved"] = r["correct"] if ref is not None and ref["correct"] else None
    return out
