"""What each Ray Train (V2) worker of the train stage runs: :func:`train_loop`, driven by a :class:`TrainSpec`.

The driver (:mod:`pipelines.train`) decides everything and hands each worker one frozen :class:`TrainSpec`. A worker
builds the student (:func:`build_student`: the base model in fp32 retrofitted with the spec's policy, its scorers
loaded from ``spec.init_from`` when set, the base frozen in ``scorer_only`` mode:
:func:`kvpop.parameters.trainable_parameters`), shards it with the FSDP2 plan
(:func:`kvpop.sharding.shard`) when the spec says so, and runs ``spec.steps`` steps of the spec's objective on the
batches of its dataset shard (:func:`batch_losses`). The policies (``train.policy``):

* ``kvpop``: a scorer per layer, :class:`kvpop.objective.Objective`; in ``scorer_only`` mode the KL carries no
  gradient (it is still reported).
* ``dms``: DMS gates (``scorer="dms"``) under the relaxed DMS policy (Gumbel-sigmoid at ``dms_temperature``),
  :class:`kvpop.objective.DMSObjective` at the scheduled keep-rate of the step. In ``scorer_only`` mode only the
  gates train (adapter-only, as NVIDIA Model-Optimizer's public DMS trainer does); ``distill`` trains the base too.
  The final model is saved with the hard policy (the form prefill and the cache run).
* ``streaming`` (StreamingLLM+): no scorers, the base trains (``distill``) under the sinks + window mask,
  :class:`kvpop.objective.StreamingObjective`.
 Metrics are all-reduced over workers; rank 0 logs them to the run's MLflow run and
prints one line per logged step.

**Checkpoints** every ``checkpoint_every`` steps and at the last one (:mod:`kvpop.checkpointing`: each worker
writes its shard of the model and optimizer state — only what trains in scorer-only mode — reported through
``ray.train.report``). A restarted worker group gets the latest one from ``ray.train.get_checkpoint()``, restores it
and skips the batches already consumed (:func:`start_student`: the run's own checkpoint always wins over
``init_from``, which only seeds a fresh run). DCP checkpoints are pickles: resume only from run folders you wrote.

**The final model** (rank 0, gathered from the shards): :func:`write_final_model`, a :func:`kvpop.save_retrofitted`
folder — the scorers and the base model's identity in scorer-only mode (the base weights did not change), the full
weights in distill mode — plus ``kvpop_train.json`` with the steps it holds.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import kvpop
from kvpop import checkpointing
from kvpop.budget import Budget
from kvpop.objective import METRICS as OBJECTIVE_METRICS
from kvpop.objective import DMSObjective, Objective, StreamingObjective, student_forward
from kvpop.parameters import trainable_parameters
from kvpop.pretrained import load_pretrained
from kvpop.sharding import shard

TRAIN_MARKER = "kvpop_train.json"


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
                       scorer_options=dict(spec.scorer_options))
        if spec.init_from:  # fine-tuning: a resumed run's checkpoint replaces these (start_student)
            kvpop.load_scorers(model, spec.init_from)
    trainable_parameters(model, spec.mode)
    model.to(device)
    model.train()
    return model, tokenizer


def batch_losses(model, batch: dict, spec: TrainSpec, step: int = 0) -> dict[str, torch.Tensor]:
    """The spec's objective at ``step`` on a batch of shard rows: ``input_ids [B, S]``,
    ``topk_values``/``topk_indices [B, S, K]`` and (policy kvpop) the target column ``[B, L, Hkv, S]``; the metrics
    of :data:`kvpop.objective.METRICS` for the policy (``loss`` carries the gradient)."""
    ids, top_values, top_indices = batch["input_ids"].long(), batch["topk_values"], batch["topk_indices"]
    if spec.policy == "streaming":
        return spec.objective(model(input_ids=ids, use_cache=False).logits, top_values, top_indices)
    logits, collected = student_forward(model, ids)  # kvpop: ranked priorities; dms: relaxed decision logits
    if spec.policy == "dms":
        return spec.objective(logits, collected, top_values, top_indices, step)
    teacher = batch[spec.target_column].permute(1, 0, 2, 3)  # -> [L, B, Hkv, S], the layout of the priorities
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
    (:func:`build_student`: its scorers from ``spec.init_from`` if set), sharded if the spec says so, a fresh AdamW,
    then ``checkpoint`` (the run's own, a ``ray.train.Checkpoint``; None on a fresh run) restored over both — so a
    resumed run continues its own weights, never ``init_from``'s — and the step it holds (0 if none)."""
    model, tokenizer = build_student(spec, device=device)
    if spec.sharded:
        shard(model, bf16=spec.bf16)
    params = trainable_parameters(model, spec.mode)  # after sharding: the DTensors the optimizer must step
    groups = [{"params": params["scorers"], "lr": spec.lr}] if params["scorers"] else []
    if params["base"]:
        groups.append({"params": params["base"], "lr": spec.base_lr})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    trainable = [p for g in groups for p in g["params"]]
    return model, tokenizer, optimizer, trainable, _resume(model, optimizer, spec, rank, checkpoint)


def train_loop(config: dict) -> None:
    """The Ray Train (V2) per-worker training function; ``config = {"spec": TrainSpec}``."""
    import ray.train
    import ray.train.torch

    spec: TrainSpec = config["spec"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device() if spec.use_gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(spec.threads)

    model, tokenizer, optimizer, trainable, start_step = start_student(spec, device, rank,
                                                                       ray.train.get_checkpoint())

    client = None
    if rank == 0:
        import mlflow

        client = mlflow.MlflowClient(spec.tracking_uri)
    batches = _batches(ray.train.get_dataset_shard("train"), spec.batch_size, start_step, device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if spec.bf16 and not spec.sharded
                and device.type == "cuda" else contextlib.nullcontext())
    tokens_per_step = spec.batch_size * spec.seq_len * world
    names = OBJECTIVE_METRICS[spec.policy]
    marker = Path(spec.run_dir) / f".fault-injected-at-{spec.fail_at_step}"
    for step in range(start_step + 1, spec.steps + 1):
        if spec.fail_at_step == step and rank == 0 and not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            raise RuntimeError(f"fault injected at step {step} (train.fail_at_step)")
        t_wait = time.perf_counter()
        batch = next(batches)
        t0 = time.perf_counter()
        with autocast:
            parts = batch_losses(model, batch, spec, step)
        optimizer.zero_grad(set_to_none=True)
        if parts["loss"].requires_grad:
            parts["loss"].backward()
            if spec.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_([p for p in trainable if p.grad is not None], spec.grad_clip)
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        values = torch.stack([torch.as_tensor(parts[k]).detach().float().to(device) for k in names])
        if dist.is_available() and dist.is_initialized() and world > 1:
            dist.all_reduce(values)
            values /= world
        metrics = {"step": step, **dict(zip(names, values.tolist())), "tokens_per_s": tokens_per_step / seconds,
                   "step_s": seconds, "data_wait_s": t0 - t_wait, "resumed_from": start_step}
        if rank == 0 and (step % spec.log_every == 0 or step == spec.steps):
            _log_metrics(client, spec.mlflow_run_id, metrics, step)
            shown = " ".join(f"{k} {metrics[k]:.4f}" for k in names)
            print(f"[kvpop.train] step {step}/{spec.steps} {shown} {metrics['tokens_per_s']:.0f} tok/s", flush=True)
        if step % spec.checkpoint_every == 0 or step == spec.steps:
            _report_checkpoint(model, optimizer, spec, step, metrics)
        elif spec.report_every_step:
            ray.train.report(metrics)
    if spec.save_final:
        _save_final(model, spec, tokenizer, rank, max(start_step, spec.steps))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
