"""Learning curves of scorer-only KVpop training against training tokens (issue 12), on one GPU without Ray.

Cheapest design that reaches tens of millions of tokens inside a 30-minute GPU session:

* **Online targets** (:mod:`kvpop.online`): in scorer-only mode the frozen base *is* the teacher, so every step runs
  one dense pass that yields the targets (``teacher_pass``: forward + transposed target pass) and the keys/values
  the scorers read (``--features dense``; ``student`` adds a sparse forward for the exact inference inputs). No
  precompute stage, no Parquet: the write (36k tokens/s) was the bottleneck of the stored path.
* **One run, many points**: a constant learning rate after warm-up, and the held-out evaluation at log-spaced token
  counts (``--checkpoints``) of that one run, instead of one run per scale (0.5 + 2 + 4 + 16M = 22.5M tokens for
  four separate runs vs 16M here). The points are "anytime" checkpoints, not runs tuned to their length.
* A wall-clock guard (``--time-budget-s``): training stops before the budget is spent, evaluates, and writes.

Held-out metrics per checkpoint, on sequences from documents training never sees: ``kvpop.diagnostics``
(balanced accuracy, AUC and raw agreement of the keep/evict decisions next to newest-wins / oldest-wins, kept-set
overlap with the oracle, Spearman) at the training budget and the evaluation budgets, and teacher-forced KL / top-1
against dense (``kvpop.metrics``) at the evaluation budgets, with streaming and the oracle measured once as the floor
and the ceiling. Writes ``<out>/learning_curves_<tag>.json`` + ``.md`` + ``.png``.

    python benchmarks/learning_curves.py --out benchmarks/results            # the H200 run (S = 4096, to 16M tokens)
    python benchmarks/learning_curves.py --plan                              # the cost of each scale, nothing run
    python benchmarks/learning_curves.py --device cpu --seq-len 128 --batch 1 --eval-sequences 2 \\
        --checkpoints 256 512 1024 --eval-crs 0.5 --topk 32 --window 16 --tag cpu-tiny --out /tmp/lc   # CPU proof
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# measured on the H200 (benchmarks/results): tokens/s of the stored path's two stages
PRECOMPUTE_WRITTEN_TPS = 36_000
STORED_TRAIN_TPS = 40_000


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2 or a local HF folder")
    p.add_argument("--source", default="champ", help="data.source of pipelines.data (champ, stdlib, a local file)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--topk", type=int, default=380, help="training long-range slots (380: B = 512, CR 87.5 %% at 4k)")
    p.add_argument("--train-topks", type=int, nargs="*", default=[],
                   help="more long-range sizes trained at once (retention_loss topks)")
    p.add_argument("--eval-crs", type=float, nargs="+", default=[0.875, 0.9375])
    p.add_argument("--eval-topks", type=int, nargs="*", default=[], help="evaluation budgets as long-range sizes "
                   "(instead of --eval-crs)")
    p.add_argument("--checkpoints", type=float, nargs="+", default=[0.25e6, 0.5e6, 1e6, 2e6, 4e6, 8e6, 16e6],
                   help="training-token counts at which the held-out set is evaluated (the last ends training); from "
                   "0.25M, a run the time guard stops after 8M still spans 32x")
    p.add_argument("--scorer", default="mlstm")
    p.add_argument("--scorer-options", default="{}", help="JSON: fields of the scorer's config")
    p.add_argument("--loss-options", default="{}", help='JSON: retention_loss options, e.g. {"balance": true}')
    p.add_argument("--recency", type=float, default=0.0)
    p.add_argument("--features", default="dense", choices=["dense", "student"])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then constant")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--eval-sequences", type=int, default=32)
    p.add_argument("--eval-batch", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto", help="base model dtype: auto (bf16 on CUDA, fp32 on CPU) | float32")
    p.add_argument("--time-budget-s", type=float, default=0, help="stop training after this many seconds (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan", action="store_true", help="print the cost of each scale and exit")
    p.add_argument("--tag", default="h200")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    return p.parse_args(argv)


def plan(args) -> list[dict]:
    """Seconds per scale for the stored path (precompute + train) and for this driver (online, one run)."""
    rows = []
    for tokens in sorted(args.checkpoints):
        stored = tokens / PRECOMPUTE_WRITTEN_TPS + tokens / STORED_TRAIN_TPS
        rows.append({"tokens": int(tokens), "sequences": math.ceil(tokens / args.seq_len),
                     "stored_path_s": round(stored), "stored_path_all_scales_s": None})
    total_separate = sum(r["tokens"] for r in rows)
    for r in rows:
        r["stored_path_all_scales_s"] = round(total_separate / PRECOMPUTE_WRITTEN_TPS + total_separate / STORED_TRAIN_TPS)
    return rows


# ------------------------------------------------------------------------------------------------ evaluation
def budgets_for(args):
    from kvpop import Budget

    train = Budget(args.sink, args.window, args.topk)
    if args.eval_topks:
        return train, [Budget(args.sink, args.window, k) for k in args.eval_topks]
    evals = []
    for cr in args.eval_crs:
        total = round(args.seq_len * (1 - cr))
        if total < args.sink + args.window + 1:
            print(f"[curves] CR {cr}: B = {total} leaves no long-range slot (sink + window = "
                  f"{args.sink + args.window}); skipped", flush=True)
            continue
        evals.append(Budget.from_total(total, sink=args.sink, window=args.window))
    return train, evals


def policy_logits(model, policy: str, budget, ids, targets=None):
    """Teacher-forced logits of one static policy (or dense) in one masked forward."""
    import kvpop

    if policy == "dense":
        kvpop.set_policy(model, "dense")
        return model(input_ids=ids, use_cache=False).logits
    kvpop.set_policy(model, policy, budget)
    if policy == "oracle":
        with kvpop.oracle_priorities(model, targets):
            return model(input_ids=ids, use_cache=False).logits
    return model(input_ids=ids, use_cache=False).logits


def quality(model, eval_ids, budgets, policies, train_budget, recency, batch: int) -> dict:
    """``{policy: {str(budget): {"kl", "top1_agreement", "per_sequence_kl": [...]}}}`` over positions >= B."""
    import torch

    import kvpop
    from kvpop import metrics
    from kvpop.online import online_targets

    out: dict = {p: {str(b): {"stats": [], "per_sequence_kl": []} for b in budgets} for p in policies}
    with torch.no_grad():
        for ids in eval_ids.split(batch):
            kvpop.set_policy(model, "kvpop", train_budget, recency=recency)
            targets = online_targets(model, ids)["targets"] if "oracle" in policies else None
            dense = policy_logits(model, "dense", None, ids)
            for policy in policies:
                for budget in budgets:
                    logits = policy_logits(model, policy, budget, ids, targets)
                    for row in range(ids.shape[0]):
                        stats = metrics.compare_logits(logits[row], dense[row], ids[row], start=budget.total)
                        out[policy][str(budget)]["stats"].append(stats)
                        out[policy][str(budget)]["per_sequence_kl"].append(stats["kl"] / max(1, stats["positions"]))
                    del logits
            del dense
    kvpop.set_policy(model, "kvpop", train_budget, recency=recency)
    for policy in policies:
        for budget in budgets:
            cell = out[policy][str(budget)]
            summary = metrics.summarize(cell.pop("stats"))
            cell.update(kl=summary["kl"], top1_agreement=summary["top1_agreement"])
    return out


def diagnostics(model, eval_ids, eval_topks, batch: int) -> dict:
    """Held-out decision / kept-set / rank diagnostics, means per layer and overall."""
    from kvpop.diagnostics import diagnose_model, summarize

    report = diagnose_model(model, eval_ids, topks=eval_topks, batch_size=batch)
    summary = summarize(report)
    out = {"spearman": {rule: v.nanmean().item() for rule, v in summary["spearman"].items()}, "budgets": {}}
    for budget, views in summary["budgets"].items():
        cell = out["budgets"][budget] = {}
        for rule, m in views["decisions"].items():
            cell[rule] = {k: m[k].nanmean().item() for k in ("agreement", "balanced_accuracy", "auc", "keep_rate")}
            cell[rule]["balanced_accuracy_per_layer"] = m["balanced_accuracy"].nanmean(-1).tolist()
        for rule, m in views["kept"].items():
            cell[rule].update(overlap_end=m["overlap"][..., -1].nanmean().item(),
                              mass_ratio_end=m["mass_ratio"][..., -1].nanmean().item())
    return out


# ------------------------------------------------------------------------------------------------ the run
def load_data(args, tokenizer, train_sequences: int):
    import torch

    from pipelines.config import load_config
    from pipelines.data import load_sequences

    cfg = load_config(None, [f"model.path={args.model}", f"data.source={args.source}", f"data.seq_len={args.seq_len}",
                             f"data.num_sequences={train_sequences}", f"data.eval_sequences={args.eval_sequences}",
                             f"data.seed={args.seed}"])
    as_ids = lambda rows: torch.tensor([r["input_ids"] for r in rows], dtype=torch.long)  # noqa: E731
    return as_ids(load_sequences(cfg, "train", tokenizer)), as_ids(load_sequences(cfg, "eval", tokenizer))


def run(args) -> dict:
    import torch

    import kvpop
    from kvpop.losses import check_retention_options
    from kvpop.online import scorer_only_step
    from kvpop.pretrained import load_pretrained
    from pipelines.models import smollm2_dir

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cpu":  # spinning intra-op threads on a busy small box cost far more than they give
        torch.set_num_threads(1)
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if args.dtype == "auto" \
        else getattr(torch, args.dtype)
    path = smollm2_dir() if args.model == "smollm2" else args.model
    model, tokenizer = load_pretrained(path, dtype=dtype, device=device)
    train_budget, eval_budgets = budgets_for(args)
    checkpoints = sorted(int(c) for c in args.checkpoints)
    tokens_per_step = args.batch * args.seq_len
    total_steps = math.ceil(checkpoints[-1] / tokens_per_step)
    t0 = time.perf_counter()
    train_ids, eval_ids = load_data(args, tokenizer, min(total_steps * args.batch, 10 ** 6))
    data_s = time.perf_counter() - t0
    eval_ids = eval_ids.to(device)
    print(f"[curves] {len(train_ids)} training / {len(eval_ids)} held-out sequences of {args.seq_len} "
          f"({data_s:.0f}s); {total_steps} steps of {tokens_per_step} tokens", flush=True)

    kvpop.retrofit(model, train_budget, scorer=args.scorer, policy="kvpop", recency=args.recency,
                   scorer_options=json.loads(args.scorer_options))
    for name, param in model.named_parameters():
        param.requires_grad_(".kvpop_scorer." in name)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    loss_options = check_retention_options(json.loads(args.loss_options))
    if args.train_topks:
        loss_options["topks"] = args.train_topks
    eval_topks = [b.topk for b in eval_budgets]

    t0 = time.perf_counter()
    floor_ceiling = quality(model, eval_ids, eval_budgets, ["streaming", "oracle"], train_budget, args.recency,
                            args.eval_batch)
    reference_s = time.perf_counter() - t0
    points = []

    def evaluate(step: int, train_s: float):
        t_eval = time.perf_counter()
        model.eval()
        point = {"step": step, "tokens": step * tokens_per_step, "train_s": round(train_s, 1),
                 "diagnostics": diagnostics(model, eval_ids, eval_topks, args.eval_batch),
                 "quality": quality(model, eval_ids, eval_budgets, ["kvpop"], train_budget, args.recency,
                                    args.eval_batch)["kvpop"]}
        point["eval_s"] = round(time.perf_counter() - t_eval, 1)
        points.append(point)
        d = point["diagnostics"]["budgets"][str(train_budget)]["scorer"]
        q = "; ".join(f"{b} KL {v['kl']:.4f} top-1 {v['top1_agreement']:.4f}" for b, v in point["quality"].items())
        print(f"[curves] {point['tokens'] / 1e6:.2f}M tokens: BA {d['balanced_accuracy']:.4f} AUC {d['auc']:.4f} "
              f"agree {d['agreement']:.4f}; {q} (eval {point['eval_s']}s)", flush=True)
        model.train()

    evaluate(0, 0.0)
    train_s, step, stopped = 0.0, 0, None
    losses, accs = [], []
    pending = [c for c in checkpoints]
    model.train()
    order = torch.Generator().manual_seed(args.seed)
    epoch: list[int] = []
    while step < total_steps:
        if len(epoch) < args.batch:  # every sequence once per epoch, in a fresh order
            epoch += torch.randperm(len(train_ids), generator=order).tolist()
        index, epoch = epoch[:args.batch], epoch[args.batch:]
        ids = train_ids[index].to(device)
        t_step = time.perf_counter()
        out = scorer_only_step(model, ids, features=args.features, **loss_options)
        optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        warmup.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_s += time.perf_counter() - t_step
        step += 1
        losses.append(out["loss"].item())
        accs.append(out["boundary_acc"].item())
        if step % 50 == 0:
            print(f"[curves] step {step}/{total_steps} loss {sum(losses[-50:]) / 50:.4f} "
                  f"train-acc {sum(accs[-50:]) / 50:.4f} {step * tokens_per_step / train_s:.0f} tok/s", flush=True)
        if pending and step * tokens_per_step >= pending[0]:
            while pending and step * tokens_per_step >= pending[0]:
                pending.pop(0)
            evaluate(step, train_s)
        if args.time_budget_s and time.perf_counter() - t0 > args.time_budget_s:
            stopped = f"time budget of {args.time_budget_s:.0f}s reached at step {step}"
            print(f"[curves] {stopped}", flush=True)
            break
    if not points or points[-1]["step"] != step:
        evaluate(step, train_s)
    return {"meta": {"device": _device_name(device), "torch": torch.__version__, "args": vars(args),
                     "train_budget": str(train_budget), "eval_budgets": [str(b) for b in eval_budgets],
                     "train_sequences": len(train_ids), "eval_sequences": len(eval_ids), "data_s": round(data_s, 1),
                     "reference_eval_s": round(reference_s, 1), "stopped": stopped,
                     "train_tokens_per_s": round(step * tokens_per_step / max(train_s, 1e-9)),
                     "losses": losses[::max(1, len(losses) // 200)], "plan": plan(args)},
            "references": floor_ceiling, "points": points}


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.node()} CPU ({os.cpu_count()} cores)"


# ------------------------------------------------------------------------------------------------ outputs
def tokens_label(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k" if n >= 1e3 else f"{int(n)}"


def render(result: dict) -> str:
    from benchmarks.bootstrap import format_interval, paired_bootstrap

    meta, refs, points = result["meta"], result["references"], result["points"]
    train_budget = meta["train_budget"]
    lines = [f"# Learning curves ({meta['device']})", "",
             f"Scorer-only `{meta['args']['scorer']}`, online targets (`--features {meta['args']['features']}`), "
             f"training budget {train_budget}, S = {meta['args']['seq_len']}, {meta['train_sequences']} training / "
             f"{meta['eval_sequences']} held-out sequences, {meta['train_tokens_per_s']} training tokens/s. One run, "
             f"evaluated at each token count (constant lr {meta['args']['lr']} after {meta['args']['warmup']} "
             f"warm-up steps)." + (f" Stopped early: {meta['stopped']}." if meta["stopped"] else ""), "",
             "| tokens | BA (train k) | AUC | agreement | newest agr. | oldest agr. | overlap end | Spearman | "
             + " | ".join(f"KL {b} | top-1 {b}" for b in meta["eval_budgets"]) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|---|" * len(meta["eval_budgets"])]
    for p in points:
        d = p["diagnostics"]["budgets"][train_budget]
        s = d["scorer"]
        q = " | ".join(f"{p['quality'][b]['kl']:.4f} | {p['quality'][b]['top1_agreement']:.4f}"
                       for b in meta["eval_budgets"])
        lines.append(f"| {tokens_label(p['tokens'])} | {s['balanced_accuracy']:.4f} | {s['auc']:.4f} | "
                     f"{s['agreement']:.4f} | {d['newest']['agreement']:.4f} | {d['oldest']['agreement']:.4f} | "
                     f"{s['overlap_end']:.3f} | {p['diagnostics']['spearman']['scorer']:.3f} | {q} |")
    for policy in ("streaming", "oracle"):
        q = " | ".join(f"{refs[policy][b]['kl']:.4f} | {refs[policy][b]['top1_agreement']:.4f}"
                       for b in meta["eval_budgets"])
        lines.append(f"| *{policy}* | | | | | | | | {q} |")
    lines += ["", "At the last point, per held-out sequence (paired bootstrap, mean [95 % interval], * where it "
              "excludes 0):", ""]
    last = points[-1]["quality"] if points else {}
    for b in meta["eval_budgets"] if last else []:
        floor, ceiling = refs["streaming"][b]["kl"], refs["oracle"][b]["kl"]
        closed = f"{(floor - last[b]['kl']) / (floor - ceiling):.0%}" if floor > ceiling else "n/a"
        delta = paired_bootstrap(last[b]["per_sequence_kl"], refs["streaming"][b]["per_sequence_kl"])
        lines.append(f"- {b}: KL(KVpop) − KL(streaming) = {format_interval(delta, 4)}; closes {closed} of the "
                     f"streaming→oracle KL gap")
    lines += ["",
              "Training seconds to reach each scale: this driver (online targets, one run, at the throughput "
              "measured here) vs the stored path (precompute written at "
              f"{PRECOMPUTE_WRITTEN_TPS} tok/s + training at {STORED_TRAIN_TPS} tok/s, measured on the H200) with "
              "one run per scale:", "",
              "| tokens | sequences | online, one run (cumulative) | stored, this scale | stored, all scales |",
              "|---|---|---|---|---|"]
    for r in meta["plan"]:
        online = r["tokens"] / max(1, meta["train_tokens_per_s"])
        lines.append(f"| {tokens_label(r['tokens'])} | {r['sequences']} | {online:.0f} | {r['stored_path_s']} | "
                     f"{r['stored_path_all_scales_s']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, points, refs = result["meta"], result["points"], result["references"]
    train_budget = meta["train_budget"]
    tokens = [max(p["tokens"], 1) for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    d = [p["diagnostics"]["budgets"][train_budget] for p in points]
    axes[0].plot(tokens, [x["scorer"]["balanced_accuracy"] for x in d], "o-", label="scorer: balanced accuracy")
    axes[0].plot(tokens, [x["scorer"]["auc"] for x in d], "s-", label="scorer: AUC")
    axes[0].plot(tokens, [x["newest"]["auc"] for x in d], "--", color="C1", label="newest-wins: AUC")
    axes[0].axhline(0.5, color="0.5", linestyle=":", label="newest / oldest / random: BA 0.5")
    axes[0].set_title(f"held-out keep/evict decisions at {train_budget}", fontsize=9)
    axes[1].plot(tokens, [x["scorer"]["agreement"] for x in d], "o-", label="scorer")
    axes[1].plot(tokens, [x["newest"]["agreement"] for x in d], "--", color="C1", label="newest-wins")
    axes[1].plot(tokens, [x["oldest"]["agreement"] for x in d], "--", color="C2", label="oldest-wins")
    axes[1].set_title("raw agreement", fontsize=9)
    for i, b in enumerate(meta["eval_budgets"]):
        color = f"C{i}"
        axes[2].plot(tokens, [p["quality"][b]["kl"] for p in points], "o-", color=color, label=f"KVpop {b}")
        axes[2].axhline(refs["streaming"][b]["kl"], color=color, linestyle="--", label=f"streaming {b}")
        axes[2].axhline(refs["oracle"][b]["kl"], color=color, linestyle=":", label=f"oracle {b}")
    axes[2].set_title("held-out KL(dense ‖ policy)", fontsize=9)
    for ax in axes:
        ax.set_xscale("symlog", linthresh=min(t for t in tokens if t > 1) if len(tokens) > 1 else 1)
        ax.set_xlabel("training tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plan:
        for row in plan(args):
            print(row)
        return
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"learning_curves_{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(render(result))
    plot(result, stem.with_suffix(".png"))
    print(render(result))


if __name__ == "__main__":
    main()
