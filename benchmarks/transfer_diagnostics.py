"""Does a trained scorer's ranking carry over to a corpus it never saw? Issue 12's diagnostics
(:mod:`kvpop.diagnostics`: balanced accuracy of its keep/evict decisions against the teacher's, next to newest- /
oldest-wins; kept-set overlap with the oracle's; rank correlation with the targets), per corpus and per layer, for one
saved scorer.

    python benchmarks/transfer_diagnostics.py --checkpoint DIR --sources champ stdlib --sequences 4

``DIR``: a scorer folder (``kvpop.json`` + ``kvpop_scorers.safetensors``: a learning-curves step folder, a pipeline's
scorer-only ``final_model``), its base model taken from ``--model``. The held-out split of each source (the data
stage's, ``--sequences`` of ``--seq-len``) is diagnosed against that source's own teacher targets
(β = ``--query-power``) at the scorer's budget. Writes ``<out>/transfer_diagnostics_<tag>.{json,md}`` and
``…_layers.png``.
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
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    return p.parse_args(argv)


def run(args) -> dict:
    import torch

    import kvpop
    from kvpop.pretrained import load_pretrained
    from pipelines.config import ConfigError
    from pipelines.data import check_inputs, load_sequences, load_tokenizer

    from benchmarks.learning_curves import corpus_config, diagnostics

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
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, _ = load_pretrained(first.model.resolved_path(), dtype=dtype, device=device)
    budget = kvpop.Budget(**meta["budget"])
    kvpop.retrofit(model, budget, scorer=meta["scorer"]["name"], policy=meta["policy"], recency=meta["recency"],
                   scorer_options={k: v for k, v in meta["scorer"].items() if k != "name"})
    kvpop.load_scorers(model, folder)
    model.eval()
    result = {"checkpoint": str(folder), "budget": str(budget), "meta": meta, "args": vars(args), "sources": {}}
    for source, cfg in configs.items():
        t0 = time.perf_counter()
        rows = load_sequences(cfg, "eval", tokenizer)[:args.sequences]
        ids = torch.tensor([r["input_ids"] for r in rows], dtype=torch.long, device=device)
        found = diagnostics(model, ids, [budget.topk], args.batch, cfg.precompute.target_options())
        found["seconds"] = round(time.perf_counter() - t0, 1)
        found["sequences"] = len(rows)
        result["sources"][source] = found
        d = found["budgets"][str(budget)]
        print(f"[transfer] {source}: BA {d['scorer']['balanced_accuracy']:.4f} AUC {d['scorer']['auc']:.4f} "
              f"overlap end {d['scorer']['overlap_end']:.3f} Spearman {found['spearman']['scorer']:.3f} "
              f"({found['seconds']}s)", flush=True)
    return result


def render(result: dict) -> str:
    budget = result["budget"]
    lines = [f"# Transfer of a scorer's decisions across corpora ({budget})", "",
             f"Scorer `{result['checkpoint']}`; held-out sequences of each corpus (S = {result['args']['seq_len']}), "
             f"teacher targets with β = {result['args']['query_power']}; means over layers, KV heads and sequences "
             "(`kvpop.diagnostics`). Newest-wins / oldest-wins / random have balanced accuracy 0.5 by construction.",
             "", "| corpus | sequences | BA | AUC | agreement | newest agr. | oldest agr. | overlap end | oracle-mass "
             "ratio end | Spearman |", "|---|---|---|---|---|---|---|---|---|---|"]
    for source, found in result["sources"].items():
        d = found["budgets"][budget]
        s = d["scorer"]
        lines.append(f"| {source} | {found['sequences']} | {s['balanced_accuracy']:.4f} | {s['auc']:.4f} | "
                     f"{s['agreement']:.4f} | {d['newest']['agreement']:.4f} | {d['oldest']['agreement']:.4f} | "
                     f"{s['overlap_end']:.3f} | {s['mass_ratio_end']:.3f} | {found['spearman']['scorer']:.3f} |")
    return "\n".join(lines) + "\n"


def layers_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipelines.scorer_diagnostics import per_layer_figure

    budget = result["budget"]
    curves, styles = {}, {}
    for i, (source, found) in enumerate(result["sources"].items()):
        label = f"scorer on {source}"
        curves[label] = found["budgets"][budget]["scorer"]["balanced_accuracy_per_layer"]
        styles[label] = (f"C{i}", "-", "o")
    curves["newest / oldest / random"] = [0.5] * len(next(iter(curves.values())))
    styles["newest / oldest / random"] = ("0.5", ":", None)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    per_layer_figure(range(len(curves["newest / oldest / random"])), curves, ax=ax, styles=styles,
                     title=f"held-out keep/evict balanced accuracy per layer at {budget}")
    ax.set_ylim(0.4, 1.0)
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
