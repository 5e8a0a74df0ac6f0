"""A finished learning-curves study's dynamic heuristics (TOVA, H2O) on more of its held-out sequences.

A study runs TOVA and H2O — token by token through the fixed cache — on its first ``--dynamic-sequences`` held-out
sequences only (minutes each), so every comparison against them pairs over those few. This measures them on the
study's next held-out sequences up to ``--sequences`` and writes a copy of the study with those records added (the
summaries recomputed), which ``recency_blend.py --references-from`` reads like the study itself.

**Contract.** The study's text, budgets, base and settings are its own (``meta.args``): the sequences are rebuilt
from its corpus names (``--source-file NAME=PATH``: corpus NAME's text read from another file of the same text).
Nothing is paired with the study's records unless it is the very same text: where the study kept the held-out
digests (``meta.heldout_sha256``) they must match before the model loads; in every case streaming is measured on
each batch of new sequences first and must equal the study's streaming record there (KL and top-1 within
:data:`STREAMING_TOLERANCE`), else the run stops in one line (exit code 2) before the heuristics run on that batch.
The output is written after every batch, atomically; a re-run with the same ``--out`` measures only what is missing.

    python research/more_references.py --study research/results/learning_curves_h200_w256_qp16_prose.json \\
        --corpora stdlib /tmp/gpu/python_docs.jsonl --source-file /tmp/gpu/python_docs.jsonl=<the rebuilt docs> \\
        --policies tova h2o --sequences 64 --device cuda --out /tmp/r/learning_curves_h200_w256_qp16_prose_more.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DYNAMIC = ("tova", "h2o")  # the heuristics a study measures on its first --dynamic-sequences only
# the same text under the same model, device and dtype gives the same streaming record; other text differs by far more
STREAMING_TOLERANCE = 1e-3


def parse_args(argv=None):
    from jobs._cli import bare_parser, name_pairs

    p = bare_parser("more_references", __doc__)
    p.prog = "research/more_references.py"
    p.add_argument("--study", required=True, help="a finished learning_curves_*.json")
    p.add_argument("--corpora", nargs="+", required=True,
                   help="the study's corpus names to extend (its training corpus and / or its --eval-sources)")
    p.add_argument("--source-file", action="append", default=[], metavar="NAME=PATH",
                   help="read corpus NAME's held-out text from PATH (checked: the same text)")
    p.add_argument("--policies", nargs="+", default=["tova"], choices=DYNAMIC)
    p.add_argument("--sequences", type=int, required=True, help="extend to the first N held-out sequences "
                   "(at most the study's --eval-sequences)")
    p.add_argument("--batch", type=int, default=0, help="sequences per batch (default: the study's --eval-batch)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True, help="the extended study's JSON (+ .md); read first if it exists")
    args = p.parse_args(argv)
    args.source_file, bad = name_pairs(args.source_file, args.corpora)
    if bad:
        p.error(f"--source-file: give NAME=PATH with NAME one of --corpora, got {bad}")
    return args


def corpus_records(study: dict) -> dict[str, list[dict]]:
    """``{corpus name: its reference records}`` (:func:`research.learning_curves.reference_records`)."""
    from research.learning_curves import reference_records

    return reference_records(study)


def open_study(args) -> tuple[dict, argparse.Namespace]:
    """The study to extend (``--out`` when it exists: an earlier run of this) and its own arguments; one line
    (ConfigError) when it is not a study, a corpus is not in it, or ``--sequences`` is beyond its held-out set."""
    from pipelines.config import ConfigError

    path = Path(args.out) if Path(args.out).is_file() else Path(args.study)
    try:
        study = json.loads(path.read_text())
        own = argparse.Namespace(**study["meta"]["args"])
        records = corpus_records(study)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{path}: not a learning-curves study ({type(err).__name__}: {err})") from None
    if path == Path(args.out) and study.get("more_references", {}).get("study") != str(args.study):
        raise ConfigError(f"--out {path} exists and extends another study "
                          f"({study.get('more_references', {}).get('study')!r}): give another --out")
    missing = [name for name in args.corpora if name not in records]
    if missing:
        raise ConfigError(f"--corpora: the study has no corpus {missing}; it has {sorted(records)}")
    if not 1 <= args.sequences <= own.eval_sequences:
        raise ConfigError(f"--sequences must be 1 … {own.eval_sequences} (the study's held-out sequences), "
                          f"got {args.sequences}")
    if args.batch < 0:
        raise ConfigError(f"--batch must be >= 1 (0: the study's {own.eval_batch}), got {args.batch}")
    return study, own


def heldout_rows(args, own, name: str, tokenizer) -> list[dict]:
    """Corpus ``name``'s held-out rows as the study built them, its text read from ``--source-file`` where given."""
    from research.learning_curves import study_config
    from pipelines.data import check_inputs, load_sequences

    source = args.source_file.get(name, name)
    if name == own.source:  # the training corpus: its config is the study's own
        cfg = study_config(argparse.Namespace(**{**vars(own), "source": source}), max(1, own.train_sequences))
    else:
        cfg = study_config(own, 1, source)
    check_inputs(cfg)
    return load_sequences(cfg, "eval", tokenizer)


def missing_items(records: list[dict], rows: list[dict], policy: str, B: int) -> list[int]:
    """Indices (into ``rows``) of the held-out sequences without a ``policy`` record at total budget ``B``."""
    have = {r["item"] for r in records if r["policy"] == policy and r.get("B") == B and r["part"] == "text"}
    return [i for i, row in enumerate(rows) if row["id"] not in have]


def streaming_offset(mine: list[dict], theirs: list[dict], B: int) -> float:
    """The largest |KL| or |top-1| difference between this run's streaming records and the study's at total budget
    ``B``, by item."""
    there = {r["item"]: r for r in theirs if r["policy"] == "streaming" and r["part"] == "text" and r.get("B") == B}
    if any(r["item"] not in there for r in mine):  # nothing to hold it to: not the study's sequence
        return math.inf
    return max((abs(r[m] - there[r["item"]][m]) for r in mine for m in ("kl", "top1_agreement")), default=0.0)


def summarize(study: dict, own) -> None:
    """Every corpus's reference summary recomputed from its records (as the study computes it)."""
    from research.learning_curves import summarize_records

    budgets = study["meta"]["budgets"]
    refs = study["references"]
    refs["summary"] = summarize_records(refs["records"], budgets, own.resamples, own.seed)
    for corpus in study.get("corpora", {}).values():
        corpus["references"]["summary"] = summarize_records(corpus["references"]["records"], budgets,
                                                            own.resamples, own.seed)


def render(study: dict) -> str:
    """The extension's report: per corpus and heuristic, the items it has now and their means."""
    meta = study["more_references"]
    lines = [f"# {Path(meta['study']).name}, its heuristics on more held-out sequences", "",
             *[f"    python research/more_references.py {' '.join(run)}" for run in meta["runs"]], "",
             f"Measured here: {meta['device']}, torch {meta['torch']}; streaming re-measured on every new sequence "
             f"(largest difference to the study's: {meta['streaming_offset']:.2e}).", "",
             "| corpus | policy | B | items (added) | KL | top-1 |", "|---|---|---|---|---|---|"]
    for name, records in corpus_records(study).items():
        for policy in DYNAMIC:
            for B in sorted({r["B"] for r in records if r["policy"] == policy}):
                rows = [r for r in records if r["policy"] == policy and r["B"] == B and r["part"] == "text"]
                added = meta["added"].get(name, {}).get(policy, 0)
                lines.append(f"| {name} | {policy} | {B} | {len(rows)} ({added}) | "
                             f"{sum(r['kl'] for r in rows) / len(rows):.4f} | "
                             f"{sum(r['top1_agreement'] for r in rows) / len(rows):.4f} |")
    return "\n".join(lines) + "\n"


def run(args, argv) -> dict:
    import torch

    import kvpop
    from research.learning_curves import budgets_for, check_heldout, heldout_digest, resolved_dtype, study_config
    from kvpop.evaluation import Setting, teacher_forced_items
    from kvpop.files import atomic_write_text
    from kvpop.pretrained import load_pretrained
    from pipelines.config import ConfigError
    from pipelines.data import load_tokenizer

    study, own = open_study(args)
    out = Path(args.out)
    train_budget, budgets, _ = budgets_for(own)
    cfg = study_config(own, max(1, own.train_sequences))
    tokenizer = load_tokenizer(cfg)
    full = {name: heldout_rows(args, own, name, tokenizer) for name in args.corpora}
    check_heldout(f"--study {args.study}", study["meta"].get("heldout_sha256"),
                  {name: heldout_digest(r) for name, r in full.items()})
    rows = {name: r[:args.sequences] for name, r in full.items()}
    meta = study.setdefault("more_references", {"study": str(args.study), "added": {}, "streaming_offset": 0.0,
                                                "seconds": 0.0})
    device = torch.device(args.device)
    meta.setdefault("runs", []).append(list(argv))
    meta.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                torch=torch.__version__)
    todo = {(name, policy, b.total): missing_items(corpus_records(study)[name], rows[name], policy, b.total)
            for name in args.corpora for policy in args.policies for b in budgets}
    if not any(todo.values()):
        print("[more_references] nothing to measure: every asked record is there")
        return study
    model, _ = load_pretrained(Path(cfg.model.resolved_path()), dtype=getattr(torch, resolved_dtype(own)),
                               device=device)
    # retrofitted as the study's model was (the heuristics read no scorer: its weights do not matter here)
    kvpop.retrofit(model, train_budget, scorer=own.scorer, policy="kvpop", recency=own.recency,
                   scorer_options=json.loads(own.scorer_options))
    model.eval()
    batch = args.batch or own.eval_batch
    for name in args.corpora:
        for budget in budgets:
            items = sorted({i for policy in args.policies for i in todo[(name, policy, budget.total)]})
            for start in range(0, len(items), batch):
                chunk = items[start:start + batch]
                ids = [torch.tensor(rows[name][i]["input_ids"]) for i in chunk]
                t0 = time.perf_counter()

                def measured(runs):
                    return [{"part": "text", **r, "item": rows[name][chunk[r["item"]]]["id"]} for r in
                            teacher_forced_items(model, ids, runs, batch_size=len(chunk),
                                                 target_options=cfg.precompute.target_options())]

                records = corpus_records(study)[name]  # streaming first: minutes of TOVA only on the study's text
                offset = streaming_offset(measured([Setting("streaming", budget)]), records, budget.total)
                if offset > STREAMING_TOLERANCE:
                    raise ConfigError(f"corpus {name}: streaming here differs from the study's by {offset:.2e} on "
                                      f"items {chunk[0]} … {chunk[-1]}: not the same text, model or precision "
                                      f"(--source-file, the study's base and dtype)")
                found = measured([Setting(policy, budget) for policy in args.policies
                                  if any(i in todo[(name, policy, budget.total)] for i in chunk)])
                index = {rows[name][i]["id"]: i for i in chunk}
                for r in found:
                    if index[r["item"]] in todo[(name, r["policy"], budget.total)]:
                        records.append(r)
                        added = meta["added"].setdefault(name, {})
                        added[r["policy"]] = added.get(r["policy"], 0) + 1
                meta["streaming_offset"] = max(meta["streaming_offset"], offset)
                meta["seconds"] = round(meta["seconds"] + time.perf_counter() - t0, 1)
                summarize(study, own)
                out.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(out, json.dumps(study))
                print(f"[more_references] {name} {budget}: items {chunk[0]} … {chunk[-1]} "
                      f"({time.perf_counter() - t0:.0f}s, streaming offset {offset:.1e})", flush=True)
    return study


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from jobs._cli import fail
    from pipelines.config import ConfigError

    try:
        study = run(args, argv)
    except ConfigError as err:
        return fail("more_references", err)
    text = render(study)
    from kvpop.files import atomic_write_text

    atomic_write_text(Path(args.out).with_suffix(".md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
