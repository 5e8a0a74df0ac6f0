"""Pipeline configuration: YAML presets mapped onto frozen dataclasses, overridable with ``--set key=value``.

Every stage reads one :class:`PipelineConfig`. Each section checks its own values as it is built (``__post_init__``;
the ``budget`` section is :class:`kvpop.Budget` itself) and :class:`PipelineConfig` checks the rules between sections.
Unknown keys, wrong types and failed checks are :class:`ConfigError`s (:mod:`pipelines.schema` builds the dataclasses
from YAML; the CLIs turn the error into a one-line message and exit code 2). :func:`fingerprint` hashes the parts of
a config a stage's output depends on, so outputs live under paths that never mix two configurations.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from kvpop.allocation import MODES as ALLOCATION_MODES
from kvpop.budget import Budget
from kvpop.dms import CompressionSchedule
from kvpop.names import FEATURE_SOURCES as ONLINE_FEATURES, TRAIN_MODES, TRAIN_POLICIES
from kvpop.policies import ALLOCATABLE as ALLOCATED_POLICIES, POLICIES
from kvpop.profiling import check_profile_steps
from kvpop.scorers import SCORERS
from kvpop.targets import check_query_power
from pipelines.models import REPO_ROOT, kvpop_home, smollm2_dir
from pipelines.offline import OFFLINE_ENV
from pipelines.schema import ConfigError, build, parse_override, set_path
from pipelines.recall.spec import TASKS  # the recall-task registry: imports no pipeline stage


@dataclass(frozen=True)
class ModelConfig:
    path: str = "smollm2"  # a local HF folder, or "smollm2" for the prepared SmolLM2-135M-Instruct
    dtype: str = "float32"  # float32 | bfloat16 | float16

    def __post_init__(self):
        _require([(self.dtype in ("float32", "bfloat16", "float16"), "model.dtype must be float32, bfloat16 or float16")])

    def resolved_path(self) -> Path:
        return smollm2_dir() if self.path == "smollm2" else config_path(self.path)


class OptionalSettings:
    """A config section whose :attr:`OPTIONAL` settings came after outputs keyed by it existed: they enter an output's
    identity and key only away from their default (:func:`fingerprint` hashes the section without them there), so the
    outputs made before them keep their keys; a reader takes an absent one as its default."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def optional_defaults(cls) -> dict:
        return {f.name: f.default for f in dataclasses.fields(cls) if f.name in cls.OPTIONAL}

    def optional_settings(self) -> dict:
        """The :data:`OPTIONAL` settings that differ from their default."""
        return {k: getattr(self, k) for k, default in self.optional_defaults().items() if getattr(self, k) != default}


@dataclass(frozen=True)
class DataConfig(OptionalSettings):
    source: str = "champ"  # "champ" (packaged math transcripts), "stdlib" (CPython's .py sources), a local dataset
    #                        folder / .jsonl / .parquet, or a hub name (see pipelines/data.py)
    text_field: str = "text"
    id_field: str = ""  # column holding a stable document id; "" = the row number (champ: problem/transcript)
    split: str = "train"
    seq_len: int = 512
    num_sequences: int = 16  # training sequences (SmolLM2 teacher on 2 busy CPU cores: ~4 s per 512-token sequence)
    eval_sequences: int = 8  # held-out sequences (disjoint documents): the items of the evaluation's intervals
    packing: bool = True  # concatenate documents with EOS and cut into seq_len pieces; else truncate/drop short docs
    seed: int = 0
    recall_mix: float = 0.0  # fraction of the training sequences given early facts and a question on one of them at
    #                          the end (pipelines/planted.py); held-out sequences never
    mix_source: str | None = None  # a second training corpus (a data.source value): mix_sequences of its training
    #                                split follow the source's in the training split (ids "mix-…"); its held-out
    #                                documents never enter training, and the eval split stays the source's own
    mix_sequences: int = 0

    OPTIONAL: ClassVar[tuple[str, ...]] = ("recall_mix", "mix_source", "mix_sequences")

    def __post_init__(self):
        _require([(self.seq_len >= 8, "data.seq_len must be >= 8"),
                  ((self.mix_source is None) == (self.mix_sequences == 0) and self.mix_sequences >= 0,
                   "data.mix_source and data.mix_sequences go together: a second corpus and how many (>= 1) of its "
                   "training sequences join the training split"),
                  (self.mix_source is None or self.mix_source != self.source,
                   f"data.mix_source {self.mix_source!r} is data.source itself: mix in another corpus"),
                  (self.num_sequences >= 1, "data.num_sequences must be >= 1"),
                  (self.eval_sequences >= 0, "data.eval_sequences must be >= 0"),
                  (0 <= self.recall_mix <= 1, f"data.recall_mix must be in [0, 1] (the fraction of training sequences "
                                              f"given a planted fact), got {self.recall_mix}")])


WORKDIR_ENV = "KVPOP_WORKDIR"  # the directory a config's relative paths are read from (config_path)
DEFAULT_BUDGET = Budget(sink=4, window=64, topk=32)  # the default run's B = 100 of S = 512 (CR 80%)
HELDOUT_REFERENCES = ("streaming", "oracle", "dense")  # pipelines.heldout's references: heldout.<policy>.<metric>


@dataclass(frozen=True)
class PrecomputeConfig(OptionalSettings):
    windows: tuple[int, ...] = (64,)  # targets depend on the window only (METHOD §2)
    top_k: int = 64  # teacher top-K logits kept for distillation
    group_reduce: str = "max"
    query_power: float = 1.0  # β of the power mean over the deciding queries (METHOD §2): 1 = the mean
    sequences_per_shard: int = 4
    batch_size: int = 1
    num_actors: int = 1  # teacher actors in the Ray Data actor pool
    num_gpus_per_actor: float = 0.0  # > 0: the teacher runs on CUDA (GPU clusters); 0: on CPU
    num_cpus_per_actor: float = 2.0  # Ray CPUs per teacher actor; also its torch thread count
    output_root: str = ""  # default: $KVPOP_HOME/targets

    def __post_init__(self):
        _require([(all(w >= 1 for w in self.windows), "precompute.windows must all be >= 1"),
                  (self.top_k >= 1, "precompute.top_k must be >= 1"),
                  (self.group_reduce in ("max", "mean", "sum"), "precompute.group_reduce must be max, mean or sum"),
                  (self.sequences_per_shard >= 1, "precompute.sequences_per_shard must be >= 1"),
                  (self.batch_size >= 1 and self.num_actors >= 1, "precompute.batch_size and precompute.num_actors "
                                                                  "must be >= 1")])
        try:
            object.__setattr__(self, "query_power", check_query_power(self.query_power))  # 8 and 8.0: one key
        except ValueError as err:
            raise ConfigError(f"precompute.{err}") from None

    OPTIONAL: ClassVar[tuple[str, ...]] = ("query_power",)  # came after targets were first stored

    def target_options(self) -> dict:
        """The target definition (METHOD §2) as :func:`kvpop.targets.teacher_pass` and the oracle take it: what a
        scorer trained on these targets is evaluated and diagnosed against."""
        return {"group_reduce": self.group_reduce, "query_power": self.query_power}


@dataclass(frozen=True)
class AllocateConfig:
    """pipelines/allocate.py: per-(layer, KV head) budgets from the stored targets (kvpop/allocation.py, METHOD §7)."""
    mode: str = "per_head"  # per_head | per_layer (one budget per layer, for engines whose pools differ by layer)
    mean_budget: int = 0  # B, the mean tokens per head (Σ budgets = layers × kv_heads × B); 0: budget.total
    query_stride: int = 16  # calibration queries per sequence: S-1, S-1-stride, … (1: every query)
    sequences: int = 0  # calibration sequences: the first N of the stored targets; 0: all
    output_root: str = ""  # default: $KVPOP_HOME/allocations

    def __post_init__(self):
        _require([(self.mode in ALLOCATION_MODES, f"allocate.mode must be one of {', '.join(ALLOCATION_MODES)}"),
                  (self.mean_budget >= 0, "allocate.mean_budget must be >= 0 (0: budget.total)"),
                  (self.query_stride >= 1, "allocate.query_stride must be >= 1"),
                  (self.sequences >= 0, "allocate.sequences must be >= 0 (0: all stored sequences)")])

    def resolved_mean_budget(self, budget: Budget) -> int:
        return self.mean_budget or budget.total


@dataclass(frozen=True)
class TrainConfig:
    policy: str = "kvpop"  # kvpop (scorers, budget.*) | dms (DMS gates, Budget(sink, window, 0)) | streaming
    #                        (StreamingLLM+: the base trained under the sinks + window mask at budget B; mode=distill)
    scorer: str = "mlstm"  # policy kvpop only (dms trains its gates, streaming none)
    scorer_options: dict = field(default_factory=dict)
    mode: str = "scorer_only"  # scorer_only (base frozen) | distill (base trains too, at base_lr)
    beta: float = 1.0  # L = KL + beta * L_ret
    tau: float = 1.0
    recency: float = 0.0
    loss_weight: str = "none"  # none | margin | mass (kvpop.losses.boundary_loss)
    extra_topks: tuple[int, ...] = ()  # more long-range sizes trained at once (same sink + window): L_ret averages
    #                                    their boundary losses with budget.topk's (METHOD §3, several budgets)
    lr: float = 1e-2
    base_lr: float = 1e-5  # for the base model in distill mode
    steps: int = 90  # SmolLM2, S=512, batch 2, mlstm scorer-only: ~3 s a step on 2 CPU cores
    batch_size: int = 2  # sequences per worker per step
    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: float = 2.0  # Ray CPUs per training worker (its torch threads); logical CPUs, see ray.num_cpus
    strategy: str = "auto"  # auto | fsdp | none; auto = FSDP2 (fully_shard per decoder layer) on GPUs or >1 worker
    precision: str = "auto"  # auto | fp32 | bf16; auto = bf16 compute on GPUs (fp32 master weights), fp32 on CPU
    activation_checkpointing: bool = False  # each decoder layer of the student keeps only its inputs for the backward
    #     and runs its forward again there (kvpop.sharding.checkpoint_layers), in either mode: the same loss and
    #     gradients for about one more forward per step; what lets distillation at long S fit one GPU
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    checkpoint_every: int = 10  # steps between torch.distributed.checkpoint saves (and the last step)
    max_failures: int = 1  # Ray Train FailureConfig: worker-group restarts from the last checkpoint
    log_every: int = 1  # steps between MLflow metric points / progress lines
    targets: str = ""  # a precomputed target directory; default: the one the precompute stage recorded for this config
    fail_at_step: int = 0  # fault injection for drills/tests: raise once per run at this step (0 = never)
    run_name: str = ""  # default: derived from the config hash, so a restart resumes
    output_root: str = ""  # default: $KVPOP_HOME/runs
    dms_keep_rate: float = 0.25  # policy dms: the final target keep-rate of decided tokens (1 / compression ratio)
    dms_schedule_steps: int = 60  # policy dms: steps over which CR anneals linearly from 1 (<= train.steps; 0: none)
    dms_temperature: float = 0.1  # policy dms: the Gumbel-sigmoid temperature of the relaxed gates
    dms_keep_weight: float = 1.0  # policy dms: weight of the one-sided keep-rate penalty
    init_from: str | None = None  # policy kvpop: a saved scorer folder (kvpop.json + kvpop_scorers.safetensors, e.g.
    #     another run's final_model) whose scorers a fresh run starts from: fine-tuning. Same scorer and options, same
    #     budget.window, same base weights (checked before training); a run resuming its own checkpoint ignores it.
    #     The run's identity holds the folder's scorer weights digest, not its path (pipelines.identity.init_identity)
    targets_source: str = "stored"  # stored (the precompute stage's targets) | online (policy kvpop, scorer_only: the
    #     frozen base is the teacher, each step runs its dense pass + the transposed target pass; no precompute stage)
    online_features: str = "student"  # online: what the scorers read — student (the keys and values of the student's
    #     own sparse forward, as on stored targets) | dense (those of the step's dense teacher pass: one forward less,
    #     the scorers' inputs as dense attention saw them; the KL of the sparse forward is then not measured)
    warmup_steps: int = 0  # the learning rate rises linearly over these first steps (lr * step / warmup_steps)
    schedule: str = "constant"  # constant | cosine (after the warm-up, lr decays to 0 over the run's train.steps:
    #     then train.steps is part of what is optimised, and a cosine run is not lengthened by resuming it)
    shuffle_seed: int | None = None  # null: rows in file order every epoch; an int: epoch e reads the rows in a
    #     permutation drawn from (shuffle_seed, e) (pipelines.row_sequence.epoch_permutation)
    eval_every: int = 0  # held-out evaluation every this many steps (and at the last), logged as the run's MLflow
    #     metrics heldout.* (pipelines.heldout); 0 = none
    eval_sequences: int = 0  # held-out sequences it evaluates: the first N of the data stage's eval split (0 = all
    #     data.eval_sequences)
    eval_recall_samples: int = 0  # samples per recall cell (eval.tasks x eval.task_contexts x eval.task_depths) it
    #     also measures greedy exact match on (heldout.recall_exact: headline cells); 0 = none
    eval_heldout_sources: bool = False  # it also evaluates each eval.heldout_sources corpus's held-out split (the
    #     first eval_sequences sequences; text metrics), logged as heldout.<corpus>.*: the curve out of domain too
    profile_steps: tuple[int, ...] = ()  # [first, count]: torch.profiler around steps first … first + count - 1 on
    #     rank 0 (kvpop.profiling.StepProfiler): ops and kernels per step, host vs device time, device→host syncs by
    #     source line, top operators; written as <run dir>/step_profile.md and the run's MLflow artifact. []: off
    allocation: str = ""  # policy kvpop: train at per-(layer, KV head) budgets (METHOD §7): "allocate" = this config's
    #     allocate stage's (python -m jobs.allocate; allocate.mean_budget must be budget.total), or a folder holding
    #     kvpop_allocation.json; "": every head at budget.*. The run's keys hold the allocation's digest

    DMS_KEYS: ClassVar[tuple[str, ...]] = ("dms_keep_rate", "dms_schedule_steps", "dms_temperature", "dms_keep_weight")
    KVPOP_KEYS: ClassVar[tuple[str, ...]] = ("scorer", "scorer_options", "beta", "tau", "recency", "loss_weight",
                                             "extra_topks")
    # settings that do not change what is optimised: left out of the run-name hash so a restart resumes
    OPERATIONAL: ClassVar[tuple[str, ...]] = (
        "steps", "num_workers", "use_gpu", "cpus_per_worker", "strategy", "precision", "activation_checkpointing",
        "checkpoint_every", "max_failures", "log_every", "targets", "fail_at_step", "run_name", "output_root",
        "eval_every", "eval_sequences", "eval_recall_samples", "eval_heldout_sources", "profile_steps")
    # settings that came after runs were first named: in the run-name hash only away from their default
    LATER: ClassVar[dict[str, Any]] = {"targets_source": "stored", "online_features": "student", "warmup_steps": 0,
                                       "schedule": "constant", "shuffle_seed": None, "allocation": ""}

    def __post_init__(self):
        _require([
            (self.scorer in SCORERS, f"train.scorer: unknown scorer {self.scorer!r}; known: {', '.join(sorted(SCORERS))}"),
            (self.mode in TRAIN_MODES, f"train.mode must be one of {', '.join(TRAIN_MODES)}"),
            (self.loss_weight in ("none", "margin", "mass"), "train.loss_weight must be none, margin or mass"),
            (self.strategy in ("auto", "fsdp", "none"), "train.strategy must be auto, fsdp or none"),
            (self.precision in ("auto", "fp32", "bf16"), "train.precision must be auto, fp32 or bf16"),
            (self.precision != "bf16" or self.use_gpu, "train.precision=bf16 is for GPUs: use fp32 (or auto) on CPU"),
            (self.num_workers >= 1 and self.checkpoint_every >= 1 and self.log_every >= 1,
             "train.num_workers, train.checkpoint_every and train.log_every must be >= 1"),
            (self.steps >= 1 and self.batch_size >= 1, "train.steps and train.batch_size must be >= 1"),
            (self.tau > 0 and self.lr > 0, "train.tau and train.lr must be > 0"),
            (self.recency >= 0, "train.recency must be >= 0"),
            (all(k >= 1 for k in self.extra_topks), "train.extra_topks must be long-range sizes >= 1"),
            (not self.extra_topks or self.policy == "kvpop", "train.extra_topks is for train.policy=kvpop"),
            (self.cpus_per_worker > 0, "train.cpus_per_worker must be > 0"),
            (self.policy in TRAIN_POLICIES, f"train.policy must be one of {', '.join(TRAIN_POLICIES)}"),
            (self.policy != "streaming" or self.mode == "distill",
             "train.policy=streaming (StreamingLLM+) trains the base model: set train.mode=distill"),
            (self.init_from is None or (self.policy == "kvpop" and bool(self.init_from)),
             "train.init_from is a saved scorer folder for train.policy=kvpop (null: scorers start fresh)"),
            (self.dms_temperature > 0 and self.dms_keep_weight >= 0,
             "train.dms_temperature must be > 0 and train.dms_keep_weight >= 0"),
            (self.targets_source in ("stored", "online"), "train.targets_source must be stored or online"),
            (self.targets_source != "online" or (self.policy == "kvpop" and self.mode == "scorer_only"),
             "train.targets_source=online needs train.policy=kvpop and train.mode=scorer_only (the frozen base is the "
             "teacher): distill and the baselines train on stored targets"),
            (self.targets_source != "online" or not self.targets,
             "train.targets names stored targets: drop it for train.targets_source=online"),
            (self.online_features in ONLINE_FEATURES, f"train.online_features must be one of "
                                                       f"{', '.join(ONLINE_FEATURES)}"),
            (self.online_features == "student" or self.targets_source == "online",
             "train.online_features=dense reads the step's own dense pass: set train.targets_source=online"),
            (self.schedule in ("constant", "cosine"), "train.schedule must be constant or cosine"),
            (self.warmup_steps >= 0, "train.warmup_steps must be >= 0"),
            (self.eval_every >= 0 and self.eval_sequences >= 0 and self.eval_recall_samples >= 0,
             "train.eval_every, train.eval_sequences and train.eval_recall_samples must be >= 0"),
            (not self.eval_every or self.policy == "kvpop",
             "train.eval_every evaluates the scorers: it is for train.policy=kvpop"),
            (not self.allocation or self.policy == "kvpop",
             "train.allocation moves the scorers' long-range slots between heads: it is for train.policy=kvpop"),
            (not (self.allocation and self.extra_topks),
             "train.extra_topks are uniform long-range sizes, not defined beside train.allocation: drop one"),
        ])
        try:
            window = check_profile_steps(self.profile_steps)
        except ValueError as err:
            raise ConfigError(f"train.profile_steps: {err} ([] = off)") from None
        if window is not None and sum(window) - 1 > self.steps:
            raise ConfigError(f"train.profile_steps: steps {window[0]} … {sum(window) - 1} are past "
                              f"train.steps={self.steps}")
        if self.policy == "dms":
            self.dms_schedule()

    def dms_schedule(self) -> CompressionSchedule:
        """The DMS compression schedule of this run (one :class:`ConfigError` if the keep-rate or length is wrong)."""
        try:
            return CompressionSchedule(self.dms_keep_rate, self.dms_schedule_steps, self.steps)
        except ValueError as err:
            raise ConfigError(f"train.dms_keep_rate / train.dms_schedule_steps: {err}") from None

    @property
    def label(self) -> str:
        """What trains, for run names: the scorer (policy kvpop), ``dms`` or ``streaming+``."""
        return {"kvpop": self.scorer, "dms": "dms", "streaming": "streaming+"}[self.policy]

    @property
    def resolved_strategy(self) -> str:
        """``fsdp`` (FSDP2) on GPUs or several workers, else ``none`` (a plain module), unless set explicitly."""
        if self.strategy != "auto":
            return self.strategy
        return "fsdp" if self.use_gpu or self.num_workers > 1 else "none"

    @property
    def resolved_precision(self) -> str:
        """``bf16`` compute on GPUs, ``fp32`` on CPU, unless set explicitly."""
        if self.precision != "auto":
            return self.precision
        return "bf16" if self.use_gpu else "fp32"

    def optimisation(self) -> dict[str, Any]:
        """The settings that change what is optimised (everything but :attr:`OPERATIONAL`; the policy and the DMS
        settings only where they apply — a kvpop run keeps the name it had before they existed — and the scorer and
        ranking-loss settings only for policy kvpop; ``extra_topks`` and the :attr:`LATER` settings only away from
        their default, for the same reason; ``steps`` with the cosine schedule, whose decay spans the run). Never
        ``init_from``: a path; what it changes is its weights digest, which the run's keys add
        (:func:`pipelines.identity.init_identity`) so that a moved folder is the same run."""
        skip = set(self.OPERATIONAL) | {"init_from"} | (set() if self.policy == "dms" else set(self.DMS_KEYS))
        skip |= {"policy"} if self.policy == "kvpop" else set(self.KVPOP_KEYS)
        skip |= set() if self.extra_topks else {"extra_topks"}
        skip |= {k for k, default in self.LATER.items() if getattr(self, k) == default}
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
        if self.schedule == "cosine":  # the decay spans the run: its length is what is optimised
            out["steps"] = self.steps
        return out

    @property
    def online(self) -> bool:
        """Targets computed inside each step (``targets_source=online``): no precompute stage, no stored targets."""
        return self.targets_source == "online"


@dataclass(frozen=True)
class SweepConfig:
    """Ray Tune over training variants (pipelines/sweep.py): the grid scorers × lrs × budgets × grid, ASHA-stopped."""
    scorers: tuple[str, ...] = ("mlstm", "mlp")  # grid over train.scorer; empty: train.scorer only
    lrs: tuple[float, ...] = ()  # grid over train.lr; empty: train.lr only (or lr_range)
    lr_range: tuple[float, ...] = ()  # [low, high]: train.lr sampled log-uniformly instead, num_samples per grid point
    budgets: tuple[tuple[int, int, int], ...] = ()  # (sink, window, topk); empty: the main budget only. Every window
    #                                                 needs precomputed targets (precompute.windows)
    grid: dict = field(default_factory=dict)  # more train.* keys (and allocate.mode) -> lists of values, e.g.
    #     {"train.beta": [0.5, 1.0]}; {"train.allocation": ["", "allocate"], "allocate.mode": [per_head, per_layer]}
    #     with sweep.budgets sweeps uniform vs allocation mode × mean budget
    num_samples: int = 1  # Tune's num_samples: draws per grid point (> 1 only with lr_range: else trials repeat)
    max_concurrent_trials: int = 1  # trials (TorchTrainer runs) at once; 1 on the 2-core default (no spare CPUs)
    steps: int = 20  # training steps per trial (replaces train.steps in the trials; the best config keeps train.steps)
    grace_period: int = 5  # ASHA: steps before a trial can be stopped
    reduction_factor: int = 2  # ASHA: keep the best 1/reduction_factor at each rung
    metric: str = "kl"  # loss | ret_loss | kl | boundary_acc: what ASHA and the best config compare (last value)
    mode: str = "min"  # min | max
    in_pipeline: bool = False  # jobs.pipeline runs the sweep after precompute, then trains/evaluates its best config
    name: str = ""  # default: <config name>-sweep-<UTC time>; the Tune experiment and the parent MLflow run
    output_root: str = ""  # default: $KVPOP_HOME/sweeps

    METRICS: ClassVar[tuple[str, ...]] = ("loss", "ret_loss", "kl", "boundary_acc")  # what a training step reports
    # train.* keys the sweep sets in its trials (not sweepable through sweep.grid)
    OWNED: ClassVar[tuple[str, ...]] = ("scorer", "lr", "steps", "targets", "run_name", "output_root", "fail_at_step")

    def __post_init__(self):
        """The sweep section on its own; :func:`pipelines.sweep.plan` checks it against the rest (windows, targets)."""
        for name in self.scorers:
            _require([(name in SCORERS, f"sweep.scorers: unknown scorer {name!r}; known: {', '.join(sorted(SCORERS))}")])
        _require([
            (all(lr > 0 for lr in self.lrs), "sweep.lrs must all be > 0"),
            (not (self.lrs and self.lr_range), "sweep.lrs and sweep.lr_range exclude each other: give a grid or a range"),
            (len(self.lr_range) in (0, 2) and (not self.lr_range or 0 < self.lr_range[0] < self.lr_range[1]),
             "sweep.lr_range must be [low, high] with 0 < low < high"),
            (self.num_samples >= 1, "sweep.num_samples must be >= 1"),
            (self.num_samples == 1 or bool(self.lr_range), "sweep.num_samples > 1 repeats identical trials unless "
                                                           "sweep.lr_range samples the learning rate"),
            (self.max_concurrent_trials >= 1, "sweep.max_concurrent_trials must be >= 1"),
            (self.steps >= 1, "sweep.steps must be >= 1"),
            (1 <= self.grace_period <= self.steps, "sweep.grace_period must be between 1 and sweep.steps"),
            (self.reduction_factor >= 2, "sweep.reduction_factor must be >= 2"),
            (self.metric in self.METRICS, f"sweep.metric must be one of {', '.join(self.METRICS)}"),
            (self.mode in ("min", "max"), "sweep.mode must be min or max"),
            (all(isinstance(v, list) and v for v in self.grid.values()),
             "sweep.grid maps train.* keys to non-empty lists"),
        ])
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        for key in self.grid:
            section, _, name = str(key).partition(".")
            if key == "allocate.mode":  # with train.allocation=allocate: allocation mode × mean budget (sweep.budgets)
                continue
            if section != "train" or name not in known:
                raise ConfigError(f"sweep.grid: {key!r} is not a train.* key or allocate.mode (known: train."
                                  f"{', train.'.join(sorted(known))})")
            if name in self.OWNED:
                raise ConfigError(f"sweep.grid: {key} is set by the sweep itself (use sweep.scorers / sweep.lrs / "
                                  f"sweep.steps)")


@dataclass(frozen=True)
class EvalConfig(OptionalSettings):
    """pipelines/evaluate.py: every policy × budget on held-out text, recall tasks and long generation, with 95 %
    bootstrap intervals over items and paired differences (pipelines/stats.py)."""

    # came after evaluations were first recorded
    OPTIONAL: ClassVar[tuple[str, ...]] = ("recency", "anchor_share", "anchor_recency", "read_windows",
                                           "heldout_sources", "allocated", "capped")
    policies: tuple[str, ...] = ("dense", "streaming", "tova", "h2o", "random", "oracle", "kvpop")
    budgets: tuple[int, ...] = ()  # total budgets B (sink and window of the training budget, topk swept)
    compression_ratios: tuple[float, ...] = (0.75, 0.875, 0.9375, 0.96875)  # CR = 1 - B / seq_len; a CR whose B
    #                                     is below sink + window is reported as unreachable. Neither set: training B
    tasks: tuple[str, ...] = ("niah_single", "niah_multikey_2")  # pipelines/recall
    task_contexts: tuple[int, ...] = (384,)  # prompt lengths in tokens
    task_depths: tuple[float, ...] = (0.5,)  # where the needle sits, as a fraction of the filler
    task_samples: int = 4  # per (task, context, depth) cell; 0 = no recall tasks
    task_min_dense: float = 0.9  # headline recall metrics: only cells where dense exact match >= this
    max_new_tokens: int = 12  # greedy tokens per recall answer
    generation_prompts: int = 4  # held-out champ problems for long free generation; 0 = none
    generation_tokens: int = 64  # greedy tokens per long generation
    resamples: int = 4000  # bootstrap resamples (fixed seed); exact enumeration when fewer distinct ones exist
    checkpoint: str = ""  # a saved retrofitted model; default: the train stage's output for this config
    batch_size: int = 4  # held-out sequences per teacher-forced forward (fixed: not sized to the free GPU memory)
    generation_batch_size: int = 12  # prompts per left-padded generation batch
    dynamic_sequences: int = 4  # TOVA/H2O teacher-forced on the first N held-out sequences only; 0 = all
    baselines: dict = field(default_factory=dict)  # trained baselines as extra rows: {row name: a saved retrofitted
    #     model folder, e.g. the final_model of a train.policy=streaming or dms run}, each under its own policy on the
    #     same items; DMS (ragged) at the budget of its mean retained tokens
    recency: float | None = None  # the kvpop rows rank by scorer + recency * t (METHOD §3) instead of the trained
    #     model's own term; the other rows keep theirs. A static decay added at inference: the scorer is unchanged
    anchor_share: float | None = None  # the kvpop rows' anchor slots (METHOD §1): this share of the topk slots keeps
    #     the best by scorer + anchor_recency * t, beside the rest ranked with `recency`; null: the model's own
    anchor_recency: float | None = None  # the anchors' recency term; null: the model's own
    read_windows: tuple[int, ...] = ()  # shorter windows the trained scorers are also read at, no retraining: each
    #     CR whose B is below the trained sink + window gets an evaluation of its own at the largest of these windows
    #     that leaves long-range slots (sink + window < B), every policy at that budget (pipelines.evaluate.readings)
    heldout_sources: tuple[str, ...] = ()  # more corpora (data.source values) whose held-out split is evaluated too:
    #     text metrics only, every policy and budget, reported and logged per corpus as <corpus>.<policy>.B<total>.*
    allocated: tuple[str, ...] = ()  # static policies (kvpop, oracle, random, window_attention) also run under
    #     per-head budgets (METHOD §7) at every budget, as rows <policy>-H: allocated from the allocate stage's slot
    #     gains (python -m jobs.allocate first) at each budget's mean, in allocate.mode
    capped: bool = False  # each ragged trained baseline (DMS) also runs capped (at most C tokens per (layer, KV head),
    #     its kept token of the highest logit dropped first when full) at its budget B, C = the largest peak of the
    #     fixed-budget rows there (the -H rows' allocation when eval.allocated, else B): row <name>-cap, the
    #     comparison at the same reservation (issue 43)

    def __post_init__(self):
        _validate_eval(self)


@dataclass(frozen=True)
class RayConfig:
    address: str = ""  # "" = start a local cluster (or join RAY_ADDRESS when set)
    num_cpus: int = 4  # logical CPUs of a local cluster: oversubscribed on purpose (docs/ENVIRONMENT.md: Train+Data deadlock)
    no_progress_timeout_s: int = 600

    def __post_init__(self):
        _require([(self.num_cpus >= 1, "ray.num_cpus must be >= 1")])


@dataclass(frozen=True)
class TrackingConfig:
    uri: str = ""  # default: $MLFLOW_TRACKING_URI if set (a cluster's MLflow server), else sqlite:///$KVPOP_HOME/mlflow.db
    experiment: str = "kvpop"


@dataclass(frozen=True)
class PipelineConfig:
    name: str = "default"
    home: str = ""  # default: $KVPOP_HOME or <repo>/.kvpop
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    budget: Budget = DEFAULT_BUDGET  # YAML keys budget.sink / budget.window / budget.topk
    precompute: PrecomputeConfig = field(default_factory=PrecomputeConfig)
    allocate: AllocateConfig = field(default_factory=AllocateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self):
        """Each section has checked itself; here, the rules between sections."""
        budget = self.budget
        if self.train.eval_sequences > self.data.eval_sequences:
            raise ConfigError(f"train.eval_sequences={self.train.eval_sequences} is more than the data stage's "
                              f"{self.data.eval_sequences} held-out sequences (data.eval_sequences)")
        if self.train.eval_every and self.data.eval_sequences < 1:
            raise ConfigError("train.eval_every evaluates held-out sequences: set data.eval_sequences >= 1")
        if self.train.eval_heldout_sources:
            names = [corpus_name(s) for s in self.eval.heldout_sources]
            if not names:
                raise ConfigError("train.eval_heldout_sources evaluates the eval.heldout_sources corpora: name at "
                                  "least one (or set it false)")
            if set(names) & set(HELDOUT_REFERENCES):
                raise ConfigError(f"train.eval_heldout_sources: corpus names {names} may not be "
                                  f"{' / '.join(HELDOUT_REFERENCES)} (its metrics heldout.<corpus>.* would be taken "
                                  f"for the references heldout.<policy>.*)")
        if budget.window not in self.precompute.windows:
            raise ConfigError(f"budget.window={budget.window} has no targets: add it to precompute.windows "
                              f"(now {list(self.precompute.windows)})")
        if budget.total > self.data.seq_len:
            raise ConfigError(f"budget {budget} keeps {budget.total} tokens, more than data.seq_len="
                              f"{self.data.seq_len}: nothing would be evicted")
        mean = self.allocate.resolved_mean_budget(budget)
        if not budget.sink + budget.window <= mean <= self.data.seq_len:
            raise ConfigError(f"allocate.mean_budget={mean} must be in [sink + window, data.seq_len] = "
                              f"[{budget.sink + budget.window}, {self.data.seq_len}]")
        if self.train.allocation == "allocate" and self.train.online:
            raise ConfigError("train.allocation=allocate is made from the stored targets (the allocate stage): with "
                              "train.targets_source=online give an allocation folder instead")
        if self.eval.allocated and self.train.online:
            raise ConfigError("eval.allocated allocates from stored targets (the allocate stage), which "
                              "train.targets_source=online does not make: evaluate the trained model (eval.checkpoint) "
                              "with train.targets_source=stored after python -m jobs.precompute and jobs.allocate")
        if self.train.allocation == "allocate" and mean != budget.total:
            raise ConfigError(f"train.allocation=allocate trains at the allocate stage's allocation, whose mean is "
                              f"allocate.mean_budget={mean}, not budget.total={budget.total}: set allocate.mean_budget "
                              f"to 0 (the budget's total)")
        for total in self.eval.budgets:
            if total < budget.sink + budget.window:
                raise ConfigError(f"eval.budgets: {total} is smaller than sink + window = "
                                  f"{budget.sink + budget.window} (impossible budget)")
        for ratio in self.eval.compression_ratios:
            if not 0 <= ratio < 1:
                raise ConfigError(f"eval.compression_ratios: {ratio} is not in [0, 1)")

    # -- derived locations ----------------------------------------------------------------------------------
    def home_dir(self) -> Path:
        return config_path(self.home).resolve() if self.home else Path(kvpop_home()).resolve()

    def tracking_uri(self) -> str:
        """``tracking.uri``, else ``$MLFLOW_TRACKING_URI`` (a cluster's head sets it: infra/), else the local sqlite."""
        return (self.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
                or f"sqlite:///{self.home_dir() / 'mlflow.db'}")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))


def _require(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _validate_eval(ev: "EvalConfig") -> None:
    for name in ev.policies:
        if name not in POLICIES:
            raise ConfigError(f"eval.policies: unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    for name in ev.tasks:
        if name not in TASKS:
            raise ConfigError(f"eval.tasks: unknown task {name!r}; known: {', '.join(TASKS)}")
    checks = [
        (ev.batch_size >= 1 and ev.generation_batch_size >= 1, "eval.batch_size and eval.generation_batch_size "
                                                               "must be >= 1"),
        (ev.dynamic_sequences >= 0, "eval.dynamic_sequences must be >= 0 (0 = all held-out sequences)"),
        (ev.task_samples >= 0, "eval.task_samples must be >= 0 (0 = no recall tasks)"),
        (all(c >= 64 for c in ev.task_contexts), "eval.task_contexts must all be >= 64 tokens"),
        (all(0 <= d <= 1 for d in ev.task_depths), "eval.task_depths must all be in [0, 1] (a fraction of the "
                                                   "context)"),
        (not ev.task_samples or (ev.tasks and ev.task_contexts and ev.task_depths),
         "eval.task_samples > 0 needs eval.tasks, eval.task_contexts and eval.task_depths"),
        (0 <= ev.task_min_dense <= 1, "eval.task_min_dense must be in [0, 1]"),
        (ev.max_new_tokens >= 1 and ev.generation_tokens >= 1, "eval.max_new_tokens and eval.generation_tokens "
                                                               "must be >= 1"),
        (ev.generation_prompts >= 0, "eval.generation_prompts must be >= 0 (0 = no long generation)"),
        (ev.resamples >= 100, "eval.resamples must be >= 100 (bootstrap resamples)"),
        (ev.recency is None or ev.recency >= 0, "eval.recency must be >= 0 (or null: the trained model's own)"),
        (ev.recency is None or "kvpop" in ev.policies, "eval.recency sets the kvpop rows' recency term: add kvpop "
                                                        "to eval.policies"),
        (ev.anchor_share is None or 0 <= ev.anchor_share <= 1, "eval.anchor_share must be in [0, 1] (a share of the "
                                                               "topk slots; or null: the trained model's own)"),
        (ev.anchor_recency is None or ev.anchor_recency >= 0, "eval.anchor_recency must be >= 0 (or null: the "
                                                              "trained model's own)"),
        (all(w >= 1 for w in ev.read_windows), "eval.read_windows must all be >= 1 (protected windows)"),
        (all(p in ALLOCATED_POLICIES for p in ev.allocated), f"eval.allocated: per-head budgets are for "
                                                              f"{', '.join(ALLOCATED_POLICIES)}"),
        (all(p in ev.policies for p in ev.allocated), "eval.allocated: each policy must also be in eval.policies "
                                                      "(its -H row is compared with its uniform row)"),
        (not ev.read_windows or "kvpop" in ev.policies, "eval.read_windows reads the kvpop scorers at other windows: "
                                                        "add kvpop to eval.policies"),
        (ev.anchor_share is None and ev.anchor_recency is None or "kvpop" in ev.policies,
         "eval.anchor_share / eval.anchor_recency set the kvpop rows' anchor slots: add kvpop to eval.policies"),
        (not ev.capped or bool(ev.baselines), "eval.capped caps a trained DMS baseline: name it in eval.baselines"),
    ]
    names = [corpus_name(str(s)) for s in ev.heldout_sources]
    checks += [(all(isinstance(s, str) and s for s in ev.heldout_sources), "eval.heldout_sources must be data.source "
                                                                            "values (strings)"),
               (len(set(names)) == len(names), f"eval.heldout_sources: two sources share a corpus name ({names})"),
               (all(re.fullmatch(r"[A-Za-z0-9_-]+", n) and n not in ("recall", "generation") for n in names),
                f"eval.heldout_sources: corpus names {names} must be letters, digits, _ - and not recall / generation "
                f"(MLflow keys <corpus>.<policy>.B<total>.<metric>)")]
    for name, folder in ev.baselines.items():
        checks += [
            (re.fullmatch(r"[A-Za-z0-9_.-]+", str(name)) is not None, f"eval.baselines: row name {name!r} may hold "
                                                                        f"only letters, digits, _ . - (MLflow keys)"),
            (name not in ev.policies and name != "dense", f"eval.baselines: {name!r} is also in eval.policies: name "
                                                          f"the baseline's row differently (e.g. {name}_trained)"),
            (isinstance(folder, str) and bool(folder), f"eval.baselines.{name} must be a model folder (a string)")]
    _require(checks)


def _yaml_problem(err) -> str:
    """PyYAML's error on one line with its position (its own text spreads them over several lines)."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is None or not problem:
        return " ".join(str(err).split())
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, where = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and where is not None:
        text += f" ({context} at line {where.line + 1}, column {where.column + 1})"
    return text


def corpus_name(source: str) -> str:
    """A corpus as a name (report sections, MLflow key prefixes, ledger cells): ``champ``, ``stdlib``, or a file's
    stem up to its first digit-led part (``/tmp/gpu/python_docs_deb12u8.jsonl`` → ``python_docs``)."""
    if "/" not in source and not source.endswith((".jsonl", ".json", ".parquet")):
        return source
    stem = Path(source).name.split(".")[0]
    words = []
    for word in stem.split("_"):
        if re.match(r"^deb\d|^\d", word):
            break
        words.append(word)
    return "_".join(words) or stem


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """The default config, updated by a YAML file, then by ``key=value`` overrides (dotted keys)."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML ({_yaml_problem(err)})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    for item in overrides:
        key, value = parse_override(item)
        set_path(tree, key, value)
    return build(PipelineConfig, tree)


def config_from_dict(values: dict) -> PipelineConfig:
    return build(PipelineConfig, values)


def apply_overrides(tree: dict, overrides: dict[str, Any]) -> PipelineConfig:
    """The config ``tree`` (a :meth:`PipelineConfig.to_dict`) with dotted overrides applied, validated."""
    tree = copy.deepcopy(tree)
    for key, value in overrides.items():
        set_path(tree, key, value)
    return config_from_dict(tree)


def fingerprint(*parts: Any, length: int = 16) -> str:
    """A stable hash of JSON-able parts (dataclasses included; an :class:`OptionalSettings` section without its
    optional settings at their default)."""
    def plain(x):
        if isinstance(x, OptionalSettings):
            unset = x.optional_defaults().keys() - x.optional_settings().keys()
            return {k: v for k, v in dataclasses.asdict(x).items() if k not in unset}
        if dataclasses.is_dataclass(x):
            return dataclasses.asdict(x)
        if isinstance(x, Path):
            return str(x)
        return x
    blob = json.dumps([plain(p) for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def config_path(value: str | os.PathLike) -> Path:
    """A path a config names (a corpus, a model or scorer folder, an output root, the home), ``~`` expanded. A
    relative one is relative to the directory the command ran in: ``$KVPOP_WORKDIR``, which the driver hands to every
    Ray worker (:func:`env_home`) because Ray Train and Tune run their workers in folders of their own, else the
    current directory. Configs keep the path as written, so that their hashes do not depend on where a clone is."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else Path(workdir()) / path


def workdir() -> str:
    """The directory :func:`config_path` reads relative paths from: ``$KVPOP_WORKDIR``, else the current one."""
    return os.environ.get(WORKDIR_ENV) or os.getcwd()


def env_home(cfg: PipelineConfig) -> dict[str, str]:
    """Environment for Ray workers so that they resolve the same home, and the same relative paths, as the driver."""
    return {"KVPOP_HOME": str(cfg.home_dir()), WORKDIR_ENV: workdir(),
            **OFFLINE_ENV, "RAY_USAGE_STATS_ENABLED": "0",
            **({"PYTHONPATH": str(REPO_ROOT)} if "PYTHONPATH" not in os.environ else {})}
