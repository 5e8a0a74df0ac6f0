"""Stage: per-(layer, KV head) budgets from the stored targets, between precompute and train (METHOD §7).

``run(cfg)``, in the driver and without Ray (the work is one sort per calibration query over stored targets):

1. **Inputs, before anything is written**: this config's targets (``train.targets`` or the precompute record, found
   as the train stage finds them: :func:`pipelines.train.targets_path`), opened by
   :func:`pipelines.store.open_targets` against this config's identity and holding ``budget.window``'s column; at
   least ``allocate.sequences`` stored rows. ``allocate.mean_budget`` (0: ``budget.total``) in ``[sink + window, S]``
   is the config's own check. Any of these: one :class:`~pipelines.config.ConfigError` line, nothing written.
2. With a record for this config whose allocation file is still there, return it: no work, no MLflow run.
3. Read the ``budget.window`` target column shard by shard (the first ``allocate.sequences`` rows; 0: all), sum the
   slot gains over the calibration queries (:func:`kvpop.allocation.slot_gain_sums`, ranked by the targets: the
   oracle, every ``allocate.query_stride``-th query), solve (:func:`kvpop.allocation.allocate`, ``allocate.mode``)
   and write :data:`kvpop.allocation.ALLOCATION_FILE` into ``<allocate.output_root or $KVPOP_HOME/allocations>/<key>/``
   with its provenance: the calibration digest (targets key, each shard read with its sha256 and the rows used), the
   teacher's weights digest, the utility source, the targets' directory; beside it the slot gains
   (:data:`GAINS_FILE`), from which :func:`allocations_at` allocates at any other mean budget (the evaluation stage's
   ``<policy>-H`` rows at every budget) without reading the targets again.
4. An MLflow run (stage ``allocate``; the whole config as params): the budgets' mean, peak, min and spread, the mean
   long-range target mass a head keeps per query under the uniform budget and under the allocation
   (:func:`kvpop.allocation.kept_mass`), the seconds spent; the JSON as the run's artifact. Then the ``allocate``
   record (:mod:`pipelines.records`) — the commit point. A run killed before it leaves no record: the next run
   computes again (cheap) into the same file.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch

from kvpop.allocation import (ALLOCATION_FILE, AllocationError, Allocation, allocate, budget_summary, kept_mass,
                              load_allocation, save_allocation, slot_gain_sums)
from pipelines import records, store, tracking
from pipelines.config import ConfigError, PipelineConfig, config_path
from pipelines.data import load_tokenizer
from pipelines.train import targets_path

UTILITY = "oracle"  # the pipeline ranks by the stored targets; a scorer's ranking is kvpop.allocation's option
GAINS_FILE = "slot_gains.pt"  # the calibration's gains [L, Hkv, K] (float64) beside the allocation


@dataclass(frozen=True)
class AllocateResult:
    path: Path  # the allocation file
    allocation: Allocation
    mlflow_run_id: str
    computed: bool  # False: this config's committed allocation was returned as it was


def allocations_root(cfg: PipelineConfig) -> Path:
    root = cfg.allocate.output_root
    return config_path(root).resolve() if root else cfg.home_dir() / "allocations"


def open_inputs(cfg: PipelineConfig) -> store.Targets:
    """The verified targets this config allocates from, or one :class:`ConfigError` line."""
    targets = store.open_targets(targets_path(cfg), expect=store.training_identity(cfg, load_tokenizer(cfg)),
                                 windows=(cfg.budget.window,))
    wanted = cfg.allocate.sequences
    if wanted > targets.num_rows:
        raise ConfigError(f"allocate.sequences={wanted} but the targets at {targets.path} hold {targets.num_rows} "
                          f"sequences: lower it (0: all) or precompute more (data.num_sequences)")
    return targets


def calibration_gains(cfg: PipelineConfig, targets: store.Targets) -> tuple[torch.Tensor, int, str, int]:
    """``(gains [L, Hkv, K], queries, calibration digest, sequences)`` from the ``budget.window`` column."""
    b, column = cfg.budget, store.target_column(cfg.budget.window)
    left = cfg.allocate.sequences or targets.num_rows
    sums, queries, used = None, 0, []
    for record, file in zip(targets.records, targets.files):
        if left == 0:
            break
        rows = pq.read_table(file, columns=[column]).column(column).combine_chunks().to_numpy_ndarray()[:left]
        part, count = slot_gain_sums(torch.from_numpy(rows.copy()), b.sink, b.window,
                                     query_stride=cfg.allocate.query_stride)
        sums = part if sums is None else sums + part
        queries += count
        left -= len(rows)
        used.append([record.file, record.sha256, len(rows)])
    digest = hashlib.sha256(json.dumps([targets.key, column, used]).encode()).hexdigest()
    return sums / queries, queries, digest, sum(u[2] for u in used)


def run(cfg: PipelineConfig) -> AllocateResult:
    """Allocate (or return the committed allocation of) this config; see the module docstring."""
    cfg = dataclasses.replace(cfg, home=str(cfg.home_dir()))
    targets = open_inputs(cfg)
    identity = targets.identity
    shape = {"num_layers": identity["num_layers"], "num_kv_heads": identity["num_kv_heads"]}
    weights = identity["teacher"]["weights_sha256"]
    committed = records.for_config(cfg, "allocate")
    if committed is not None and Path(committed.payload["path"]).is_file() \
            and (Path(committed.payload["path"]).parent / GAINS_FILE).is_file():
        folder = Path(committed.payload["path"]).parent
        try:
            allocation = load_allocation(folder, **shape, weights_sha256=weights)
            return AllocateResult(Path(committed.payload["path"]), allocation, committed.payload["mlflow_run_id"],
                                  False)
        except AllocationError:
            pass  # edited or stale: allocate again
    key = records.key_for(cfg, "allocate")
    b, mean, mode = cfg.budget, cfg.allocate.resolved_mean_budget(cfg.budget), cfg.allocate.mode
    started = time.perf_counter()
    gains, queries, digest, sequences = calibration_gains(cfg, targets)
    budgets = allocate(gains, sink=b.sink, window=b.window, mean_budget=mean, mode=mode)
    seconds = time.perf_counter() - started
    allocation = Allocation.from_tensor(
        budgets, mean_budget=mean, sink=b.sink, window=b.window, seq_len=identity["seq_len"], mode=mode,
        provenance={"calibration_sha256": digest, "weights_sha256": weights, "utility": UTILITY,
                    "targets_key": targets.key, "targets": str(targets.path), "sequences": sequences,
                    "queries": queries, "query_stride": cfg.allocate.query_stride})
    path = save_allocation(allocations_root(cfg) / key, allocation)
    torch.save(gains, path.parent / GAINS_FILE)
    summary = budget_summary(budgets)
    uniform = torch.full_like(budgets, mean)
    metrics = {"budget_mean": summary["mean"], "budget_peak": summary["peak"], "budget_min": summary["min"],
               "budget_std": summary["std"], "allocate_seconds": seconds,
               "kept_mass_uniform": kept_mass(gains, uniform, sink=b.sink, window=b.window),
               "kept_mass_allocated": kept_mass(gains, budgets, sink=b.sink, window=b.window)}
    with tracking.run(cfg, f"{cfg.name}-allocate-{mode}-B{mean}-{key[:10]}", stage="allocate",
                      tags={"kvpop.targets": str(targets.path)}) as active:
        import mlflow

        mlflow.log_metrics(metrics)
        mlflow.log_artifact(str(path))
        run_id = active.info.run_id
    records.crash_point("allocate.tracked")
    records.commit(cfg, "allocate", {"path": str(path), "mlflow_run_id": run_id, "targets": str(targets.path),
                                     "mode": mode, "mean": summary["mean"], "peak": summary["peak"]})
    return AllocateResult(path, allocation, run_id, True)


def allocations_at(cfg: PipelineConfig, totals) -> dict[int, Allocation]:
    """``{total: Allocation}``: this config's committed slot gains (the allocate record's, :data:`GAINS_FILE`)
    allocated at each mean budget ``total`` in ``allocate.mode``, with the record's provenance (and the gains file it
    came from). One :class:`ConfigError` line without a record, or for a total outside ``[sink + window, S]``."""
    committed = records.for_config(cfg, "allocate")
    folder = None if committed is None else Path(committed.payload["path"]).parent
    if folder is None or not (folder / GAINS_FILE).is_file():
        raise ConfigError(f"no allocation for config {cfg.name!r} (no allocate record with its {GAINS_FILE}): run "
                          f"the allocate stage first (python -m jobs.allocate, same config)")
    made = Allocation.from_json((folder / ALLOCATION_FILE).read_text())
    gains = torch.load(folder / GAINS_FILE)
    out = {}
    for total in totals:
        try:
            budgets = allocate(gains, sink=made.sink, window=made.window, mean_budget=int(total), mode=made.mode)
        except AllocationError as err:
            raise ConfigError(f"allocating at B={total}: {err}") from None
        out[int(total)] = Allocation.from_tensor(
            budgets, mean_budget=int(total), sink=made.sink, window=made.window, seq_len=made.seq_len, mode=made.mode,
            provenance={**made.provenance, "gains": str(folder / GAINS_FILE)})
    return out


def gains_digest(cfg: PipelineConfig) -> str:
    """The sha256 of this config's committed slot gains (what the evaluation's ``-H`` rows depend on)."""
    committed = records.for_config(cfg, "allocate")
    path = None if committed is None else Path(committed.payload["path"]).parent / GAINS_FILE
    if path is None or not path.is_file():
        raise ConfigError(f"eval.allocated: no allocation for config {cfg.name!r} (no allocate record with its "
                          f"{GAINS_FILE}): run the allocate stage first (python -m jobs.allocate, same config)")
    return hashlib.sha256(path.read_bytes()).hexdigest()
