"""Does running some layers as a streaming cache (``kvpop.set_streaming_layers``) beat the scorer everywhere, end to
end? Teacher-forced KL and top-1 agreement against the dense model at the scorer's own B, per held-out sequence, for
streaming, KVpop (scorers in every layer) and KVpop with the streaming layers, with paired bootstrap intervals.

    python research/streaming_layers.py --checkpoint DIR --calibrate-source champ --sources stdlib champ

The streaming layers come from ``--layers`` (say where they were chosen) or are calibrated here
(:func:`kvpop.diagnostics.streaming_layers`) on ``--calibrate-sequences`` of ``--calibrate-source``'s *training*
split, never on the held-out text that is scored. ``DIR``: a scorer folder (``kvpop.json`` +
``kvpop_scorers.safetensors``), its base model from ``--model``. One record per (corpus, sequence, rule) goes to
``<out>/streaming_layers_<tag>_items.jsonl`` as it is measured; a re-run skips what is there (with the same layers and
checkpoint, else it refuses in one line before loading anything), as does the calibration
(``…_<tag>_calibration.json``). Writes
``<out>/streaming_layers_<tag>.{json,md}``.
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

RULES = ("streaming", "kvpop", "kvpop+streaming_layers")
DYNAMIC = ("tova", "h2o")  # step by step only: on the first --dynamic-sequences


def parse_layers(spec: str) -> list[int]:
    """``"0,12-21,27"`` → ``[0, 12, …, 21, 27]``."""
    out: set[int] = set()
    for part in filter(None, spec.split(",")):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return sorted(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="streaming_layers", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a scorer folder (kvpop.json + kvpop_scorers.safetensors)")
    p.add_argument("--model", default="smollm2", help="its base: smollm2 or a local HF folder")
    chosen = p.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--layers", type=parse_layers, help="the streaming layers, e.g. 0,12-21,27,29")
    chosen.add_argument("--calibrate-source", help="calibrate on this data.source's training split")
    p.add_argument("--calibrate-sequences", type=int, default=2)
    p.add_argument("--sources", nargs="+", default=["stdlib", "champ"], help="held-out corpora (data.source values)")
    p.add_argument("--sequences", type=int, default=16, help="held-out sequences per corpus")
    p.add_argument("--dynamic-sequences", type=int, default=0, help="TOVA and H2O on the first this many")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out", default=str(REPO / "research" / "results"))
    args = p.parse_args(argv)
    if args.calibrate_sequences < 1 or args.sequences < 1:
        p.error("--calibrate-sequences and --sequences must be >= 1")
    return args


def calibration_identity(args) -> dict:
    return {"checkpoint": str(Path(args.checkpoint).resolve()), "source": args.calibrate_source,
            "sequences": args.calibrate_sequences, "seq_len": args.seq_len}


def calibrate(model, args, meta, tokenizer, path: Path) -> dict:
    """The streaming layers calibrated on ``--calibrate-source``'s training split, committed to ``path`` as one JSON
    line (a re-run reads it back: :func:`research.scorer_records.committed`)."""
    import torch

    from research.learning_curves import corpus_config
    from kvpop.diagnostics import streaming_layers
    from kvpop.files import atomic_write_text
    from pipelines.data import load_sequences

    cfg = corpus_config(args.model, args.calibrate_source, args.seq_len, meta["budget"], 1.0, 1,
                        train_sequences=args.calibrate_sequences)
    rows = load_sequences(cfg, "train", tokenizer)[:args.calibrate_sequences]
    ids = torch.tensor([r["input_ids"] for r in rows], dtype=torch.long, device=args.device)
    t0 = time.perf_counter()
    found = {**calibration_identity(args), **streaming_layers(model, ids),
             "seconds": round(time.perf_counter() - t0, 1)}
    atomic_write_text(path, json.dumps(found) + "\n")
    print(f"[streaming_layers] calibrated on {len(rows)} {args.calibrate_source} training sequences "
          f"({found['seconds']:.0f} s): layers {found['layers']}", flush=True)
    return found


def records_identity(args, layers: list[int]) -> dict:
    return {"checkpoint": str(Path(args.checkpoint).resolve()), "layers": layers}


def measure(model, args, meta, tokenizer, layers: list[int], records_path: Path) -> list[dict]:
    """Every (corpus, sequence, rule) not yet in ``records_path``, appended as measured."""
    import kvpop
    from research.scorer_records import measure as measure_rules
    from kvpop.evaluation import Setting, forced_logits

    def logits_of(rule, ids, budget, start):
        kvpop.set_streaming_layers(model, layers if rule == "kvpop+streaming_layers" else ())
        if rule in DYNAMIC:
            return forced_logits(model, Setting(rule, budget), ids, start=start)
        kvpop.set_policy(model, "streaming" if rule == "streaming" else "kvpop", budget, recency=meta["recency"])
        return model(input_ids=ids, use_cache=False, logits_to_keep=ids.shape[1] - start).logits

    return measure_rules(model, args, meta, tokenizer, records_path, records_identity(args, layers),
                         lambda item: RULES + DYNAMIC * (item < args.dynamic_sequences), logits_of,
                         "streaming_layers")


def summarize(records: list[dict], sources: list[str]) -> dict:
    """Per corpus: the means over the sequences every static rule has, and paired differences of KVpop with the
    streaming layers (``SL``) against each other rule, each over the sequences both have."""
    from research.bootstrap import paired_bootstrap

    out = {}
    for source in sources:
        by_rule = {rule: {r["item"]: r for r in records if r["source"] == source and r["rule"] == rule}
                   for rule in RULES + DYNAMIC}
        items = sorted(set.intersection(*(set(by_rule[r]) for r in RULES)))
        cell = out[source] = {"items": items, "dynamic_items": sorted(set(by_rule["tova"]) & set(by_rule[RULES[2]]))}
        for metric in ("kl", "top1"):
            cell[metric] = {rule: sum(by_rule[rule][i][metric] for i in items) / len(items) if items else None
                            for rule in RULES}
            for a, b in [(RULES[2], r) for r in (*RULES[:2], *DYNAMIC)] + [("kvpop", "streaming")]:
                both = sorted(set(by_rule[a]) & set(by_rule[b]))
                cell[f"{metric}:{a}-{b}"] = paired_bootstrap([by_rule[a][i][metric] for i in both],
                                                             [by_rule[b][i][metric] for i in both])
    return out


def render(result: dict) -> str:
    from research.bootstrap import format_interval

    pairs = [(RULES[2], r) for r in (*RULES[:2], *DYNAMIC)] + [("kvpop", "streaming")]
    lines = [f"# Streaming layers: {result['checkpoint']} at {result['budget']}", "",
             f"Streaming layers {result['layers']} ({result['chosen']}). Teacher-forced against the dense model over "
             f"positions ≥ B, one value per held-out sequence; intervals: 95 % paired bootstrap over the sequences "
             f"both rules have (n; * where it excludes 0). KL: lower is better; top-1: higher. SL = KVpop with the "
             f"streaming layers.", "",
             "| corpus | n | metric | streaming / KVpop / SL | " + " | ".join(f"{a} − {b}" for a, b in pairs) + " |",
             "|---|---|---|---|" + "---|" * len(pairs)]
    for source, cell in result["summary"].items():
        if not cell["items"]:
            continue
        for metric in ("kl", "top1"):
            diffs = [cell[f"{metric}:{a}-{b}"] for a, b in pairs]
            lines.append(f"| {source} | {len(cell['items'])} | {metric} | " +
                         " / ".join(f"{cell[metric][r]:.4f}" for r in RULES) + " | " +
                         " | ".join(f"{format_interval(d, 4)} (n {d['n']})" if d["n"] > 1 else
                                    f"{d['mean']:+.4f} (n {d['n']}, no interval)" if d["n"] else "–"
                                    for d in diffs) + " |")
    if result.get("calibration"):
        c = result["calibration"]
        lines += ["", f"Calibration ({c['sequences']} {c['source']} training sequences of {c['seq_len']} tokens): output error Σ|o_rule − o| / "
                  f"Σ|o| per layer, scorer vs streaming:", "", "| layer | scorer | streaming | streams |",
                  "|---|---|---|---|"]
        lines += [f"| {i} | {a:.4f} | {b:.4f} | {'yes' if i in c['layers'] else ''} |"
                  for i, (a, b) in enumerate(zip(c["scorer"], c["streaming"]))]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from research.learning_curves import load_saved_scorer
    from research.scorer_records import committed, saved_scorer, write_result
    from kvpop import Budget
    from pipelines.config import ConfigError
    from pipelines.data import load_tokenizer

    folder = Path(args.checkpoint)
    try:
        meta, configs = saved_scorer(folder, args.model, [*args.sources, *([args.calibrate_source] if
                                     args.calibrate_source else [])], args.seq_len, args.sequences)
    except ConfigError as err:
        print(f"streaming_layers: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    calibration_path = out / f"streaming_layers_{args.tag}_calibration.json"
    records_path = out / f"streaming_layers_{args.tag}_items.jsonl"
    try:  # what an earlier run committed is read (and refused if it is another run's) before the model loads
        calibration = (next(iter(committed(calibration_path, calibration_identity(args), "a calibration")), None)
                       if args.calibrate_source else None)
        layers = calibration["layers"] if calibration else args.layers
        if calibration:
            print(f"[streaming_layers] calibration read from {calibration_path}: layers {layers}", flush=True)
        if layers is not None:
            committed(records_path, records_identity(args, layers), "records")
    except ValueError as err:
        print(f"streaming_layers: {err}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(configs[0])
    model = load_saved_scorer(args.checkpoint, meta, configs[0], args.device)
    out.mkdir(parents=True, exist_ok=True)
    if args.calibrate_source and calibration is None:
        calibration = calibrate(model, args, meta, tokenizer, calibration_path)
        layers = calibration["layers"]
    try:
        records = measure(model, args, meta, tokenizer, layers, records_path)
    except ValueError as err:  # records another run left meanwhile
        print(f"streaming_layers: {err}", file=sys.stderr)
        return 2
    result = {"checkpoint": str(folder), "budget": str(Budget(**meta["budget"])), "layers": layers,
              "chosen": (f"calibrated on {calibration['sequences']} {calibration['source']} training sequences"
                         if calibration else "given with --layers"),
              "calibration": calibration, "args": {k: v for k, v in vars(args).items()},
              "summary": summarize(records, args.sources)}
    write_result(out, f"streaming_layers_{args.tag}", result, render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
