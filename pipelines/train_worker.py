"""What each Ray Train (V2) worker of the train stage runs: :func:`train_loop`, driven by a :class:`TrainSpec`.

The driver (:mod:`pipelines.train`) decides everything and hands each worker one frozen :class:`TrainSpec`. A worker
builds the student (:func:`build_student`: the base model in fp32 retrofitted with the spec's policy, its scorers
loaded from ``spec.init_from`` when set, the base frozen in ``scorer_only`` mode:
:func:`kvpop.parameters.trainable_parameters`), checkpoints the activations of its decoder layers with
``spec.activation_checkpointing`` (:func:`kvpop.sharding.checkpoint_layers`, either mode: the same loss and
gradients in less memory), shards it with the FSDP2 plan (:func:`kvpop.sharding.shard`) when the spec says so, and
runs ``spec.steps`` steps of the spec's objective on the batches of its dataset shard (:func:`batch_losses`). The
policies (``train.policy``):

* ``kvpop``: a scorer per layer, :class:`kvpop.objective.Objective`; in ``scorer_only`` mode the KL carries no
  gradient (it is still reported). Online (``spec.online``) the batch holds token ids only and
  :func:`online_batch` computes the rest — the targets and top-K logits a stored row would hold — from the frozen
  base inside the step.
* ``dms``: DMS gates (``scorer="dms"``) under the relaxed DMS policy (Gumbel-sigmoid at ``dms_temperature``),
  :class:`kvpop.objective.DMSObjective` at the scheduled keep-rate of the step. In ``scorer_only`` mode only the
  gates train (adapter-only, as NVIDIA Model-Optimizer's public DMS trainer does); ``distill`` trains the base too.
  The final model is saved with the hard policy (the form prefill and the cache run).
* ``streaming`` (StreamingLLM+): no scorers, the base trains (``distill``) under the sinks + window mask,
  :class:`kvpop.objective.StreamingObjective`.

The learning rate of each step is its group's peak times :func:`lr_factor` (warm-up, then constant or cosine): a
function of the step, so a resumed run continues the schedule exactly. Metrics are all-reduced over workers; rank 0
logs them (and ``lr``) to the run's MLflow run and prints one line per logged step. With ``spec.eval_every``, rank 0
also evaluates held-out items at step 0 of a fresh run, every ``eval_every`` steps and at the last
(:class:`HeldoutRunner`, :mod:`pipelines.heldout`) and logs ``heldout.*`` at that step.

**Profiling** (``spec.profile_steps = (first, count)``, ``train.profile_steps``): rank 0 runs those steps under
:class:`kvpop.profiling.StepProfiler` (collection paused between them) and writes its report — operators and kernels
per step, host vs device time, device→host syncs by source line, the top operators — as :data:`PROFILE_ARTIFACT` in
the run dir and the run's MLflow artifacts after the window's last step.

**Checkpoints** every ``checkpoint_every`` steps and at the last one (:mod:`kvpop.checkpointing`: each worker
writes its shard of the model and optimizer state — only what trains in scorer-only mode — reported through
``ray.train.report``). A restarted worker group gets the latest one from ``ray.train.get_checkpoint()``, restores it
and skips the batches already consumed (:func:`start_student`: the run's own checkpoint always wins over
``init_from``, which only seeds a fresh run). DCP checkpoints are pickles: resume only from run folders you wrote
(each carries a manifest that :func:`kvpop.checkpointing.load` verifies first, and the driver before it starts us).
A resumed run replays the steps after its checkpoint: their metrics reach MLflow only past the run's last logged
step (:func:`_last_logged_step`), so that each step has one point in every history.

**The final model** (rank 0, gathered from the shards): :func:`write_final_model`, a :func:`kvpop.save_retrofitted`
folder — the scorers and the base model's identity in scorer-only mode (the base weights did not change), the full
weights in distill mode — plus ``kvpop_train.json`` with the steps it holds.
"""
from __future__ import annotations

import contextlib
import json
import math
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

import kvpop
from kvpop import checkpointing
from kvpop.allocation import Allocation
from kvpop.budget import Budget
from kvpop.objective import METRICS as OBJECTIVE_METRICS
from kvpop.objective import DMSObjective, Objective, StreamingObjective, student_forward
from kvpop.online import dense_priorities, online_targets
from kvpop.parameters import trainable_parameters
from kvpop.pretrained import load_pretrained
from kvpop.profiling import StepProfiler
from kvpop.sharding import checkpoint_layers, shard
from pipelines.config import config_from_dict
from pipelines.heldout import METRICS as HELDOUT_METRICS, HeldoutEvaluator

TRAIN_MARKER = "kvpop_train.json"
PROFILE_ARTIFACT = "step_profile.md"  # train.profile_steps: the profiled steps' report, in the run dir and MLflow


@dataclass(frozen=True)
class TrainSpec:
    """One training run as the driver decided it; every worker gets the same one."""

    run_name: str
    run_dir: str  # <storage>/<run name>: Ray Train's run folder, where final_model goes
    base_path: str  # the teacher's folder: the student's base weights
    base_sha256: str  # its weights (files) digest (recorded by a scorer-only final model)
    objective: Objective | DMSObjective | StreamingObjective
    policy: str  # kvpop | dms | streaming (train.policy)
    scorer: str
    scorer_options: dict
    mode: str  # scorer_only | distill
    target_column: str  # the shard column of the teacher targets for objective.budget.window ("" unless kvpop)
    lr: float
    base_lr: float
    grad_clip: float
    steps: int
    batch_size: int
    seq_len: int
    seed: int
    use_gpu: bool
    sharded: bool  # the FSDP2 plan (kvpop.sharding)
    bf16: bool
    threads: int
    checkpoint_every: int
    log_every: int
    fail_at_step: int
    tracking_uri: str
    mlflow_run_id: str
    dms_temperature: float = 0.1
    report_every_step: bool = False  # a Tune trial: every step's metrics reach the scheduler
    save_final: bool = True
    init_from: str = ""  # a saved scorer folder the scorers start from (train.init_from, checked by the driver)
    base_tensors_sha256: str = ""  # the base's tensors digest: a scorer-only final model's portable base identity
    online: bool = False  # targets and top-K logits computed inside each step from the frozen base (train.online)
    target_options: dict = field(default_factory=dict)  # online: the target definition (group_reduce, query_power)
    top_k: int = 0  # online: the teacher logits the KL is measured on (precompute.top_k)
    online_features: str = "student"  # online: the scorers read the student's forward | the dense pass's (dense)
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine (lr_factor)
    eval_every: int = 0  # held-out evaluation every this many steps on rank 0 (pipelines.heldout); 0 = none
    eval_config: dict = field(default_factory=dict)  # the run's PipelineConfig as a dict, for that evaluation
    allocation: Allocation | None = None  # per-head budgets (train.allocation, METHOD §7); saved with the final model
    activation_checkpointing: bool = False  # each decoder layer recomputed in the backward (kvpop.sharding)
    profile_steps: tuple[int, ...] = ()  # (first, count): rank 0 profiles those steps (train.profile_steps)

    @property
    def budget(self) -> Budget:
        return self.objective.budget


def build_student(spec: TrainSpec, device="cpu"):
    """The retrofitted student in fp32 (master weights) with only what trains marked trainable; ``(model, tokenizer)``.
    """
    model, tokenizer = load_pretrained(spec.base_path, dtype=torch.float32, device="cpu")
    torch.manual_seed(spec.seed)  # identical scorer init on every worker
    if spec.policy == "dms":  # the gates' defaults are the published ones (scale 100, offset 5: keep all at step 0)
        kvpop.retrofit(model, spec.budget, scorer="dms", policy="dms")
        kvpop.set_policy(model, "dms", spec.budget, relaxed=True, temperature=spec.dms_temperature)
    elif spec.policy == "streaming":
        kvpop.retrofit(model, spec.budget, scorer=None, policy="streaming")
    else:
        kvpop.retrofit(model, spec.budget, scorer=spec.scorer, policy="kvpop", recency=spec.objective.recency,
                       scorer_options=dict(spec.scorer_options), allocation=spec.allocation)
        if spec.init_from:  # fine-tuning: a resumed run's checkpoint replaces these (start_student)
            kvpop.load_scorers(model, spec.init_from)
    trainable_parameters(model, spec.mode)
    model.to(device)
    model.train()
    return model, tokenizer


def lr_factor(step: int, warmup_steps: int, schedule: str, steps: int) -> float:
    """The learning rate of (1-based) ``step`` as a fraction of the peak: ``step / warmup_steps`` during the warm-up,
    then 1 (``constant``) or a half cosine from 1 at the first step after the warm-up towards 0 after step ``steps``
    (``cosine``). A function of the step alone: a resumed run continues the schedule exactly."""
    if step <= warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"schedule must be constant or cosine, got {schedule!r}")
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps - 1) / max(1, steps - warmup_steps)))


def peak_lrs(model, spec: TrainSpec) -> list[float]:
    """Each of :func:`start_student`'s optimizer groups' peak learning rate (scorers, then base), in its order."""
    params = trainable_parameters(model, spec.mode)
    return [spec.lr] * bool(params["scorers"]) + [spec.base_lr] * bool(params["base"])


def online_batch(model, ids: torch.Tensor, spec: TrainSpec) -> dict[str, torch.Tensor]:
    """What a stored row holds, computed from ``ids [B, S]`` by the frozen base inside the step
    (:func:`kvpop.online.online_targets`: its dense pass and the transposed target pass, no gradient): the target
    column ``[B, L, Hkv, S]`` and the top-K logits. Under the FSDP2 plan the root's own parameters (embeddings, final
    norm, LM head) are gathered around it: the teacher pass runs the base and the head, not the root's forward."""
    sharded = hasattr(model, "unshard")  # an FSDPModule
    if sharded:
        model.unshard()
    try:
        out = online_targets(model, ids, top_k=spec.top_k, **spec.target_options)
    finally:
        if sharded:
            model.reshard()
    return {"input_ids": ids, "targets": out["targets"].permute(1, 0, 2, 3), "topk_values": out["topk_values"],
            "topk_indices": out["topk_indices"]}


def dense_feature_losses(model, ids: torch.Tensor, spec: TrainSpec) -> dict[str, torch.Tensor]:
    """Online with ``online_features=dense``: the scorers read the keys and values of the step's dense teacher pass
    (:func:`kvpop.online.dense_priorities`), no student forward; ``loss`` = β · ``ret_loss`` (the KL of the sparse
    forward carries no gradient in scorer-only mode, and is not measured here)."""
    sharded = hasattr(model, "unshard")  # an FSDPModule: see online_batch
    if sharded:
        model.unshard()
    try:
        out = online_targets(model, ids, keep=("keys", "values"), **spec.target_options)
    finally:
        if sharded:
            model.reshard()
    ranking = spec.objective.ranking(dense_priorities(model, out["keys"], out["values"]), out["targets"])
    return {"loss": spec.objective.beta * ranking["ret_loss"], **ranking}


def metric_names(spec: TrainSpec) -> tuple[str, ...]:
    """What a step of this spec reports (:data:`kvpop.objective.METRICS` of its policy; no ``kl`` when the scorers
    read the dense pass)."""
    names = OBJECTIVE_METRICS[spec.policy]
    return tuple(n for n in names if n != "kl") if spec.online and spec.online_features == "dense" else names


def batch_losses(model, batch: dict, spec: TrainSpec, step: int = 0) -> dict[str, torch.Tensor]:
    """The spec's objective at ``step`` on a batch of shard rows: ``input_ids [B, S]``,
    ``topk_values``/``topk_indices [B, S, K]`` and (policy kvpop) the target column ``[B, L, Hkv, S]`` — online,
    ``input_ids`` alone (:func:`online_batch` computes the rest; :func:`dense_feature_losses` with dense features);
    the metrics of :func:`metric_names` (``loss`` carries the gradient)."""
    column = spec.target_column
    if spec.online and spec.online_features == "dense":
        return dense_feature_losses(model, batch["input_ids"].long(), spec)
    if spec.online:
        batch, column = online_batch(model, batch["input_ids"].long(), spec), "targets"
    ids, top_values, top_indices = batch["input_ids"].long(), batch["topk_values"], batch["topk_indices"]
    if spec.policy == "streaming":
        return spec.objective(model(input_ids=ids, use_cache=False).logits, top_values, top_indices)
    logits, collected = student_forward(model, ids)  # kvpop: ranked priorities; dms: relaxed decision logits
    if spec.policy == "dms":
        return spec.objective(logits, collected, top_values, top_indices, step)
    teacher = batch[column].permute(1, 0, 2, 3)  # -> [L, B, Hkv, S], the layout of the priorities
    return spec.objective(collected, teacher, logits, top_values, top_indices)


def write_final_model(model, out: Path, tokenizer, spec: TrainSpec, steps: int) -> None:
    """``out`` replaced by a :func:`kvpop.save_retrofitted` folder of ``model`` (an unsharded module)."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    distilled = spec.mode == "distill"  # the base weights changed: they must be stored
    if spec.policy == "dms":
        kvpop.set_policy(model, "dms", spec.budget)  # the hard gates: what prefill and the DMS cache run
    with torch.no_grad():
        kvpop.save_retrofitted(model, tmp, tokenizer, base=None if distilled else spec.base_path,
                               base_sha256=None if distilled else spec.base_sha256,
                               base_tensors_sha256=None if distilled else spec.base_tensors_sha256 or None)
    (tmp / TRAIN_MARKER).write_text(json.dumps({"steps": steps, "run_name": spec.run_name, "mode": spec.mode,
                                                "policy": spec.policy}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def trained_steps(final_model: Path) -> int | None:
    """The steps a written final model holds, or None if there is none."""
    try:
        return int(json.loads((final_model / TRAIN_MARKER).read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save_final(model, spec: TrainSpec, tokenizer, rank: int, steps: int) -> None:
    """Gather the model on rank 0 (FSDP2) into a plain student and write it as the final model."""
    if spec.sharded:
        full = checkpointing.full_model_state(model)  # collective
        if rank != 0:
            return
        plain, _ = build_student(spec, device="cpu")
        loaded = plain.load_state_dict(full, strict=False)
        tied = {"lm_head.weight"} if getattr(plain.config, "tie_word_embeddings", False) else set()
        if set(loaded.missing_keys) - tied or loaded.unexpected_keys:
            raise RuntimeError(f"gathered state dict does not fit the model: missing {loaded.missing_keys}, "
                               f"unexpected {loaded.unexpected_keys}")
        model = plain
    elif rank != 0:
        return
    write_final_model(model, Path(spec.run_dir) / "final_model", tokenizer, spec, steps)


def _batches(shard_iterator, batch_size: int, skip: int, device):
    """Batches in a fixed order, skipping the first ``skip`` (those a resumed run already trained on).

    The driver hands over the shards repeated enough times to cover every step in one pass (one Ray Data execution
    instead of one per epoch); should a pass still run out, the next one starts.
    """
    while True:
        produced = 0
        for batch in shard_iterator.iter_torch_batches(batch_size=batch_size, drop_last=True, device=device):
            produced += 1
            if skip:
                skip -= 1
                continue
            yield batch
        if produced == 0:
            raise RuntimeError("this worker's dataset shard yields no full batch")


def _log_metrics(client, run_id: str, metrics: dict, step: int) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()
                                      if k not in ("step", "resumed_from")])


def _last_logged_step(client, run_id: str) -> int:
    """The last step the run's metric histories hold (``step_s`` is logged at every logged step), 0 if none."""
    return max((m.step for m in client.get_metric_history(run_id, "step_s")), default=0)


def _last_logged_value(client, run_id: str, name: str) -> float:
    """The value of metric ``name`` at the run's last logged step (0 if none): ``train_s``, the seconds the run's
    worker has spent so far — each (re)start adds its own time to what the killed one had logged, so a run resumed
    across sessions reports the time it cost (to its last logged step), the replayed steps included."""
    history = client.get_metric_history(run_id, name)
    return max(history, key=lambda m: (m.step, m.timestamp)).value if history else 0.0


def _write_profile(profiler: StepProfiler, spec: TrainSpec, client, step: int, world: int) -> None:
    """Rank 0: the profiled steps' report as ``<run dir>/step_profile.md`` and the run's MLflow artifact."""
    title = (f"train step profile of {spec.run_name}: steps {profiler.first}-{step}, batch {spec.batch_size} x "
             f"{spec.seq_len} tokens x {world} worker(s), {'online ' if spec.online else ''}"
             f"{spec.online_features + ' features, ' if spec.online else ''}{spec.policy} {spec.mode}, "
             f"{'FSDP2, ' if spec.sharded else ''}{'bf16' if spec.bf16 else 'fp32'}")
    path = Path(spec.run_dir) / PROFILE_ARTIFACT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profiler.markdown(title))
    if client is not None and spec.mlflow_run_id:
        client.log_artifact(spec.mlflow_run_id, str(path))
    s = profiler.summary()
    print(f"[kvpop.train] profiled steps {profiler.first}-{step}: {s['kernels']:.0f} kernels, {s['ops']:.0f} aten ops, "
          f"{s['host_reads']:.0f} host reads per step; host {s['host_s']:.3f} s / wall {s['wall_s']:.3f} s; {path}",
          flush=True)


def _report_checkpoint(model, optimizer, spec: TrainSpec, step: int, metrics: dict) -> None:
    import ray.train

    folder = tempfile.mkdtemp(prefix=f"kvpop-ckpt-{step}-")
    try:
        checkpointing.save(model, optimizer, folder, step=step, trainable_only=spec.mode == "scorer_only")
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _resume(model, optimizer, spec: TrainSpec, rank: int, checkpoint) -> int:
    """The step of ``checkpoint`` (the one Ray Train hands a (re)started worker group), restored; 0 if None."""
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as folder:
        step = checkpointing.load(model, optimizer, folder, trainable_only=spec.mode == "scorer_only")
    if rank == 0:
        print(f"[kvpop.train] resumed {spec.run_name} from the checkpoint of step {step}", flush=True)
    return step


def start_student(spec: TrainSpec, device, rank: int = 0, checkpoint=None):
    """``(model, tokenizer, optimizer, trainable parameters, step)`` a worker starts training from: the student
    (:func:`build_student`: its scorers from ``spec.init_from`` if set), its layers checkpointed, then sharded, as
    the spec says, a fresh AdamW, then ``checkpoint`` (the run's own, a ``ray.train.Checkpoint``; None on a fresh run)
    restored over both — so a resumed run continues its own weights, never ``init_from``'s — and the step it holds (0
    if none)."""
    model, tokenizer = build_student(spec, device=device)
    if spec.activation_checkpointing:
        checkpoint_layers(model)
    if spec.sharded:
        shard(model, bf16=spec.bf16)
        if spec.online:
            # FSDP2 initialises every unit on the root's first forward; the online teacher pass calls the decoder and
            # the head, not the root, and would make the first decoder layer a root of its own: the root goes first
            with torch.no_grad():
                model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False)
    params = trainable_parameters(model, spec.mode)  # after sharding: the DTensors the optimizer must step
    groups = [{"params": params["scorers"], "lr": spec.lr}] if params["scorers"] else []
    if params["base"]:
        groups.append({"params": params["base"], "lr": spec.base_lr})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    trainable = [p for g in groups for p in g["params"]]
    return model, tokenizer, optimizer, trainable, _resume(model, optimizer, spec, rank, checkpoint)


def heldout_identity(spec: TrainSpec, device) -> dict:
    """What the held-out references' records depend on beyond their items and settings
    (:func:`pipelines.heldout.references_key`): the base's weights, the model as evaluated (fp32 weights; sharded
    ones gathered into a plain student), the card, torch."""
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"base_sha256": spec.base_sha256, "bf16": spec.bf16, "sharded": spec.sharded, "device": card,
            "torch": torch.__version__}


class HeldoutRunner:
    """The in-training held-out evaluation of one worker (``spec.eval_every`` > 0; else calls do nothing): rank 0
    evaluates the scorers as they are (:class:`pipelines.heldout.HeldoutEvaluator`) and logs ``heldout.*`` to the
    run's MLflow run at the step. A sharded model is first gathered (every rank takes part) into a plain student
    that rank 0 builds once; an unsharded one is evaluated as it is, in eval mode."""

    def __init__(self, model, spec: TrainSpec, rank: int, client, device):
        self.model, self.spec, self.rank, self.client, self.device = model, spec, rank, client, device
        self.plain = None
        # the held-out items are built now: a corpus that cannot be read fails the run before its first step, not
        # eval_every steps into a resumed run
        self.evaluator = (HeldoutEvaluator(config_from_dict(spec.eval_config), heldout_identity(spec, device))
                          if spec.eval_every and rank == 0 else None)

    def __call__(self, step: int) -> None:
        spec = self.spec
        if not spec.eval_every:
            return
        model = self.model
        if spec.sharded:
            full = checkpointing.full_model_state(model)  # collective
            if self.rank == 0:
                if self.plain is None:
                    self.plain, _ = build_student(spec, device=self.device)
                self.plain.load_state_dict(full, strict=False)
            model = self.plain
        if self.rank == 0:
            was_training = model.training
            model.eval()
            try:
                t0 = time.perf_counter()
                found = self.evaluator(model)
            finally:
                model.train(was_training)
            _log_metrics(self.client, spec.mlflow_run_id, {**found, "heldout.eval_s": time.perf_counter() - t0},
                         step)
            shown = " ".join(f"{k.removeprefix('heldout.')} {v:.4f}" for k, v in found.items()
                             if k in HELDOUT_METRICS or k.endswith(".gap_closed"))  # other corpora: their gap
            print(f"[kvpop.train] step {step}/{spec.steps} held-out {shown}", flush=True)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()


def train_loop(config: dict) -> None:
    """The Ray Train (V2) per-worker training function; ``config = {"spec": pickled TrainSpec}``."""
    import ray.train
    import ray.train.torch

    t_start = time.perf_counter()
    spec: TrainSpec = pickle.loads(config["spec"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device() if spec.use_gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(spec.threads)

    model, tokenizer, optimizer, trainable, start_step = start_student(spec, device, rank,
                                                                       ray.train.get_checkpoint())

    client, logged_up_to, spent_before = None, 0, 0.0
    if rank == 0:
        import mlflow

        client = mlflow.MlflowClient(spec.tracking_uri)
        logged_up_to = _last_logged_step(client, spec.mlflow_run_id)
        spent_before = _last_logged_value(client, spec.mlflow_run_id, "train_s")
    batches = _batches(ray.train.get_dataset_shard("train"), spec.batch_size, start_step, device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if spec.bf16 and not spec.sharded
                and device.type == "cuda" else contextlib.nullcontext())
    tokens_per_step = spec.batch_size * spec.seq_len * world
    names = metric_names(spec)
    peaks = peak_lrs(model, spec)
    heldout = HeldoutRunner(model, spec, rank, client, device)
    if start_step == 0:
        heldout(0)  # the untrained scorers: the learning curve's first point
    profiler = StepProfiler(device, *spec.profile_steps) if spec.profile_steps and rank == 0 else None
    marker = Path(spec.run_dir) / f".fault-injected-at-{spec.fail_at_step}"
    for step in range(start_step + 1, spec.steps + 1):
        if spec.fail_at_step == step and rank == 0 and not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            raise RuntimeError(f"fault injected at step {step} (train.fail_at_step)")
        t_wait = time.perf_counter()
        batch = next(batches)
        t0 = time.perf_counter()
        with profiler.step(step) if profiler is not None else contextlib.nullcontext():
            with autocast:
                parts = batch_losses(model, batch, spec, step)
            optimizer.zero_grad(set_to_none=True)
            factor = lr_factor(step, spec.warmup_steps, spec.schedule, spec.steps)
            for group, peak in zip(optimizer.param_groups, peaks, strict=True):
                group["lr"] = peak * factor
            if parts["loss"].requires_grad:
                parts["loss"].backward()
                if spec.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_([p for p in trainable if p.grad is not None], spec.grad_clip)
                optimizer.step()
            if profiler is not None:
                profiler.issued()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        if profiler is not None and profiler.done and step == profiler.last:
            _write_profile(profiler, spec, client, step, world)
        values = torch.stack([torch.as_tensor(parts[k]).detach().float().to(device) for k in names])
        if dist.is_available() and dist.is_initialized() and world > 1:
            dist.all_reduce(values)
            values /= world
        metrics = {"step": step, **dict(zip(names, values.tolist())), "tokens_per_s": tokens_per_step / seconds,
                   "step_s": seconds, "data_wait_s": t0 - t_wait, "resumed_from": start_step,
                   "lr": optimizer.param_groups[0]["lr"], "train_s": spent_before + time.perf_counter() - t_start}
        if rank == 0 and (step % spec.log_every == 0 or step == spec.steps):
            if step > logged_up_to:  # a replayed step after a resume is in the histories already
                _log_metrics(client, spec.mlflow_run_id, metrics, step)
            shown = " ".join(f"{k} {metrics[k]:.4f}" for k in names)
            print(f"[kvpop.train] step {step}/{spec.steps} {shown} {metrics['tokens_per_s']:.0f} tok/s", flush=True)
        if spec.eval_every and (step % spec.eval_every == 0 or step == spec.steps):
            heldout(step)
        if step % spec.checkpoint_every == 0 or step == spec.steps:
            _report_checkpoint(model, optimizer, spec, step, metrics)
        elif spec.report_every_step:
            ray.train.report(metrics)
    if spec.save_final:
        _save_final(model, spec, tokenizer, rank, max(start_step, spec.steps))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
