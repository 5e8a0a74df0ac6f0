"""What the saved-scorer benchmarks (``streaming_layers.py``, ``window_attention.py``, ``recency_blend.py``) share: a
scorer folder and the corpora it is scored on, checked before anything loads; per-item records committed as they are
measured (a re-run skips them, another run's are refused in one line); the teacher-forced measurement of named rules
against the dense model at the scorer's B (or the one it is evaluated at), one record per (corpus, held-out
sequence, rule)."""
from __future__ import annotations

import json
import time
from pathlib import Path


def saved_scorer(folder, model: str, sources, seq_len: int, sequences: int) -> tuple[dict, list]:
    """``(kvpop.json of the scorer folder, the pipeline config of each corpus in sources)``, every corpus checked;
    bad input is a :class:`pipelines.config.ConfigError` (one line)."""
    from research.learning_curves import corpus_config
    from pipelines.config import ConfigError
    from pipelines.data import check_inputs

    folder = Path(folder)
    if not (folder / "kvpop.json").is_file():
        raise ConfigError(f"--checkpoint {folder} has no kvpop.json; give a scorer folder")
    meta = json.loads((folder / "kvpop.json").read_text())
    configs = [corpus_config(model, source, seq_len, meta["budget"], 1.0, sequences) for source in sources]
    for cfg in configs:
        check_inputs(cfg)
    return meta, configs


def committed(path: Path, identity: dict, what: str) -> list[dict]:
    """The JSON lines of ``path`` (none if it is missing); a line of another run (``identity`` differs) is refused."""
    found = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    for record in found:
        if {k: record.get(k) for k in identity} != identity:
            theirs = ", ".join(f"{k} {record.get(k)}" for k in identity)
            raise ValueError(f"{path} holds {what} of {theirs}: use another --tag or remove the file")
    return found


def open_records(args, name: str, topk: int | None = None, streaming_layers=None
                 ) -> tuple[dict, list, dict, Path, dict]:
    """A saved-scorer benchmark's run, checked before anything loads: ``(kvpop.json, each corpus's config, the
    budget measured at — the scorer's, or with ``topk`` long-range slots —, <out>/<name>_<tag>_items.jsonl, the
    identity its records carry)``; records already there of another run are refused. ``streaming_layers``: the
    layers the run makes streaming (None: the checkpoint's own), part of the identity when given. Bad input:
    ConfigError (one line)."""
    from pipelines.config import ConfigError

    folder = Path(args.checkpoint)
    meta, configs = saved_scorer(folder, args.model, args.sources, args.seq_len, args.sequences)
    budget = {**meta["budget"], **({"topk": topk} if topk is not None else {})}
    records_path = Path(args.out) / f"{name}_{args.tag}_items.jsonl"
    identity = {"checkpoint": str(folder.resolve()), "budget": budget, "seq_len": args.seq_len}
    if streaming_layers is not None:
        identity["streaming_layers"] = sorted(set(streaming_layers))
    try:
        committed(records_path, identity, "records")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return meta, configs, budget, records_path, identity


def write_result(out: Path, stem: str, result: dict, text: str) -> None:
    """``<out>/<stem>.json`` (the result) and ``.md`` (its report, also printed)."""
    from kvpop.files import atomic_write_text

    atomic_write_text(out / f"{stem}.json", json.dumps(result, indent=2))
    atomic_write_text(out / f"{stem}.md", text)
    print(text)


def measure(model, args, meta, tokenizer, records_path: Path, identity: dict, rules, logits_of,
            name: str) -> list[dict]:
    """Every (corpus of ``args.sources``, sequence, rule) not yet in ``records_path``, appended as measured:
    ``rules(item)`` names the rules of held-out sequence ``item``, ``logits_of(rule, ids, budget, start)`` gives the
    model's logits under it from position ``start = B`` on (the model left in the dense policy before each
    sequence); KL and top-1 agreement against the dense logits."""
    import torch

    import kvpop
    from research.learning_curves import corpus_config
    from kvpop.metrics import per_sequence
    from pipelines.data import load_sequences

    done = committed(records_path, identity, "records")
    have = {(r["source"], r["item"], r["rule"]) for r in done}
    budget = kvpop.Budget(**meta["budget"])
    start = budget.total
    with records_path.open("a") as sink, torch.no_grad():
        for source in args.sources:
            cfg = corpus_config(args.model, source, args.seq_len, meta["budget"], 1.0, args.sequences)
            rows = load_sequences(cfg, "eval", tokenizer)[:args.sequences]
            for item, row in enumerate(rows):
                todo = [r for r in rules(item) if (source, item, r) not in have]
                if not todo:
                    continue
                t0 = time.perf_counter()
                ids = torch.tensor([row["input_ids"]], dtype=torch.long, device=args.device)
                kvpop.set_policy(model, "dense")
                dense = model(input_ids=ids, use_cache=False, logits_to_keep=ids.shape[1] - start).logits
                for rule in todo:
                    metrics = per_sequence(logits_of(rule, ids, budget, start).float(), dense.float(),
                                           ids[:, start:])[0]
                    record = {**identity, "source": source, "item": item, "id": row["id"], "rule": rule,
                              "kl": metrics["kl"], "top1": metrics["top1_agreement"]}
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                    done.append(record)
                print(f"[{name}] {source} item {item}: " + ", ".join(
                    f"{r['rule']} {r['kl']:.4f}" for r in done[-len(todo):]) +
                    f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    return done
