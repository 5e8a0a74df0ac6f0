"""Learning curves of scorer-only KVpop training against training tokens (issue 12): one GPU, no Ray, and a study that
continues across GPU sessions.

**Training.** Online targets (:mod:`kvpop.online`): in scorer-only mode the frozen base *is* the teacher, so every
step runs one dense pass that yields the targets (forward + transposed target pass) and the keys / values the scorers
read (``--features dense``; ``student`` adds a sparse forward for the exact inference inputs). No precompute stage, no
Parquet (the stored path's write, 36k tokens/s, was its bottleneck). One run, constant learning rate after warm-up,
evaluated at log-spaced token counts (``--checkpoints``): "anytime" points, not runs tuned to their length. Batches of
``--batch`` sequences come from a pool of ``--train-sequences`` packed sequences (default: as many as the last
checkpoint needs), each used once per epoch in a fresh seeded order.

**At every checkpoint**, on held-out sequences from documents training never sees, through the evaluation stage's own
code (:func:`pipelines.eval_parts.evaluate_items`; statistics :func:`pipelines.report.summarize`, i.e.
:mod:`pipelines.stats`):

* text: per held-out sequence KL(dense ‖ policy) and top-1 agreement over positions >= B, for kvpop at each
  evaluation budget. Streaming, the oracle and ``--heuristics`` (TOVA / H2O: token by token through the fixed cache,
  graphed on CUDA, on the first ``--dynamic-sequences``; window_attention: one masked forward, on every sequence) do
  not depend on the scorer: measured once, as references;
* recall (``--recall-samples`` > 0): the recall tasks' greedy exact match and the gold answer's log-probability;
  dense and the references once, kvpop at every checkpoint; headline cells: dense >= ``--recall-min-dense``;
* per point and budget: the mean with its 95 % bootstrap interval over items, the paired differences kvpop − streaming
  and kvpop − best heuristic (best of streaming and the heuristics by point estimate, per metric), and the fraction
  of the streaming → oracle gap closed (a paired ratio). The markdown says "above" / "below" only where the paired
  interval excludes 0, else "not resolved". The JSON keeps every per-item record;
* the keep/evict diagnostics of :mod:`kvpop.diagnostics` at the training and evaluation budgets.

**A study across sessions** (a GPU session: 30 minutes, a wiped disk, only files <= 16 MiB come back).
``--save-state DIR`` writes, at every checkpoint and at the end, ``DIR/step-<n>/`` — the scorers as
:func:`kvpop.save_retrofitted` writes them without the base (so it also serves as ``eval.checkpoint``) and the AdamW
moments in fp32 safetensors shards of at most 15 MiB — and then ``DIR/state.json``, atomically and last: the step, the
data order's generator and the rest of its epoch, the loss's generator, the learning-rate schedule, the study's
settings (:data:`STUDY_ARGS`, :data:`EVAL_ARGS`), the base weights' digest, the sha256 of each file, and every point
and reference so far. A save cut off midway leaves the previous state whole. ``--resume DIR`` continues exactly there
(the batches it would have drawn next: N + M steps resumed give the weights of one run of N + M steps) and refuses, in
one line (exit code 2), a run whose study settings or base weights differ, or whose corpora hold other held-out
sequences under the same name (``meta.heldout_sha256``: the sha256 of each corpus's held-out token ids, checked
before the model loads; ``--references-from`` is held to it too); it reuses the references, its checkpoints
continue the token axis, and its outputs hold every earlier point. ``--time-budget-s`` stops training early enough for
the last evaluation and save to fit.

Writes ``<out>/learning_curves_<tag>.json`` (+ ``.md``, ``.png``) at every checkpoint.

    python research/learning_curves.py --train-sequences 5120 --save-state /tmp/curves_state \\
        --out research/results                          # H200 session 1: S = 4096, to 16M tokens
    python research/learning_curves.py --train-sequences 5120 --resume /tmp/curves_state \\
        --checkpoints 32e6 64e6 --out research/results  # a later session: continues the study to 64M
    python research/learning_curves.py --plan           # the stored path's cost of each scale, nothing run

CPU proof (SmolLM2, S = 128), then the same options continue it:

    python research/learning_curves.py --device cpu --seq-len 128 --batch 2 --train-sequences 16 \\
        --eval-sequences 4 --eval-batch 4 --eval-crs 0.5 --topk 32 --window 16 --heuristics tova h2o \\
        --dynamic-sequences 2 --recall-contexts 192 --recall-depths 0.2 --recall-samples 4 --tag cpu-tiny \\
        --out /tmp/lc --checkpoints 512 1024 --save-state /tmp/lc_state
    python research/learning_curves.py <the same options> --checkpoints 2048 --resume /tmp/lc_state
"""
from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# measured on the H200 (research/results): tokens/s of the stored path's two stages
PRECOMPUTE_WRITTEN_TPS = 36_000
STORED_TRAIN_TPS = 40_000

# What a resumed run must share with the saved study, besides the base weights (their digest) and the resolved dtype
# and training pool: what the scorer is trained on and how, and what the curve's points are measured on.
STUDY_ARGS = ("source", "mix_source", "mix_sequences", "recall_mix", "seq_len", "sink", "window", "topk", "train_topks",
              "scorer", "scorer_options", "loss_options", "kl_options", "recency", "features", "query_power", "lr",
              "warmup", "batch", "seed", "window_attention_prior")
# study settings that came after studies were first saved: the value a study saved without one ran with
SAVED_BEFORE = {"query_power": 1.0, "eval_sources": [], "mix_source": None, "mix_sequences": 0, "recall_mix": 0.0,
                "kl_options": {}, "init_from": None,
                "window_attention_prior": False}
EVAL_ARGS = ("eval_crs", "eval_topks", "eval_sequences", "eval_sources", "heuristics", "dynamic_sequences",
             "recall_tasks", "recall_contexts", "recall_depths", "recall_samples", "recall_min_dense", "recall_tokens",
             "resamples")
# what a study's reference records depend on besides their setting: a saved study's are reused only where these agree
REUSE_MUST_MATCH = ("source", "seq_len", "seed", "eval_sequences", "dynamic_sequences", "recall_tasks",
                    "recall_contexts", "recall_depths", "recall_samples", "recall_tokens", "base_sha256", "dtype")
# The curves' metrics (pipelines.report names), their labels and digits (differences get one more).
TEXT_METRICS = [("kl", "KL", 4), ("top1_agreement", "top-1", 4)]
HEURISTIC_NAMES = ("streaming", "tova", "h2o", "window_attention")
RECALL_METRICS = [("recall_exact", "exact", 3), ("recall_gold_logprob", "gold logp", 2)]
STATE_VERSION = 1
STATE_FILE = "state.json"
SHARD_BYTES = 15 * 2 ** 20  # each returned file must stay under 16 MiB


def parse_args(argv=None):
    from jobs._cli import bare_parser  # a bad command line: one line and exit code 2

    p = bare_parser("learning_curves", __doc__)
    p.prog = "research/learning_curves.py"
    p.add_argument("--model", default="smollm2", help="smollm2 or a local HF folder")
    p.add_argument("--source", default="champ", help="data.source of pipelines.data (champ, stdlib, a local file)")
    p.add_argument("--mix-source", default=None, help="a second training corpus (a data.source value): "
                   "--mix-sequences of its training split join the pool; its held-out documents stay unseen")
    p.add_argument("--mix-sequences", type=int, default=0, help="sequences of --mix-source in the training pool")
    p.add_argument("--recall-mix", type=float, default=0.0, help="share of the training corpus's sequences given "
                   "planted facts and a question at their end (data.recall_mix, pipelines.planted: a format disjoint "
                   "from the recall tasks); held-out sequences are never planted")
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
                   "0.25M, a run the time guard stops after 8M still spans 32x. A resumed run evaluates those above "
                   "the tokens already seen")
    p.add_argument("--train-sequences", type=int, default=0, help="the training corpus's sequences in the pool (each "
                   "once per epoch, as are --mix-sequences); 0: as many as the last checkpoint needs (a resumed run: "
                   "the saved study's). Set it in the first session of a study that will continue (champ at S = 4096 "
                   "holds 5180)")
    p.add_argument("--scorer", default="mlstm")
    p.add_argument("--scorer-options", default="{}", help="JSON: fields of the scorer's config")
    p.add_argument("--loss-options", default="{}", help='JSON: retention_loss options, e.g. {"balance": true}')
    p.add_argument("--kl-options", default="{}", help='JSON: KL through the mask beside the boundary loss '
                   '(kvpop.objective.KLThroughMask: weight, tau, top_k, relative, recency), e.g. {"weight": 1, "tau": 0.25, '
                   '"relative": true}; {}: none')
    p.add_argument("--recency", type=float, default=0.0)
    p.add_argument("--init-from", metavar="DIR", default="", help="start the scorers from a saved scorer folder (a "
                   "study's step-* folder on this base, at this --window and --scorer-options): fine-tuning; its "
                   "weights' sha256 is a study setting")
    p.add_argument("--window-attention-prior", action="store_true", help="train the scorers on top of the window "
                   "attention prior (kvpop.set_window_attention_prior: priority = scorer + observed attention)")
    p.add_argument("--features", default="dense", choices=["dense", "student"])
    p.add_argument("--query-power", type=float, default=1.0, help="β of the targets' power mean over the deciding "
                   "queries (METHOD §2): 1 = their mean; larger = nearer their max. Training, diagnostics and oracle")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then constant")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--eval-sequences", type=int, default=32)
    p.add_argument("--eval-sources", nargs="*", default=[], help="other corpora (data.source values) never trained "
                   "on: the same text evaluation on --eval-sequences of each (its held-out split), at every point")
    p.add_argument("--eval-batch", type=int, default=16, help="held-out sequences per teacher-forced batch (TOVA / "
                   "H2O step a whole batch at once: fewer, larger batches are faster)")
    p.add_argument("--heuristics", nargs="*", default=["tova", "h2o"], choices=["tova", "h2o", "window_attention"],
                   help="heuristics measured once as references (none: give the option without values)")
    p.add_argument("--dynamic-sequences", type=int, default=16, help="TOVA / H2O on the first N held-out sequences "
                   "(paired on those); 0 = all")
    p.add_argument("--recall-tasks", nargs="+", default=["niah_single"], help="pipelines.recall task names")
    p.add_argument("--recall-contexts", type=int, nargs="+", default=[2048], help="prompt lengths in tokens")
    p.add_argument("--recall-depths", type=float, nargs="+", default=[0.1, 0.5])
    p.add_argument("--recall-samples", type=int, default=8, help="samples per (task, context, depth) cell; 0 = no "
                   "recall part")
    p.add_argument("--recall-min-dense", type=float, default=0.9, help="headline recall cells: dense exact match "
                   "at least this (every cell is still reported)")
    p.add_argument("--recall-tokens", type=int, default=12, help="greedy tokens per recall answer")
    p.add_argument("--recall-batch", type=int, default=16, help="recall prompts per generation batch")
    p.add_argument("--resamples", type=int, default=4000, help="bootstrap resamples (fixed seed)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="base model dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--time-budget-s", type=float, default=0, help="wall-clock seconds for the whole run: training "
                   "stops in time for the last evaluation and save (0: no limit)")
    p.add_argument("--save-state", metavar="DIR", default="", help="save the study here at every checkpoint and at "
                   "the end (default with --resume: the same folder)")
    p.add_argument("--resume", metavar="DIR", default="", help="continue the study saved in DIR")
    p.add_argument("--references-from", metavar="JSON", default="", help="a finished study's learning_curves_*.json "
                   "on the same held-out items and base: its streaming / TOVA / H2O / oracle records at the very "
                   "same budgets (the oracle only under the same β) are reused instead of measured again, on each "
                   "corpus both runs evaluate (another --eval-sources corpus is measured here)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan", action="store_true", help="print the cost of each scale and exit")
    p.add_argument("--redraw", metavar="JSON", default="", help="rewrite <JSON stem>.md, .png and _layers.png "
                   "from a study's JSON (after a change to the report), then exit")
    p.add_argument("--tag", default="h200")
    p.add_argument("--out", default=str(REPO / "research" / "results"))
    args = p.parse_args(argv)
    if args.resume and not args.save_state:
        args.save_state = args.resume
    return args


def plan(checkpoints, seq_len: int) -> list[dict]:
    """Seconds per scale for the stored path (precompute + train), one run per scale."""
    rows = []
    for tokens in sorted(checkpoints):
        stored = tokens / PRECOMPUTE_WRITTEN_TPS + tokens / STORED_TRAIN_TPS
        rows.append({"tokens": int(tokens), "sequences": math.ceil(tokens / seq_len),
                     "stored_path_s": round(stored), "stored_path_all_scales_s": None})
    total_separate = sum(r["tokens"] for r in rows)
    for r in rows:
        r["stored_path_all_scales_s"] = round(total_separate / PRECOMPUTE_WRITTEN_TPS + total_separate / STORED_TRAIN_TPS)
    return rows


# ------------------------------------------------------------------------------------------------ inputs
def budgets_for(args):
    """``(training budget, evaluation budgets, unreachable CRs)``: the evaluation stage's rule (sink and window of
    the training budget, topk from each CR)."""
    from kvpop import Budget
    from pipelines.evaluate import resolve_budgets

    train = Budget(args.sink, args.window, args.topk)
    if args.eval_topks:
        return train, [Budget(args.sink, args.window, k) for k in args.eval_topks], []
    evals, unreachable = resolve_budgets(train, args.seq_len, ratios=args.eval_crs)
    for u in unreachable:
        print(f"[curves] CR {u['CR']}: B = {u['B']} is unreachable ({u['reason']}); skipped", flush=True)
    return train, evals, unreachable


def retrofitted_base(meta: dict, cfg, device: str = "cpu", scorer_options: dict | None = None):
    """``cfg``'s base model (bf16 on CUDA, fp32 else) retrofitted as the scorer folder's ``kvpop.json`` ``meta``
    says — budget, policy, recency, untrained scorers (``scorer_options`` added to its own), the prior and streaming
    layers — in eval mode; the scorer weights are not loaded."""
    import torch

    import kvpop
    from kvpop.pretrained import load_pretrained

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, _ = load_pretrained(cfg.model.resolved_path(), dtype=dtype, device=device)
    options = {**{k: v for k, v in meta["scorer"].items() if k != "name"}, **(scorer_options or {})}
    kvpop.retrofit(model, kvpop.Budget(**meta["budget"]), scorer=meta["scorer"]["name"], policy=meta["policy"],
                   recency=meta["recency"], scorer_options=options)
    kvpop.set_window_attention_prior(model, bool(meta.get("window_attention_prior", False)))
    kvpop.set_streaming_layers(model, meta.get("streaming_layers", ()))
    return model.eval()


def load_saved_scorer(folder, meta: dict, cfg, device: str = "cpu"):
    """A saved scorer folder (``kvpop.json`` ``meta`` + ``kvpop_scorers.safetensors``) on :func:`retrofitted_base`."""
    import kvpop

    model = retrofitted_base(meta, cfg, device)
    kvpop.load_scorers(model, folder)
    return model


def corpus_config(model: str, source: str, seq_len: int, budget: dict, query_power: float, eval_sequences: int,
                  seed: int = 0, train_sequences: int = 1, more: list[str] | None = None):
    """The pipeline config of one corpus's sequences at a scorer's ``budget`` (``{"sink", "window", "topk"}``) and
    targets (β = ``query_power``); ``train_sequences`` = 1 where only its held-out split is read (a corpus the scorer
    never trains on); ``more``: further overrides."""
    from pipelines.config import load_config

    return load_config(None, [
        f"model.path={model}", f"budget.sink={budget['sink']}", f"budget.window={budget['window']}",
        f"budget.topk={budget['topk']}", f"precompute.windows=[{budget['window']}]", f"data.source={source}",
        f"data.seq_len={seq_len}", f"precompute.query_power={query_power}", f"data.num_sequences={train_sequences}",
        f"data.eval_sequences={eval_sequences}", f"data.seed={seed}", *(more or [])])


def study_config(args, train_sequences: int, source: str | None = None):
    """The pipeline config whose data and eval sections this study uses (the held-out split, the recall cells);
    ``source``: another corpus's (its held-out split only: a one-sequence training split)."""
    def as_list(values):
        return "[" + ",".join(str(v) for v in values) + "]"

    evaluation = [
        f"eval.batch_size={args.eval_batch}", f"eval.dynamic_sequences={args.dynamic_sequences}",
        f"eval.tasks={as_list(args.recall_tasks)}", f"eval.task_contexts={as_list(args.recall_contexts)}",
        f"eval.task_depths={as_list(args.recall_depths)}", f"eval.task_samples={args.recall_samples}",
        f"eval.task_min_dense={args.recall_min_dense}", f"eval.max_new_tokens={args.recall_tokens}",
        f"eval.generation_batch_size={args.recall_batch}", "eval.generation_prompts=0",
        f"eval.resamples={args.resamples}"]
    planted = [f"data.recall_mix={args.recall_mix}"] if args.recall_mix and not source else []
    return corpus_config(args.model, source or args.source, args.seq_len, training_budget(args), args.query_power,
                         args.eval_sequences, args.seed, 1 if source else train_sequences, evaluation + planted)


def training_config(args, train_sequences: int):
    """:func:`study_config` with ``--mix-source`` as the pipeline's data mix (``data.mix_source`` /
    ``data.mix_sequences``, :mod:`pipelines.data`): its training split is the pool — the corpus's sequences, then the
    mix corpus's own first ``--mix-sequences`` training sequences (its held-out documents never enter). Only the pool
    is read from it: readers of a study's held-out split keep :func:`study_config`, which needs no mix file."""
    cfg = study_config(args, train_sequences)
    if not args.mix_source:
        return cfg
    return replace(cfg, data=replace(cfg.data, mix_source=args.mix_source, mix_sequences=args.mix_sequences))


def training_budget(args) -> dict:
    """The budget the scorer trains at, as :func:`corpus_config` takes it."""
    return {"sink": args.sink, "window": args.window, "topk": args.topk}


def resolved_dtype(args) -> str:
    return ("bfloat16" if args.device.startswith("cuda") else "float32") if args.dtype == "auto" else args.dtype


def study_settings(args, base_sha256: str, train_sequences: int) -> dict:
    """The settings a resumed run must share with the saved study (JSON options parsed: spacing does not count)."""
    out = {name: getattr(args, name) for name in STUDY_ARGS + EVAL_ARGS}
    for name in ("scorer_options", "loss_options", "kl_options"):
        out[name] = json.loads(getattr(args, name))
    out.update(base_sha256=base_sha256, dtype=resolved_dtype(args), train_sequences=train_sequences,
               init_from=init_scorers(args, base_sha256))
    return out


def init_scorers(args, base_sha256: str) -> str | None:
    """``--init-from``'s scorer weights sha256 (``None`` without it), after checking in one :class:`ConfigError` line
    that the folder holds this study's scorers (``--scorer``, ``--scorer-options``) trained on this base at this
    window (:func:`kvpop.retrofit.check_scorer_folder`, the pipeline's ``train.init_from`` rule too)."""
    from kvpop.retrofit import check_scorer_folder
    from pipelines.config import ConfigError

    if not args.init_from:
        return None
    try:
        return check_scorer_folder(args.init_from, scorer=args.scorer, scorer_options=json.loads(args.scorer_options),
                                   window=args.window, base_sha256=base_sha256)
    except ValueError as err:
        raise ConfigError(f"--init-from {args.init_from}: {err}") from None


# ------------------------------------------------------------------------------------------------ training state
class EpochOrder:
    """Every sequence of the pool once per epoch, in a fresh order drawn from a seeded generator; its state (the
    generator and the rest of the current epoch) is all a resumed run needs to draw the batches it would have drawn
    next."""

    def __init__(self, size: int, seed: int):
        import torch

        self.size, self.left = size, []
        self.generator = torch.Generator().manual_seed(seed)

    def take(self, count: int) -> list[int]:
        import torch

        while len(self.left) < count:
            self.left += torch.randperm(self.size, generator=self.generator).tolist()
        out, self.left = self.left[:count], self.left[count:]
        return out

    def state(self) -> dict:
        return {"size": self.size, "left": self.left, "generator": _generator_state(self.generator)}

    def load(self, state: dict) -> None:
        self.size, self.left = state["size"], list(state["left"])
        _set_generator_state(self.generator, state["generator"])


def _generator_state(generator) -> str:
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode()


def _set_generator_state(generator, text: str) -> None:
    import torch

    generator.set_state(torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8))


class Trainer:
    """Scorer-only training with online targets: the scorers' AdamW, the warm-up schedule, the data order and the
    loss's own generator (``random_pairs``), with :meth:`state` / :meth:`load` for an exact resume."""

    def __init__(self, model, args, pool: int, device):
        import torch

        from kvpop.losses import check_retention_options
        from kvpop.objective import KLThroughMask

        self.model, self.device, self.features = model, device, args.features
        self.query_power = args.query_power
        for name, param in model.named_parameters():
            param.requires_grad_(".kvpop_scorer." in name)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=args.lr, weight_decay=0.0)
        warmup = max(1, args.warmup)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        self.order = EpochOrder(pool, args.seed)
        self.loss_generator = torch.Generator(device=device).manual_seed(args.seed)
        self.loss_options = check_retention_options(json.loads(args.loss_options))
        if args.train_topks:
            self.loss_options["topks"] = args.train_topks
        self.kl = KLThroughMask.from_options(json.loads(args.kl_options))
        self.batch = args.batch
        self.step, self.train_s, self.losses, self.accs, self.kls = 0, 0.0, [], [], []

    def train_step(self, train_ids) -> None:
        import torch

        from kvpop.online import scorer_only_step

        ids = train_ids[self.order.take(self.batch)].to(self.device)
        t0 = time.perf_counter()
        out = scorer_only_step(self.model, ids, features=self.features, query_power=self.query_power,
                               generator=self.loss_generator, kl=self.kl, **self.loss_options)
        self.optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.schedule.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.train_s += time.perf_counter() - t0
        self.step += 1
        self.losses.append(out["loss"].item())
        self.accs.append(out["boundary_acc"].item())
        if "kl" in out:
            self.kls.append(out["kl"].item())

    def state(self) -> tuple[dict, dict]:
        """``(JSON-able progress, tensors)``: the tensors are the AdamW moments by parameter name."""
        saved = self.optimizer.state_dict()
        tensors, steps = {}, {}
        for index, entry in saved["state"].items():
            name = self.names[index]
            steps[name] = float(entry["step"])
            tensors.update({f"{name}.{key}": value.detach().cpu().contiguous() for key, value in entry.items()
                            if key != "step"})
        schedule = {k: v for k, v in self.schedule.state_dict().items() if k != "lr_lambdas"}
        return {"step": self.step, "train_s": self.train_s, "losses": self.losses, "accs": self.accs, "kls": self.kls,
                "parameters": self.names, "adam_steps": steps, "param_groups": saved["param_groups"],
                "schedule": schedule, "order": self.order.state(),
                "loss_generator": _generator_state(self.loss_generator)}, tensors

    def load(self, progress: dict, tensors: dict) -> None:
        import torch

        if progress["parameters"] != self.names:
            raise ValueError("the saved optimizer state is for other scorer parameters than this model's")
        index = {name: i for i, name in enumerate(self.names)}
        state = {index[name]: {"step": torch.tensor(step)} for name, step in progress["adam_steps"].items()}
        for key, value in tensors.items():
            name, field = key.rsplit(".", 1)  # AdamW's fields: exp_avg, exp_avg_sq (no dot)
            state[index[name]][field] = value
        self.optimizer.load_state_dict({"state": state, "param_groups": progress["param_groups"]})
        self.schedule.load_state_dict({**progress["schedule"], "lr_lambdas": [None]})
        self.order.load(progress["order"])
        _set_generator_state(self.loss_generator, progress["loss_generator"])
        self.step, self.train_s = progress["step"], progress["train_s"]
        self.losses, self.accs = list(progress["losses"]), list(progress["accs"])
        self.kls = list(progress.get("kls", []))  # the relaxed forward's KL per step (studies with --kl-options)


# ------------------------------------------------------------------------------------------------ saved state
def save_state(folder: Path, trainer: Trainer, study: Study, result: dict) -> None:
    """``folder/step-<n>/`` (scorers + optimizer shards), then ``folder/state.json`` naming it, atomically; older
    step folders are removed only after that."""
    import kvpop
    from kvpop.files import atomic_write_text, sha256_file

    progress, tensors = trainer.state()
    name = f"step-{trainer.step:07d}"
    target = folder / name
    shutil.rmtree(target, ignore_errors=True)  # a save of this step that was cut off
    kvpop.save_retrofitted(trainer.model, target, base=study.base, base_sha256=study.base_sha256)
    shards = write_shards(target, "optimizer", tensors)
    files = {p.name: sha256_file(p) for p in sorted(target.iterdir())}
    manifest = {"version": STATE_VERSION, "study": study.settings, "tokens": trainer.step * study.tokens_per_step,
                "model": name, "files": files, "shards": shards, "progress": progress, "result": result}
    atomic_write_text(folder / STATE_FILE, json.dumps(manifest))
    for old in folder.glob("step-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)


def write_shards(folder: Path, stem: str, tensors: dict, limit: int = SHARD_BYTES) -> list[str]:
    """``tensors`` into ``<stem>-00.safetensors``, … of at most ``limit`` bytes of data each (a tensor larger than
    ``limit`` gets a file of its own); returns the file names."""
    from safetensors.torch import save_file

    groups: list[dict] = []
    size = limit
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if size + nbytes > limit or not groups:
            groups.append({})
            size = 0
        groups[-1][key] = tensors[key]
        size += nbytes
    names = [f"{stem}-{i:02d}.safetensors" for i in range(len(groups))]
    for name, group in zip(names, groups):
        save_file(group, str(folder / name))
    return names


def read_state(folder: Path) -> dict:
    """The manifest of a saved study, its files checked against their recorded sha256."""
    from pipelines.config import ConfigError
    from kvpop.files import sha256_file

    path = folder / STATE_FILE
    if not path.is_file():
        raise ConfigError(f"--resume {folder}: no {STATE_FILE} there (a folder written by --save-state)")
    manifest = json.loads(path.read_text())
    if manifest.get("version") != STATE_VERSION:
        raise ConfigError(f"--resume {folder}: state version {manifest.get('version')}, this script reads "
                          f"{STATE_VERSION}")
    for name, digest in manifest["files"].items():
        file = folder / manifest["model"] / name
        if not file.is_file() or sha256_file(file) != digest:
            raise ConfigError(f"--resume {folder}: {manifest['model']}/{name} is missing or differs from the "
                              f"state's record (an incomplete copy?)")
    return manifest


def check_resume(folder: Path, saved: dict, study: dict) -> None:
    """One line naming every study setting that differs from the saved study's."""
    from pipelines.config import ConfigError

    def flag(key):
        return {"base_sha256": "base weights sha256", "dtype": "--dtype resolves to"}.get(
            key, f"--{key.replace('_', '-')}")

    def text(key, value):
        if key == "base_sha256":
            return str(value)[:12] + "…"
        return json.dumps(value) if isinstance(value, (dict, list)) else str(value)

    saved, study = {**SAVED_BEFORE, **saved}, {**SAVED_BEFORE, **study}
    differ = [f"{flag(k)} {text(k, study.get(k))} (saved {text(k, saved.get(k))})"
              for k in sorted(set(saved) | set(study)) if saved.get(k) != study.get(k)]
    if differ:
        raise ConfigError(f"--resume {folder}: this run's study differs from the saved one: {'; '.join(differ)}. "
                          f"Resume with the saved settings, or start a new --save-state folder")


def load_optimizer_tensors(folder: Path, manifest: dict) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for name in manifest["shards"]:
        tensors.update(load_file(str(folder / manifest["model"] / name)))
    return tensors


# ------------------------------------------------------------------------------------------------ evaluation
def heldout_digest(rows: list[dict]) -> str:
    """sha256 of a corpus's held-out sequences (their token ids, in order): a corpus is the same only if this is."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row["input_ids"]).encode())
    return digest.hexdigest()


def check_heldout(what: str, saved: dict | None, digests: dict[str, str]) -> None:
    """One line when a corpus of this run has other held-out sequences than in the ``saved`` digests (a study's
    ``meta.heldout_sha256``; older studies have none and are not checked): the same name, another text — e.g. the
    stdlib of another Python, or a local file rebuilt."""
    from pipelines.config import ConfigError

    differ = [f"{name} ({digest[:12]}… here, {saved[name][:12]}… there)" for name, digest in digests.items()
              if saved and name in saved and saved[name] != digest]
    if differ:
        raise ConfigError(f"{what}: other held-out sequences under the same corpus name: {'; '.join(differ)}. "
                          f"Evaluate on the very same text (the same file, the same Python for stdlib) or start anew")


def reference_runs(args, budgets):
    """The settings that do not depend on the scorer: streaming, the oracle and the asked heuristics per budget."""
    from kvpop.evaluation import settings

    return settings(["streaming", *args.heuristics, "oracle"], budgets)


def reference_study(path: Path, settings: dict) -> dict:
    """The finished study at ``path`` whose references a run with ``settings`` may reuse; one line naming what
    differs when it was measured on other items or another base."""
    from pipelines.config import ConfigError

    try:
        saved = json.loads(Path(path).read_text())
        theirs = {**SAVED_BEFORE, **saved["meta"]["study"]}
        saved["references"]["records"]  # every finished study has them
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"--references-from {path}: not a learning-curves study ({type(err).__name__}: {err})") \
            from None
    differ = [f"{key} {settings.get(key)!r} (there {theirs.get(key)!r})" for key in REUSE_MUST_MATCH
              if settings.get(key) != theirs.get(key)]
    if differ:
        raise ConfigError(f"--references-from {path}: measured on other items or another base: {'; '.join(differ)}")
    return saved


def reference_records(study: dict, training: str | None = None) -> dict[str, list[dict]]:
    """A finished study's reference records per corpus: its training corpus's (under ``training``, default its
    source name), then each ``--eval-sources``'."""
    name = study["meta"]["study"]["source"] if training is None else training
    return {name: study["references"]["records"],
            **{source: c["references"]["records"] for source, c in study.get("corpora", {}).items()}}


def reusable_references(saved: dict, settings: dict, runs, corpora: list[str]) -> tuple[dict, dict, dict]:
    """Per corpus of this run (``""``: the training corpus, then its ``--eval-sources``), from a finished study
    (:func:`reference_study`): ``(records, runs left, reused)`` — the saved reference records of each run in ``runs``
    it measured on that corpus at the very same budget (the oracle only under the same β), with its dense records;
    the runs still to measure there (all of them on a corpus it did not evaluate); ``policy@budget`` of those
    reused."""
    from kvpop.policies import build_policy

    theirs = {**SAVED_BEFORE, **saved["meta"]["study"]}
    measured = reference_records(saved, training="")
    records, left, reused = {}, {}, {}
    for name in corpora:
        rows = measured.get(name, [])
        found = {(r["policy"], r["budget"]) for r in rows if r["policy"] != "dense"}
        here, left[name] = set(), []
        for run in runs:
            wanted = (run.policy, str(build_policy(run.policy, run.budget).budget))
            same_targets = run.policy != "oracle" or theirs["query_power"] == settings["query_power"]
            if same_targets and wanted in found:
                here.add(wanted)
            else:
                left[name].append(run)
        records[name] = [r for r in rows if here and (r["policy"] == "dense" or (r["policy"], r["budget"]) in here)]
        reused[name] = sorted(f"{policy}@{budget}" for policy, budget in here)
    return records, left, reused


def evaluate_records(cfg, inputs: dict, model, runs) -> list[dict]:
    """Per-item records of ``runs`` on the held-out text and the recall samples (the evaluation stage's code)."""
    from pipelines.eval_parts import evaluate_items

    records, _ = evaluate_items(cfg, inputs, model, progress=False, runs=runs)
    for r in records:
        r.pop("ranks", None)  # per gold token; the summary reads first_rank / all_top1
    return records


def summarize_records(records: list[dict], budgets: list[dict], resamples: int, seed: int,
                      policy: str | None = None) -> dict:
    """:func:`pipelines.report.summarize` of the records; ``policy``: keep only its rows (and its sentences)."""
    from pipelines import report

    summary = report.summarize(records, budgets, resamples=resamples, seed=seed)
    if policy is not None:
        summary = {kind: [e for e in entries if e["policy"] == policy] for kind, entries in summary.items()}
    summary["sentences"] = report.sentences(summary, budgets)
    return summary


def diagnostics(model, eval_ids, eval_topks, batch: int, target_options: dict | None = None) -> dict:
    """Held-out decision / kept-set / rank diagnostics against the training targets (``target_options``: their
    definition, :meth:`pipelines.config.PrecomputeConfig.target_options`), means per layer and overall."""
    from kvpop.diagnostics import diagnose_model, summarize as per_layer

    summary = per_layer(diagnose_model(model, eval_ids, topks=eval_topks, batch_size=batch,
                                       target_options=target_options))
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
def load_data(cfg, tokenizer, training=None):
    """``(training ids [N, S], held-out rows [{"id", "input_ids"}])``: the data stage's training split of
    ``training`` (:func:`training_config`, with the mix if any; default ``cfg``) and held-out split of ``cfg``."""
    import torch

    from pipelines.data import load_sequences

    train = load_sequences(training or cfg, "train", tokenizer)
    return torch.tensor([r["input_ids"] for r in train], dtype=torch.long), load_sequences(cfg, "eval", tokenizer)


def check_args(args) -> None:
    """Bad input that argparse cannot see, as one :class:`ConfigError` line (before anything is loaded)."""
    from kvpop.losses import check_retention_options
    from kvpop.objective import KLThroughMask
    from kvpop.targets import check_query_power
    from pipelines.config import ConfigError

    for name in ("scorer_options", "loss_options", "kl_options"):
        try:
            value = json.loads(getattr(args, name))
        except ValueError as err:
            raise ConfigError(f"--{name.replace('_', '-')}: not JSON ({err})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"--{name.replace('_', '-')}: give a JSON object, got {value!r}")
    try:
        check_retention_options(json.loads(args.loss_options))
    except ValueError as err:
        raise ConfigError(f"--loss-options: {err}") from None
    try:
        KLThroughMask.from_options(json.loads(args.kl_options))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"--kl-options: {err}") from None
    try:
        check_query_power(args.query_power)
    except ValueError as err:
        raise ConfigError(f"--query-power: {err}") from None
    for name in ("batch", "seq_len", "eval_sequences", "eval_batch", "recall_batch", "recall_tokens", "resamples"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.train_sequences < 0 or args.recall_samples < 0 or args.dynamic_sequences < 0:
        raise ConfigError("--train-sequences, --recall-samples and --dynamic-sequences must be >= 0")
    if not 0 <= args.recall_mix <= 1:
        raise ConfigError(f"--recall-mix must be in [0, 1] (the share of training sequences given planted facts), "
                          f"got {args.recall_mix}")
    if (args.mix_source is None) != (args.mix_sequences == 0) or args.mix_sequences < 0:
        raise ConfigError("--mix-source and --mix-sequences go together: a corpus and how many of its training "
                          "sequences (>= 1) join the pool")
    if args.mix_source in (args.source, *args.eval_sources):
        raise ConfigError(f"--mix-source {args.mix_source!r} is the training corpus or one of --eval-sources: mix in "
                          f"a corpus the evaluation does not judge transfer on")


@dataclass
class Study:
    """What a run is, resolved and checked before the model loads: the pipeline config (data and eval sections), the
    base folder and its weights' digest, the settings a resume must match, the saved state if resuming, the
    checkpoints still ahead and the step that ends this run, the recall samples."""

    cfg: object
    base: Path
    base_sha256: str
    settings: dict
    resume: Path | None
    manifest: dict | None
    tokens_per_step: int
    seen: int
    checkpoints: list[int]
    total_steps: int
    tokenizer: object
    samples: list
    corpora: dict  # --eval-sources: source -> its pipeline config (held-out split only)
    training: object  # the pipeline config whose training split is the pool (cfg, plus --mix-source as data.mix_*)
    references_from: dict | None  # --references-from: the finished study whose reference records may be reused


def open_study(args) -> Study:
    """Resolve and check the run (bad input: :class:`ConfigError`, one line): a resume is refused here when the saved
    study's settings or base weights differ, or when no checkpoint lies beyond the tokens it has seen."""
    from kvpop.files import weights_digest
    from kvpop.pretrained import read_model_config
    from pipelines.config import ConfigError
    from pipelines.data import check_inputs, load_tokenizer
    from pipelines.eval_parts import recall_samples

    check_args(args)
    resume = Path(args.resume) if args.resume else None
    manifest = read_state(resume) if resume else None
    tokens_per_step = args.batch * args.seq_len
    seen = manifest["progress"]["step"] * tokens_per_step if manifest else 0
    checkpoints = sorted(int(c) for c in args.checkpoints if c > seen)
    if not checkpoints:
        raise ConfigError(f"--checkpoints: none above the {seen} training tokens already seen (e.g. --checkpoints "
                          f"{2 * seen} {4 * seen})" if seen else "--checkpoints: give token counts above 0")
    total_steps = math.ceil(checkpoints[-1] / tokens_per_step)
    pool = args.train_sequences or (manifest["study"]["train_sequences"] if manifest else total_steps * args.batch)
    cfg = study_config(args, pool)
    check_inputs(cfg)
    if args.source in args.eval_sources:
        raise ConfigError(f"--eval-sources: {args.source!r} is the training corpus (its held-out split is evaluated "
                          f"anyway); name corpora the scorer never trains on")
    corpora = {source: study_config(args, pool, source) for source in dict.fromkeys(args.eval_sources)}
    training = training_config(args, pool)
    for other in [*corpora.values(), training]:  # the training config: the mix corpus exists
        check_inputs(other)
    base = cfg.model.resolved_path()
    base_sha256 = weights_digest(base)
    settings = study_settings(args, base_sha256, pool)
    if manifest:
        check_resume(resume, manifest["study"], settings)
    references_from = reference_study(Path(args.references_from), settings) if args.references_from else None
    tokenizer = load_tokenizer(cfg)
    try:
        samples = recall_samples(cfg, tokenizer, read_model_config(base).get("max_position_embeddings"))
    except ValueError as err:
        raise ConfigError(f"--recall-*: {err}") from None
    return Study(cfg, base, base_sha256, settings, resume, manifest, tokens_per_step, seen, checkpoints, total_steps,
                 tokenizer, samples, corpora, training, references_from)


def run(args) -> dict:
    """Train (or continue) the study, evaluating and saving at every checkpoint; returns the result."""
    import torch

    import kvpop
    from kvpop.evaluation import Setting
    from kvpop.pretrained import load_pretrained
    from kvpop.scorers.base import HEAD_RECENCY_UNIT
    from pipelines.config import ConfigError
    from pipelines.data import load_sequences

    started = time.perf_counter()
    study = open_study(args)
    cfg, manifest, tokens_per_step = study.cfg, study.manifest, study.tokens_per_step
    device = torch.device(args.device)
    if device.type == "cpu":  # spinning intra-op threads on a busy small box cost far more than they give
        torch.set_num_threads(1)
    train_budget, eval_budgets, unreachable = budgets_for(args)
    t0 = time.perf_counter()
    train_ids, heldout = load_data(cfg, study.tokenizer, study.training)
    data_s = time.perf_counter() - t0
    eval_ids = torch.tensor([r["input_ids"] for r in heldout], dtype=torch.long, device=device)
    inputs = {"tokenizer": study.tokenizer, "sequences": heldout, "budgets": eval_budgets, "samples": study.samples,
              "problems": [], "prompts": []}
    others = {}  # other corpora: text only, the same budgets; per source (its config, its inputs, its token ids)
    for source, other in study.corpora.items():
        rows = load_sequences(other, "eval", study.tokenizer)
        others[source] = (other, {**inputs, "sequences": rows, "samples": []},
                          torch.tensor([r["input_ids"] for r in rows], dtype=torch.long, device=device))
    digests = {args.source: heldout_digest(heldout),
               **{source: heldout_digest(corpus_inputs["sequences"]) for source, (_, corpus_inputs, _) in
                  others.items()}}
    if manifest:
        check_heldout(f"--resume {study.resume}", manifest["result"]["meta"].get("heldout_sha256"), digests)
    if study.references_from:
        check_heldout(f"--references-from {args.references_from}",
                      study.references_from["meta"].get("heldout_sha256"), digests)
    model, _ = load_pretrained(study.base, dtype=getattr(torch, resolved_dtype(args)), device=device)
    budgets = [{"B": b.total, "CR": 1 - b.total / args.seq_len, "budget": str(b)} for b in eval_budgets]
    print(f"[curves] {len(train_ids)} training / {len(heldout)} held-out sequences of {args.seq_len} ({data_s:.0f}s), "
          f"{len(study.samples)} recall samples; training to step {study.total_steps} ({tokens_per_step} tokens each)",
          flush=True)

    torch.manual_seed(args.seed)
    kvpop.retrofit(model, train_budget, scorer=args.scorer, policy="kvpop", recency=args.recency,
                   scorer_options=json.loads(args.scorer_options))
    kvpop.set_window_attention_prior(model, args.window_attention_prior)
    if args.init_from and not manifest:
        try:
            kvpop.load_scorers(model, args.init_from)
        except ValueError as err:  # other scorer options: the weights do not fit
            raise ConfigError(f"--init-from {args.init_from}: {err}") from None
        print(f"[curves] scorers start from {args.init_from}", flush=True)
    trainer = Trainer(model, args, len(train_ids), device)
    if manifest:  # the scorers, the optimizer, the data order, and every point and reference so far
        kvpop.load_scorers(model, study.resume / manifest["model"])
        trainer.load(manifest["progress"], load_optimizer_tensors(study.resume, manifest))
        result = manifest["result"]
        print(f"[curves] resumed {study.resume} at step {trainer.step} ({tokens_label(study.seen)} tokens, "
              f"{len(result['points'])} points)", flush=True)
    else:
        t0 = time.perf_counter()
        model.eval()
        runs = reference_runs(args, eval_budgets)
        names = ["", *others]
        reused, left, labels = (reusable_references(study.references_from, study.settings, runs, names)
                                if study.references_from else ({}, {name: runs for name in names}, {}))

        def references(config, corpus_inputs, name: str) -> list[dict]:
            """This corpus's reference records: those reused, then the runs left (their dense records dropped where
            the saved study's are reused)."""
            fresh = evaluate_records(config, corpus_inputs, model, left[name]) if left[name] else []
            if reused.get(name):
                fresh = reused[name] + [r for r in fresh if r["policy"] != "dense"]
            return fresh

        refs = references(cfg, inputs, "")
        result = {"references": {"records": refs, "seconds": round(time.perf_counter() - t0, 1),
                                 "summary": summarize_records(refs, budgets, args.resamples, args.seed)},
                  "corpora": {}, "points": [], "meta": {"sessions": []}}
        if args.references_from:
            result["references"]["reused_from"] = {"study": str(args.references_from), "settings": labels[""],
                                                   "corpora": {name: labels[name] for name in others}}
        for source, (other, other_inputs, _) in others.items():
            t0 = time.perf_counter()
            other_refs = references(other, other_inputs, source)
            result["corpora"][source] = {"references": {
                "records": other_refs, "seconds": round(time.perf_counter() - t0, 1),
                "eval_sequences": len(other_inputs["sequences"]),
                "summary": summarize_records(other_refs, budgets, args.resamples, args.seed)}}
        print(f"[curves] references: {result['references']['seconds']}s", flush=True)
    result["meta"].update(args=vars(args), study=study.settings, heldout_sha256=digests, train_budget=str(train_budget),
                          eval_budgets=[str(b) for b in eval_budgets], budgets=budgets, unreachable=unreachable,
                          tokens_per_step=tokens_per_step, train_sequences=len(train_ids),
                          eval_sequences=len(heldout), recall_samples=len(study.samples),
                          plan=plan({r["tokens"] for r in result["meta"].get("plan", [])} | set(study.checkpoints),
                                    args.seq_len))
    session = {"device": _device_name(device), "torch": torch.__version__, "args": vars(args),
               "data_s": round(data_s, 1), "first_step": trainer.step, "train_s_before": trainer.train_s,
               "stopped": None}
    result["meta"]["sessions"].append(session)
    refs = result["references"]["records"]
    last_checkpoint_s = 0.0

    def checkpoint() -> None:
        """Evaluate the scorer as it is now, then save the state and write the outputs."""
        nonlocal last_checkpoint_s
        t_eval = time.perf_counter()
        model.eval()
        found = [r for r in evaluate_records(cfg, inputs, model, [Setting("kvpop", b) for b in eval_budgets])
                 if r["policy"] == "kvpop"]  # dense's recall records again: the references hold them
        point = {"step": trainer.step, "tokens": trainer.step * tokens_per_step,
                 "epochs": round(trainer.step * args.batch / len(train_ids), 3), "train_s": round(trainer.train_s, 1),
                 "session": len(result["meta"]["sessions"]), "records": found,
                 "summary": summarize_records(refs + found, budgets, args.resamples, args.seed, policy="kvpop"),
                 "diagnostics": diagnostics(model, eval_ids, [b.topk for b in eval_budgets], args.eval_batch,
                                            cfg.precompute.target_options())}
        point["corpora"] = {}
        for source, (other, other_inputs, other_ids) in others.items():
            found = evaluate_records(other, other_inputs, model, [Setting("kvpop", b) for b in eval_budgets])
            other_refs = result["corpora"][source]["references"]["records"]
            point["corpora"][source] = {"records": found, "summary": summarize_records(
                other_refs + found, budgets, args.resamples, args.seed, policy="kvpop"),
                "diagnostics": diagnostics(model, other_ids, [b.topk for b in eval_budgets], args.eval_batch,
                                           other.precompute.target_options())}
        if kvpop.scorers(model)[0].config.head_recency:  # the learned λ per layer and KV head
            point["head_recency"] = [(s.head_recency.detach().float().cpu() / HEAD_RECENCY_UNIT).tolist()
                                     for s in kvpop.scorers(model)]
        point["eval_s"] = round(time.perf_counter() - t_eval, 1)
        result["points"].append(point)
        print(f"[curves] {describe_point(point, train_budget)} (eval {point['eval_s']}s)", flush=True)
        update_session(session, trainer, tokens_per_step)
        if args.save_state:
            save_state(Path(args.save_state), trainer, study, result)
        write_outputs(result, Path(args.out), args.tag)
        last_checkpoint_s = time.perf_counter() - t_eval
        model.train()

    if not manifest:
        checkpoint()  # the untrained scorer: the curve's first point
    pending = list(study.checkpoints)
    model.train()
    while trainer.step < study.total_steps:
        trainer.train_step(train_ids)
        if trainer.step % 50 == 0:
            update_session(session, trainer, tokens_per_step)
            recent = trainer.losses[-50:], trainer.accs[-50:]
            kl = f" kl {sum(trainer.kls[-50:]) / 50:.4f}" if trainer.kls else ""
            print(f"[curves] step {trainer.step}/{study.total_steps} loss {sum(recent[0]) / 50:.4f} train-acc "
                  f"{sum(recent[1]) / 50:.4f}{kl} {session['train_tokens_per_s']} tok/s", flush=True)
        if pending and trainer.step * tokens_per_step >= pending[0]:
            pending = [c for c in pending if c > trainer.step * tokens_per_step]
            checkpoint()
        if args.time_budget_s and time.perf_counter() - started + 1.25 * last_checkpoint_s > args.time_budget_s:
            session["stopped"] = f"time budget of {args.time_budget_s:.0f}s: stopped at step {trainer.step}"
            print(f"[curves] {session['stopped']}", flush=True)
            break
    if result["points"][-1]["step"] != trainer.step:
        checkpoint()
    return result


def update_session(session: dict, trainer: Trainer, tokens_per_step: int) -> None:
    """This session's steps, training seconds and throughput, and its losses (at most ~200 of them)."""
    steps = trainer.step - session["first_step"]
    seconds = trainer.train_s - session["train_s_before"]
    session.update(last_step=trainer.step, train_s=round(seconds, 1),
                   train_tokens_per_s=round(steps * tokens_per_step / seconds) if seconds > 0 else None,
                   losses=trainer.losses[session["first_step"]:][::max(1, steps // 200)])


def describe_point(point: dict, train_budget) -> str:
    d = point["diagnostics"]["budgets"][str(train_budget)]["scorer"]

    def quality(summary):
        return "; ".join(f"B {m['B']} {m['metric']} {m['estimate']:.4f}" for m in summary["metrics"]
                         if m["metric"] in ("kl", "top1_agreement", "recall_exact"))

    others = "".join(f" | {source}: {quality(c['summary'])}" for source, c in point.get("corpora", {}).items())
    return (f"{tokens_label(point['tokens'])} tokens: BA {d['balanced_accuracy']:.4f} AUC {d['auc']:.4f} "
            f"agree {d['agreement']:.4f}; {quality(point['summary'])}{others}")


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.node()} CPU ({os.cpu_count()} cores)"


# ------------------------------------------------------------------------------------------------ outputs
def tokens_label(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k" if n >= 1e3 else f"{int(n)}"


def _find(entries: list[dict], **match) -> dict | None:
    return next((e for e in entries if all(e.get(k) == v for k, v in match.items())), None)


def _span(entry: dict | None, digits: int, signed: bool = False) -> str:
    """``mean [lo, hi]``."""
    if entry is None or entry["estimate"] is None or not math.isfinite(entry["estimate"]):
        return "-"
    f = (lambda v: f"{v:+.{digits}f}") if signed else (lambda v: f"{v:.{digits}f}")
    return f"{f(entry['estimate'])} [{f(entry['lo'])}, {f(entry['hi'])}]"


def _difference(entry: dict | None, digits: int) -> str:
    """The paired difference, "above" / "below" only where its interval excludes 0."""
    if entry is None:
        return "-"
    if entry["vs"] == "best_heuristic" and entry["baseline"] == "streaming":
        return "(= streaming)"
    word = ("above" if entry["estimate"] > 0 else "below") if entry["resolved"] else "not resolved"
    against = f" ({entry['baseline']})" if entry["vs"] == "best_heuristic" else ""
    return f"{_span(entry, digits, True)} {word}{against}"


def _curve_table(result: dict, B: int, metrics: list[tuple[str, str, int]], gaps: bool) -> list[str]:
    """One row per point: each metric's mean [interval], its paired differences to streaming and to the best
    heuristic (and the gap closed); then the references' rows."""
    head = ["tokens", "epochs", *(label for _, label, _ in metrics),
            *(f"{label} − streaming" for _, label, _ in metrics),
            *(f"{label} − best heuristic" for _, label, _ in metrics)]
    if gaps:
        head += [f"{label} gap closed" for _, label, _ in metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in result["points"]:
        s = p["summary"]
        cells = [tokens_label(p["tokens"]), f"{p['epochs']:.2f}"]
        cells += [_span(_find(s["metrics"], metric=m, B=B), d) for m, _, d in metrics]
        for vs in ("streaming", "best_heuristic"):
            cells += [_difference(_find(s["differences"], metric=m, B=B, vs=vs), d + 1) for m, _, d in metrics]
        if gaps:
            cells += [_span(_find(s["gap_closed"], metric=m, B=B), 2) for m, _, _ in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    reference = result["references"]["summary"]["metrics"]
    for policy in ("dense", "streaming", "tova", "h2o", "window_attention", "oracle"):
        values = [_find(reference, metric=m, B=B, policy=policy) for m, _, _ in metrics]
        if any(values):
            cells = [f"*{policy}*", "", *(_span(v, d) for v, (_, _, d) in zip(values, metrics))]
            lines.append("| " + " | ".join(cells + [""] * (len(head) - len(cells))) + " |")
    return lines


def _cells_table(result: dict, B: int) -> list[str]:
    """Recall exact match per cell (headline or not): one row per point, then the references'."""
    cells = result["references"]["summary"]["cells"]
    keys = sorted({(c["task"], c["context"], c["depth"]) for c in cells})
    head = ["tokens", *(f"{t} c{c} d{d:g}" for t, c, d in keys)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def row(label, entries, at):
        found = [_find(entries, task=t, context=c, depth=d, B=at) for t, c, d in keys]
        return "| " + " | ".join([label, *(f"{e['exact']:.2f}" if e else "-" for e in found)]) + " |"

    lines += [row(tokens_label(p["tokens"]), p["summary"]["cells"], B) for p in result["points"]]
    lines += [row("*dense*", [c for c in cells if c["policy"] == "dense"], None)]
    for policy in ("streaming", "tova", "h2o", "window_attention", "oracle"):
        mine = [c for c in cells if c["policy"] == policy]
        if mine:
            lines.append(row(f"*{policy}*", mine, B))
    return lines


def _decisions_table(points: list[dict], budget: str) -> list[str]:
    """Per point: the scorer's held-out keep/evict diagnostics at ``budget`` next to newest- / oldest-wins."""
    lines = ["| tokens | BA | AUC | agreement | newest agr. | oldest agr. | overlap end | Spearman |",
             "|---|---|---|---|---|---|---|---|"]
    for p in points:
        d = p["diagnostics"]["budgets"][budget]
        s = d["scorer"]
        lines.append(f"| {tokens_label(p['tokens'])} | {s['balanced_accuracy']:.4f} | {s['auc']:.4f} | "
                     f"{s['agreement']:.4f} | {d['newest']['agreement']:.4f} | {d['oldest']['agreement']:.4f} | "
                     f"{s['overlap_end']:.3f} | {p['diagnostics']['spearman']['scorer']:.3f} |")
    return lines


def _versus_table(result: dict) -> list[str]:
    """Per corpus, budget and text metric at the last point: KVpop, its paired difference to each heuristic, and the
    share of the streaming → oracle gap it closes."""
    last = result["points"][-1]
    corpora = [(result["meta"]["args"]["source"], last["summary"]),
               *((source, c["summary"]) for source, c in last.get("corpora", {}).items())]
    ran = {r["policy"] for r in result["references"]["records"]}
    heuristics = [h for h in HEURISTIC_NAMES if h in ran]
    head = ["corpus", "B", "metric", "KVpop", *(f"− {h}" for h in heuristics), "gap closed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for source, summary in corpora:
        for b in result["meta"]["budgets"]:
            for metric, label, digits in TEXT_METRICS:
                versus = [_difference(_find(summary["differences"], metric=metric, B=b["B"], baseline=h), digits + 1)
                          for h in heuristics]
                lines.append("| " + " | ".join([source, str(b["B"]), label,
                                                _span(_find(summary["metrics"], metric=metric, B=b["B"]), digits),
                                                *versus,
                                                _span(_find(summary["gap_closed"], metric=metric, B=b["B"]), 2)])
                             + " |")
    return lines


def corpus_view(result: dict, source: str) -> dict:
    """``result`` as seen on another corpus (``--eval-sources``): its references and, per point, its summary and
    diagnostics (``None`` where a study predates them)."""
    return {"references": result["corpora"][source]["references"],
            "points": [{**p, "summary": p["corpora"][source]["summary"],
                        "diagnostics": p["corpora"][source].get("diagnostics")} for p in result["points"]
                       if source in p.get("corpora", {})]}


def render(result: dict) -> str:
    meta, points = result["meta"], result["points"]
    args, train_budget = meta["args"], meta["train_budget"]
    n_text = meta["eval_sequences"]
    sessions = "; ".join(
        f"{i + 1}: {s['device']}, steps {s['first_step']} → {s.get('last_step', s['first_step'])}, "
        f"{s.get('train_tokens_per_s') or '-'} tokens/s" + (f", stopped early ({s['stopped']})" if s["stopped"] else "")
        for i, s in enumerate(meta["sessions"]))
    epoch_tokens = meta["train_sequences"] * args["seq_len"]
    recall_items = f" and {meta['recall_samples']} recall samples" if meta["recall_samples"] else ""
    lines = [f"# Learning curves ({', '.join(sorted({s['device'] for s in meta['sessions']}))})", "",
             f"Scorer-only `{args['scorer']}`, online targets (`--features {args['features']}`"
             f"{', --query-power ' + str(args['query_power']) if args.get('query_power', 1.0) != 1.0 else ''}"
             f"{', on the window attention prior' if args.get('window_attention_prior') else ''}), "
             f"training budget "
             f"{train_budget}, S = {args['seq_len']}, {args['batch']} sequences per step from a pool of "
             f"{meta['train_sequences']}"
             + (f" ({args['mix_sequences']} of them from `{args['mix_source']}`)" if args.get("mix_source") else "")
             + (f", {args['recall_mix']:.0%} of the training corpus's with planted facts (`--recall-mix`)"
                if args.get("recall_mix") else "")
             + f" (one epoch = {tokens_label(epoch_tokens)} tokens), constant lr {args['lr']} "
             f"after {args['warmup']} warm-up steps; one run evaluated at each token count on {n_text} held-out "
             f"sequences{recall_items}. Sessions: {sessions}."
             + (f" Reference records of {', '.join(reuse['settings']) or 'none'} reused from `{reuse['study']}` "
                f"(same held-out items and base)" + "".join(
                    f"; on `{name}`: {', '.join(done) or 'none'}" for name, done in reuse.get("corpora", {}).items())
                + "." if (reuse := result["references"].get("reused_from")) else ""), "",
             "Intervals: 95 % percentile bootstrap over items (`pipelines.stats`); differences paired over the items "
             "both policies have; \"above\" / \"below\" only where the paired interval excludes 0. Best heuristic: "
             "the best of streaming and the `--heuristics` that ran by point estimate, per metric"
             + (f" (TOVA / H2O on the first {args['dynamic_sequences']} sequences)"
                if args["heuristics"] and args["dynamic_sequences"] else "") + ".", "",
             f"## Held-out keep/evict decisions at the training budget {train_budget}", "",
             *_decisions_table(points, train_budget)]
    for source in result.get("corpora", {}):
        view = [p for p in corpus_view(result, source)["points"] if p.get("diagnostics")]
        if view:
            lines += ["", f"## `{source}` (never trained on): keep/evict decisions at {train_budget}", "",
                      *_decisions_table(view, train_budget)]
    for b in meta["budgets"]:
        title = f"B = {b['B']} ({b['budget']}, CR {100 * b['CR']:g} %)"
        lines += ["", f"## Held-out text at {title}: mean [95 % interval] over {n_text} sequences", ""]
        lines += _curve_table(result, b["B"], TEXT_METRICS, gaps=True)
        if meta["recall_samples"]:
            lines += ["", f"## Recall at {title}: headline cells (dense >= {args['recall_min_dense']})", ""]
            if _find(result["references"]["summary"]["metrics"], part="recall", B=b["B"]):
                lines += _curve_table(result, b["B"], RECALL_METRICS, gaps=False)
            else:
                lines.append("No cell reaches the dense threshold: no headline recall numbers.")
            lines += ["", "Exact match per cell (every cell):", "", *_cells_table(result, b["B"])]
    for source, corpus in result.get("corpora", {}).items():
        view = corpus_view(result, source)
        n = corpus["references"]["eval_sequences"]
        for b in meta["budgets"]:
            lines += ["", f"## `{source}` (never trained on), held-out text at B = {b['B']} ({b['budget']}, CR "
                          f"{100 * b['CR']:g} %): mean [95 % interval] over {n} sequences", ""]
            lines += _curve_table(view, b["B"], TEXT_METRICS, gaps=True)
    if points:
        lines += ["", f"## At the last point ({tokens_label(points[-1]['tokens'])} tokens)", "",
                  *(f"- {s}" for s in points[-1]["summary"]["sentences"])]
        for source, corpus in points[-1].get("corpora", {}).items():
            lines += [f"- `{source}`: {s}" for s in corpus["summary"]["sentences"]]
        lines += ["", "KVpop against each heuristic at the last point (paired over the items both have; TOVA / H2O "
                      "on their subset):", "", *_versus_table(result)]
    lines += ["",
              "Training seconds to reach each scale: this driver (online targets, one run, at the throughput "
              "of its latest session) vs the stored path (precompute written at "
              f"{PRECOMPUTE_WRITTEN_TPS} tok/s + training at {STORED_TRAIN_TPS} tok/s, measured on the H200) with "
              "one run per scale:", "",
              "| tokens | sequences | online, one run (cumulative) | stored, this scale | stored, all scales |",
              "|---|---|---|---|---|"]
    rate = meta["sessions"][-1].get("train_tokens_per_s") or 0
    for r in meta["plan"]:
        online = f"{r['tokens'] / rate:.0f}" if rate else "-"
        lines.append(f"| {tokens_label(r['tokens'])} | {r['sequences']} | {online} | {r['stored_path_s']} | "
                     f"{r['stored_path_all_scales_s']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, points = result["meta"], result["points"]
    reference = result["references"]["summary"]["metrics"]
    train_budget = meta["train_budget"]
    tokens = [max(p["tokens"], 1) for p in points]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    d = [p["diagnostics"]["budgets"][train_budget] for p in points]
    ax = axes[0][0]
    ax.plot(tokens, [x["scorer"]["balanced_accuracy"] for x in d], "o-", label="scorer: balanced accuracy")
    ax.plot(tokens, [x["scorer"]["auc"] for x in d], "s-", label="scorer: AUC")
    ax.plot(tokens, [x["newest"]["auc"] for x in d], "--", color="C1", label="newest-wins: AUC")
    ax.axhline(0.5, color="0.5", linestyle=":", label="newest / oldest / random: BA 0.5")
    ax.set_title(f"held-out keep/evict decisions at {train_budget}", fontsize=9)
    ax = axes[0][1]
    ax.plot(tokens, [x["scorer"]["agreement"] for x in d], "o-", label="scorer")
    ax.plot(tokens, [x["newest"]["agreement"] for x in d], "--", color="C1", label="newest-wins")
    ax.plot(tokens, [x["oldest"]["agreement"] for x in d], "--", color="C2", label="oldest-wins")
    ax.set_title("raw agreement", fontsize=9)

    def curve(ax, metric, B, color, label, kind="metrics", at=points, style="o-", **match):
        found = [_find(p["summary"][kind], metric=metric, B=B, **match) for p in at]
        xs = [max(p["tokens"], 1) for p, e in zip(at, found) if e]
        if not xs:
            return
        es = [e for e in found if e]
        ax.plot(xs, [e["estimate"] for e in es], style, color=color, label=label)
        ax.fill_between(xs, [e["lo"] for e in es], [e["hi"] for e in es], color=color, alpha=0.2, lw=0)

    def level(ax, metric, B, color, policy, style):
        e = _find(reference, metric=metric, B=B, policy=policy)
        if e:
            ax.axhline(e["estimate"], color=color, linestyle=style, lw=1, label=f"{policy} B={B}")

    panels = [(axes[0][2], "kl", "held-out KL(dense ‖ policy), 95 % interval"),
              (axes[1][0], "top1_agreement", "held-out top-1 agreement with dense")]
    for ax, metric, title in panels:
        for i, b in enumerate(meta["budgets"]):
            curve(ax, metric, b["B"], f"C{i}", f"KVpop B={b['B']}")
            for policy, style in (("streaming", "--"), ("tova", "-."), ("h2o", (0, (5, 1, 1, 1))),
                                  ("window_attention", (0, (1, 1))), ("oracle", ":")):
                level(ax, metric, b["B"], f"C{i}", policy, style)
        ax.set_title(title, fontsize=9)
    ax = axes[1][1]
    for i, b in enumerate(meta["budgets"]):
        curve(ax, "kl", b["B"], f"C{i}", f"KL B={b['B']}", "differences", vs="streaming")
        curve(ax, "top1_agreement", b["B"], f"C{i + len(meta['budgets'])}", f"top-1 B={b['B']}", "differences",
              vs="streaming")
        for source in result.get("corpora", {}):  # corpora never trained on: the same differences, dashed
            view = corpus_view(result, source)["points"]
            curve(ax, "kl", b["B"], f"C{i}", f"KL B={b['B']} {source}", "differences", view, "s--", vs="streaming")
            curve(ax, "top1_agreement", b["B"], f"C{i + len(meta['budgets'])}", f"top-1 B={b['B']} {source}",
                  "differences", view, "s--", vs="streaming")
    ax.axhline(0, color="0.3", lw=1)
    ax.set_title("paired KVpop − streaming (KL below 0, top-1 above 0: better)", fontsize=9)
    ax = axes[1][2]
    if _find(reference, part="recall"):
        for i, b in enumerate(meta["budgets"]):
            curve(ax, "recall_gold_logprob", b["B"], f"C{i}", f"KVpop B={b['B']}")
            for policy, style in (("streaming", "--"), ("oracle", ":")):
                level(ax, "recall_gold_logprob", b["B"], f"C{i}", policy, style)
        level(ax, "recall_gold_logprob", meta["budgets"][0]["B"], "0.3", "dense", "-")  # dense: every budget's row
        ax.set_title("recall: gold answer log-probability (headline cells)", fontsize=9)
    else:
        ax.text(0.5, 0.5, "no headline recall cells", ha="center", va="center", transform=ax.transAxes)
    for ax in axes.flat:
        ax.set_xscale("symlog", linthresh=min([t for t in tokens if t > 1] or [1]))
        ax.set_xlabel("training tokens")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def layers_plot(result: dict, path: Path) -> None:
    """Per layer, the held-out balanced accuracy of the scorer's keep/evict decisions at each evaluated budget, at
    three points of training (the first trained one, the one nearest 1M tokens, the last), next to newest-wins,
    oldest-wins and random (0.5 by construction): "above newest-wins at every layer" in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipelines.scorer_diagnostics import per_layer_figure

    trained = [p for p in result["points"] if p["tokens"] > 0]
    if not trained:
        return
    chosen = [trained[0], min(trained, key=lambda p: abs(math.log(p["tokens"] / 1e6))), trained[-1]]
    chosen = [p for i, p in enumerate(chosen) if p not in chosen[:i]]
    budgets = list(trained[-1]["diagnostics"]["budgets"])
    fig, axes = plt.subplots(1, len(budgets), figsize=(6.5 * len(budgets), 3.8), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        curves, styles = {}, {}
        for color, point in zip(("C0", "C4", "C9"), chosen):
            label = f"scorer, {point['tokens'] / 1e6:.2f}M tokens"
            curves[label] = point["diagnostics"]["budgets"][budget]["scorer"]["balanced_accuracy_per_layer"]
            styles[label] = (color, "-", "o")
        last = trained[-1]["diagnostics"]["budgets"][budget]
        curves.update({rule: last[rule]["balanced_accuracy_per_layer"] for rule in ("newest", "oldest", "random")})
        first = next(iter(curves.values()))
        per_layer_figure(range(len(first)), curves, ax=ax, styles=styles,
                         title=f"held-out keep/evict balanced accuracy per layer at {budget}")
        ax.set_ylim(0.4, 1.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict, out: Path, tag: str) -> Path:
    """``<out>/learning_curves_<tag>.json`` (+ ``.md``, ``.png``), each written atomically."""
    from kvpop.files import atomic_write_text

    stem = out / f"learning_curves_{tag}"
    atomic_write_text(stem.with_suffix(".json"), json.dumps(result, indent=1))
    atomic_write_text(stem.with_suffix(".md"), render(result))
    partial = stem.with_name(stem.name + ".tmp.png")
    plot(result, partial)
    os.replace(partial, stem.with_suffix(".png"))
    write_layers_plot(result, stem)
    return stem


def write_layers_plot(result: dict, stem: Path) -> None:
    """``<stem>_layers.png`` (:func:`layers_plot`), written atomically."""
    partial = stem.with_name(stem.name + "_layers.tmp.png")
    layers_plot(result, partial)
    if partial.exists():
        os.replace(partial, stem.with_name(stem.name + "_layers.png"))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plan:
        for row in plan(args.checkpoints, args.seq_len):
            print(row)
        return 0
    if args.redraw:
        source = Path(args.redraw)
        tag = source.stem.removeprefix("learning_curves_")
        stem = write_outputs(json.loads(source.read_text()), source.parent, tag)
        print(f"wrote {stem}.md, .png and _layers.png")
        return 0
    from jobs._cli import fail
    from pipelines.config import ConfigError

    try:
        result = run(args)
    except ConfigError as err:
        return fail("learning_curves", err)
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
