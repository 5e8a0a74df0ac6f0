"""Does the KL gap a rule closes follow the text's document structure? A packed sequence of champ holds ~5 short
transcripts, while one of held-out code or prose is mostly a single long file. So the question is whether the scorer
stops at about half the held-out gap because it was never trained on long documents.

For each held-out sequence of each corpus in a recency-blend records file, this script counts the documents the
sequence packs. It also measures the *own-document reach*: the share of evaluated positions ``d >= B`` whose own
document starts at least ``w`` tokens back. Only at those positions does the query's own text compete for the
long-range slots; elsewhere everything past the window belongs to earlier, unrelated documents. It then gives the
share of the streaming → oracle KL gap that ``--rule`` closes, for these groups of sequences:

- one document against several;
- reach at or above the corpus's median against below it (only where the two halves differ).

Each share comes with its 95 % bootstrap interval over sequences, and each pair of groups with the interval of their
difference (independent groups: each resampled on its own). Streaming is taken from the records file and the oracle
from ``--references-from``, as ``recency_blend.py`` pairs them. The script also reports the length, in tokens, of
every document of each corpus.

    python research/heldout_structure.py research/results/recency_blend_h200_w256_qp16_norms_items.jsonl \\
        --rule kvpop+0.002 --references-from research/results/learning_curves_h200_w256_qp16_prose_more.json \\
        --reference-source /tmp/gpu/python_docs_deb12u8.jsonl=/tmp/gpu/python_docs.jsonl --tag h200_w256_qp16_norms

Writes ``<out>/heldout_structure_<tag>.{json,md}``. Nothing is measured on a model: it needs only the tokenizer and
the corpora the records name.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LENGTHS = (1024, 2048, 4096, 8192)  # document lengths (tokens) whose shares of each corpus are reported
RESAMPLES, SEED = 4000, 0


def parse_args(argv=None):
    from jobs._cli import bare_parser, name_pairs  # a bad command line: one line and exit code 2

    p = bare_parser("heldout_structure", __doc__.split("\n\n")[0])
    p.prog = "research/heldout_structure.py"
    p.add_argument("records", help="a recency_blend_<tag>_items.jsonl")
    p.add_argument("--rule", required=True, help="the rule whose gap is split, e.g. kvpop+0.002")
    p.add_argument("--references-from", required=True, help="the learning-curves study holding the oracle's records")
    p.add_argument("--reference-source", action="append", default=[], metavar="NAME=THEIRS",
                   help="corpus NAME of the records is the study's THEIRS (a rebuilt file)")
    p.add_argument("--model", default="smollm2", help="whose tokenizer cut the sequences")
    p.add_argument("--tag", required=True)
    p.add_argument("--out", default=str(REPO / "research" / "results"))
    args = p.parse_args(argv)
    args.reference_source, bad = name_pairs(args.reference_source)
    if bad:
        p.error(f"--reference-source takes NAME=THEIRS, got {bad}")
    return args


def own_document_reach(input_ids, eos: int, start: int, window: int) -> float:
    """The share of positions ``d`` in ``[start, len)`` whose own document began at least ``window`` tokens back
    (``d - first >= window``, ``first`` the token after the last ``eos`` before ``d``, or 0): there the query's own
    document has tokens outside the protected window, so its text competes for the long-range slots. A separator
    ``eos`` at ``d`` itself ends ``d``'s document and does not start it."""
    if start >= len(input_ids):
        raise ValueError(f"no evaluated position: start {start} >= the sequence's {len(input_ids)} tokens")
    first, reached = 0, 0
    for d, token in enumerate(input_ids):
        if d >= start and d - first >= window:
            reached += 1
        if token == eos:
            first = d + 1
    return reached / (len(input_ids) - start)


def ratio_draws(numerator, denominator, seed: int):
    """``mean(numerator) / mean(denominator)`` on each of :data:`RESAMPLES` Monte Carlo resamples of the items
    (NaN where a resample's denominator is 0)."""
    from pipelines.stats import Bootstrap

    return Bootstrap(len(numerator), resamples=RESAMPLES, seed=seed, exact=False).ratios(numerator, denominator)


def gap_of(items: list[dict]) -> dict:
    """The share of the streaming → oracle KL gap closed over ``items`` (``{"rule", "streaming", "oracle"}`` KLs),
    with its 95 % interval (:func:`pipelines.stats.gap_closed`)."""
    from pipelines.stats import gap_closed

    g = gap_closed([i["rule"] for i in items], [i["streaming"] for i in items], [i["oracle"] for i in items])
    return {"mean": g.estimate, "low": g.lo, "high": g.hi, "n": g.n}


def gap_difference(first: list[dict], second: list[dict]) -> dict:
    """The gap closed over ``first`` minus that over ``second``, two independent groups of items, with the 95 %
    percentile interval of the difference when each group is resampled on its own (different seeds)."""
    import numpy as np

    def parts(items):
        return [i["streaming"] - i["rule"] for i in items], [i["streaming"] - i["oracle"] for i in items]

    (a_num, a_den), (b_num, b_den) = parts(first), parts(second)
    estimate = sum(a_num) / sum(a_den) - sum(b_num) / sum(b_den)
    if len(first) < 2 or len(second) < 2:
        return {"mean": estimate, "low": math.nan, "high": math.nan, "n": [len(first), len(second)]}
    draws = ratio_draws(a_num, a_den, SEED) - ratio_draws(b_num, b_den, SEED + 1)
    draws = draws[np.isfinite(draws)]
    return {"mean": estimate, "low": float(np.quantile(draws, 0.025)), "high": float(np.quantile(draws, 0.975)),
            "n": [len(first), len(second)]}


def split_by_structure(items: list[dict]) -> dict[str, tuple[list[dict], list[dict]]]:
    """The two comparisons: one document vs several, and own-document reach >= the median vs below (each only where
    both groups have items)."""
    reach = sorted(i["reach"] for i in items)
    median = reach[len(reach) // 2]
    pairs = {"one document − several": ([i for i in items if i["documents"] == 1],
                                         [i for i in items if i["documents"] > 1]),
             f"reach ≥ {median:.2f} − below": ([i for i in items if i["reach"] >= median],
                                               [i for i in items if i["reach"] < median])}
    return {name: (a, b) for name, (a, b) in pairs.items() if a and b}


def document_lengths(cfg, tokenizer) -> dict:
    """The token length of every document of ``cfg``'s corpus: quantiles and the shares at least :data:`LENGTHS`."""
    from pipelines.data import load_documents

    texts = [text for _, text in load_documents(cfg)]
    lengths = sorted(len(ids) for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"])
    n = len(lengths)
    return {"documents": n, "median": lengths[n // 2], "p90": lengths[min(n - 1, int(0.9 * n))], "max": lengths[-1],
            "share_at_least": {str(k): sum(x >= k for x in lengths) / n for k in LENGTHS}}


def analyse(records: list[dict], rule: str, references: dict, rows_of, lengths_of) -> dict:
    """Per corpus of ``records``: the items of ``rule`` with their structure and KLs, the groups' gaps and
    differences, and the corpus's document lengths. ``rows_of(source, budget, seq_len, n)``: its held-out rows
    (``{"id", "input_ids", "docs"}``) and the tokenizer's EOS id; ``lengths_of(source)``: :func:`document_lengths`."""
    from kvpop import Budget

    out = {}
    for source in dict.fromkeys(r["source"] for r in records):
        mine = {(r["rule"], r["id"]): r for r in records if r["source"] == source}
        ids = sorted(i for (name, i) in mine if name == rule and ("streaming", i) in mine)
        oracle = references.get(source, {}).get("oracle", {})
        missing = [i for i in ids if i not in oracle]
        if not ids:
            raise ValueError(f"{source}: no {rule} records with streaming beside them")
        if missing:
            raise ValueError(f"{source}: no oracle record of {missing[0]} in --references-from "
                             f"({len(missing)} of {len(ids)} sequences unpaired)")
        first = mine[(rule, ids[0])]
        budget = Budget(**first["budget"])
        rows, eos = rows_of(source, first["budget"], first["seq_len"], len(ids))
        by_id = {r["id"]: r for r in rows}
        items = [{"id": i, "documents": len(by_id[i]["docs"]),
                  "reach": own_document_reach(by_id[i]["input_ids"], eos, budget.total, budget.window),
                  "rule": mine[(rule, i)]["kl"], "streaming": mine[("streaming", i)]["kl"],
                  "oracle": oracle[i]["kl"]} for i in ids]
        groups = split_by_structure(items)
        out[source] = {
            "budget": str(budget), "items": items, "all": gap_of(items),
            "mean_documents": sum(i["documents"] for i in items) / len(items),
            "mean_reach": sum(i["reach"] for i in items) / len(items),
            "comparisons": {name: {"first": gap_of(a), "second": gap_of(b), "difference": gap_difference(a, b)}
                            for name, (a, b) in groups.items()},
            "document_lengths": lengths_of(source)}
    return out


def share(x: dict) -> str:
    """A gap closed with its interval (none for one item)."""
    text = f"{x['mean']:.2f}"
    return text if math.isnan(x["low"]) else f"{text} [{x['low']:.2f}, {x['high']:.2f}]"


def difference(x: dict) -> str:
    """A difference of two groups' gaps with its interval, * where that excludes 0."""
    text = f"{x['mean']:+.2f}"
    if math.isnan(x["low"]):
        return text
    return f"{text} [{x['low']:+.2f}, {x['high']:+.2f}]" + (" *" if x["low"] > 0 or x["high"] < 0 else "")


def render(result: dict) -> str:
    lines = [f"# Held-out gap against document structure: {result['rule']} of `{result['records']}`", "",
             "Share of the streaming → oracle KL gap closed (oracle from "
             f"`{result['references_from']}`), 95 % bootstrap intervals over sequences; a difference between groups "
             "resamples each group on its own, * where its interval excludes 0. Reach: the share of evaluated "
             "positions whose own document starts at least w tokens back (`research/heldout_structure.py`).", "",
             "| corpus | B | n | documents / sequence | reach | gap closed | comparison | first | second | "
             "first − second |", "|---|---|---|---|---|---|---|---|---|---|"]
    for source, c in result["corpora"].items():
        head = (f"| {Path(source).name} | {c['budget']} | {c['all']['n']} | {c['mean_documents']:.2f} | "
                f"{c['mean_reach']:.2f} | {share(c['all'])} |")
        if not c["comparisons"]:
            lines.append(head + " – | | | |")
        for k, (name, cell) in enumerate(c["comparisons"].items()):
            lead = head if k == 0 else "| | | | | | |"
            lines.append(f"{lead} {name} | {share(cell['first'])} (n {cell['first']['n']}) | "
                         f"{share(cell['second'])} (n {cell['second']['n']}) | {difference(cell['difference'])} |")
    lines += ["", "Document lengths (tokens, every document of the corpus):", "",
              "| corpus | documents | median | p90 | max | " + " | ".join(f"≥ {k}" for k in LENGTHS) + " |",
              "|---|---|---|---|---|" + "---|" * len(LENGTHS)]
    for source, c in result["corpora"].items():
        d = c["document_lengths"]
        lines.append(f"| {Path(source).name} | {d['documents']} | {d['median']} | {d['p90']} | {d['max']} | " +
                     " | ".join(f"{d['share_at_least'][str(k)]:.4f}" for k in LENGTHS) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from research.learning_curves import corpus_config
    from research.recency_blend import study_references
    from research.scorer_records import write_result
    from pipelines.config import ConfigError
    from pipelines.data import check_inputs, load_sequences, load_tokenizer

    try:
        path = Path(args.records)
        records = [json.loads(line) for line in path.read_text().splitlines()]
        if not records or any(k not in r for r in records for k in ("id", "rule", "source", "kl", "budget")):
            raise ValueError(f"{path}: not a recency_blend records file (records with a sequence id and a rule)")
        totals = {sum(r["budget"].values()) for r in records}
        if len(totals) != 1:
            raise ValueError(f"{path}: records of several budgets {sorted(totals)}")
        sources = list(dict.fromkeys(r["source"] for r in records))
        references = study_references(Path(args.references_from), sources, totals.pop(), args.reference_source)
        configs = {}

        def config_of(source, budget=None, seq_len=None, n=1):
            if source not in configs:
                configs[source] = corpus_config(args.model, source, seq_len, budget, 1.0, n)
                check_inputs(configs[source])
            return configs[source]

        def rows_of(source, budget, seq_len, n):
            cfg = config_of(source, budget, seq_len, n)
            tokenizer = load_tokenizer(cfg)
            return load_sequences(cfg, "eval", tokenizer), tokenizer.eos_token_id

        def lengths_of(source):
            cfg = config_of(source)
            return document_lengths(cfg, load_tokenizer(cfg))

        corpora = analyse(records, args.rule, references, rows_of, lengths_of)
    except (ConfigError, ValueError, OSError) as err:
        print(f"heldout_structure: {err}", file=sys.stderr)
        return 2
    result = {"records": str(args.records), "rule": args.rule, "references_from": str(args.references_from),
              "reference_source": args.reference_source, "corpora": corpora}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out, f"heldout_structure_{args.tag}", result, render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
