"""A recency term per layer (METHOD §3's λ, one per layer), chosen by the end-to-end KL it gives on training text.

One global λ decays every layer alike, and champ's text and held-out text want different λ (0.002 / 0.003 at CR
87.5 %). This calibrates one λ per layer for a saved scorer by coordinate descent on the mean teacher-forced
KL(dense ‖ kvpop) over ``--sequences`` of ``--source``'s *training* split (never a held-out sequence): all layers
start at ``--start``; a sweep tries, layer by layer, each λ of ``--grid`` with the others fixed and keeps a move only
where the KL drops. The result is installed as the scorer's per-head recency (METHOD §4, ``head_recency``: every head
of a layer at its λ; a static priority, so the retention rule and decode ≡ masked forward hold) and saved as a
scorer folder that ``recency_blend.py --checkpoint`` evaluates on held-out text like any other. The same KL on as
many *other* training sequences (``validation``) is reported for the start and the result: a calibration that only
fits its own sequences shows there.

    python research/layer_recency.py --checkpoint DIR --source champ --sequences 8 --device cuda \\
        --tag h200_w256_qp16_norms --out /tmp/r       # then: recency_blend.py --checkpoint <out>/…_scorer

Writes ``<out>/layer_recency_<tag>.{json,md}`` and the scorer folder ``<out>/layer_recency_<tag>_scorer/``.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    from jobs._cli import bare_parser

    p = bare_parser("layer_recency", __doc__)
    p.prog = "research/layer_recency.py"
    p.add_argument("--checkpoint", required=True, help="a scorer folder (kvpop.json + kvpop_scorers.safetensors)")
    p.add_argument("--model", default="smollm2", help="its base: smollm2 or a local HF folder")
    p.add_argument("--source", default="champ", help="the corpus whose training split calibrates (data.source)")
    p.add_argument("--sequences", type=int, default=8, help="calibration sequences (as many again validate)")
    p.add_argument("--grid", type=float, nargs="+", default=[0.0, 0.001, 0.002, 0.003, 0.005],
                   help="the λ each layer may take")
    p.add_argument("--start", type=float, default=0.002, help="every layer's λ before the first sweep")
    p.add_argument("--sweeps", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tag", required=True)
    p.add_argument("--out", default=str(REPO / "research" / "results"))
    args = p.parse_args(argv)
    if args.sequences < 1 or args.sweeps < 1 or args.batch < 1:
        p.error("--sequences, --sweeps and --batch must be >= 1")
    if min(args.grid + [args.start]) < 0:
        p.error("--grid and --start: λ must be >= 0")
    return args


def load_with_layer_recency(folder: Path, meta: dict, cfg, device: str):
    """The saved scorer on its base (:func:`research.learning_curves.retrofitted_base`) with a per-head recency
    term added, 0 until :func:`set_layer_recency`. The checkpoint's weights must fit exactly but for that term
    (ValueError otherwise)."""
    from safetensors.torch import load_file

    from research.learning_curves import retrofitted_base
    from kvpop.retrofit import scoring_modules

    model = retrofitted_base(meta, cfg, device, scorer_options={"head_recency": True})
    weights = load_file(str(folder / "kvpop_scorers.safetensors"))
    for module in scoring_modules(model):
        i = module.layer_idx
        prefix = f"layers.{i}."
        state = {k[len(prefix):]: v.to(device) for k, v in weights.items() if k.startswith(prefix)}
        missing, unexpected = module.kvpop_scorer.load_state_dict(state, strict=False)
        if unexpected or list(missing) != ["head_recency"]:
            raise ValueError(f"{folder}: layer {i}'s scorer weights do not fit (missing {list(missing)}, "
                             f"unexpected {list(unexpected)})")
    return model


def set_layer_recency(model, lambdas: list[float]) -> None:
    """Every KV head of layer ``l`` ranks by its scorer's output + ``lambdas[l] · t`` (the per-head term, METHOD §4)."""
    import torch

    import kvpop
    from kvpop.scorers.base import HEAD_RECENCY_UNIT

    scorers = kvpop.scorers(model)
    if len(lambdas) != len(scorers):
        raise ValueError(f"one λ per layer: {len(scorers)} layers, got {len(lambdas)}")
    with torch.no_grad():
        for scorer, value in zip(scorers, lambdas):
            scorer.head_recency.fill_(value * HEAD_RECENCY_UNIT)


class Calibration:
    """The mean KL(dense ‖ kvpop) over positions >= B of a fixed set of sequences, for a per-layer λ; the dense
    logits are computed once."""

    def __init__(self, model, ids, batch: int):
        import kvpop
        from kvpop.evaluation import dense_logits
        from kvpop.retrofit import runtime_of

        self.model, self.batch = model, batch
        self.start = runtime_of(model).policy.budget.total
        self.ids = ids.split(batch)
        self.dense = [dense_logits(model, chunk)[:, self.start:].float() for chunk in self.ids]
        self.evaluations = 0
        self.layers = len(kvpop.scorers(model))

    def kl(self, lambdas: list[float]) -> float:
        from kvpop.evaluation import Setting, forced_logits
        from kvpop.metrics import per_sequence
        from kvpop.retrofit import runtime_of

        set_layer_recency(self.model, lambdas)
        setting = Setting("kvpop", runtime_of(self.model).policy.budget)
        values = []
        for chunk, dense in zip(self.ids, self.dense):
            logits = forced_logits(self.model, setting, chunk, start=self.start).float()
            values += [r["kl"] for r in per_sequence(logits, dense, chunk[:, self.start:])]
        self.evaluations += 1
        return sum(values) / len(values)


def coordinate_descent(kl, layers: int, grid: list[float], start: float, sweeps: int) -> dict:
    """Per layer the λ of ``grid`` that lowers ``kl(lambdas)`` most with the other layers fixed, layer after layer,
    ``sweeps`` times from every layer at ``start``; a move is kept only where the KL drops. ``{"lambdas", "kl",
    "start_kl", "moves": [{"sweep", "layer", "from", "to", "kl"}]}``."""
    lambdas = [start] * layers
    best = start_kl = kl(lambdas)
    moves = []
    for sweep in range(sweeps):
        for layer in range(layers):
            current = lambdas[layer]  # its KL is known: not tried again after a move
            for value in grid:
                if value == current:
                    continue
                trial = lambdas[:layer] + [value] + lambdas[layer + 1:]
                found = kl(trial)
                if found < best:
                    moves.append({"sweep": sweep, "layer": layer, "from": lambdas[layer], "to": value, "kl": found})
                    best, lambdas = found, trial
    return {"lambdas": lambdas, "kl": best, "start_kl": start_kl, "moves": moves}


def render(result: dict) -> str:
    a = result["args"]
    lines = [f"# A recency term per layer: {result['checkpoint']} at {result['budget']}", "",
             f"Coordinate descent on the mean teacher-forced KL over positions >= B of {a['sequences']} `{a['source']}` "
             f"training sequences ({result['evaluations']} evaluations, {result['seconds']:.0f} s on "
             f"{result['device']}): every layer from λ = {a['start']}, grid {a['grid']}, {a['sweeps']} sweep(s). "
             f"Validation: as many other training sequences of the same corpus.", "",
             "| λ | calibration KL | validation KL |", "|---|---|---|",
             f"| {a['start']} in every layer | {result['start_kl']:.5f} | {result['validation']['start']:.5f} |",
             f"| per layer (below) | {result['kl']:.5f} | {result['validation']['calibrated']:.5f} |", "",
             "| layer | λ |", "|---|---|"]
    lines += [f"| {i} | {value:g} |" for i, value in enumerate(result["lambdas"])]
    lines += ["", f"Scorer folder: `{result['scorer']}` (evaluate it with `research/recency_blend.py "
              f"--checkpoint`)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm.auto import tqdm

    import kvpop
    from research.learning_curves import corpus_config
    from research.scorer_records import saved_scorer, write_result
    from jobs._cli import fail
    from pipelines.config import ConfigError
    from pipelines.data import check_inputs, load_sequences, load_tokenizer

    folder = Path(args.checkpoint)
    try:
        meta, _ = saved_scorer(folder, args.model, [], args.seq_len, 1)
        if meta["scorer"].get("head_recency"):
            raise ConfigError(f"--checkpoint {folder} already has a learned per-head recency; calibrate a scorer "
                              f"without one")
        cfg = corpus_config(args.model, args.source, args.seq_len, meta["budget"], 1.0, 1,
                            train_sequences=2 * args.sequences)
        check_inputs(cfg)
        rows = load_sequences(cfg, "train", load_tokenizer(cfg))[:2 * args.sequences]  # as many again validate
    except ConfigError as err:
        return fail("layer_recency", err)
    t0 = time.perf_counter()
    model = load_with_layer_recency(folder, meta, cfg, args.device)
    ids = torch.tensor([r["input_ids"] for r in rows], dtype=torch.long, device=args.device)
    with torch.no_grad():
        calibration = Calibration(model, ids[:args.sequences], args.batch)
        trials = len([g for g in args.grid if g != args.start])  # per layer in the first sweep (at most, later)
        with tqdm(total=1 + args.sweeps * calibration.layers * trials, desc="layer_recency", unit="KL") as bar:
            def kl(lambdas):
                bar.update(1)
                return calibration.kl(lambdas)

            found = coordinate_descent(kl, calibration.layers, args.grid, args.start, args.sweeps)
        validation = Calibration(model, ids[args.sequences:], args.batch)
        checked = {"start": validation.kl([args.start] * validation.layers),
                   "calibrated": validation.kl(found["lambdas"])}
    out = Path(args.out)
    scorer = out / f"layer_recency_{args.tag}_scorer"
    set_layer_recency(model, found["lambdas"])
    kvpop.save_retrofitted(model, scorer, base=cfg.model.resolved_path())  # the base loaded here, its digest taken
    device = torch.device(args.device)
    result = {"checkpoint": str(folder), "budget": str(kvpop.Budget(**meta["budget"])), "args": vars(args),
              **found, "validation": checked, "evaluations": calibration.evaluations, "scorer": str(scorer),
              "seconds": round(time.perf_counter() - t0, 1),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    write_result(out, f"layer_recency_{args.tag}", result, render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
