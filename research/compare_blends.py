"""Two scorers' held-out records on the same sequences: the candidate's rule minus the baseline's same rule, per corpus,
paired by sequence id with 95 % bootstrap intervals — scorers of different studies compared where each was measured.

    python research/compare_blends.py BASELINE CANDIDATE --tag NAME [--rules kvpop kvpop+0.002] \\
        [--alias NEW=OLD] [--B 512]

``BASELINE`` / ``CANDIDATE``: a ``recency_blend_<tag>_items.jsonl`` (its rules as named there), or a learning-curves
study ``learning_curves_<tag>.json@TOKENS`` (its scorer's records at the point nearest ``TOKENS``, on every corpus it
evaluated, as rule ``kvpop``). ``--alias NEW=OLD``: corpus ``NEW`` of either side is the same held-out text as ``OLD``
(a rebuilt file, :mod:`research.recency_blend`'s ``--reference-source``). ``--B``: the total budget of a study's
records (default: the blend side's, else the study's only one). Compared: KL (lower is better) and top-1 agreement
over the sequences both sides have; where both sides are blend files with their ``recency_blend_<tag>_recall.jsonl``
beside them, also each recall task's exact match and gold log-probability over the samples both have (paired by
sample). Writes ``<out>/compare_<tag>.{json,md}``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

METRICS = (("kl", "KL", -1), ("top1", "top-1", 1))
RECALL_METRICS = (("exact", "exact", 1), ("logprob", "gold logp", 1))


def parse_args(argv=None):
    from jobs._cli import bare_parser, name_pairs  # a bad command line: one line and exit code 2

    p = bare_parser("compare_blends", __doc__.split("\n\n")[0])
    p.prog = "research/compare_blends.py"
    p.add_argument("baseline", help="recency_blend_<tag>_items.jsonl or learning_curves_<tag>.json@TOKENS")
    p.add_argument("candidate", help="the same kinds")
    p.add_argument("--tag", required=True)
    p.add_argument("--rules", nargs="*", default=[], help="rules to compare (default: every rule both sides have)")
    p.add_argument("--alias", action="append", default=[], metavar="NEW=OLD", help="corpus NEW is corpus OLD")
    p.add_argument("--B", type=int, default=None, help="total budget of a study's records")
    p.add_argument("--out", default=str(REPO / "research" / "results"))
    args = p.parse_args(argv)
    args.alias, bad = name_pairs(args.alias)
    if bad:
        p.error(f"--alias takes NEW=OLD, got {bad}")
    return args


def blend_records(path: Path, aliases: dict) -> tuple[dict, int | None]:
    """{(corpus, sequence id, rule): {"kl", "top1"}} of a recency_blend records file, and its total budget."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    if not rows or any("id" not in r or "rule" not in r for r in rows):
        raise ValueError(f"{path}: not a recency_blend records file (records with a sequence id and a rule)")
    totals = {sum(r["budget"].values()) for r in rows}
    if len(totals) != 1:
        raise ValueError(f"{path}: records of several budgets {sorted(totals)}")
    out = {(aliases.get(r["source"], r["source"]), r["id"], r["rule"]): {"kl": r["kl"], "top1": r["top1"]}
           for r in rows}
    return out, totals.pop()


def recall_records(items_path: Path) -> dict | None:
    """{("recall <task>", sample id, rule): {"exact", "logprob"}} of the recall answers beside a blend records file
    (``…_items.jsonl`` → ``…_recall.jsonl``); None where there are none."""
    if not items_path.name.endswith("_items.jsonl"):
        return None
    path = items_path.with_name(items_path.name.removesuffix("_items.jsonl") + "_recall.jsonl")
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    if any(not {"task", "item", "rule", "exact", "logprob"} <= set(r) for r in rows):
        raise ValueError(f"{path}: not a recency_blend recall file (answers with a task, sample, rule, exact, logprob)")
    return {(f"recall {r['task']}", r["item"], r["rule"]): {"exact": r["exact"], "logprob": r["logprob"]}
            for r in rows}


def study_records(spec: str, aliases: dict, B: int | None) -> tuple[dict, int]:
    """The scorer's records of a learning-curves study at the point nearest ``TOKENS`` (``path@TOKENS``), at total
    budget ``B`` (or the study's only one), as rule ``kvpop``."""
    from research.compare_studies import kvpop_records, load_point

    path, _, tokens = spec.rpartition("@")
    try:
        tokens = float(tokens)
    except ValueError:
        raise ValueError(f"{spec}: give a study as PATH@TOKENS (e.g. learning_curves_x.json@4e6)") from None
    study, point = load_point(Path(path), tokens)
    try:
        corpora = {name or study["meta"]["study"]["source"]: records for name, records in kvpop_records(point).items()}
    except (KeyError, TypeError) as err:
        raise ValueError(f"{spec}: not a learning-curves study ({type(err).__name__}: {err})") from None
    rows = [(name, r) for name, records in corpora.items() for r in records
            if r.get("policy") == "kvpop" and r.get("part") == "text"]
    budgets = sorted({r["B"] for _, r in rows})
    if B is None and len(budgets) != 1:
        raise ValueError(f"{spec}: records at budgets {budgets}: give --B")
    B = B if B is not None else budgets[0]
    if B not in budgets:
        raise ValueError(f"{spec}: no records at B = {B} (it has {budgets})")
    return {(aliases.get(name, name), r["item"], "kvpop"): {"kl": r["kl"], "top1": r["top1_agreement"]}
            for name, r in rows if r["B"] == B}, B


def load_side(spec: str, aliases: dict, B: int | None) -> tuple[dict, int]:
    if spec.endswith(".jsonl"):
        return blend_records(Path(spec), aliases)
    return study_records(spec, aliases, B)


def compare(baseline: dict, candidate: dict, rules: list[str], metrics=METRICS) -> list[dict]:
    """Per (corpus, rule, metric) over the sequences (or recall samples) both have: the means and candidate −
    baseline, paired."""
    from research.bootstrap import paired_bootstrap

    shared = sorted(set(baseline) & set(candidate))
    wanted = rules or sorted({rule for _, _, rule in shared})
    out = []
    for corpus in sorted({c for c, _, _ in shared}):
        for rule in wanted:
            ids = sorted(i for c, i, r in shared if c == corpus and r == rule)
            if not ids:
                continue
            for metric, label, better in metrics:
                a = [baseline[corpus, i, rule][metric] for i in ids]
                b = [candidate[corpus, i, rule][metric] for i in ids]
                diff = paired_bootstrap(b, a)
                sign = (1 if diff["mean"] * better > 0 else -1) if diff["low"] > 0 or diff["high"] < 0 else 0
                out.append({"corpus": corpus, "rule": rule, "metric": metric, "label": label, "n": len(ids),
                            "baseline": sum(a) / len(a), "candidate": sum(b) / len(b), "difference": diff,
                            "verdict": {1: "candidate better", -1: "candidate worse", 0: "not resolved"}[sign]})
    return out


def render(result: dict) -> str:
    from research.bootstrap import format_interval

    lines = [f"# {result['candidate']} − {result['baseline']}", "",
             "Paired by held-out sequence id, 95 % bootstrap intervals; a verdict only where the interval excludes 0. "
             f"Budget B = {result['B']}.", "",
             "| corpus | rule | metric | n | baseline | candidate | candidate − baseline [95 %] | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['corpus']} | {row['rule']} | {row['label']} | {row['n']} | {row['baseline']:.4f} | "
                     f"{row['candidate']:.4f} | {format_interval(row['difference'], 4)} | {row['verdict']} |")
    if result.get("recall"):
        lines += ["", "Recall, paired by sample (every sample of each task both sides answered, whatever dense "
                  "scored on it):", "",
                  "| task | rule | metric | n | baseline | candidate | candidate − baseline [95 %] | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in result["recall"]:
            lines.append(f"| {row['corpus'].removeprefix('recall ')} | {row['rule']} | {row['label']} | {row['n']} | "
                         f"{row['baseline']:.3f} | {row['candidate']:.3f} | {format_interval(row['difference'], 3)} "
                         f"| {row['verdict']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from research.scorer_records import write_result

    try:
        sides = {}
        for name in ("baseline", "candidate"):  # a blend side fixes the budget a study side is read at
            spec = getattr(args, name)
            if spec.endswith(".jsonl"):
                sides[name] = load_side(spec, args.alias, args.B)
        for name in ("baseline", "candidate"):
            if name not in sides:
                known = args.B if args.B is not None else next((b for _, b in sides.values()), None)
                sides[name] = load_side(getattr(args, name), args.alias, known)
        (base, b_total), (cand, c_total) = sides["baseline"], sides["candidate"]
        if b_total != c_total:
            raise ValueError(f"the two sides are at other budgets: B = {b_total} and {c_total}")
        rows = compare(base, cand, args.rules)
        if not rows:
            raise ValueError("no (corpus, sequence, rule) in common: other corpora, rules or items")
        answers = [recall_records(Path(getattr(args, name))) if getattr(args, name).endswith(".jsonl") else None
                   for name in ("baseline", "candidate")]
        recall = compare(*answers, args.rules, RECALL_METRICS) if None not in answers else []
    except ValueError as err:
        print(f"compare_blends: {err}", file=sys.stderr)
        return 2
    result = {"baseline": args.baseline, "candidate": args.candidate, "B": b_total, "aliases": args.alias,
              "rows": rows, "recall": recall}
    write_result(Path(args.out), f"compare_{args.tag}", result, render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
