"""Does a trained scorer's ranking carry over to a corpus it never saw? Issue 12's diagnostics
(:mod:`kvpop.diagnostics`: balanced accuracy of its keep/evict decisions against the teacher's, next to newest- /
oldest-wins; kept-set overlap with the oracle's; rank correlation with the targets; the share of the dense model's
own attention each rule evicts, next to a streaming cache of the same size and the oracle), per corpus and per layer,
for one saved scorer.

    python research/transfer_diagnostics.py --checkpoint DIR --sources champ stdlib --sequences 4

``DIR``: a scorer folder (``kvpop.json`` + ``kvpop_scorers.safetensors``: a learning-curves step folder, a pipeline's
scorer-only ``final_model``), its base model taken from ``--model``. The held-out split of each source (the data
stage's, ``--sequences`` of ``--seq-len``) is diagnosed against that source's own teacher targets
(β = ``--query-power``) at the scorer's budget and at each ``--topks`` long-range size. Writes
``<out>/transfer_diagnostics_<tag>.{json,md}`` and ``…_layers.png``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="transfer_diagnostics", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a scorer folder (kvpop.json + kvpop_scorers.safetensors)")
    p.add_argument("--model", default="smollm2", help="its base: smollm2 or a local HF folder")
    p.add_argument("--sources", nargs="+", default=["champ", "stdlib"], help="data.source values")
    p.add_argument("--sequences", type=int, default=4, help="held-out sequences per source")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--query-power", type=float, default=1.0, help="β of the targets the scorer was trained on")
    p.add_argument("--topks", type=int, nargs="*", default=[], help="more long-range sizes to diagnose at")
    p.add_argument("--no-decisions", action="store_true",
                   help="only the attention view (the decision, kept-set and rank views take most of the time)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out", default=str(REPO / "research" / "results"))
    return p.parse_args(argv)


def run(args) -> dict:
    import torch

    import kvpop
    from pipelines.config import ConfigError
    from pipelines.data import check_inputs, load_sequences, load_tokenizer

    from research.learning_curves import corpus_config, diagnostics, load_saved_scorer
    from kvpop.diagnostics import attention_model

    folder = Path(args.checkpoint)
    meta_file = folder / "kvpop.json"
    if not meta_file.is_file():
        raise ConfigError(f"--checkpoint {folder}: no kvpop.json there; give a folder with kvpop.json and "
                          f"kvpop_scorers.safetensors (a learning-curves step folder or a scorer-only final_model)")
    meta = json.loads(meta_file.read_text())
    configs = {source: corpus_config(args.model, source, args.seq_len, meta["budget"], args.query_power,
                                     args.sequences) for source in args.sources}
    for cfg in configs.values():
        check_inputs(cfg)
    first = next(iter(configs.values()))
    tokenizer = load_tokenizer(first)
    device = torch.device(args.device)
    model = load_saved_scorer(folder, meta, first, args.device)
    budget = kvpop.Budget(**meta["budget"])
    result = {"checkpoint": str(folder), "budget": str(budget), "meta": meta, "args": vars(args), "sources": {}}
    for source, cfg in configs.items():
        t0 = time.perf_counter()
        rows = load_sequences(cfg, "eval", tokenizer)[:args.sequences]
        ids = torch.tensor([r["input_ids"] for r in rows], dtype=torch.long, device=device)
        topks = [budget.topk, *args.topks]
        found = {} if args.no_decisions else diagnostics(model, ids, topks, args.batch,
                                                          cfg.precompute.target_options())
        found["attention"] = attention_summary(attention_model(
            model, ids, topks, batch_size=args.batch, target_options=cfg.precompute.target_options()))
        found["seconds"] = round(time.perf_counter() - t0, 1)
        found["sequences"] = len(rows)
        result["sources"][source] = found
        mass = found["attention"][str(budget)]
        print(f"[transfer] {source}: attention lost / output error: scorer {mass['scorer']['lost']:.4f} / "
              f"{mass['scorer']['output_error']:.4f}, streaming {mass['newest']['lost']:.4f} / "
              f"{mass['newest']['output_error']:.4f}, oracle {mass['oracle']['lost']:.4f} / "
              f"{mass['oracle']['output_error']:.4f} ({found['seconds']}s)", flush=True)
        if "budgets" in found:
            d = found["budgets"][str(budget)]
            print(f"[transfer] {source}: BA {d['scorer']['balanced_accuracy']:.4f} AUC {d['scorer']['auc']:.4f} "
                  f"overlap end {d['scorer']['overlap_end']:.3f} Spearman {found['spearman']['scorer']:.3f}",
                  flush=True)
    return result


def attention_summary(found: dict) -> dict:
    """Per budget and rule: the mean share of attention lost (``lost``), its part older than the streaming band
    (``lost_far``) and the rest (``lost_near``), and the output error ``Σ |o_rule - o| / Σ |o|`` over queries and
    heads (``output_error``); each per layer, and per sequence (for paired intervals)."""
    from kvpop.diagnostics import layer_output_errors

    out, per_layer = {}, layer_output_errors(found)
    for budget, rules in found.items():
        out[budget] = {}
        for rule, parts in rules.items():
            lost, far, change, norm = (parts[p].double() for p in ("lost", "lost_far", "output_change", "output_norm"))
            cell = out[budget][rule] = {"lost_near": (lost - far).mean().item(),
                                        "output_error": (change.mean() / norm.mean()).item(),
                                        "output_error_per_layer": per_layer[budget][rule],
                                        "output_error_per_sequence": (change.mean((0, 2)) / norm.mean((0, 2))).tolist()}
            for name, value in (("lost", lost), ("lost_far", far)):  # [layers, N, H]
                cell[name] = value.mean().item()
                cell[f"{name}_per_layer"] = value.mean((1, 2)).tolist()
                cell[f"{name}_per_sequence"] = value.mean((0, 2)).tolist()
    return out


def attention_rows(result: dict) -> list[str]:
    """The attention table: each rule's share lost and output error, the scorer's split around the streaming band,
    and the scorer's paired difference from streaming with its interval over sequences."""
    from research.bootstrap import format_interval, paired_bootstrap

    lines = ["", "The dense model's own attention under each rule's evictions (every query from d = B on, every layer "
             "and query head, teacher-forced: only the choice of tokens differs). *Lost*: share of attention on "
             "evicted tokens, the scorer's split into the band a streaming cache keeps (ages w … w + k − 1) / older "
             "tokens. *Output error*: Σ |o_rule − o| / Σ |o| over queries and heads, o_rule the head's output with "
             "the softmax over the retained tokens only. Streaming = newest-wins at the same budget. Recovered: "
             "(streaming − scorer) / (streaming − oracle). Intervals: paired bootstrap over sequences (few: a "
             "direction).", "",
             "| corpus | budget | lost: streaming / scorer / oracle / random | scorer lost near / far | output error: "
             "streaming / scorer / oracle / random | scorer − streaming, output error | recovered: lost / output |",
             "|---|---|---|---|---|---|---|"]

    def recovered(m, part):
        span = m["newest"][part] - m["oracle"][part]
        return (m["newest"][part] - m["scorer"][part]) / span if span > 0 else float("nan")

    for source, found in result["sources"].items():
        for budget, m in found.get("attention", {}).items():
            shares = " / ".join(f"{m[r]['lost']:.4f}" for r in ("newest", "scorer", "oracle", "random"))
            errors = " / ".join(f"{m[r]['output_error']:.4f}" for r in ("newest", "scorer", "oracle", "random"))
            diff = paired_bootstrap(m["scorer"]["output_error_per_sequence"], m["newest"]["output_error_per_sequence"])
            lines.append(f"| {source} | {budget} | {shares} | {m['scorer']['lost_near']:.4f} / "
                         f"{m['scorer']['lost_far']:.4f} | {errors} | {format_interval(diff, 4)} | "
                         f"{recovered(m, 'lost'):.2f} / {recovered(m, 'output_error'):.2f} |")
    return lines


def render(result: dict) -> str:
    budget = result["budget"]
    lines = [f"# Transfer of a scorer's decisions across corpora ({budget})", "",
             f"Scorer `{result['checkpoint']}`; held-out sequences of each corpus (S = {result['args']['seq_len']}), "
             f"teacher targets with β = {result['args']['query_power']}."]
    decided = {source: found for source, found in result["sources"].items() if "budgets" in found}
    if decided:
        lines += ["", "Decisions, kept sets and ranks: means over layers, KV heads and sequences "
                  "(`kvpop.diagnostics`). Newest-wins / oldest-wins / random have balanced accuracy 0.5 by "
                  "construction.", "",
                  "| corpus | sequences | BA | AUC | agreement | newest agr. | oldest agr. | overlap end | oracle-mass "
                  "ratio end | Spearman |", "|---|---|---|---|---|---|---|---|---|---|"]
    for source, found in decided.items():
        d = found["budgets"][budget]
        s = d["scorer"]
        lines.append(f"| {source} | {found['sequences']} | {s['balanced_accuracy']:.4f} | {s['auc']:.4f} | "
                     f"{s['agreement']:.4f} | {d['newest']['agreement']:.4f} | {d['oldest']['agreement']:.4f} | "
                     f"{s['overlap_end']:.3f} | {s['mass_ratio_end']:.3f} | {found['spearman']['scorer']:.3f} |")
    lines += attention_rows(result)
    return "\n".join(lines) + "\n"


def layers_plot(result: dict, path: Path) -> None:
    """Per layer: the scorer's balanced accuracy (when the decisions were diagnosed), then the share of attention
    evicted and the output error of the scorer, streaming and the oracle, one colour per corpus."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipelines.scorer_diagnostics import per_layer_figure

    budget = result["budget"]
    sources = result["sources"]
    decided = all("budgets" in found for found in sources.values())
    layers = range(len(next(iter(sources.values()))["attention"][budget]["scorer"]["lost_per_layer"]))
    fig, axes = plt.subplots(3 if decided else 2, 1, figsize=(8, 11 if decided else 7.5), squeeze=False)
    panels = iter(axes[:, 0])
    if decided:
        curves, styles = {}, {}
        for i, (source, found) in enumerate(sources.items()):
            label = f"scorer on {source}"
            curves[label] = found["budgets"][budget]["scorer"]["balanced_accuracy_per_layer"]
            styles[label] = (f"C{i}", "-", "o")
        curves["newest / oldest / random"] = [0.5] * len(layers)
        styles["newest / oldest / random"] = ("0.5", ":", None)
        ax = next(panels)
        per_layer_figure(layers, curves, ax=ax, styles=styles,
                         title=f"held-out keep/evict balanced accuracy per layer at {budget}")
        ax.set_ylim(0.4, 1.0)
    for part, ylabel, title in (("lost", "share of attention evicted", "dense attention on evicted tokens"),
                                ("output_error", "sum |o_rule - o| / sum |o|", "change of the heads' outputs")):
        per_rule, rule_styles = {}, {}
        for i, (source, found) in enumerate(sources.items()):
            for rule, label, style in (("scorer", "scorer", "-"), ("newest", "streaming", "--"),
                                       ("oracle", "oracle", ":")):
                name = f"{label} on {source}"
                per_rule[name] = found["attention"][budget][rule][f"{part}_per_layer"]
                rule_styles[name] = (f"C{i}", style, "o" if rule == "scorer" else None)
        per_layer_figure(layers, per_rule, ax=next(panels), styles=rule_styles, ylabel=ylabel,
                         title=f"{title} per layer at {budget} (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    from jobs._cli import fail
    from kvpop.files import atomic_write_text
    from pipelines.config import ConfigError

    args = parse_args(argv)
    try:
        result = run(args)
    except ConfigError as err:
        return fail("transfer_diagnostics", err)
    stem = Path(args.out) / f"transfer_diagnostics_{args.tag}"
    atomic_write_text(stem.with_suffix(".json"), json.dumps(result, indent=1))
    atomic_write_text(stem.with_suffix(".md"), render(result))
    layers_plot(result, stem.with_name(stem.name + "_layers.png"))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
