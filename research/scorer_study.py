"""What limits the learned scorer (issue 12): a CPU study with the project's scorers, losses and diagnostics.

Scorer-only training decomposes by layer when the scorers read the keys and values of the dense pass
(``kvpop.online``, ``features="dense"``): each layer's scorer sees only its own layer's keys, values and targets.
So the study caches, once, the dense pass of SmolLM2-135M-Instruct over packed champ sequences (targets of every
layer; keys and values of a subset of layers) and trains only that subset's scorers, one *variant* at a time, on 1
CPU thread. Each variant changes one thing against the baseline (the default config's mLSTM, S = 512, s4-w64-k32):
data and steps, the scorer's input features, the loss, τ, the recency λ, training at several budgets at once.
Features a scorer cannot see today (the attention a token received while in the window, its position) are tried as
*probes*: an MLP scorer given them as extra inputs, against the same MLP without them.

Held-out metrics come from :func:`kvpop.diagnostics.diagnose` against the plain (λ = 0) teacher — the METHOD §1
oracle — at the training budget and the evaluation budgets, per layer, KV head and sequence. Every comparison with
its reference is a paired bootstrap over held-out sequences (95 % interval of the mean difference:
``pipelines/stats.py`` through ``research/bootstrap.py``).

    python research/scorer_study.py prepare                   # the cache (~10 min on one core at S = 512)
    python research/scorer_study.py run baseline norms …      # one JSON per variant (skipped when present)
    python research/scorer_study.py report --out research/results/scorer_study_cpu   # table + figure
    python research/scorer_study.py list                      # the variants
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from research.bootstrap import format_interval, paired_bootstrap  # noqa: E402
from kvpop import Budget  # noqa: E402
from kvpop.diagnostics import diagnose  # noqa: E402
from kvpop.losses import retention_loss  # noqa: E402
from kvpop.retention import with_recency  # noqa: E402
from kvpop.scorers import build_scorer  # noqa: E402
from kvpop.scorers.base import PerHeadMLP, fp32_region  # noqa: E402

LAYERS = (0, 4, 8, 12, 16, 20, 24, 29)  # of SmolLM2's 30
BUDGET = Budget(4, 64, 32)  # the default config's
EVAL_TOPKS = (8, 32, 128)
HEADLINE = ("balanced_accuracy", "auc", "agreement", "weighted_agreement")

BASE = {"scorer": "mlstm", "options": {}, "loss": {}, "recency": 0.0, "train": 64, "steps": 400, "lr": 3e-3,
        "batch": 4, "extras": [], "eval_every": 100, "seed": 0, "vs": "baseline"}
VARIANTS = {  # each changes one thing against its reference ("vs"; the mLSTM baseline unless said)
    "baseline": {},
    # data and steps
    "data16": {"train": 16},
    "data256": {"train": 256},
    "data256-steps1200": {"train": 256, "steps": 1200},
    "data256-steps1200+multik+pairs4": {"train": 256, "steps": 1200,
                                        "loss": {"topks": [8, 16, 64, 128], "random_pairs": 4},
                                        "vs": "data256-steps1200"},
    "steps100": {"steps": 100},
    # input features
    "norms": {"options": {"features": "kv_norms"}},
    # the loss, τ, λ
    "balance": {"loss": {"balance": True}},
    "margin": {"loss": {"weight": "margin"}},
    "multik": {"loss": {"topks": [8, 16, 64, 128]}},
    "pairs4": {"loss": {"random_pairs": 4}},
    "multik+pairs4": {"loss": {"topks": [8, 16, 64, 128], "random_pairs": 4}},
    "tau0.3": {"loss": {"tau": 0.3}},
    "recency0.01": {"recency": 0.01},
    # the stateless scorer (10x cheaper to train: the fast bench for probes of inputs no scorer sees today)
    "mlp": {"scorer": "mlp"},
    "mlp-norms": {"scorer": "mlp", "options": {"features": "kv_norms"}, "vs": "mlp"},
    "mlp-balance": {"scorer": "mlp", "loss": {"balance": True}, "vs": "mlp"},
    "mlp-multik": {"scorer": "mlp", "loss": {"topks": [8, 16, 64, 128]}, "vs": "mlp"},
    "mlp-pairs4": {"scorer": "mlp", "loss": {"random_pairs": 4}, "vs": "mlp"},
    "mlp-data16": {"scorer": "mlp", "train": 16, "vs": "mlp"},
    "mlp-data256": {"scorer": "mlp", "train": 256, "vs": "mlp"},
    "mlp-data256-steps1600": {"scorer": "mlp", "train": 256, "steps": 1600, "vs": "mlp-data256"},
    "mlp-tau0.3": {"scorer": "mlp", "loss": {"tau": 0.3}, "vs": "mlp"},
    "mlp-tau3": {"scorer": "mlp", "loss": {"tau": 3.0}, "vs": "mlp"},
    "mlp-margin": {"scorer": "mlp", "loss": {"weight": "margin"}, "vs": "mlp"},
    "mlp-recency0.002": {"scorer": "mlp", "recency": 0.002, "vs": "mlp"},
    "mlp-recency0.01": {"scorer": "mlp", "recency": 0.01, "vs": "mlp"},
    "mlp-multik+pairs4": {"scorer": "mlp", "loss": {"topks": [8, 16, 64, 128], "random_pairs": 4}, "vs": "mlp"},
    "mlp-multik+pairs4-data256": {"scorer": "mlp", "loss": {"topks": [8, 16, 64, 128], "random_pairs": 4},
                                  "train": 256, "vs": "mlp-data256"},
    "probe-mlp+window_attn": {"scorer": "mlp", "extras": ["window_attn"], "vs": "mlp"},
    "probe-mlp+position": {"scorer": "mlp", "extras": ["position"], "vs": "mlp"},
    "probe-mlp+norms+window_attn+position": {"scorer": "mlp", "options": {"features": "kv_norms"},
                                            "extras": ["window_attn", "position"], "vs": "mlp"},
}


def variant_spec(name: str) -> dict:
    if name not in VARIANTS:
        raise SystemExit(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
    spec = {**BASE, **VARIANTS[name]}
    spec["name"] = name
    return spec


# ------------------------------------------------------------------------------------------------ the cache
def study_dir(args) -> Path:
    home = Path(os.environ.get("KVPOP_HOME", REPO / ".kvpop"))
    return home / "study" / f"S{args.seq_len}-n{args.train}-e{args.eval}"


def window_attention(query: torch.Tensor, key: torch.Tensor, window: int) -> torch.Tensor:
    """``log max_{h in g} mean_{t <= d < t + window} P[h, d, t]`` ``[B, Hkv, S]``: the attention a token received
    from the queries for which it was protected (dense S×S: small S only)."""
    b, hq, size, dim = query.shape
    hkv = key.shape[1]
    keys = key.float().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", query.float(), keys) * dim ** -0.5
    pos = torch.arange(size)
    scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    prob = scores.softmax(-1)  # [b, h, d, t]
    band = (pos[:, None] >= pos[None, :]) & (pos[:, None] < pos[None, :] + window)
    count = band.sum(0).clamp(min=1)
    mean = (prob * band).sum(-2) / count
    return mean.view(b, hkv, hq // hkv, size).amax(2).clamp(min=1e-30).log()


def prepare(args) -> None:
    from kvpop.pretrained import load_pretrained
    from kvpop.targets import teacher_pass
    from pipelines.config import load_config
    from pipelines.data import load_sequences

    torch.set_num_threads(args.threads)
    folder = study_dir(args)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [f"data.seq_len={args.seq_len}", f"data.num_sequences={args.train}",
                             f"data.eval_sequences={args.eval}"])
    model, _ = load_pretrained(cfg.model.resolved_path(), dtype=torch.float32)
    for split in ("eval", "train"):
        rows = load_sequences(cfg, split)
        for start in range(0, len(rows), args.part):
            part = folder / f"{split}-{start:05d}.pt"
            if part.is_file():
                continue
            t0 = time.perf_counter()
            ids = torch.tensor([r["input_ids"] for r in rows[start:start + args.part]], dtype=torch.long)
            chunks = {"ids": ids, "targets": [], "keys": [], "values": [], "window_attn": []}
            for one in ids.split(1):
                out = teacher_pass(model, one, [BUDGET.window], top_k=0, keep=("queries", "keys", "values"))
                chunks["targets"].append(out["targets"][BUDGET.window].permute(1, 0, 2, 3))  # [1, L, H, S]
                chunks["keys"].append(torch.stack([out["keys"][i] for i in LAYERS], 1).half())  # [1, Lsel, H, S, D]
                chunks["values"].append(torch.stack([out["values"][i] for i in LAYERS], 1).half())
                chunks["window_attn"].append(torch.stack(
                    [window_attention(out["queries"][i], out["keys"][i], BUDGET.window) for i in LAYERS], 1))
            data = {k: (v if k == "ids" else torch.cat(v)) for k, v in chunks.items()}
            torch.save(data, part.with_suffix(".tmp"))
            part.with_suffix(".tmp").rename(part)
            print(f"[study] {split} {start}+{len(ids)} in {time.perf_counter() - t0:.1f}s", flush=True)
    (folder / "meta.json").write_text(json.dumps({"layers": LAYERS, "budget": str(BUDGET), "seq_len": args.seq_len,
                                                  "train": args.train, "eval": args.eval}))


def load_split(folder: Path, split: str, limit: int | None = None) -> dict:
    parts = sorted(folder.glob(f"{split}-*.pt"))  # a cache still being prepared serves what it has
    if not parts:
        raise SystemExit(f"no {split} sequences in {folder}: run `python research/scorer_study.py prepare` first")
    loaded = [torch.load(p) for p in parts]
    data = {k: torch.cat([d[k] for d in loaded]) for k in loaded[0]}
    if limit is not None:
        data = {k: v[:limit] for k, v in data.items()}
    data["targets"] = data["targets"][:, list(LAYERS)]  # [N, Lsel, H, S]
    return data


# ------------------------------------------------------------------------------------------------ models
class Probe(torch.nn.Module):
    """An MLP scorer given extra per-token inputs a real scorer does not see (the study's probes)."""

    def __init__(self, scorer, extras: int):
        super().__init__()
        self.scorer = scorer  # for its features() only
        self.mlp = PerHeadMLP(scorer.num_kv_heads, scorer.in_features + extras, scorer.config.hidden)

    def forward(self, keys, values, extra):
        with fp32_region(keys.device):
            return self.mlp(torch.cat([self.scorer.features(keys, values, None), extra], -1))


def extra_inputs(data: dict, names, stats: dict) -> torch.Tensor | None:
    """``[N, Lsel, H, S, E]`` standardised extra inputs (statistics from the training split)."""
    if not names:
        return None
    n, layers, heads, size = data["targets"].shape
    cols = []
    for name in names:
        if name == "window_attn":
            cols.append((data["window_attn"] - stats["wa_mean"]) / stats["wa_std"])
        elif name == "position":
            pos = torch.arange(size, dtype=torch.float32)
            for f in (pos / size, torch.log1p(pos) / math.log1p(size)):
                cols.append(f.expand(n, layers, heads, size))
        else:
            raise SystemExit(f"unknown extra input {name!r}")
    return torch.stack(cols, -1)


def build_models(spec: dict, heads: int, head_dim: int):
    torch.manual_seed(spec["seed"])
    models = []
    for _ in LAYERS:
        scorer = build_scorer(spec["scorer"], heads, head_dim, BUDGET.window, **spec["options"])
        if spec["extras"]:
            width = sum(2 if e == "position" else 1 for e in spec["extras"])
            scorer = Probe(scorer, width)
        models.append(scorer)
    return torch.nn.ModuleList(models)


def priorities(models, data: dict, index, extra, recency: float) -> torch.Tensor:
    """Ranked priorities ``[Lsel, b, H, S]`` for the sequences ``index`` (scorer output + λ·t)."""
    out = []
    for li, model in enumerate(models):
        k, v = data["keys"][index, li].float(), data["values"][index, li].float()
        p = model(k, v, extra[index, li]) if extra is not None else model(k, v)
        out.append(p)
    return with_recency(torch.stack(out), recency)


# ------------------------------------------------------------------------------------------------ evaluation
EVAL_BUDGETS = [Budget(BUDGET.sink, BUDGET.window, k) for k in EVAL_TOPKS]


@torch.no_grad()
def evaluate(models, data: dict, extra, recency: float) -> dict:
    """Per-sequence ``[N]`` and per-layer ``[Lsel]`` means of the diagnostics, for the scorer and the references."""
    index = torch.arange(data["targets"].shape[0])
    student = torch.cat([priorities(models, data, index[i:i + 8], extra, recency) for i in range(0, len(index), 8)],
                        dim=1)
    targets = data["targets"].permute(1, 0, 2, 3)  # [Lsel, N, H, S]
    report = diagnose(student, targets, EVAL_BUDGETS, recency=0.0)
    out = {"per_sequence": {}, "per_layer": {}, "queries": report["queries"]}

    def put(key, value):  # value [Lsel, N, H] (or [Lsel, N, H, Q] for kept sets: the last query, i.e. S - 1)
        if value.dim() == 4:
            value = value[..., -1]
        out["per_sequence"][key] = value.nanmean((0, 2)).tolist()
        out["per_layer"][key] = value.nanmean((1, 2)).tolist()

    for rule, rho in report["spearman"].items():
        put(f"{rule}.spearman", rho)
    for budget_name, views in report["budgets"].items():
        for rule, metrics in views["decisions"].items():
            for metric in (*HEADLINE, "keep_rate"):
                put(f"{budget_name}.{rule}.{metric}", metrics[metric])
        for rule, metrics in views["kept"].items():
            for metric, value in metrics.items():
                put(f"{budget_name}.{rule}.{metric}_end", value)
    return out


# ------------------------------------------------------------------------------------------------ training
def run_variant(args, name: str) -> dict:
    spec = variant_spec(name)
    folder = study_dir(args)
    out_file = folder / "results" / f"{name}.json"
    if out_file.is_file() and not args.force:
        print(f"[study] {name}: done already ({out_file})")
        return json.loads(out_file.read_text())
    torch.set_num_threads(args.threads)
    train = load_split(folder, "train", spec["train"])
    held_out = load_split(folder, "eval")
    if train["targets"].shape[0] < spec["train"]:
        raise SystemExit(f"the cache has {train['targets'].shape[0]} training sequences, {name} wants {spec['train']}")
    n, layers, heads, size = train["targets"].shape
    wa = train["window_attn"][torch.isfinite(train["window_attn"])]
    stats = {"wa_mean": wa.mean(), "wa_std": wa.std()}
    extra_train, extra_eval = (extra_inputs(d, spec["extras"], stats) for d in (train, held_out))
    models = build_models(spec, heads, train["keys"].shape[-1])
    optimizer = torch.optim.AdamW(models.parameters(), lr=spec["lr"], weight_decay=0.0)
    teacher = with_recency(train["targets"].permute(1, 0, 2, 3), spec["recency"])  # [Lsel, N, H, S]
    loss_options = dict(spec["loss"])
    if loss_options.get("random_pairs"):
        loss_options["generator"] = torch.Generator().manual_seed(spec["seed"])
    order = torch.Generator().manual_seed(spec["seed"] + 1)
    curve, t0 = [], time.perf_counter()
    for step in range(1, spec["steps"] + 1):
        index = torch.randint(0, n, (spec["batch"],), generator=order)
        student = priorities(models, train, index, extra_train, spec["recency"])
        loss = retention_loss(student, teacher[:, index], BUDGET, **loss_options)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(models.parameters(), 1.0)
        optimizer.step()
        if step % spec["eval_every"] == 0 or step == spec["steps"]:
            held = evaluate(models, held_out, extra_eval, spec["recency"])
            key = f"{BUDGET}.scorer.balanced_accuracy"
            value = sum(held["per_sequence"][key]) / len(held["per_sequence"][key])
            curve.append({"step": step, "tokens": step * spec["batch"] * size, "loss": loss.item(),
                          "held_out_balanced_accuracy": value, "seconds": time.perf_counter() - t0})
            print(f"[study] {name} step {step} loss {loss.item():.4f} held-out BA {value:.4f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    in_sample = {k: train[k][:32] for k in ("keys", "values", "targets")}
    result = {"variant": name, "spec": spec, "curve": curve, "held_out": held,
              "in_sample": evaluate(models, in_sample, None if extra_train is None else extra_train[:32],
                                    spec["recency"]),
              "train_seconds": time.perf_counter() - t0, "threads": args.threads}
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(result))
    return result


# ------------------------------------------------------------------------------------------------ report
def mean(values) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def report(args) -> None:
    folder = study_dir(args) / "results"
    results = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    if "baseline" not in results:
        raise SystemExit(f"no baseline result in {folder}: run the baseline variant first")
    base = results["baseline"]
    order = [v for v in VARIANTS if v in results]
    train_key = str(BUDGET)
    cols = [(f"{train_key}.scorer.balanced_accuracy", "BA k32"), (f"{train_key}.scorer.auc", "AUC k32"),
            (f"{train_key}.scorer.agreement", "agree k32"),
            (f"{train_key}.scorer.weighted_agreement", "w-agree k32"),
            (f"{EVAL_BUDGETS[0]}.scorer.balanced_accuracy", "BA k8"),
            (f"{EVAL_BUDGETS[2]}.scorer.balanced_accuracy", "BA k128"),
            (f"{train_key}.scorer.overlap_end", "overlap k32"), (f"{train_key}.scorer.mass_ratio_end", "mass k32"),
            ("scorer.spearman", "Spearman")]
    rows, table = [], {}
    for name in order:
        held = results[name]["held_out"]["per_sequence"]
        row = {"variant": name, "train_tokens": results[name]["spec"]["train"] * args.seq_len,
               "steps": results[name]["spec"]["steps"],
               "in_sample_BA": mean(results[name]["in_sample"]["per_sequence"][cols[0][0]])}
        ref = results.get(results[name]["spec"].get("vs", "baseline"))
        row["vs"] = None if ref is None or ref is results[name] else ref["variant"]
        for key, label in cols:
            values = held.get(key, [])  # empty for a result saved before this metric existed
            row[label] = mean(values)
            if row["vs"]:
                ref_values = ref["held_out"]["per_sequence"].get(key, [])
                row[f"Δ {label}"] = paired_bootstrap(values if ref_values else [], ref_values if values else [])
        rows.append(row)
        table[name] = row
    refs = {rule: {label: mean(base["held_out"]["per_sequence"].get(key.replace("scorer", rule), [math.nan]))
                   for key, label in cols} for rule in ("newest", "oldest", "random", "oracle")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": f"{platform.node()} ({os.cpu_count()} cores, CPU)", "torch": torch.__version__,
            "layers": LAYERS, "budget": str(BUDGET), "eval_topks": EVAL_TOPKS, "seq_len": args.seq_len,
            "held_out_sequences": len(base["held_out"]["per_sequence"][cols[0][0]])}
    payload = {"meta": meta, "rows": rows, "references": refs,
               "per_layer": {name: results[name]["held_out"]["per_layer"] for name in order},
               "curves": {name: results[name]["curve"] for name in order}}
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    out.with_suffix(".md").write_text(render(payload, cols))
    plot(payload, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())


def DELTA_COLS(cols):  # noqa: N802 - the columns the paired table shows
    return [c for c in cols if c[1] in ("BA k32", "AUC k32", "agree k32", "w-agree k32", "overlap k32", "mass k32")]


def render(payload: dict, cols) -> str:
    meta = payload["meta"]
    lines = [f"# Scorer study ({meta['machine']})", "",
             f"SmolLM2-135M-Instruct, champ, S = {meta['seq_len']}, training budget {meta['budget']}, scorers of "
             f"layers {list(meta['layers'])} trained on the dense pass's keys/values (scorer-only decomposes by "
             f"layer), {meta['held_out_sequences']} held-out sequences. Metrics: `kvpop.diagnostics` against the "
             f"λ = 0 teacher, mean over layers, KV heads and sequences; kept sets at the last position. Δ: paired "
             f"bootstrap over held-out sequences vs the variant's reference (`vs`), mean [95 % interval], * where "
             f"it excludes 0.", "",
             "| variant | train tokens | steps | in-sample BA | " + " | ".join(label for _, label in cols) + " |",
             "|---|---|---|---|" + "---|" * len(cols)]
    for row in payload["rows"]:
        lines.append(f"| {row['variant']} | {row['train_tokens']} | {row['steps']} | {row['in_sample_BA']:.3f} | "
                     + " | ".join(f"{row[label]:.3f}" for _, label in cols) + " |")
    for rule, vals in payload["references"].items():
        lines.append(f"| *{rule}* | | | | " + " | ".join(f"{vals[label]:.3f}" for _, label in cols) + " |")
    lines += ["", "Paired differences vs each variant's reference:", "",
              "| variant | vs | " + " | ".join(f"Δ {label}" for _, label in DELTA_COLS(cols)) + " |",
              "|---|---|" + "---|" * len(DELTA_COLS(cols))]
    for row in payload["rows"]:
        if not row["vs"]:
            continue
        lines.append(f"| {row['variant']} | {row['vs']} | " + " | ".join(format_interval(row[f"Δ {label}"])
                                                                       for _, label in DELTA_COLS(cols)) + " |")
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    """Per layer: balanced accuracy of the decisions and the share of the oracle's kept future attention, for the
    baseline, the variant that keeps the most of it, and the reference rules."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipelines.scorer_diagnostics import per_layer_figure

    per_layer, layers = payload["per_layer"], list(payload["meta"]["layers"])
    best = max((r for r in payload["rows"] if r["variant"] != "baseline"), key=lambda r: r["mass k32"], default=None)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for ax, metric, label in ((axes[0], "balanced_accuracy", "balanced accuracy of keep/evict decisions"),
                              (axes[1], "mass_ratio_end", "oracle's kept future attention held at the end")):
        key = f"{BUDGET}.{{rule}}.{metric}"
        curves = {"scorer": per_layer["baseline"][key.format(rule="scorer")]}
        if best is not None:
            curves[f"best variant: {best['variant']}"] = per_layer[best["variant"]][key.format(rule="scorer")]
        for rule in ("newest", "oldest", "random"):
            curves[rule] = per_layer["baseline"][key.format(rule=rule)]
        per_layer_figure(layers, curves, ax=ax, ylabel=metric.replace("_", " "),
                         title=f"held-out, {BUDGET}: {label}")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["prepare", "run", "report", "list"])
    parser.add_argument("variants", nargs="*")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--train", type=int, default=256, help="training sequences in the cache")
    parser.add_argument("--eval", type=int, default=32, help="held-out sequences in the cache")
    parser.add_argument("--part", type=int, default=16, help="sequences per cache file")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the box is shared)")
    parser.add_argument("--force", action="store_true", help="re-run variants that have a result")
    parser.add_argument("--out", default=str(REPO / "research" / "results" / "scorer_study_cpu"))
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args)
    elif args.command == "run":
        for name in args.variants or ["baseline"]:
            run_variant(args, name)
    elif args.command == "report":
        report(args)
    else:
        for name, change in VARIANTS.items():
            print(f"{name:40s} {change}")


if __name__ == "__main__":
    main()
