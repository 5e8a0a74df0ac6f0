"""``python -m jobs.results <render|import|export|scorer|ingest>``: the results ledger (``results/ledger.jsonl``), RESULTS.md
and MLflow.

* ``render [--check]`` — RESULTS.md from the ledger (byte-identical on a re-render) and README.md's block between
  ``<!-- BEGIN results:headline -->`` and ``<!-- END results:headline -->`` where the markers are; ``--check``
  writes nothing and exits 1 if either file is not what the ledger renders.
* ``import [--config …] [--set …]`` — every ledger run not yet in the config's MLflow store (``tracking.uri``)
  becomes a finished run of experiment ``tracking.experiment``, its ledger id as tag ``kvpop.ledger_id``; a
  re-import adds nothing.
* ``export [--config …] [--set …] [--dry-run]`` — the store's finished runs of the stages (evaluate, train, the
  benchmarks) that the ledger lacks become new ledger lines. This is how the evaluation stage's runs reach the ledger.
* ``scorer FOLDER --name NAME --commit SHA`` — a train stage's ``final_model`` packed (byte-reproducibly) into the
  tracked artifact ``results/artifacts/<NAME>_scorer.tgz`` and appended as the training line ``train/<NAME>`` that
  names it: the scorer a RESULTS.md row measured, loadable with ``pipelines.ledger.artifact``.
* ``ingest --at COMMIT PATH …`` — result files of the ``benchmarks/results/`` era, read from git at COMMIT (never
  the working tree), converted and appended (the one-time migration; the converters are ``pipelines/ledger.py``'s).

``--ledger PATH`` (default ``results/ledger.jsonl``) picks another ledger; ``render --out`` / ``--readme`` other
files. Bad input (a bad ledger line, an unknown commit, a bad config) is one line and exit code 2.
"""
from __future__ import annotations

import sys
from pathlib import Path

from jobs import _cli
from pipelines import ledger as L
from pipelines.config import ConfigError, load_config


def _parser():
    p = _cli.bare_parser("results", "The results ledger (results/ledger.jsonl), RESULTS.md rendered from it, and "
                                    "MLflow (import / export).")
    p.add_argument("--ledger", type=Path, default=L.LEDGER, help="the ledger file (default results/ledger.jsonl)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=type(p))
    render = sub.add_parser("render", help="RESULTS.md (and README.md's headline block) from the ledger")
    render.add_argument("--out", type=Path, default=L.RESULTS_MD)
    render.add_argument("--readme", type=Path, default=L.README)
    render.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is not up to date")
    for name, text in (("import", "ledger → MLflow (idempotent)"), ("export", "MLflow → new ledger lines")):
        q = sub.add_parser(name, help=text)
        q.add_argument("--config", metavar="YAML", help="a preset or recipe whose tracking section names the store")
        q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
        if name == "export":
            q.add_argument("--dry-run", action="store_true", help="print the runs, append nothing")
    scorer = sub.add_parser("scorer", help="a trained final_model → a tracked artifact and its ledger line")
    scorer.add_argument("folder", type=Path, help="the train stage's final_model folder")
    scorer.add_argument("--name", required=True, help="the config's name: the line is train/<name>, the file "
                                                     "results/artifacts/<name>_scorer.tgz")
    scorer.add_argument("--commit", required=True, help="the commit that trained it")
    ingest = sub.add_parser("ingest", help="legacy result files from git → ledger lines")
    ingest.add_argument("--at", required=True, metavar="COMMIT", help="the commit to read the files from")
    ingest.add_argument("paths", nargs="+", metavar="PATH")
    return p


def _render(args) -> int:
    runs = L.read(args.ledger)
    if args.check:
        stale = [str(args.out)] if not args.out.exists() or args.out.read_text() != L.render(runs) else []
        if args.readme.exists():
            text = args.readme.read_text()
            if L.refresh_readme(text, runs) != text:
                stale.append(str(args.readme))
        for path in stale:
            print(f"kvpop results: {path} is not what the ledger renders: run python -m jobs.results render")
        return 1 if stale else 0
    changed = L.write_results(args.ledger, args.out, args.readme)
    print(f"{args.out}: {len(runs)} runs" + (f"; rewrote {', '.join(map(str, changed))}" if changed else
                                              "; up to date"))
    return 0


def _config(args):
    """The config whose tracking section names the store: a recipe's (its phases share one) or a preset's."""
    from pipelines.recipe import is_recipe, load_recipe

    if is_recipe(args.config):
        recipe = load_recipe(args.config, args.overrides)
        return recipe.config(recipe.phases[-1])
    return load_config(args.config, args.overrides)


def _import(args) -> int:
    cfg = _config(args)
    done = L.import_runs(L.read(args.ledger), cfg)
    print(f"imported {len(done)} runs into {cfg.tracking_uri()} (experiment {cfg.tracking.experiment})")
    return 0


def _export(args) -> int:
    cfg = _config(args)
    known = {r.run_id for r in L.read(args.ledger)}
    skipped: list[str] = []
    runs = L.export_runs(cfg, known, skipped)
    for line in skipped:
        print(f"kvpop results: left out {line}", file=sys.stderr)
    for run in runs:
        print(f"{run.run_id} {run.name} ({run.kind}, {len(run.metrics)} metrics)")
    if not args.dry_run and runs:
        L.append(runs, args.ledger)
    print(f"{'would append' if args.dry_run else 'appended'} {len(runs)} runs to {args.ledger}")
    return 0


def _scorer(args) -> int:
    # the artifact lies beside its ledger (results/artifacts/ of the repository whose results/ holds the ledger)
    run = L.scorer_folder_run(args.folder, args.name, args.commit, root=args.ledger.resolve().parent.parent)
    L.append([run], args.ledger)
    artifact = run.artifacts[0]
    print(f"{run.run_id} {run.name}: {artifact.path} ({artifact.size:,} bytes, sha256 {artifact.sha256[:16]}…)")
    return 0


def _ingest(args) -> int:
    runs = L.append(L.ingest_legacy(args.paths, args.at), args.ledger)
    for run in runs:
        print(f"{run.run_id} {run.name} ({run.kind}, commit {run.commit[:10]}, {len(run.metrics)} metrics)")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"render": _render, "import": _import, "export": _export, "scorer": _scorer,
                "ingest": _ingest}[args.command](args)
    except (ConfigError, ValueError, OSError) as err:
        return _cli.fail("results", err)
    except KeyboardInterrupt:
        return _cli.interrupted("results")


if __name__ == "__main__":
    sys.exit(main())
