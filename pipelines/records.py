"""Committed hand-over records: what a stage produced, for the next stage to read.

A stage writes its record **last**, atomically, once everything the record names exists and (for a tracked stage)
its MLflow run is complete: the record is the stage's commit point. The next stage resolves its input from the
record of the same configuration (or from an explicit path the user gives), never by re-deriving where the output
must be from its upstream inputs: finding the trained model reads one small JSON file, no tokenizer, no weights.

**Where.** ``$KVPOP_HOME/records/<stage>/<key>.json``. ``<key>`` (:func:`key_for`) hashes the *values* of the config
settings the stage's output depends on — never file contents, so any process with the config finds it in
microseconds; one exception: ``train.init_from`` enters the train key as its scorer weights' digest
(:func:`pipelines.identity.init_identity`, cached by the file's stat), so that other weights in the same folder are
another run. A re-run of the stage with the same settings replaces the record (the newest output wins).

**Record.** ``{"stage", "key", "config" (the config's name), "time", "payload"}``; payloads:

* ``precompute``: ``targets_key``, ``path`` (the target directory), ``rows``, ``shards``;
* ``allocate``: ``path`` (the allocation file), ``mlflow_run_id``, ``targets`` (directory), ``mode``, ``mean``,
  ``peak``;
* ``train``: ``run_name``, ``model_dir``, ``mlflow_run_id``, ``steps``, ``targets`` (directory), ``mode``;
* ``evaluate``: ``output_dir``, ``mlflow_run_id``.

**Fault injection.** :func:`crash_point` kills the process (``os._exit``, no clean-up of any kind) at a named point
when ``KVPOP_CRASH_AT`` names it, so that tests can stop a driver between its commit steps.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from kvpop.files import atomic_write_text
from pipelines.config import PipelineConfig, fingerprint
from pipelines.identity import init_identity

RECORDS = "records"
CRASH_ENV = "KVPOP_CRASH_AT"
CRASH_EXIT_CODE = 86


@dataclass(frozen=True)
class Record:
    stage: str
    key: str
    config: str
    time: str
    payload: dict[str, Any]


def path_of(home: str | os.PathLike, stage: str, key: str) -> Path:
    return Path(home) / RECORDS / stage / f"{key}.json"


def write(home: str | os.PathLike, stage: str, key: str, payload: dict[str, Any], *, config: str = "") -> Record:
    """Commit ``payload`` as the record of ``stage`` under ``key`` (atomic: readers see the old record or this one)."""
    record = Record(stage, key, config, time.strftime("%Y-%m-%dT%H:%M:%S"), dict(payload))
    atomic_write_text(path_of(home, stage, key), json.dumps(asdict(record), indent=1, sort_keys=True))
    return record


def read(home: str | os.PathLike, stage: str, key: str) -> Record | None:
    """The committed record, or None (none yet, or an unreadable file: the stage has not committed)."""
    try:
        raw = json.loads(path_of(home, stage, key).read_text())
        return Record(raw["stage"], raw["key"], raw["config"], raw["time"], dict(raw["payload"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest(home: str | os.PathLike, stage: str, config: str) -> Record | None:
    """The newest record of ``stage`` written for a config named ``config`` (whatever its settings)."""
    folder = Path(home) / RECORDS / stage
    found = [r for r in (read(home, stage, p.stem) for p in folder.glob("*.json")) if r and r.config == config]
    return max(found, key=lambda r: r.time, default=None)


# ------------------------------------------------------------------------------------------------ keys
def precompute_key(cfg: PipelineConfig) -> str:
    """The teacher, the data and the target settings (not the actor layout or the output root)."""
    p = cfg.precompute
    return fingerprint("precompute", cfg.model, cfg.data, sorted(set(p.windows)), p.top_k, p.group_reduce,
                       p.sequences_per_shard, *p.optional_settings().items())


def allocate_key(cfg: PipelineConfig) -> str:
    """The targets it reads (the precompute record's key, or an explicit directory), sink and window, and every
    allocation setting."""
    return fingerprint("allocate", cfg.train.targets or precompute_key(cfg), cfg.budget.sink, cfg.budget.window,
                       cfg.allocate.resolved_mean_budget(cfg.budget), cfg.allocate.mode, cfg.allocate.query_stride,
                       cfg.allocate.sequences, cfg.allocate.output_root)


def train_key(cfg: PipelineConfig) -> str:
    """What names a training run: its targets (the precompute record's key, or an explicit directory), the budget,
    what is optimised, the seed, the config's name and the run's name and storage."""
    targets = cfg.train.targets or precompute_key(cfg)
    return fingerprint("train", cfg.name, targets, cfg.budget, cfg.train.optimisation(), cfg.data.seed,
                       cfg.train.run_name, cfg.train.output_root, *init_identity(cfg))


def evaluate_key(cfg: PipelineConfig) -> str:
    """The evaluated model (``eval.checkpoint``, or the train record's key), the teacher, the held-out data and
    every evaluation setting."""
    return fingerprint("evaluate", cfg.eval.checkpoint or train_key(cfg), cfg.model, cfg.data, cfg.eval)


KEYS: dict[str, Callable[[PipelineConfig], str]] = {"precompute": precompute_key, "allocate": allocate_key,
                                                     "train": train_key, "evaluate": evaluate_key}


def key_for(cfg: PipelineConfig, stage: str) -> str:
    if stage not in KEYS:
        raise ValueError(f"no record key for stage {stage!r}; known: {', '.join(KEYS)}")
    return KEYS[stage](cfg)


def for_config(cfg: PipelineConfig, stage: str) -> Record | None:
    """The record ``stage`` committed for this config, or None."""
    return read(cfg.home_dir(), stage, key_for(cfg, stage))


def commit(cfg: PipelineConfig, stage: str, payload: dict[str, Any]) -> Record:
    """Write this config's record of ``stage``."""
    return write(cfg.home_dir(), stage, key_for(cfg, stage), payload, config=cfg.name)


def crash_point(name: str) -> None:
    """Die here, at once and without clean-up, if ``$KVPOP_CRASH_AT`` is ``name`` (fault injection for tests)."""
    if os.environ.get(CRASH_ENV) == name:
        print(f"[kvpop] {CRASH_ENV}={name}: exiting here", flush=True)
        os._exit(CRASH_EXIT_CODE)
