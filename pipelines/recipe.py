"""A recipe: one YAML file, one command (``python -m jobs.pipeline --config <recipe>``), one or more phases.

**The file** is a pipeline config (every section of :class:`pipelines.config.PipelineConfig`: the shared base) plus

* ``phases:`` — a list, run in order, each ``{name, set: {dotted key: value}, init_from: <an earlier phase's name>,
  baselines: {row name: <an earlier phase's name>}, evaluate: true|false}``. A phase's config is the base with its
  ``set`` applied, named ``<name>-<phase name>``; ``init_from`` makes the phase start its scorers from that phase's
  final model, found through that phase's train record (:mod:`pipelines.records`) once it has trained — never a path
  written by hand; ``baselines`` likewise makes earlier phases' final models rows of this phase's evaluation
  (``eval.baselines``: a DMS or a uniformly trained KVpop beside the model of this phase). ``evaluate: false``
  skips the evaluate stage of a phase whose model only feeds the next one (default true).
* ``inputs:`` — optional, ``{path: the command that makes it}``: files the recipe reads but cannot make (a corpus
  built from a Debian package). A missing one is refused before any stage runs, in one line naming its command.

``--set key=value`` applies to every phase, ``--set phases.<phase name>.<key>=value`` to one (the command line wins
over the file; ``phases.<phase name>.evaluate=true|false`` sets its ``evaluate``).

**Running it** (:func:`run`): every phase's config and inputs are checked first (one :class:`ConfigError` line,
nothing written: no MLflow run, no folder). Then each phase is :func:`run_pipeline` — precompute → [sweep →] train
→ evaluate, each stage resuming — except that a phase whose train record already holds its ``train.steps`` steps
(and whose final model is there) skips precompute and train: a finished phase is reused through its record, so the
same command after a kill (or on a fresh machine after ``python -m jobs.state import``) continues where it stopped;
a half-trained phase resumes through the train stage's own DCP checkpoint.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipelines import allocate, evaluate, precompute, records, sweep, train
from pipelines.cluster import check_address
from pipelines.config import ConfigError, PipelineConfig, config_from_dict, config_path
from pipelines.data import check_inputs
from pipelines.identity import teacher_identity
from pipelines.schema import parse_override, set_path
from pipelines.train_worker import trained_steps

PHASE_KEYS = ("name", "set", "init_from", "baselines", "evaluate")
EARLIER = "phase:"  # eval.baselines.<row> of a phase whose baselines phase has not trained yet (checking only)


@dataclass(frozen=True)
class Phase:
    name: str
    overrides: dict[str, Any]  # dotted key → value, on the shared base (the file's ``set``)
    init_from: str | None  # an earlier phase whose final model this phase's scorers start from
    evaluate: bool
    command_line: dict[str, Any] = dataclasses.field(default_factory=dict)  # --set phases.<name>.<key>=value
    baselines: dict[str, str] = dataclasses.field(default_factory=dict)  # eval.baselines row → an earlier phase


@dataclass(frozen=True)
class Recipe:
    name: str
    base: dict  # the shared config tree
    phases: tuple[Phase, ...]
    inputs: dict[str, str]  # path → the command that makes it
    command_line: dict[str, Any] = dataclasses.field(default_factory=dict)  # --set key=value: every phase

    def config(self, phase: Phase, init_from: str | Path | None = None,
               baselines: dict[str, str | Path] | None = None) -> PipelineConfig:
        """``phase``'s config: the base, the phase's ``set``, the command line's every-phase then this phase's
        overrides (the command line wins), its name; ``train.init_from`` = ``init_from``; ``eval.baselines.<row>`` =
        ``baselines[row]``, the final models of the phase's ``baselines`` (``phase:<name>`` until they exist)."""
        tree = copy.deepcopy(self.base)
        for overrides in (phase.overrides, self.command_line, phase.command_line):
            for key, value in overrides.items():
                set_path(tree, key, value)
        tree["name"] = f"{self.name}-{phase.name}"
        if init_from is not None:
            set_path(tree, "train.init_from", str(init_from))
        for row, earlier in phase.baselines.items():
            set_path(tree, f"eval.baselines.{row}", str((baselines or {}).get(row, EARLIER + earlier)))
        try:
            return config_from_dict(tree)
        except ConfigError as err:
            raise ConfigError(f"phase {phase.name}: {err}") from None


def is_recipe(path: str | Path | None) -> bool:
    """Whether the YAML file at ``path`` declares ``phases`` (unreadable files are left to the config loader)."""
    if path is None or not Path(path).is_file():
        return False
    try:
        tree = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError:
        return False
    return isinstance(tree, dict) and "phases" in tree


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """The recipe at ``path`` with command-line ``overrides``; every phase's config is built once here, so that a bad
    key or value of any phase is one :class:`ConfigError` line before anything runs."""
    path = Path(path)
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})".replace("\n", " ")) from None
    phases_raw, inputs = tree.pop("phases"), tree.pop("inputs", None) or {}
    if not isinstance(phases_raw, list) or not phases_raw:
        raise ConfigError(f"{path}: phases must be a non-empty list of {{name, set, init_from, evaluate}}")
    if not isinstance(inputs, dict) or not all(isinstance(v, str) and v for v in inputs.values()):
        raise ConfigError(f"{path}: inputs maps each input file to the command that makes it")
    phases: list[Phase] = []
    for i, raw in enumerate(phases_raw):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
            raise ConfigError(f"{path}: phase {i + 1} needs a name")
        unknown = set(raw) - set(PHASE_KEYS)
        if unknown:
            raise ConfigError(f"{path}: phase {raw['name']}: unknown key(s) {', '.join(sorted(unknown))}; a phase has "
                              f"{', '.join(PHASE_KEYS)}")
        if raw["name"] in {p.name for p in phases}:
            raise ConfigError(f"{path}: two phases are named {raw['name']}")
        start = raw.get("init_from")
        if start is not None and start not in {p.name for p in phases}:
            raise ConfigError(f"{path}: phase {raw['name']}: init_from {start!r} is not an earlier phase")
        sets = raw.get("set") or {}
        if not isinstance(sets, dict):
            raise ConfigError(f"{path}: phase {raw['name']}: set maps dotted config keys to values")
        if start is not None and "train.init_from" in sets:
            raise ConfigError(f"{path}: phase {raw['name']}: give init_from (a phase) or set train.init_from, not both")
        evaluate = raw.get("evaluate", True)
        if not isinstance(evaluate, bool):
            raise ConfigError(f"{path}: phase {raw['name']}: evaluate must be true or false")
        rows = raw.get("baselines") or {}
        if not isinstance(rows, dict) or not all(isinstance(v, str) and v in {p.name for p in phases}
                                                 for v in rows.values()):
            raise ConfigError(f"{path}: phase {raw['name']}: baselines maps row names to earlier phases' names "
                              f"({', '.join(p.name for p in phases) or 'none before it'})")
        phases.append(Phase(raw["name"], dict(sets), start, evaluate, baselines={str(k): v for k, v in rows.items()}))
    names = {p.name for p in phases}
    every: dict[str, Any] = {}
    for item in overrides:
        key, value = parse_override(item)
        if key.startswith("phases."):
            name, _, rest = key[len("phases."):].partition(".")
            if name not in names or not rest:
                raise ConfigError(f"--set {item}: phases.<phase>.<key> names a phase of {path} ({', '.join(names)})")
            if rest == "evaluate" and not isinstance(value, bool):
                raise ConfigError(f"--set {item}: a phase's evaluate is true or false")
            phases = [dataclasses.replace(p, **({"evaluate": value} if rest == "evaluate" else
                                                {"command_line": {**p.command_line, rest: value}}))
                      if p.name == name else p for p in phases]
        else:
            every[key] = value
    name = every.get("name", tree.get("name")) or path.stem
    recipe = Recipe(str(name), tree, tuple(phases), {str(k): v for k, v in inputs.items()}, every)
    for phase in recipe.phases:
        recipe.config(phase)  # every phase's settings, checked now
    return recipe


def missing_inputs(recipe: Recipe) -> list[str]:
    """One line per declared input that is not there, naming the command that makes it."""
    return [f"input {path} is missing: make it with `{command}`" for path, command in recipe.inputs.items()
            if not config_path(path).exists()]


def check(recipe: Recipe) -> None:
    """Everything checkable before any stage runs, without Ray or writing: the declared inputs, then each phase's
    model folder, data sources and budget (:func:`pipelines.data.check_inputs`)."""

    missing = missing_inputs(recipe)
    if missing:
        raise ConfigError(missing[0] + (f" (and {len(missing) - 1} more input(s))" if len(missing) > 1 else ""))
    for phase in recipe.phases:
        cfg = recipe.config(phase)
        try:
            check_inputs(cfg)
        except ConfigError as err:
            raise ConfigError(f"phase {phase.name}: {err}") from None
    check_address(recipe.config(recipe.phases[0]))


# ------------------------------------------------------------------------------------------------ running
def finished_training(cfg: PipelineConfig):
    """This config's train record if it holds ``train.steps`` steps and its final model is there, else None."""

    record = records.for_config(cfg, "train")
    if record is None or record.payload.get("steps") != cfg.train.steps:
        return None
    return record if trained_steps(Path(record.payload["model_dir"])) == cfg.train.steps else None


def needs_allocation(cfg: PipelineConfig) -> bool:
    """Whether the allocate stage runs after precompute: the scorer trains at its allocation
    (``train.allocation=allocate``) or the evaluation adds ``-H`` rows (``eval.allocated``)."""
    return cfg.train.allocation == "allocate" or bool(cfg.eval.allocated)


def run_pipeline(cfg: PipelineConfig, *, evaluate_model: bool = True, label: str = "") -> dict:
    """One config through precompute → [sweep →] [allocate →] train → [evaluate], each stage resuming (allocate when
    :func:`needs_allocation`); a config whose training is already recorded as finished goes straight to evaluation.
    Returns ``{"model_dir", "mlflow_run_id", "evaluations"}``."""

    def say(text: str) -> None:
        print(f"[kvpop]{label} {text}", flush=True)

    if cfg.train.init_from is not None:  # the train stage's input: refused now, not after the precompute's hours
        train.check_init_from(cfg, teacher_identity(cfg)["weights_sha256"])
    stages = 2 + cfg.sweep.in_pipeline + evaluate_model
    say(f"config {cfg.name}: model {cfg.model.resolved_path()}, data {cfg.data.source}, S={cfg.data.seq_len}, "
        f"budget {cfg.budget} (B={cfg.budget.total}), MLflow {cfg.tracking_uri()}")
    done = None if cfg.sweep.in_pipeline else finished_training(cfg)
    if done is not None:
        say(f"trained already ({done.payload['steps']} steps, train record {done.key}): "
            f"{done.payload['model_dir']}")
        model, run_id = Path(done.payload["model_dir"]), done.payload["mlflow_run_id"]
    else:
        if cfg.train.online:  # each training step computes its own targets: nothing to precompute
            say(f"1/{stages} precompute: skipped (train.targets_source=online)")
        else:
            say(f"1/{stages} precompute teacher targets")
            targets = precompute.run(cfg)
            say(f"    {targets.path} ({targets.shards} shards, {targets.computed} computed now)")
        if cfg.sweep.in_pipeline:  # its trials allocate for themselves (pipelines.sweep.allocate_trials)
            say(f"2/{stages} sweep")
            swept = sweep.run(cfg)
            cfg = swept.best_config
            say(f"    best config {swept.best_path}: scorer {cfg.train.scorer}, lr {cfg.train.lr:g}, budget "
                f"{cfg.budget}")
        if needs_allocation(cfg):  # the config that trains (the sweep's best, if any) and is evaluated
            made = allocate.run(cfg)
            say(f"    allocation {made.path} ({made.allocation.mode}, mean B {made.allocation.mean_budget}, peak "
                f"{made.allocation.peak_budget})")
        say(f"{2 + cfg.sweep.in_pipeline}/{stages} train the scorers")
        trained = train.run(cfg)
        say(f"    {trained.model_dir}")
        model, run_id = trained.model_dir, trained.mlflow_run_id
    evaluations = []
    if evaluate_model:
        if cfg.eval.allocated and done is not None:  # trained already: the -H rows still need the slot gains
            allocate.run(cfg)
        say(f"{stages}/{stages} evaluate")
        evaluations = evaluate.run_readings(cfg)
    return {"config": cfg, "model_dir": model, "mlflow_run_id": run_id, "evaluations": evaluations}


def run(recipe: Recipe) -> list[dict]:
    """Every phase in order (module docstring); each phase's :func:`run_pipeline` result."""

    results: dict[str, dict] = {}
    start = time.perf_counter()
    for i, phase in enumerate(recipe.phases):
        init_from = results[phase.init_from]["model_dir"] if phase.init_from else None
        cfg = recipe.config(phase, init_from, {row: results[earlier]["model_dir"]
                                               for row, earlier in phase.baselines.items()})
        label = f" phase {i + 1}/{len(recipe.phases)} {phase.name}:"
        print(f"[kvpop]{label} {'scorers from phase ' + phase.init_from + ' ' + str(init_from) if init_from else ''}"
              .rstrip(), flush=True)
        results[phase.name] = run_pipeline(cfg, evaluate_model=phase.evaluate, label=label)
        records.crash_point(f"recipe.phase_done.{phase.name}")
    print(f"[kvpop] recipe {recipe.name}: {len(recipe.phases)} phase(s) done in {time.perf_counter() - start:.0f} s",
          flush=True)
    return [results[p.name] for p in recipe.phases]
