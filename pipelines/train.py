"""Stage 2: train the retrofitted student on teacher targets with Ray Train (V2), tracked in MLflow.

``run(cfg)``, in the driver:

1. **Inputs, before anything is written** (:func:`open_inputs`): the target directory is ``train.targets`` or the
   one the precompute stage recorded for this config (:mod:`pipelines.records`); :func:`pipelines.store.open_targets`
   refuses it unless its identity matches this config (teacher weights, dtype, data, S, top-K, group reduction) and
   it holds ``budget.window``, is complete and intact — one :class:`~pipelines.store.TargetsError` line, no MLflow
   run, no run directory. An **online** run (``train.targets_source=online``: scorer-only, each step computes its own
   targets from the frozen base) reads the data stage's training sequences instead (:class:`OnlineSequences`).
   ``train.init_from`` (a saved scorer folder to start from) must hold scorers of this scorer and options, window
   and base weights (:func:`check_init_from`), and the held-out items of ``train.eval_every`` must exist
   (:func:`pipelines.heldout.check_heldout`), else one :class:`ConfigError` line.
2. The **stable run name** (``train.run_name`` or ``<config name>-<what trains>-<mode>-<budget>-<hash>``, what trains
   the scorer, ``dms`` or ``streaming+`` (``train.policy``: :func:`objective_of`), the hash over
   the targets (an online run: the identity its targets would have) and every setting that changes the
   optimisation — not over ``steps`` (unless the cosine schedule spans them), worker counts, precision, activation
   checkpointing, checkpoint cadence or held-out evaluation, so that a restart, a longer run or a run on other
   hardware resumes; with ``train.init_from``, its scorer weights' digest, not its path:
   :func:`pipelines.identity.init_identity`).
3. **Train** unless the run's final model already holds ``train.steps`` steps: the MLflow run found by name (else a
   new one, the whole config as params) receives the workers' metric histories; a ``TorchTrainer`` named after the
   run (:func:`make_trainer`; workers run :func:`pipelines.train_worker.train_loop` with a
   :class:`~pipelines.train_worker.TrainSpec`) resumes from the run's last checkpoint if there is one (a fresh run
   starts its scorers from ``train.init_from`` if set; a resumed one from its own checkpoint, whatever init_from).
   Fewer steps than the run's final model holds is refused: a run only grows. A run whose latest checkpoint fails
   its manifest (:func:`check_resumable`, :mod:`kvpop.checkpointing`) is refused in one line before anything starts;
   a failure while a FINISHED run trains further leaves it FINISHED (its model and record stay valid).
   The rows reach the workers as one Ray Dataset in the run's order (:mod:`pipelines.row_sequence`): file order
   every epoch, or — online, or with ``train.shuffle_seed`` — epoch after epoch in a seeded permutation
   (:func:`ordered_dataset`), so a resumed run skips exactly the batches it trained on.
4. **Commit, exactly once**: log the final model as the run's ``model`` artifact (unless already there) and, with
   ``train.eval_every``, the learning curve drawn from its held-out metrics (:data:`CURVE_ARTIFACT`), tag it,
   end the run ``FINISHED``, then write the train record — the commit point. A driver killed anywhere before the
   record leaves a final model without a record: the next run completes the same MLflow run instead of training.
   With a record for ``train.steps`` steps, ``run`` returns it without starting Ray.

The evaluate stage finds the trained model with :func:`trained_model_record` / :func:`model_dir`: one small JSON
read, no tokenizer, no weight hashing. :func:`make_spec` and :func:`make_trainer` also serve the sweep
(``pipelines/sweep.py``), one trainer per Tune trial.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvpop import checkpointing
from kvpop.allocation import ALLOCATION_FILE, Allocation, AllocationError, load_allocation
from kvpop.budget import Budget
from kvpop.objective import DMSObjective, Objective, StreamingObjective
from kvpop.retrofit import check_scorer_folder
from pipelines import records, store, tracking
from pipelines.cluster import ensure_ray, require_resources
from pipelines.config import ConfigError, PipelineConfig, config_path, env_home, fingerprint
from pipelines.curves import plot_learning_curve
from pipelines.data import load_sequences, load_tokenizer, sequences_dir
from pipelines.heldout import check_heldout
from pipelines.identity import file_digest, init_identity, tensors_digest
from pipelines.row_sequence import RowsByPosition
from pipelines.train_worker import TrainSpec, train_loop, trained_steps

FINAL_MODEL = "final_model"
CURVE_ARTIFACT = "learning_curve.png"  # the run's held-out learning curve (train.eval_every), beside final_model
RAY_CHECKPOINT_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train V2's record of a run's checkpoints
READ_ONCE_BYTES = 256 << 20  # targets up to this size on disk are read once per run, not once per epoch


# ------------------------------------------------------------------------------------------------ names and places
def runs_root(cfg: PipelineConfig) -> Path:
    root = cfg.train.output_root
    return config_path(root).resolve() if root else cfg.home_dir() / "runs"


@dataclass(frozen=True)
class OnlineSequences:
    """An online run's input (``train.targets_source=online``): the data stage's training split as token ids, and
    the identity of the targets its steps compute — what this config's precomputed targets would hold
    (:func:`pipelines.store.training_identity`: teacher weights and dtype, data, S, top-K, target definition)."""

    path: Path  # the data stage's sequence folder
    identity: dict
    input_ids: np.ndarray  # [N, S] int32, in the split's order

    @property
    def key(self) -> str:
        return fingerprint("kvpop.online", self.identity)

    @property
    def num_rows(self) -> int:
        return len(self.input_ids)


TrainInputs = store.Targets | OnlineSequences


def run_name_of(cfg: PipelineConfig, targets: TrainInputs) -> str:
    if cfg.train.run_name:
        return cfg.train.run_name
    allocation = train_allocation(cfg, targets.identity) if cfg.train.allocation else None
    extra = [] if allocation is None else [("allocation_sha256", fingerprint(allocation.to_json(), length=32))]
    digest = fingerprint("kvpop.train", targets.key, cfg.budget, cfg.train.optimisation(), cfg.data.seed,
                         *init_identity(cfg), *extra, length=10)
    budget = str(cfg.budget) if allocation is None else f"{cfg.budget}-{allocation.mode}"
    return f"{cfg.name}-{cfg.train.label}-{cfg.train.mode}-{budget}-{digest}"


def train_allocation(cfg: PipelineConfig, identity: dict) -> Allocation | None:
    """The per-head budgets ``train.allocation`` names (``None``: uniform), for the teacher of ``identity`` (the
    targets' or an online run's): ``allocate`` — this config's allocate record — or a folder holding
    ``kvpop_allocation.json``. Refused in one :class:`ConfigError` line if missing, of another shape (evicting
    layers × KV heads) or base model, or not a redistribution of ``budget``."""
    name = cfg.train.allocation
    if not name:
        return None
    if name == "allocate":
        record = records.for_config(cfg, "allocate")
        if record is None:
            raise ConfigError("train.allocation=allocate: no allocate record for this config: run the allocate stage "
                              "first (python -m jobs.allocate, same config)")
        folder = Path(record.payload["path"]).parent
    else:
        folder = config_path(name).resolve()
        folder = folder.parent if folder.name == ALLOCATION_FILE else folder
    try:
        allocation = load_allocation(folder, num_layers=identity["num_layers"], num_kv_heads=identity["num_kv_heads"],
                                     weights_sha256=identity["teacher"]["weights_sha256"])
        allocation.check_budget(cfg.budget)
    except AllocationError as err:
        raise ConfigError(f"train.allocation: {err}") from None
    return allocation


def targets_path(cfg: PipelineConfig) -> Path:
    """``train.targets``, else the directory the precompute stage recorded for this config."""
    if cfg.train.targets:
        return config_path(cfg.train.targets).resolve()
    record = records.for_config(cfg, "precompute")
    if record is None:
        raise store.TargetsError(f"no precomputed targets for config {cfg.name!r} (no precompute record under "
                                 f"{cfg.home_dir() / records.RECORDS}): run the precompute stage for this config "
                                 f"first (python -m jobs.precompute), or set train.targets")
    return Path(record.payload["path"])


def trained_model_record(cfg: PipelineConfig) -> records.Record:
    """The train stage's committed record for this config (its run, model folder, MLflow run id, steps)."""
    record = records.for_config(cfg, "train")
    if record is None:
        raise ConfigError(f"no trained retrofitted model for config {cfg.name!r} (no train record under "
                          f"{cfg.home_dir() / records.RECORDS}): run the train stage first, or set eval.checkpoint to "
                          f"a folder written by kvpop.save_retrofitted")
    return record


def model_dir(cfg: PipelineConfig) -> Path:
    """Where this config's trained retrofitted model is (``kvpop.load_retrofitted`` reads it)."""
    return Path(trained_model_record(cfg).payload["model_dir"])


# ------------------------------------------------------------------------------------------------ validation
def check_trainable(cfg: PipelineConfig, rows: int | None = None) -> None:
    """A KVpop budget has a decision to learn (DMS and StreamingLLM+ need no top-k slots), and the targets (``rows``
    sequences, if known) fill a batch per worker."""
    if cfg.train.policy == "kvpop" and cfg.budget.topk < 1:
        raise ConfigError("budget.topk is 0: every eligible token is evicted, there is no decision to learn")
    if rows is not None and rows // cfg.train.num_workers // cfg.train.batch_size < 1:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} × train.num_workers={cfg.train.num_workers} needs "
                          f"more than the {rows} precomputed sequences: lower them or precompute more "
                          f"(data.num_sequences)")


def check_init_from(cfg: PipelineConfig, base_sha256: str) -> str | None:
    """``train.init_from``'s scorer weights digest (None without it), after checking that the folder holds scorers
    of ``train.scorer`` with exactly ``train.scorer_options``, at ``budget.window``, on the base weights
    ``base_sha256`` — or, where the folder names its base by identity, on ``model.path``'s tensors
    (:func:`kvpop.retrofit.check_scorer_folder`): else one :class:`ConfigError` line."""
    t = cfg.train
    if t.init_from is None:
        return None
    try:
        return check_scorer_folder(config_path(t.init_from), scorer=t.scorer,
                                   scorer_options=dict(t.scorer_options), window=cfg.budget.window,
                                   base_sha256=base_sha256,
                                   base_tensors_sha256=tensors_digest(cfg.model.resolved_path(), cfg.home_dir()),
                                   digest=lambda f: file_digest(f, cfg.home_dir()))
    except (OSError, ValueError) as err:
        raise ConfigError(f"train.init_from {t.init_from}: {err}") from None


def open_inputs(cfg: PipelineConfig, windows: tuple[int, ...] | None = None) -> TrainInputs:
    """The verified targets for this config, or one clear error (nothing is written before this passes).

    Every policy reads the teacher's top-K logits (the store refuses targets without them); only ``kvpop`` reads a
    future-attention target column (``budget.window``'s, or ``windows``'). An online run reads the data stage's
    training sequences instead (:class:`OnlineSequences`; the data stage caches them on first use).
    """
    check_trainable(cfg)
    if cfg.train.online:
        tokenizer = load_tokenizer(cfg)
        identity = store.training_identity(cfg, tokenizer)
        rows = load_sequences(cfg, "train", tokenizer)
        check_trainable(cfg, len(rows))
        check_init_from(cfg, identity["teacher"]["weights_sha256"])
        train_allocation(cfg, identity)
        if cfg.train.eval_every:
            check_heldout(cfg, tokenizer)
        return OnlineSequences(sequences_dir(cfg, tokenizer), identity,
                               np.asarray([r["input_ids"] for r in rows], dtype=np.int32))
    path = targets_path(cfg)
    if cfg.train.policy == "kvpop":
        windows = windows or (cfg.budget.window,)
    targets = store.open_targets(path, expect=store.training_identity(cfg, load_tokenizer(cfg)), windows=windows or ())
    check_trainable(cfg, targets.num_rows)
    check_init_from(cfg, targets.identity["teacher"]["weights_sha256"])
    train_allocation(cfg, targets.identity)
    if cfg.train.eval_every:
        check_heldout(cfg)
    return targets


# ------------------------------------------------------------------------------------------------ the trainer
def objective_of(cfg: PipelineConfig, allocation: Allocation | None = None
                 ) -> Objective | DMSObjective | StreamingObjective:
    """The loss of ``train.policy`` at this config's budget: KVpop's (METHOD §3; each head at its own cutoff under
    ``allocation``, METHOD §7); DMS's on ``Budget(sink, window, 0)`` (its window is the delayed-eviction window);
    StreamingLLM+'s KL at the streaming budget of the same total B (the window takes the top-k slots, as
    :func:`kvpop.policies.build_policy` converts it)."""
    t, budget = cfg.train, cfg.budget
    if t.policy == "dms":
        return DMSObjective(Budget(budget.sink, budget.window, 0), t.dms_schedule(), keep_weight=t.dms_keep_weight)
    if t.policy == "streaming":
        return StreamingObjective(Budget(budget.sink, budget.window + budget.topk, 0))
    weight = None if t.loss_weight == "none" else t.loss_weight
    return Objective(budget, t.recency, beta=t.beta, tau=t.tau, weight=weight, extra_topks=t.extra_topks,
                     head_topk=None if allocation is None else allocation.head_topk())


def make_spec(cfg: PipelineConfig, targets: TrainInputs, name: str, storage: Path, mlflow_run_id: str, *,
              report_every_step: bool = False, save_final: bool = True) -> TrainSpec:
    """The workers' spec of one training run (the train stage's, or one sweep trial's)."""
    t = cfg.train
    online = isinstance(targets, OnlineSequences)
    allocation = train_allocation(cfg, targets.identity)
    return TrainSpec(
        run_name=name, run_dir=str(storage / name), base_path=str(cfg.model.resolved_path()),
        base_sha256=targets.identity["teacher"]["weights_sha256"],
        base_tensors_sha256=tensors_digest(cfg.model.resolved_path(), cfg.home_dir()),
        objective=objective_of(cfg, allocation), allocation=allocation,
        policy=t.policy, scorer=t.scorer, scorer_options=dict(t.scorer_options) if t.policy == "kvpop" else {},
        mode=t.mode,
        target_column=store.target_column(cfg.budget.window) if t.policy == "kvpop" and not online else "",
        dms_temperature=t.dms_temperature,
        lr=t.lr, base_lr=t.base_lr, grad_clip=t.grad_clip, steps=t.steps, batch_size=t.batch_size,
        seq_len=cfg.data.seq_len, seed=cfg.data.seed, use_gpu=t.use_gpu, sharded=t.resolved_strategy == "fsdp",
        bf16=t.resolved_precision == "bf16", activation_checkpointing=t.activation_checkpointing,
        threads=max(1, int(t.cpus_per_worker)),
        checkpoint_every=t.checkpoint_every, log_every=t.log_every, fail_at_step=t.fail_at_step,
        tracking_uri=cfg.tracking_uri(), mlflow_run_id=mlflow_run_id, report_every_step=report_every_step,
        save_final=save_final, init_from=str(config_path(t.init_from).resolve()) if t.init_from else "",
        online=online, target_options=cfg.precompute.target_options() if online else {},
        top_k=cfg.precompute.top_k if online else 0, online_features=t.online_features,
        warmup_steps=t.warmup_steps, schedule=t.schedule, eval_every=t.eval_every, eval_config=cfg.to_dict() if t.eval_every else {},
        profile_steps=tuple(t.profile_steps))


def training_dataset(targets: store.Targets, columns: list[str], copies: int):
    """``copies`` epochs of the target rows in file order, one Ray Dataset (the trainer reads it with
    ``preserve_order``, so a resumed run can skip exactly the batches it trained on). Targets up to
    :data:`READ_ONCE_BYTES` on disk are read once, by this process, into one block of the object store (one remote
    task computes its metadata), and every epoch is that block. Streamed instead, each epoch's reads started only
    when the trainer asked for them and stalled it (~8 s per epoch on 2 cores, 106 s of ``make run``'s 90 steps), and
    Ray Data's Parquet reader starts a pool of footer-reading actors per read (up to 32 processes, ~2 CPU-s each):
    more work than a small store's rows. Larger targets stream through :func:`ordered_dataset`: a union of
    several-block datasets would interleave the epochs block by block (each block three times in a row for three
    epochs), not epoch after epoch."""
    import ray

    files = [str(f) for f in targets.files]
    if sum(os.path.getsize(f) for f in files) > READ_ONCE_BYTES:
        return ordered_dataset(targets, columns, copies * targets.num_rows, seed=None)
    with _order_preserved():
        once = ray.data.from_arrow(pa.concat_tables([pq.read_table(f, columns=columns) for f in files]))
        return once.union(*[once] * (copies - 1)) if copies > 1 else once  # one block each: epoch after epoch


@contextlib.contextmanager
def _order_preserved():
    """Datasets made inside keep their blocks in order (a Dataset keeps the Ray Data context it was made in); the
    driver's own setting is restored after."""
    from ray.data import DataContext

    options = DataContext.get_current().execution_options
    before, options.preserve_order = options.preserve_order, True
    try:
        yield
    finally:
        options.preserve_order = before


def ordered_dataset(targets: TrainInputs, columns: list[str], rows_needed: int, seed: int | None):
    """The first ``rows_needed`` rows of the run's row sequence (:mod:`pipelines.row_sequence`) as one Ray Dataset,
    in order (the trainer reads it with ``preserve_order``, so a resumed run skips exactly the batches it trained
    on)."""
    import ray

    if isinstance(targets, OnlineSequences):
        rows = RowsByPosition(targets.num_rows, seed, columns, ids_ref=ray.put(targets.input_ids))
    else:
        rows = RowsByPosition(targets.num_rows, seed, columns, files=[str(f) for f in targets.files],
                               file_rows=[r.rows for r in targets.records])
    with _order_preserved():
        return ray.data.range(rows_needed).map_batches(rows, batch_format="numpy", batch_size=64)


def make_trainer(cfg: PipelineConfig, targets: TrainInputs, spec: TrainSpec, *, callbacks: tuple = ()):
    """The ``TorchTrainer`` of one run: Ray Train's run name and storage are ``spec.run_dir`` (same pair → resume);
    ``callbacks``: Ray Train callbacks (a sweep passes Tune's ``TuneReportCallback``)."""
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    t = cfg.train
    columns = (["input_ids"] if spec.online else  # an online step computes the rest from the ids
               ["input_ids", *([spec.target_column] if spec.target_column else []), "topk_values", "topk_indices"])
    rows_needed = t.steps * t.batch_size * t.num_workers
    if spec.online or t.shuffle_seed is not None:  # one spare batch per worker: every worker's last step is full
        dataset = ordered_dataset(targets, columns, rows_needed + t.batch_size * t.num_workers, t.shuffle_seed)
    else:
        copies = -(-rows_needed // targets.num_rows) + 1  # epochs, in one pass (see train_worker._batches)
        dataset = training_dataset(targets, columns, copies)
    ingest = ray.train.DataConfig.default_ingest_options()
    ingest.preserve_order = True  # the same batch order on a restart (a resumed run skips what it already saw)
    resources = {"CPU": t.cpus_per_worker, **({"GPU": 1} if t.use_gpu else {})}
    run_dir = Path(spec.run_dir)
    return TorchTrainer(
        train_loop,
        # pickled here: Ray Train's controller process unpickles its config, and a TrainSpec would import this
        # stage's worker module (transformers + kvpop: ~4 CPU-s more than the controller needs, per run)
        train_loop_config={"spec": pickle.dumps(spec)},
        torch_config=TorchConfig(backend="nccl" if t.use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=t.num_workers, use_gpu=t.use_gpu,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            name=run_dir.name, storage_path=str(run_dir.parent),
            failure_config=ray.train.FailureConfig(max_failures=t.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            callbacks=list(callbacks),
            worker_runtime_env={"env_vars": {
                **env_home(cfg), "OMP_NUM_THREADS": str(spec.threads),
                # Ray Train V2 patches print() in its workers to print *and* log each line: every progress line
                # reached the console twice
                "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
                **({"NCCL_NVLS_ENABLE": "0"} if t.use_gpu else {})}}),
        datasets={"train": dataset},
        # one worker iterates the whole dataset itself: a split would start a coordinator actor for nothing
        dataset_config=ray.train.DataConfig(datasets_to_split="all" if t.num_workers > 1 else [],
                                            execution_options=ingest),
    )


# ------------------------------------------------------------------------------------------------ the stage
@dataclass
class TrainResult:
    run_name: str
    mlflow_run_id: str
    model_dir: Path
    run_dir: Path
    steps: int
    resumed_from: int
    metrics: dict
    targets: Path  # the stored targets, or (online) the data stage's sequence folder


def _join_cluster(cfg: PipelineConfig) -> None:
    ensure_ray(cfg)
    t = cfg.train
    require_resources("train.num_workers × train.cpus_per_worker", t.num_workers * t.cpus_per_worker,
                      t.num_workers if t.use_gpu else 0)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint folder Ray Train hands a restarted run (the latest in its checkpoint manager's snapshot), or
    None if the run has none."""
    try:
        snapshot = json.loads((run_dir / RAY_CHECKPOINT_SNAPSHOT).read_text())
        name = snapshot["latest_checkpoint_result"]["checkpoint_dir_name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return run_dir / name


def check_resumable(run_dir: Path) -> None:
    """The run's latest checkpoint, if any, is intact (:func:`kvpop.checkpointing.verify`), else one
    :class:`ConfigError` saying what to do — before Ray starts, MLflow is touched or anything is unpickled. A damaged
    checkpoint is refused rather than skipped: Ray Train resumes from its latest one only."""
    folder = latest_checkpoint(run_dir)
    if folder is None:
        return
    try:
        checkpointing.verify(folder)
    except checkpointing.CheckpointError as err:
        raise ConfigError(f"{err}: this run cannot resume from it; nothing was trained. Delete {run_dir} to train "
                          f"the run again from step 0, or set train.run_name to train a new run") from None


def _fit(cfg: PipelineConfig, targets: TrainInputs, name: str, run_id: str) -> dict:
    """Train the run to ``train.steps`` (resuming from its last checkpoint); the last metrics. Marks the MLflow run
    FAILED if training fails — unless it was FINISHED (a finished run asked for more steps: its model and record
    are still intact, and say so)."""
    import mlflow

    client = mlflow.MlflowClient(cfg.tracking_uri())
    before = client.get_run(run_id).info.status
    client.update_run(run_id, status="RUNNING")
    spec = make_spec(cfg, targets, name, runs_root(cfg), run_id)
    try:
        result = make_trainer(cfg, targets, spec).fit()
    except BaseException:
        client.set_terminated(run_id, "FINISHED" if before == "FINISHED" else "FAILED")
        raise
    return dict(result.metrics or {})


def _complete_tracking(cfg: PipelineConfig, run_id: str, final: Path) -> None:
    """The run's ``model`` artifact, its tag and ``FINISHED``; each step is idempotent (a re-run after a crash
    redoes what is missing)."""
    import mlflow

    client = mlflow.MlflowClient(cfg.tracking_uri())
    logged = {Path(a.path).name for a in client.list_artifacts(run_id, "model")}
    if not {p.name for p in final.iterdir() if p.is_file()} <= logged:
        client.log_artifacts(run_id, str(final), artifact_path="model")
    if cfg.train.eval_every and not any(a.path == CURVE_ARTIFACT for a in client.list_artifacts(run_id)):
        figure = plot_learning_curve(run_id, cfg.tracking_uri(), final.parent / CURVE_ARTIFACT)
        if figure is not None:
            client.log_artifact(run_id, str(figure))
    records.crash_point("train.artifact_logged")
    client.set_tag(run_id, "kvpop.model_dir", str(final))
    client.set_terminated(run_id, "FINISHED")
    records.crash_point("train.run_finished")


def run(cfg: PipelineConfig) -> TrainResult:
    """Train (or resume, or finish committing) this config's student; returns where the model is and its metrics."""
    cfg = dataclasses.replace(cfg, home=str(cfg.home_dir()))
    targets = open_inputs(cfg)  # one clear error before anything is written
    name = run_name_of(cfg, targets)
    run_dir = runs_root(cfg) / name
    final = run_dir / FINAL_MODEL
    steps = cfg.train.steps
    done = trained_steps(final)
    committed = records.for_config(cfg, "train")
    if (committed is not None and committed.payload["run_name"] == name and committed.payload["steps"] == steps
            and done == steps):
        return TrainResult(name, committed.payload["mlflow_run_id"], final, run_dir, steps, steps, {}, targets.path)
    if done is not None and done > steps:
        raise ConfigError(f"run {name} has already trained {done} steps and train.steps={steps} asks for fewer: set "
                          f"train.steps={done} to use that run, or set train.run_name to train a new run")

    if done != steps:
        check_resumable(run_dir)
        _join_cluster(cfg)  # before the MLflow run: a cluster that cannot train leaves nothing behind
    run_id = tracking.find_run(cfg, name, "train") or tracking.create_run(
        cfg, name, stage="train", tags={"kvpop.targets": str(targets.path),
                                        "kvpop.strategy": cfg.train.resolved_strategy,
                                        "kvpop.precision": cfg.train.resolved_precision})
    metrics: dict = {}
    if done == steps:
        print(f"[kvpop.train] {name} already holds {steps} trained steps: completing its MLflow run {run_id}",
              flush=True)
    else:
        metrics = _fit(cfg, targets, name, run_id)
        if trained_steps(final) != steps:
            raise RuntimeError(f"training finished without writing {final} for {steps} steps")
    records.crash_point("train.fitted")
    _complete_tracking(cfg, run_id, final)
    records.commit(cfg, "train", {"run_name": name, "model_dir": str(final), "mlflow_run_id": run_id, "steps": steps,
                                  "targets": str(targets.path), "mode": cfg.train.mode,
                                  "policy": cfg.train.policy,
                                  **({"targets_source": "online"} if cfg.train.online else {})})
    return TrainResult(name, run_id, final, run_dir, steps, int(metrics.get("resumed_from", steps)), metrics,
                       targets.path)
