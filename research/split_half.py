"""A rule chosen on the first held-out items, checked on items it was not chosen on.

A blend (:mod:`research.recency_blend`) measured on ``--split`` items per corpus is where a scorer and its λ are
picked; re-measured on more items of the same corpora, the items from ``--split`` on are a fresh sample that the
choice never saw. This reads the records of one scorer (``--items``: one or more ``recency_blend_<tag>_items.jsonl``
of the same checkpoint, budget and length) and writes, per corpus and rule, the share of the streaming → oracle KL
gap closed (:func:`pipelines.stats.gap_closed`, paired by item) and the rule minus streaming on KL and top-1, over the
items before the split, from it on, and all of them — each with its 95 % bootstrap interval.

The oracle of a corpus may come from another blend on the same held-out sequences (``--oracle-from``, e.g. a run
that measured it with ``--oracle``): its records are used only where the scorer's own file has none, and only after
its streaming record of every such item equals this scorer's (same sequence, same model: identical to the bit), so
that a file of other sequences can never be paired in. Items lacking any of streaming, oracle or the rule are left
out and counted. Bad input is one line and exit code 2.

    python research/split_half.py --items A_items.jsonl [B_items.jsonl ...] \\
        --oracle-from research/results/recency_blend_h200_w256_qp16_lam_docs_items.jsonl \\
        --rules kvpop+0.0025 kvpop+0.003 --split 32 --tag h200_w256_qp16_ft_plain_half_mix_kernel
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

IDENTITY = ("checkpoint", "budget", "seq_len")


def read_records(paths: list[str]) -> dict[tuple, dict]:
    """``{(source, item, rule): record}`` of ``paths``, one run's (same identity); a record given twice must agree."""
    from pipelines.config import ConfigError

    records: dict[tuple, dict] = {}
    identity = None
    for path in paths:
        if not Path(path).is_file():
            raise ConfigError(f"--items {path}: no such file")
        for line in Path(path).read_text().splitlines():
            record = json.loads(line)
            mine = {k: record.get(k) for k in IDENTITY}
            identity = identity or mine
            if mine != identity:
                raise ConfigError(f"--items: {path} holds records of {mine}, not of {identity}: give one scorer's files")
            key = (record["source"], record["item"], record["rule"])
            if key in records and (records[key]["kl"], records[key]["top1"]) != (record["kl"], record["top1"]):
                raise ConfigError(f"--items: {key} is recorded twice with different values")
            records[key] = record
    return records


def borrow_oracle(records: dict[tuple, dict], path: str) -> int:
    """Adds ``path``'s oracle records where ``records`` has none, after checking streaming item by item; returns how
    many were added."""
    from pipelines.config import ConfigError

    if not Path(path).is_file():
        raise ConfigError(f"--oracle-from {path}: no such file")
    theirs = {(r["source"], r["item"], r["rule"]): r
              for r in map(json.loads, Path(path).read_text().splitlines())}
    added = 0
    for (source, item, rule), record in theirs.items():
        if rule != "oracle" or (source, item, "oracle") in records or (source, item, "streaming") not in records:
            continue
        own, other = records[(source, item, "streaming")], theirs.get((source, item, "streaming"))
        if other is None or (own["kl"], own["top1"]) != (other["kl"], other["top1"]):
            raise ConfigError(f"--oracle-from {path}: its streaming record of {source} item {item} differs from "
                              f"this scorer's (or is missing): not the same held-out sequences")
        records[(source, item, "oracle")] = record
        added += 1
    return added


def summarize(records: dict[tuple, dict], rules: list[str], split: int) -> list[dict]:
    """One row per (corpus, rule, item range): gap closed and the rule − streaming on KL / top-1, with intervals."""
    from research.bootstrap import paired_bootstrap
    from pipelines.stats import gap_closed

    rows = []
    for source in dict.fromkeys(s for s, _, _ in records):
        items = sorted({i for s, i, _ in records if s == source})
        for rule in rules:
            usable = [i for i in items if all((source, i, r) in records for r in ("streaming", "oracle", rule))]
            for label, chosen in ((f"< {split}", [i for i in usable if i < split]),
                                  (f">= {split}", [i for i in usable if i >= split]), ("all", usable)):
                row = {"corpus": source, "rule": rule, "items": label, "n": len(chosen),
                       "left_out": len(items) - len(usable)}
                if chosen:
                    get = {r: [records[(source, i, r)] for i in chosen] for r in ("streaming", "oracle", rule)}
                    g = gap_closed([x["kl"] for x in get[rule]], [x["kl"] for x in get["streaming"]],
                                   [x["kl"] for x in get["oracle"]])
                    row["gap"] = {"mean": g.estimate, "low": g.lo, "high": g.hi}
                    for metric in ("kl", "top1"):
                        row[f"{metric}_minus_streaming"] = paired_bootstrap([x[metric] for x in get[rule]],
                                                                            [x[metric] for x in get["streaming"]])
                rows.append(row)
    return rows


def to_markdown(rows: list[dict], meta: dict) -> str:
    from research.bootstrap import format_interval

    def gap(row):
        g = row.get("gap")
        return "–" if not g else (f"{g['mean']:.2f}" + ("" if math.isnan(g["low"]) else
                                                        f" [{g['low']:.2f}, {g['high']:.2f}]"))

    lines = [f"# Split-half check: {meta['checkpoint']} at {meta['budget']}", "",
             f"Items before {meta['split']} are where the rule was chosen; from {meta['split']} on, a sample the "
             f"choice never saw. KL gap closed: streaming → oracle, paired by item (oracle records borrowed from "
             f"{meta['oracle_from'] or 'nowhere'}: {meta['borrowed']}, streaming checked equal on each). 95 % "
             "bootstrap intervals; * where a difference's interval excludes 0.", "",
             "| corpus | rule | items | n | KL gap closed | KL − streaming | top-1 − streaming |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [format_interval(row[k], 4) if k in row else "–" for k in ("kl_minus_streaming", "top1_minus_streaming")]
        lines.append(f"| {row['corpus']} | {row['rule']} | {row['items']} | {row['n']} | {gap(row)} | {cells[0]} | "
                     f"{cells[1]} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from jobs._cli import bare_parser
    from kvpop.files import atomic_write_text
    from pipelines.config import ConfigError

    p = bare_parser("split_half", __doc__)
    p.prog = "research/split_half.py"
    p.add_argument("--items", nargs="+", required=True, help="one scorer's recency_blend_<tag>_items.jsonl files")
    p.add_argument("--oracle-from", default="", help="another blend's items on the same sequences: its oracle records "
                   "where the scorer's files have none")
    p.add_argument("--rules", nargs="+", required=True, help="the scorer's rules to check (e.g. kvpop+0.0025)")
    p.add_argument("--split", type=int, required=True, help="the first item the choice did not see")
    p.add_argument("--tag", required=True)
    p.add_argument("--out", default=str(REPO / "research" / "results"))
    args = p.parse_args(argv)
    try:
        if args.split < 1:
            raise ConfigError(f"--split must be >= 1, got {args.split}")
        records = read_records(args.items)
        borrowed = borrow_oracle(records, args.oracle_from) if args.oracle_from else 0
        missing = [r for r in args.rules if not any(k[2] == r for k in records)]
        if missing:
            raise ConfigError(f"--rules {' '.join(missing)}: not in the records "
                              f"(they have {' '.join(sorted({k[2] for k in records}))})")
    except ConfigError as err:
        print(f"split_half: {err}", file=sys.stderr)
        return 2
    first = next(iter(records.values()))
    meta = {"checkpoint": first["checkpoint"], "budget": first["budget"], "seq_len": first["seq_len"],
            "split": args.split, "items": args.items, "oracle_from": args.oracle_from, "borrowed": borrowed,
            "rules": args.rules}
    rows = summarize(records, args.rules, args.split)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"split_half_{args.tag}.json", json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    markdown = to_markdown(rows, meta)
    atomic_write_text(out / f"split_half_{args.tag}.md", markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
