"""Stage 2: train the retrofitted student on precomputed teacher shards with Ray Train (V2), tracked in MLflow.

``run(cfg)``, in the driver:

1. **Validates its inputs before anything is written**: opens the target directory (``train.targets`` or the
   precompute stage's directory for this config) with :func:`pipelines.precompute.open_targets`, which refuses
   targets of another teacher (weights digest), another ``S`` or a window other than ``budget.window``, an
   incomplete or empty manifest, a missing shard, a missing column or a corrupt file — one
   :class:`~pipelines.precompute.TargetsError` line, no MLflow run, no run directory.
2. Picks the **stable run name** (``train.run_name`` or ``<config name>-<scorer>-<mode>-<budget>-<hash>``, the hash
   over the targets and every setting that changes the optimisation — not over ``steps``, worker counts, precision
   or checkpoint cadence, so that a restart, a longer run or a run on other hardware resumes).
3. Opens (or re-opens, by name) the MLflow run with the whole config as params, and fits a ``TorchTrainer`` with
   ``RunConfig(name=<run name>, storage_path=train.output_root or $KVPOP_HOME/runs)``, a ``FailureConfig``
   (``train.max_failures`` worker-group restarts) and the shards as a Ray Data dataset.
4. Logs the final retrofitted model (``save_retrofitted`` folder) as the run's ``model`` artifact.

:func:`make_trainer` builds that ``TorchTrainer``; the sweep stage (``pipelines/sweep.py``) builds one per Tune trial
with Tune's ``TuneReportCallback``, a metrics report every step (``report_every_step``) and no final model.

**Resume.** Ray Train V2 keeps a checkpoint-manager snapshot in ``<storage_path>/<name>/``; a new ``TorchTrainer``
with the same name and storage path loads it, and ``ray.train.get_checkpoint()`` in the workers returns the latest
reported checkpoint (verified in ``tests/test_train.py``). The training function then restores model + optimizer
state with ``torch.distributed.checkpoint`` and continues at the next step, skipping the batches already consumed in
the current epoch; the MLflow run found by name keeps one metric history. A finished run (its final model records
``steps == train.steps``) returns at once without starting Ray.

**Training function** (each worker): load the base model in fp32, ``kvpop.retrofit`` it (``policy="kvpop"``); in
``scorer_only`` mode freeze the base so only scorers train, in ``distill`` mode train everything (base at
``train.base_lr``, scorers at ``train.lr``). Strategy (``train.strategy``): **FSDP2** — ``fully_shard`` on each
scorer (fp32), each decoder layer and the root, with a bf16 ``MixedPrecisionPolicy`` on GPUs (NCCL) — whenever
there are GPUs or more than one worker (on CPU over gloo); a single CPU worker runs the plain module (no wrapper).
Each step minimises ``L = KL_topK + β · L_ret`` under the student's own sparse mask: ``L_ret`` is
:func:`kvpop.losses.boundary_loss` of the collected student priorities against the teacher priority
``with_recency(target, λ)`` over all layers × KV heads; ``KL_topK`` is :func:`kvpop.losses.topk_kl` against the
teacher's top-K logits at positions ``d >= budget.total`` (the ones where eviction has happened). In
``scorer_only`` mode the KL carries no gradient (it is still reported). Metrics (all-reduced over workers): ``loss``,
``ret_loss``, ``kl``, ``boundary_acc`` (fraction of keep/evict decisions agreeing with the teacher),
``tokens_per_s``. Checkpoints every ``train.checkpoint_every`` steps and at the end (``torch.distributed.checkpoint``:
each worker writes its shard of the model + optimizer state — only the trainable parameters in scorer_only mode —
reported through ``ray.train.report``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pipelines.config import ConfigError, PipelineConfig, config_from_dict, env_home, fingerprint

FINAL_MODEL = "final_model"
TRAIN_RECORD = "kvpop_train.json"
STEP_FILE = "kvpop_step.json"
# settings that do not change what is optimised: left out of the run-name hash so a restart resumes
OPERATIONAL = ("steps", "num_workers", "use_gpu", "cpus_per_worker", "strategy", "precision", "checkpoint_every",
               "max_failures", "log_every", "targets", "fail_at_step", "run_name", "output_root")


# ------------------------------------------------------------------------------------------------ names and places
def runs_root(cfg: PipelineConfig) -> Path:
    root = cfg.train.output_root
    return Path(root).expanduser().resolve() if root else cfg.home_dir() / "runs"


def default_run_name(cfg: PipelineConfig, targets_key: str) -> str:
    train = {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in OPERATIONAL}
    digest = fingerprint("kvpop.train", targets_key, cfg.budget, train, cfg.data.seed, length=10)
    return f"{cfg.name}-{cfg.train.scorer}-{cfg.train.mode}-{cfg.budget.budget()}-{digest}"


def run_name_of(cfg: PipelineConfig, targets_key: str | None = None) -> str:
    if cfg.train.run_name:
        return cfg.train.run_name
    if targets_key is None:
        targets_key = Path(targets_path(cfg)).name
    return default_run_name(cfg, targets_key)


def targets_path(cfg: PipelineConfig) -> Path:
    if cfg.train.targets:
        return Path(cfg.train.targets).expanduser().resolve()
    from pipelines.precompute import targets_dir

    return targets_dir(cfg)


def model_dir(cfg: PipelineConfig) -> Path:
    """Where this config's trained retrofitted model is (``kvpop.load_retrofitted`` reads it)."""
    return runs_root(cfg) / run_name_of(cfg) / FINAL_MODEL


# ------------------------------------------------------------------------------------------------ validation
def open_inputs(cfg: PipelineConfig):
    """The verified targets for this config, or one clear error (nothing is written before this passes)."""
    from pipelines.identity import teacher_identity
    from pipelines.precompute import open_targets

    if cfg.budget.topk < 1:
        raise ConfigError("budget.topk is 0: every eligible token is evicted, there is no decision to learn")
    teacher = teacher_identity(cfg)
    path = targets_path(cfg)
    targets = open_targets(path, teacher_sha256=teacher["weights_sha256"], seq_len=cfg.data.seq_len,
                           window=cfg.budget.window)
    world = cfg.train.num_workers
    per_epoch = targets.num_rows // world // cfg.train.batch_size
    if per_epoch < 1:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} × train.num_workers={world} needs more than the "
                          f"{targets.num_rows} precomputed sequences: lower them or precompute more "
                          f"(data.num_sequences)")
    return targets


# ------------------------------------------------------------------------------------------------ the step (pure torch)
def build_student(cfg: PipelineConfig, path: str | Path, device="cpu"):
    """The retrofitted student in fp32 (master weights), base frozen in scorer_only mode; ``(model, tokenizer)``."""
    import torch

    import kvpop
    from kvpop.pretrained import load_pretrained

    model, tokenizer = load_pretrained(path, dtype=torch.float32, device="cpu")
    torch.manual_seed(cfg.data.seed)  # identical scorer init on every worker
    kvpop.retrofit(model, cfg.budget.budget(), scorer=cfg.train.scorer, policy="kvpop", recency=cfg.train.recency,
                   scorer_options=dict(cfg.train.scorer_options))
    for name, param in model.named_parameters():
        param.requires_grad_(cfg.train.mode == "distill" or ".kvpop_scorer." in name)
    model.to(device)
    model.train()
    return model, tokenizer


def step_losses(model, batch: dict, cfg: PipelineConfig) -> dict:
    """One forward of the student on a batch of shard rows; the loss and its parts (tensors).

    ``batch``: ``input_ids [B, S]``, ``targets_w<window> [B, L, Hkv, S]``, ``topk_values``/``topk_indices``
    ``[B, S, K]``.
    """
    import torch

    import kvpop
    from kvpop.losses import boundary_agreement, boundary_decisions, boundary_loss, topk_kl
    from kvpop.retention import with_recency
    from pipelines.precompute import target_column

    budget = cfg.budget.budget()
    ids = batch["input_ids"].long()
    teacher = with_recency(batch[target_column(budget.window)].float().permute(1, 0, 2, 3), cfg.train.recency)
    with kvpop.collect_priorities(model) as collected:
        logits = model(input_ids=ids, use_cache=False).logits
    student = torch.stack([collected[i] for i in range(len(collected))]).float()
    decisions = boundary_decisions(teacher, budget)
    weight = "margin" if cfg.train.loss_weight == "margin" else None
    ret = boundary_loss(student, teacher, budget, tau=cfg.train.tau, weight=weight, decisions=decisions)
    positions = torch.arange(ids.shape[1], device=ids.device)
    mask = (positions >= budget.total).expand(ids.shape[0], -1)
    kl = topk_kl(logits, batch["topk_values"].float(), batch["topk_indices"].long(), mask=mask)
    loss = kl + cfg.train.beta * ret
    with torch.no_grad():
        acc = boundary_agreement(student.detach(), decisions)
    return {"loss": loss, "ret_loss": ret, "kl": kl, "boundary_acc": acc}


# ------------------------------------------------------------------------------------------------ worker side
def _decoder_layers(model):
    base = getattr(model, model.base_model_prefix)
    return list(base.layers)


def _shard(model, bf16: bool) -> None:
    """FSDP2: each scorer (fp32), each decoder layer and the root; bf16 compute with fp32 reduction on GPUs."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from kvpop.retrofit import attention_modules

    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else fp32
    for attn in attention_modules(model):
        if hasattr(attn, "kvpop_scorer"):
            fully_shard(attn.kvpop_scorer, mp_policy=fp32)
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=mixed)
    fully_shard(model, mp_policy=mixed)


def _batches(shard, batch_size: int, skip: int, device):
    """Batches in a fixed order, skipping the first ``skip`` (those a resumed run already trained on).

    The driver hands over the shards repeated enough times to cover every step in one pass (one Ray Data execution
    instead of one per epoch); should a pass still run out, the next one starts.
    """
    while True:
        produced = 0
        for batch in shard.iter_torch_batches(batch_size=batch_size, drop_last=True, device=device):
            produced += 1
            if skip:
                skip -= 1
                continue
            yield batch
        if produced == 0:
            raise RuntimeError("this worker's dataset shard yields no full batch")


def _state(model, optimizer, trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    if trainable_only:
        names = {n for n, p in model.named_parameters() if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in names}
    return {"model": model_sd, "optim": optim_sd}


def _save_final(model, cfg: PipelineConfig, teacher_path: str, out: Path, tokenizer, sharded: bool, rank: int,
                step: int) -> None:
    """The retrofitted model as ``kvpop.save_retrofitted`` writes it (gathered from FSDP shards on rank 0)."""
    import torch

    import kvpop

    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank != 0:
            return
        plain, _ = build_student(cfg, teacher_path, device="cpu")
        loaded = plain.load_state_dict(full, strict=False)
        tied = {"lm_head.weight"} if getattr(plain.config, "tie_word_embeddings", False) else set()
        if set(loaded.missing_keys) - tied or loaded.unexpected_keys:
            raise RuntimeError(f"gathered state dict does not fit the model: missing {loaded.missing_keys}, "
                               f"unexpected {loaded.unexpected_keys}")
        model = plain
    elif rank != 0:
        return
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.no_grad():
        kvpop.save_retrofitted(model, tmp, tokenizer)
    (tmp / TRAIN_RECORD).write_text(json.dumps({"steps": step, "run_name": out.parent.name,
                                                "mode": cfg.train.mode}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def train_loop(config: dict) -> None:
    """The Ray Train (V2) per-worker training function."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    cfg = config_from_dict(config["cfg"])
    t = cfg.train
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device() if t.use_gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, int(t.cpus_per_worker)))
    sharded = config["strategy"] == "fsdp"
    bf16 = config["precision"] == "bf16"

    model, tokenizer = build_student(cfg, config["teacher_path"], device=device)
    if sharded:
        _shard(model, bf16)
    groups = [{"params": [p for n, p in model.named_parameters() if ".kvpop_scorer." in n], "lr": t.lr}]
    if t.mode == "distill":
        groups.append({"params": [p for n, p in model.named_parameters() if ".kvpop_scorer." not in n],
                       "lr": t.base_lr})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    trainable = [p for g in groups for p in g["params"]]

    start_step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = _state(model, optimizer, t.mode == "scorer_only")
            dcp.load(state, checkpoint_id=folder)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=StateDictOptions(strict=False))
            start_step = json.loads((Path(folder) / STEP_FILE).read_text())["step"]
        if rank == 0:
            print(f"[kvpop.train] resumed {config['run_name']} from the checkpoint of step {start_step}", flush=True)

    client = None
    if rank == 0:
        import mlflow

        client = mlflow.MlflowClient(config["tracking_uri"])
    shard = ray.train.get_dataset_shard("train")
    batches = _batches(shard, t.batch_size, start_step, device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if bf16 and not sharded and device.type == "cuda"
                else contextlib.nullcontext())
    tokens_per_step = t.batch_size * cfg.data.seq_len * world
    marker = Path(config["run_dir"]) / f".fault-injected-at-{t.fail_at_step}"
    last: dict = {}
    for step in range(start_step + 1, t.steps + 1):
        if t.fail_at_step == step and rank == 0 and not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            raise RuntimeError(f"fault injected at step {step} (train.fail_at_step)")
        t_wait = time.perf_counter()
        batch = next(batches)
        t0 = time.perf_counter()
        with autocast:
            parts = step_losses(model, batch, cfg)
        optimizer.zero_grad(set_to_none=True)
        if parts["loss"].requires_grad:
            parts["loss"].backward()
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_([p for p in trainable if p.grad is not None], t.grad_clip)
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        values = torch.stack([parts[k].detach().float() for k in ("loss", "ret_loss", "kl", "boundary_acc")]).to(device)
        if dist.is_available() and dist.is_initialized() and world > 1:
            dist.all_reduce(values)
            values /= world
        loss, ret, kl, acc = values.tolist()
        last = {"step": step, "loss": loss, "ret_loss": ret, "kl": kl, "boundary_acc": acc,
                "tokens_per_s": tokens_per_step / seconds, "step_s": seconds, "data_wait_s": t0 - t_wait,
                "resumed_from": start_step}
        if rank == 0 and (step % t.log_every == 0 or step == t.steps):
            _log_metrics(client, config["mlflow_run_id"], last, step)
            print(f"[kvpop.train] step {step}/{t.steps} loss {loss:.4f} ret {ret:.4f} kl {kl:.4f} "
                  f"acc {acc:.3f} {last['tokens_per_s']:.0f} tok/s", flush=True)
        if step % t.checkpoint_every == 0 or step == t.steps:
            _report_checkpoint(model, optimizer, t.mode == "scorer_only", step, rank, last, config)
        elif config.get("report_every_step"):  # a Tune trial: every step reaches the scheduler (ASHA)
            ray.train.report(last)
    if config.get("save_final", True):
        _save_final(model, cfg, config["teacher_path"], Path(config["run_dir"]) / FINAL_MODEL, tokenizer, sharded,
                    rank, max(start_step, t.steps))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _log_metrics(client, run_id: str, metrics: dict, step: int) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    keys = ("loss", "ret_loss", "kl", "boundary_acc", "tokens_per_s", "step_s", "data_wait_s")
    client.log_batch(run_id, metrics=[Metric(k, float(metrics[k]), now, step) for k in keys])


def _report_checkpoint(model, optimizer, trainable_only: bool, step: int, rank: int, metrics: dict,
                       config: dict) -> None:
    import ray.train
    import torch.distributed.checkpoint as dcp

    folder = tempfile.mkdtemp(prefix=f"kvpop-ckpt-{step}-")
    try:
        dcp.save(_state(model, optimizer, trainable_only), checkpoint_id=folder)
        if rank == 0:
            Path(folder, STEP_FILE).write_text(json.dumps({"step": step, "run_name": config["run_name"]}))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ driver side
@dataclass
class TrainResult:
    run_name: str
    mlflow_run_id: str
    model_dir: Path
    run_dir: Path
    steps: int
    resumed_from: int
    metrics: dict
    targets: Path


def _strategy(cfg: PipelineConfig) -> tuple[str, str]:
    t = cfg.train
    strategy = t.strategy if t.strategy != "auto" else ("fsdp" if t.use_gpu or t.num_workers > 1 else "none")
    precision = t.precision if t.precision != "auto" else ("bf16" if t.use_gpu else "fp32")
    if precision == "bf16" and not t.use_gpu:
        raise ConfigError("train.precision=bf16 is for GPUs: use fp32 (or auto) on CPU")
    return strategy, precision


def run(cfg: PipelineConfig) -> TrainResult:
    """Train (or resume training) this config's student; returns where the model is and the last metrics."""
    from pipelines import tracking

    cfg = dataclasses.replace(cfg, home=str(cfg.home_dir()))
    strategy, precision = _strategy(cfg)
    targets = open_inputs(cfg)  # one clear error before anything is written
    name = run_name_of(cfg, targets.path.name)
    storage = runs_root(cfg)
    run_dir = storage / name
    final = run_dir / FINAL_MODEL
    record = final / TRAIN_RECORD
    if record.is_file() and json.loads(record.read_text()).get("steps") == cfg.train.steps:
        run_id = tracking.find_run(cfg, name, "train") or ""
        return TrainResult(name, run_id, final, run_dir, cfg.train.steps, cfg.train.steps, {}, targets.path)

    _check_resources(cfg)
    existing = tracking.find_run(cfg, name, "train")
    with tracking.run(cfg, name, stage="train", run_id=existing,
                      tags={"kvpop.targets": str(targets.path), "kvpop.strategy": strategy,
                            "kvpop.precision": precision}) as active:
        result = _fit(cfg, targets, name, storage, strategy, precision, active.info.run_id)
        import mlflow

        metrics = dict(result.metrics or {})
        if not final.is_dir():
            raise RuntimeError(f"training finished without writing {final}")
        mlflow.log_artifacts(str(final), artifact_path="model")
        mlflow.set_tag("kvpop.model_dir", str(final))
        return TrainResult(name, active.info.run_id, final, run_dir, cfg.train.steps,
                           int(metrics.get("resumed_from", 0)), metrics, targets.path)


def _check_resources(cfg: PipelineConfig) -> None:
    """Start/join Ray and make sure the workers leave CPUs to Ray Data (NOTES.md: the Train+Data deadlock)."""
    import ray

    from pipelines.cluster import ensure_ray

    ensure_ray(cfg)
    t = cfg.train
    cpus = ray.cluster_resources().get("CPU", 0)
    if t.num_workers * t.cpus_per_worker >= cpus:
        raise ConfigError(f"train.num_workers × train.cpus_per_worker = {t.num_workers * t.cpus_per_worker:g} CPUs "
                          f"leaves none of the cluster's {cpus:g} to Ray Data, which would hang: lower them or raise "
                          f"ray.num_cpus (logical CPUs may exceed the cores)")
    gpus = ray.cluster_resources().get("GPU", 0)
    if t.use_gpu and gpus < t.num_workers:
        raise ConfigError(f"train.use_gpu with {t.num_workers} workers needs {t.num_workers} GPUs; the cluster has "
                          f"{gpus:g}")


def _fit(cfg: PipelineConfig, targets, name: str, storage: Path, strategy: str, precision: str, run_id: str):
    return make_trainer(cfg, targets, name, storage, strategy, precision, run_id).fit()


def make_trainer(cfg: PipelineConfig, targets, name: str, storage: Path, strategy: str, precision: str, run_id: str,
                 *, callbacks: tuple = (), report_every_step: bool = False, save_final: bool = True):
    """The ``TorchTrainer`` of one training run (the train stage's, or one sweep trial's).

    ``name``/``storage``: Ray Train's run name and storage path (same pair → resume); ``run_id``: the MLflow run rank 0
    logs metric histories to; ``callbacks``: Ray Train callbacks (a sweep passes Tune's ``TuneReportCallback``);
    ``report_every_step``: ``ray.train.report`` the metrics every step, not only at checkpoints; ``save_final``:
    write ``<storage>/<name>/final_model`` at the end.
    """
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from pipelines.precompute import target_column

    t = cfg.train
    columns = ["input_ids", target_column(cfg.budget.window), "topk_values", "topk_indices"]
    files = [str(f) for f in targets.files]
    rows_needed = t.steps * t.batch_size * t.num_workers
    copies = -(-rows_needed // targets.num_rows) + 1  # epochs, in one pass (see _batches)
    dataset = ray.data.read_parquet(files * copies).select_columns(columns)
    loop_config = {"cfg": cfg.to_dict(), "teacher_path": str(cfg.model.resolved_path()), "run_name": name,
                   "run_dir": str(storage / name), "tracking_uri": cfg.tracking_uri(), "mlflow_run_id": run_id,
                   "strategy": strategy, "precision": precision, "report_every_step": report_every_step,
                   "save_final": save_final}
    ingest = ray.train.DataConfig.default_ingest_options()
    ingest.preserve_order = True  # the same batch order on a restart (a resumed run skips what it already saw)
    resources = {"CPU": t.cpus_per_worker, **({"GPU": 1} if t.use_gpu else {})}
    return TorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if t.use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=t.num_workers, use_gpu=t.use_gpu,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            name=name, storage_path=str(storage),
            failure_config=ray.train.FailureConfig(max_failures=t.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            callbacks=list(callbacks),
            worker_runtime_env={"env_vars": {**env_home(cfg), "OMP_NUM_THREADS": str(max(1, int(t.cpus_per_worker))),
                                             **({"NCCL_NVLS_ENABLE": "0"} if t.use_gpu else {})}}),
        datasets={"train": dataset},
        dataset_config=ray.train.DataConfig(execution_options=ingest),
    )


def _main() -> None:  # pragma: no cover - a convenience for manual runs; jobs/ hold the real CLIs
    import sys

    from pipelines.config import load_config

    args = sys.argv[1:]
    path = args[0] if args and not args[0].count("=") else None
    cfg = load_config(path, [a for a in args if "=" in a])
    print(run(cfg))


if __name__ == "__main__":  # pragma: no cover
    _main()
