"""Does a static priority from the attention a token received while it sat in the protected window (the
``window_attention`` policy) keep better tokens than streaming, a learned KVpop scorer and TOVA / H2O, on corpora
the scorer never saw — and does the scorer on top of it (``kvpop+prior``, ``kvpop.set_window_attention_prior``)?
Teacher-forced KL and top-1 agreement against the dense model at the scorer's own B, per held-out sequence, with
paired bootstrap intervals.

    python research/window_attention.py --checkpoint DIR --sources stdlib champ --sequences 16

``DIR``: a scorer folder (``kvpop.json`` + ``kvpop_scorers.safetensors``, its base model from ``--model``); its
budget is every rule's. TOVA and H2O (step by step) run on the first ``--dynamic-sequences``. One record per (corpus,
sequence, rule) goes to ``<out>/window_attention_<tag>_items.jsonl`` as it is measured; a re-run skips what is there
(records of another checkpoint are refused in one line before anything loads). Writes
``<out>/window_attention_<tag>.{json,md}``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# one masked forward each; kvpop+prior: the scorer's output plus the window attention prior
# (kvpop.set_window_attention_prior), as trained with it — or, for a scorer trained without, an untrained blend
STATIC = ("streaming", "kvpop", "window_attention", "kvpop+prior")
DYNAMIC = ("tova", "h2o")  # step by step only: on the first --dynamic-sequences
PAIRS = [("window_attention", "streaming"), ("window_attention", "kvpop"), ("window_attention", "tova"),
         ("window_attention", "h2o"), ("kvpop", "streaming"), ("kvpop", "tova"), ("kvpop+prior", "kvpop"),
         ("kvpop+prior", "window_attention")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="window_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a scorer folder (kvpop.json + kvpop_scorers.safetensors)")
    p.add_argument("--model", default="smollm2", help="its base: smollm2 or a local HF folder")
    p.add_argument("--sources", nargs="+", default=["stdlib", "champ"], help="held-out corpora (data.source values)")
    p.add_argument("--sequences", type=int, default=16, help="held-out sequences per corpus")
    p.add_argument("--dynamic-sequences", type=int, default=0, help="TOVA and H2O on the first this many")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out", default=str(REPO / "research" / "results"))
    args = p.parse_args(argv)
    if args.sequences < 1 or args.dynamic_sequences < 0:
        p.error("--sequences must be >= 1 and --dynamic-sequences >= 0")
    return args


def measure(model, args, meta, tokenizer, records_path: Path, identity: dict) -> list[dict]:
    """Every (corpus, sequence, rule) not yet in ``records_path``, appended as measured."""
    import kvpop
    from research.scorer_records import measure as measure_rules
    from kvpop.evaluation import Setting, forced_logits

    prior = bool(meta.get("window_attention_prior", False))  # a scorer trained on the prior: its kvpop row has it

    def logits_of(rule, ids, budget, start):
        if rule in DYNAMIC:
            return forced_logits(model, Setting(rule, budget), ids, start=start)
        policy = rule.removesuffix("+prior")
        kvpop.set_policy(model, policy, budget, recency=meta["recency"] if policy == "kvpop" else 0.0)
        kvpop.set_window_attention_prior(model, rule == "kvpop+prior" or prior)
        return model(input_ids=ids, use_cache=False, logits_to_keep=ids.shape[1] - start).logits

    return measure_rules(model, args, meta, tokenizer, records_path, identity,
                         lambda item: STATIC + DYNAMIC * (item < args.dynamic_sequences), logits_of, "window_attention")


def summarize(records: list[dict], sources: list[str]) -> dict:
    """Per corpus: each rule's mean over the sequences every static rule has, and the paired differences of
    :data:`PAIRS`, each over the sequences both rules have."""
    from research.bootstrap import paired_bootstrap

    out = {}
    for source in sources:
        by_rule = {rule: {r["item"]: r for r in records if r["source"] == source and r["rule"] == rule}
                   for rule in STATIC + DYNAMIC}
        items = sorted(set.intersection(*(set(by_rule[r]) for r in STATIC)))
        dynamic = sorted(set(items) & set(by_rule["tova"]) & set(by_rule["h2o"]))
        cell = out[source] = {"items": items, "dynamic_items": dynamic}
        for metric in ("kl", "top1"):
            cell[metric] = {rule: sum(by_rule[rule][i][metric] for i in (dynamic if rule in DYNAMIC else items))
                            / len(dynamic if rule in DYNAMIC else items) if (dynamic if rule in DYNAMIC else items)
                            else None for rule in STATIC + DYNAMIC}
            for a, b in PAIRS:
                both = sorted(set(by_rule[a]) & set(by_rule[b]))
                cell[f"{metric}:{a}-{b}"] = paired_bootstrap([by_rule[a][i][metric] for i in both],
                                                             [by_rule[b][i][metric] for i in both])
    return out


def render(result: dict) -> str:
    from research.bootstrap import format_interval

    lines = [f"# Window attention: {result['checkpoint']} at {result['budget']}", "",
             "Teacher-forced against the dense model over positions ≥ B, one value per held-out sequence; means over "
             "the sequences every static rule has (TOVA / H2O: over their subset); intervals: 95 % paired bootstrap "
             "over the sequences both rules have (n; * where it excludes 0). KL: lower is better; top-1: higher. "
             "WA = window_attention.", "",
             "| corpus | n | metric | streaming / KVpop / WA / KVpop+prior | TOVA / H2O (n) | " +
             " | ".join(f"{a} − {b}".replace("window_attention", "WA") for a, b in PAIRS) + " |",
             "|---|---|---|---|---|" + "---|" * len(PAIRS)]
    for source, cell in result["summary"].items():
        if not cell["items"]:
            continue
        for metric in ("kl", "top1"):
            dynamic = (" / ".join(f"{cell[metric][r]:.4f}" for r in DYNAMIC) + f" ({len(cell['dynamic_items'])})"
                       if cell["dynamic_items"] else "–")
            diffs = [cell[f"{metric}:{a}-{b}"] for a, b in PAIRS]
            lines.append(f"| {source} | {len(cell['items'])} | {metric} | " +
                         " / ".join(f"{cell[metric][r]:.4f}" for r in STATIC) + f" | {dynamic} | " +
                         " | ".join(f"{format_interval(d, 4)} (n {d['n']})" if d["n"] > 1 else
                                    f"{d['mean']:+.4f} (n {d['n']}, no interval)" if d["n"] else "–"
                                    for d in diffs) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from research.learning_curves import load_saved_scorer
    from research.scorer_records import open_records, write_result
    from kvpop import Budget
    from pipelines.config import ConfigError
    from pipelines.data import load_tokenizer

    try:
        meta, configs, _, records_path, identity = open_records(args, "window_attention")
    except ConfigError as err:
        print(f"window_attention: {err}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(configs[0])
    model = load_saved_scorer(args.checkpoint, meta, configs[0], args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = measure(model, args, meta, tokenizer, records_path, identity)
    result = {"checkpoint": str(Path(args.checkpoint)), "budget": str(Budget(**meta["budget"])), "args": vars(args),
              "summary": summarize(records, args.sources)}
    write_result(out, f"window_attention_{args.tag}", result, render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
