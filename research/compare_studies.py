"""Two learning-curves studies' scorers on the same held-out items: the candidate's KVpop minus the baseline's, per
corpus and budget, paired per item with 95 % bootstrap intervals (``pipelines.stats``, the evaluation's own rule).

    python research/compare_studies.py BASELINE.json CANDIDATE.json --tag NAME [--tokens-a N] [--tokens-b N]

Each ``.json`` is a finished ``research/learning_curves.py`` study; the point compared is the last one unless
``--tokens-a`` / ``--tokens-b`` name another (the nearest token count). The two must have measured the same items on
the same base (the rule of ``--references-from``: ``learning_curves.REUSE_MUST_MATCH``, and the same held-out text where
both record its digest) — otherwise one line and exit 2. Compared: KL and top-1 on the held-out text of every corpus both evaluated, at every budget both have; recall exact
match and gold log-probability over the headline cells. Writes ``<out>/compare_<tag>.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TEXT = (("kl", "KL", "lower"), ("top1_agreement", "top-1", "higher"))
RECALL = (("exact", "recall exact", "higher"), ("logprob", "gold logp", "higher"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="compare_studies", description=__doc__.split("\n\n")[0])
    p.add_argument("baseline", type=Path, help="a finished learning-curves study (.json)")
    p.add_argument("candidate", type=Path, help="another, on the same held-out items")
    p.add_argument("--tokens-a", type=float, default=None, help="the baseline's point (default: its last)")
    p.add_argument("--tokens-b", type=float, default=None, help="the candidate's point (default: its last)")
    p.add_argument("--tag", required=True)
    p.add_argument("--out", type=Path, default=REPO / "research" / "results")
    return p.parse_args(argv)


def load_point(path: Path, tokens: float | None) -> tuple[dict, dict]:
    """``(study, point)``: the point nearest ``tokens`` (the last when None); ValueError naming what is wrong."""
    try:
        study = json.loads(path.read_text())
        points = study["points"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a learning-curves study ({type(err).__name__}: {err})") from None
    if not points:
        raise ValueError(f"{path}: the study has no evaluated point")
    point = points[-1] if tokens is None else min(points, key=lambda p: abs(p["tokens"] - tokens))
    return study, point


def kvpop_records(point: dict) -> dict[str, list[dict]]:
    """Per corpus (``""``: the training corpus) the point's KVpop records."""
    return {"": point["records"], **{name: c["records"] for name, c in point.get("corpora", {}).items()}}


def compare(baseline: dict, point_a: dict, candidate: dict, point_b: dict) -> list[dict]:
    """One row per (corpus, budget, metric) both points have: the candidate minus the baseline, paired per item."""
    from pipelines.stats import paired_difference

    rows = []
    records_a, records_b = kvpop_records(point_a), kvpop_records(point_b)
    for corpus in [c for c in records_a if c in records_b]:
        budgets = sorted({r["budget"] for r in records_a[corpus]} & {r["budget"] for r in records_b[corpus]})
        for budget in budgets:
            for part, metrics in (("text", TEXT), ("recall", RECALL)):
                def by_item(records):
                    return {r["item"]: r for r in records if r["budget"] == budget and r["part"] == part
                            and r["policy"] == "kvpop" and (part == "text" or r.get("headline"))}
                a, b = by_item(records_a[corpus]), by_item(records_b[corpus])
                items = sorted(set(a) & set(b))
                for key, label, better in metrics if len(items) > 1 else ():
                    d = paired_difference([b[i][key] for i in items], [a[i][key] for i in items])
                    gain = d.estimate if better == "higher" else -d.estimate
                    rows.append({"corpus": corpus or baseline["meta"]["study"]["source"], "budget": budget,
                                 "B": a[items[0]]["B"], "metric": label, "better": better, "n": len(items),
                                 "baseline": sum(a[i][key] for i in items) / len(items),
                                 "candidate": sum(b[i][key] for i in items) / len(items),
                                 "difference": d.to_dict(),
                                 "verdict": ("not resolved" if not d.resolved else
                                             "candidate better" if gain > 0 else "candidate worse")})
    return rows


def render(result: dict) -> str:
    a, b = result["baseline"], result["candidate"]
    lines = [f"# {result['tag']}: candidate − baseline, paired on the same items", "",
             f"- baseline: `{a['path']}` at {a['tokens'] / 1e6:.2f}M tokens ({a['label']})",
             f"- candidate: `{b['path']}` at {b['tokens'] / 1e6:.2f}M tokens ({b['label']})", "",
             "KVpop's records of each, per held-out item (text: a sequence; recall: a headline cell's sample); "
             "95 % paired bootstrap of the mean difference (`pipelines.stats`).", "",
             "| corpus | B | metric | n | baseline | candidate | candidate − baseline [95 %] | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        d = r["difference"]
        lines.append(f"| {r['corpus']} | {r['B']} | {r['metric']} ({r['better']} is better) | {r['n']} | "
                     f"{r['baseline']:.4f} | {r['candidate']:.4f} | {d['estimate']:+.4f} [{d['lo']:+.4f}, "
                     f"{d['hi']:+.4f}] | {r['verdict']} |")
    return "\n".join(lines) + "\n"


def describe(study: dict) -> str:
    s = study["meta"]["study"]
    extras = [f"{s.get('mix_sequences')} × {s.get('mix_source')} in the pool" if s.get("mix_source") else "",
              "on the window attention prior" if s.get("window_attention_prior") else "",
              f"β {s.get('query_power', 1.0):g}"]
    return ", ".join(x for x in [f"s{s['sink']}-w{s['window']}-k{s['topk']}", *extras] if x)


def main(argv=None) -> int:
    args = parse_args(argv)
    from research.learning_curves import SAVED_BEFORE, check_heldout, reference_study
    from kvpop.files import atomic_write_text
    from pipelines.config import ConfigError

    try:
        baseline, point_a = load_point(args.baseline, args.tokens_a)
        candidate, point_b = load_point(args.candidate, args.tokens_b)
        reference_study(args.candidate, {**SAVED_BEFORE, **baseline["meta"]["study"]})  # same items, same base
        check_heldout(str(args.candidate), baseline["meta"].get("heldout_sha256"),  # and the same text
                      candidate["meta"].get("heldout_sha256") or {})
    except (ValueError, ConfigError) as err:
        print(f"compare_studies: {err}", file=sys.stderr)
        return 2
    result = {"tag": args.tag,
              "baseline": {"path": str(args.baseline), "tokens": point_a["tokens"], "label": describe(baseline)},
              "candidate": {"path": str(args.candidate), "tokens": point_b["tokens"], "label": describe(candidate)},
              "rows": compare(baseline, point_a, candidate, point_b)}
    if not result["rows"]:
        print("compare_studies: the two points share no corpus, budget and items", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / f"compare_{args.tag}.json", json.dumps(result, indent=2))
    text = render(result)
    atomic_write_text(args.out / f"compare_{args.tag}.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
